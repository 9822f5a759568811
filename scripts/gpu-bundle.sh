#!/usr/bin/env bash
# Builds .gpu/tilelang.tar.xz (git-ignored): TileLang and what it needs, as an unpacked
# site tree for CPython 3.12 on x86_64, for an H200 host with no package registry
# (docs/gpu.md). scripts/gpu-run.sh unpacks it there. Run in the repository's root.
set -euo pipefail
version=${TILELANG_VERSION:-0.1.15}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$work/wheels" \
  "tilelang==$version" 'apache-tvm-ffi>=0.1.11,<0.1.13' torch-c-dlpack-ext 'z3-solver>=4.13.0,<4.15.5'
mkdir -p "$work/site" .gpu
for wheel in "$work"/wheels/*.whl; do
  unzip -q -o "$wheel" -d "$work/site"  # unzip keeps the executable bits a wheel records
done
tar -C "$work/site" -cf - . | xz -T0 -9 > .gpu/tilelang.tar.xz.part
mv .gpu/tilelang.tar.xz.part .gpu/tilelang.tar.xz
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
echo ".gpu/tilelang.tar.xz: $(du -m .gpu/tilelang.tar.xz | cut -f1) MiB (a device call carries at most 64 MiB)"
