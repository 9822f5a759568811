"""One backward call at a production shape, for a profiler to attach to.

    ncu --clock-control none -k regex:main_bwd -c 1 --set full \\
        python benchmarks/one_call.py --design fixed --H 64

The first call compiles and warms up; the profiler's kernel filter and launch
count pick the kernel of interest from the calls that follow (--calls).
"""

import argparse

import torch

from mqa_bwd import launch, wrapper
from mqa_bwd.bench import add_shape_arguments, production_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--design", choices=("fixed", "atomic"), default="fixed",
                        help="fixed: the deterministic default; atomic: the control")
    add_shape_arguments(parser, repeats=None)
    parser.add_argument("--calls", type=int, default=2)
    a = parser.parse_args()
    args = production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    deterministic = a.design != "atomic"
    launcher = launch.TileLangLauncher(deterministic=deterministic)
    for _ in range(a.calls):
        wrapper.backward_with(launcher, *args)
    torch.cuda.synchronize()
    print(f"{a.calls} calls of design {a.design} at B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}")


if __name__ == "__main__":
    main()
