#!/usr/bin/env bash
# Downloads the pure-Python packages the H200 host may lack (rich, pytest-xdist
# and what they need) as wheels into .whl (git-ignored); gpu-run.sh installs them.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl rich pytest-xdist execnet markdown-it-py mdurl pygments
ls .whl
