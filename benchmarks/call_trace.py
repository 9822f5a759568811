"""Every GPU kernel of whole backward calls, torch's included (torch profiler).

    python benchmarks/call_trace.py [--H 64] [--S 4096] [--S_kv 8192] [--L 2048] [--calls 3]

It lists each kernel by name (torch's elementwise ops, copies and reductions of
the layout and the fixed-point plan too), for the deterministic default and
the atomic control: GPU ms per call and launches per call. It is how the
plan's separate reductions of |q| and |dO| (0.26 ms at dsv32 H=64) were found.
"""

import argparse
import collections


def per_kernel(events, calls: int, width: int = 90) -> list:
    """[(name, ms per call, launches per call)] from (name, device microseconds) pairs, most time first.

    Names are cut to ``width`` characters (torch's templated kernel names run
    to thousands), so kernels that differ only past that are summed together.
    """
    time, count = collections.Counter(), collections.Counter()
    for name, micros in events:
        key = name[:width]
        time[key] += micros / 1000 / calls
        count[key] += 1
    return [(name, ms, count[name] / calls) for name, ms in time.most_common()]


def print_table(label: str, rows: list, top: int) -> None:
    total = sum(ms for _, ms, _ in rows)
    print(f"== {label}: {total:.3f} ms of GPU kernels per call, {sum(n for *_, n in rows):.0f} launches")
    for name, ms, n in rows[:top]:
        print(f"  {ms:8.3f} ms  x{n:<4g} {name}")
    rest = rows[top:]
    if rest:
        print(f"  {sum(ms for _, ms, _ in rest):8.3f} ms  ({len(rest)} more kernels)")


def main():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mqa_bwd import launch, wrapper
    from mqa_bwd.bench import add_shape_arguments, production_inputs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, repeats=None)
    parser.add_argument("--calls", type=int, default=3, help="profiled calls per design (after 3 warm-up calls)")
    parser.add_argument("--top", type=int, default=25)
    a = parser.parse_args()
    args = production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    print(f"B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}")
    for label, deterministic in (("deterministic (default design)", True), ("atomic control", False)):
        launcher = launch.TileLangLauncher(deterministic=deterministic)
        for _ in range(3):  # compilation, allocator, the plan's CUDA graph
            wrapper.backward_with(launcher, *args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.calls):
                wrapper.backward_with(launcher, *args)
            torch.cuda.synchronize()
        events = [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print_table(label, per_kernel(events, a.calls), a.top)


if __name__ == "__main__":
    main()
