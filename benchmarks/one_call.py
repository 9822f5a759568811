"""One backward call at a production shape, for a profiler to attach to.

    ncu --clock-control none -k regex:main_bwd -c 1 --set full \\
        python benchmarks/one_call.py --design fixed --H 64
    ncu --clock-control none --nvtx --nvtx-include "backward/" --section SpeedOfLight \\
        python benchmarks/one_call.py --design cudnn --H 64     # the peer, where .[cudnn] is installed

Each call runs inside the NVTX range "backward", so ``--nvtx --nvtx-include
"backward/"`` profiles the calls' kernels and none of the input preparation.

The first call compiles and warms up; the profiler's kernel filter and launch
count pick the kernel of interest from the calls that follow (--calls).
"""

import argparse

import torch

from mqa_bwd import launch, wrapper
from mqa_bwd.bench import INDEX_PATTERNS, add_shape_arguments, production_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--design", choices=("fixed", "atomic", "cudnn"), default="fixed",
                        help="fixed: the deterministic default; atomic: the control; cudnn: cuDNN-frontend's DSA backward")
    add_shape_arguments(parser, repeats=None)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--indices", choices=INDEX_PATTERNS, default="uniform", help="the top-k index pattern")
    a = parser.parse_args()
    args = production_inputs(a.B, a.S, a.S_kv, a.H, a.L, indices=a.indices)
    if a.design == "cudnn":
        from mqa_bwd.cudnn import cudnn_backward

        def call():
            cudnn_backward(*args)
    else:
        launcher = launch.TileLangLauncher(deterministic=a.design != "atomic")

        def call():
            wrapper.backward_with(launcher, *args)
    for _ in range(a.calls):
        with torch.cuda.nvtx.range("backward"):
            call()
    torch.cuda.synchronize()
    print(f"{a.calls} calls of design {a.design} at B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}")


if __name__ == "__main__":
    main()
