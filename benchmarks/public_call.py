"""What a public call adds to the wrapper's prepared run, step by step (GPU).

    python benchmarks/public_call.py [--H 64] [--repeats 15] [--timeline]

Times, interleaved round by round (bench.time_interleaved, so that every variant sees the same
allocator and clock history), one call of each way into the deterministic backward, and the
atomic control's prepared and public calls:

- prepared run: wrapper.run on a problem validated once (what benchmarks/package_ab.py times);
- with validation: wrapper.backward_with on one launcher;
- with a fresh launcher: backward_with on a new TileLangLauncher a call (as the public call);
- public: mqa_latent_sparse_bwd (the edge, the launcher, validation, run: what the bench times);
- public, collector off: the same with Python's garbage collector disabled around the rounds.

For each it prints the median and minimum event time a call, then, over as many interleaved
rounds again (untimed), how many device allocations (cudaMalloc) and frees its calls made
(torch.cuda.memory_stats): a variant that allocates from the driver mid-call, or pauses for the
collector, shows here. With --timeline, one public and one prepared call under the torch
profiler (host_overhead.print_timeline).
"""

import argparse
import gc
import statistics

import torch

from host_overhead import print_timeline
from mqa_bwd import bench, launch, wrapper


def _device_allocations() -> tuple:
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0), stats.get("num_device_free", 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_shape_arguments(parser, repeats=15)
    parser.add_argument("--timeline", action="store_true", help="also print a public and a prepared call's timelines")
    parser.add_argument("--top", type=int, default=60, help="characters of each name in the timelines")
    a = parser.parse_args()
    args = bench.production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    device = args[0].device
    det, control = launch.TileLangLauncher(True, device=device), launch.TileLangLauncher(False, device=device)
    public = bench.backend_call("tilelang", args)

    def without_collector():
        enabled = gc.isenabled()
        gc.disable()
        try:
            return public()
        finally:
            if enabled:
                gc.enable()

    calls = {
        "det: prepared run": bench.prepared_wrapper_call(args, det),
        "det: with validation": lambda: wrapper.backward_with(det, *args),
        "det: with a fresh launcher": lambda: wrapper.backward_with(launch.TileLangLauncher(True, device=device), *args),
        "det: public": public,
        "det: public, collector off": without_collector,
        "control: prepared run": bench.prepared_wrapper_call(args, control),
        "control: public": bench.backend_call("tilelang-atomic", args),
    }
    times = bench.time_interleaved(calls, repeats=a.repeats)
    # The allocator's driver calls, over as many interleaved rounds again, untimed (reading the
    # counters costs host time a timed call would carry).
    counted = dict.fromkeys(calls, (0, 0))
    for _ in range(a.repeats):
        for name, fn in calls.items():
            before = _device_allocations()
            fn()
            torch.cuda.synchronize()
            after = _device_allocations()
            counted[name] = tuple(total + now - then for total, now, then in zip(counted[name], after, before))
    print(f"B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}, {a.repeats} rounds after 3 warm-up calls each")
    for name, ms in times.items():
        allocs, frees = counted[name]
        print(f"   {name:<28} median {statistics.median(ms):7.3f} ms  min {min(ms):7.3f}   "
              f"device allocations {allocs}, frees {frees} over {a.repeats} more calls")
    if a.timeline:
        print("== one public call")
        print_timeline(public, a.top)
        print("== one prepared run")
        print_timeline(calls["det: prepared run"], a.top)


if __name__ == "__main__":
    main()
