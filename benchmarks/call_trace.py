"""Every GPU kernel of whole backward calls, torch's included (torch profiler).

    python benchmarks/call_trace.py [--H 64] [--S 4096] [--S_kv 8192] [--L 2048] [--calls 3]

It lists each kernel by name (torch's elementwise ops, copies and reductions of
the layout and the fixed-point plan too), for the deterministic default and
the atomic control: GPU ms per call and launches per call (bench.kernel_trace,
which ``mqa-bwd bench --trace`` and ``package_ab.py --trace`` print too). It is how
the plan's separate reductions of |q| and |dO| (0.26 ms at dsv32 H=64) were found.
"""

import argparse


def main():
    from mqa_bwd import launch, wrapper
    from mqa_bwd.bench import add_shape_arguments, kernel_trace, production_inputs, trace_lines

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, repeats=None)
    parser.add_argument("--calls", type=int, default=3, help="profiled calls per design (after 3 warm-up calls)")
    parser.add_argument("--top", type=int, default=25)
    a = parser.parse_args()
    args = production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    print(f"B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}")
    for label, deterministic in (("deterministic (default design)", True), ("atomic control", False)):
        launcher = launch.TileLangLauncher(deterministic=deterministic)
        for _ in range(3):  # compilation, allocator
            wrapper.backward_with(launcher, *args)
        kernels = kernel_trace(lambda: wrapper.backward_with(launcher, *args), a.calls)
        print("\n".join(trace_lines(label, kernels, a.top)))


if __name__ == "__main__":
    main()
