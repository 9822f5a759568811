#!/usr/bin/env bash
# cuDNN-frontend beside our kernels on the H200, in two device-tool calls back to back on one
# warm machine: the CUTLASS DSL archive nearly fills a call's 64 MiB by itself, so it cannot
# travel with TileLang (../shared/tools/gpu-bundle-cudnn builds both archives, and says why).
#
#   call 1, carry .gpu/tilelang.tar.xz and .gpu/cudnn/frontend.tar.xz (and .whl if you have it):
#     bash scripts/gpu-cudnn.sh prepare ['command needing no cuDNN' ...]
#   call 2, at once, carry .gpu/cudnn/dsl.tar.xz:
#     bash scripts/gpu-cudnn.sh run 'python3 -m mqa_bwd bench --shapes dsv32,fleet' ...
#
# prepare: scripts/gpu-run.sh (unpack TileLang into /tmp/site, compile every kernel) and unpack
# the frontend there. run: refuses a cold machine (exit 3), unpacks the DSL into /tmp/site, and
# runs each command through scripts/gpu-run.sh with the DSL's dsl_packages folder on PYTHONPATH
# (pip --target leaves out the .pth file that would put it on sys.path). Logs go to $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
phase=${1:-}
shift || true
dsl_path=/tmp/site/nvidia_cutlass_dsl/dsl_packages
case $phase in
  prepare)
    [[ -s .gpu/cudnn/frontend.tar.xz ]] || { echo "carry .gpu/cudnn/frontend.tar.xz in this call"; exit 2; }
    exec bash "$here/gpu-run.sh" \
      'tar -C /tmp/site -xJf .gpu/cudnn/frontend.tar.xz && echo "cuDNN-frontend unpacked into /tmp/site"' "$@"
    ;;
  run)
    [[ -d /tmp/site/tilelang && -d /tmp/site/cudnn ]] || { echo "cold machine: run 'prepare' first, at once"; exit 3; }
    if [[ ! -d $dsl_path ]]; then
      [[ -s .gpu/cudnn/dsl.tar.xz ]] || { echo "carry .gpu/cudnn/dsl.tar.xz in this call"; exit 2; }
      tar -C /tmp/site -xJf .gpu/cudnn/dsl.tar.xz || exit 2
    fi
    # Single quotes: gpu-run.sh's own PYTHONPATH is extended inside each command's shell.
    prefix='export PYTHONPATH=$PYTHONPATH:'"$dsl_path"'; '
    commands=("python3 -c 'from mqa_bwd import cudnn; print(cudnn.unavailable() or \"cuDNN DSA backward: ready\")'")
    for cmd in "$@"; do
      commands+=("$cmd")
    done
    exec bash "$here/gpu-run.sh" "${commands[@]/#/$prefix}"
    ;;
  *)
    echo "usage: $0 prepare [COMMAND ...] | run COMMAND ..."; exit 2
    ;;
esac
