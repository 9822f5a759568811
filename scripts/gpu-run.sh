#!/usr/bin/env bash
# One device-tool call on the H200: unpack tilelang, compile every kernel in
# parallel (fills TileLang's cache), then run each argument as a shell command
# with the environment set. Logs go to $OUT.
# Usage (device tool, carry .gpu and .whl):
#   bash scripts/gpu-run.sh 'python3 -m pytest -m gpu tests/' 'python3 -m mqa_bwd bench --shapes dsv32'
# COMPILE_ONLY='--d_k 576 --group-heads 32' compiles only the bench shapes' configurations (36 of the
# 62), for a call that runs nothing else (package A/B, the bench): the rest would cost device time.
# COMPILE_ONLY=none compiles no kernel configuration first (a probe that builds its own kernel).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/site "$OUT"
[[ -d /tmp/site/tilelang ]] || tar -C /tmp/site -xJf .gpu/tilelang.tar.xz
# Pure-Python packages the host may lack (rich, pytest-xdist, ...), carried as wheels in .whl.
if [[ -d .whl ]] && ! python3 -c "import rich, xdist" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
# The checkout runs from PYTHONPATH, not installed: this metadata is what an install would add, so that
# pytest finds the property suite's plugin (the pytest11 entry point) exactly as it does in a virtualenv.
info=/tmp/site/mqa_bwd-0.1.0.dist-info
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: mqa-bwd\nVersion: 0.1.0\n' > "$info/METADATA"
printf '[pytest11]\nmqa_bwd = properties.plugin\n\n[console_scripts]\nmqa-bwd = mqa_bwd.cli:main\n' > "$info/entry_points.txt"
# The sanitizer tests write their whole reports there (a failure shows only a tail).
export MQA_SANITIZER_REPORTS=${MQA_SANITIZER_REPORTS:-$OUT/sanitizer}
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1 OUT
nvidia-smi -L
python3 -c "import tilelang, torch; print('tilelang', tilelang.__version__, 'torch', torch.__version__)"
if [[ ${COMPILE_ONLY:-} != none ]]; then
  python3 -W ignore -m mqa_bwd.kernels --workers 16 ${COMPILE_ONLY:-} 2>&1 | grep -v "INFO" | tail -3
fi
n=0
for cmd in "$@"; do
  n=$((n + 1))
  echo "### $cmd"
  bash -c "$cmd" 2>&1 | grep -v "INFO\|DeprecationWarning\|disable_tma_lower\|return cache.cached\|instance = cls\|kernel = JITKernel" | tee "$OUT/step$n.log"
done
