"""One backward call at a production shape, for a profiler to attach to.

    ncu --clock-control none -k regex:main_bwd -c 1 --set full \\
        python benchmarks/one_call.py --design fixed --H 64

The first call compiles and warms up; the profiler's kernel filter and launch
count pick the kernel of interest from the calls that follow (--calls).
"""

import argparse

import torch

from mqa_bwd import kernels, launch, wrapper
from mqa_bwd.bench import add_shape_arguments, production_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--design", choices=wrapper.DKV_DESIGNS + ("atomic",), default=wrapper.DEFAULT_DKV_DESIGN)
    add_shape_arguments(parser, repeats=None)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--max-cluster", type=int, default=kernels.MAX_CLUSTER,
                        help="largest cluster of head groups of the fixed design (1: one launch per group)")
    a = parser.parse_args()
    kernels.MAX_CLUSTER = a.max_cluster
    args = production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    deterministic = a.design != "atomic"
    launcher = launch.TileLangLauncher(deterministic=deterministic)
    for _ in range(a.calls):
        wrapper.backward_with(launcher, *args, dkv_design=a.design if deterministic else None)
    torch.cuda.synchronize()
    print(f"{a.calls} calls of design {a.design} at B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}, clusters <= {a.max_cluster}")


if __name__ == "__main__":
    main()
