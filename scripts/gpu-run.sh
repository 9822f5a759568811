#!/usr/bin/env bash
# One device-tool call on the H200: unpack tilelang, compile every kernel in
# parallel (fills TileLang's cache), then run what is asked. Logs go to $OUT.
# Usage (device tool, carry .gpu): bash scripts/gpu-run.sh [pytest args...] ; BENCH=dsv32 to benchmark too.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/site "$OUT"
tar -C /tmp/site -xJf .gpu/tilelang.tar.xz
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import tilelang, torch, ml_dtypes, hypothesis; print('tilelang', tilelang.__version__, 'torch', torch.__version__)"
python3 -m mqa_bwd.kernels --workers 16 2>&1 | grep -v "INFO" | tail -5
if [[ $# -gt 0 ]]; then
  python3 -m pytest -p no:cacheprovider -q "$@" 2>&1 | tee "$OUT/pytest.log" | grep -v "^\s*$" | tail -60
fi
if [[ -n "${BENCH:-}" ]]; then
  python3 -m mqa_bwd.bench --shapes "$BENCH" --json "$OUT/bench-$BENCH.json" 2>&1 | grep -v INFO | tee "$OUT/bench-$BENCH.txt"
fi
