"""The deterministic dKV designs side by side with the atomic control (GPU only).

    python benchmarks/design_ab.py [--shapes dsv32,fleet] [--designs fixed,shards] [--repeats 10]

Every call is a whole wrapper call (bench.prepared_wrapper_call), timed
interleaved in one process (bench.time_interleaved); per shape it prints each
design's median ms, its ratio to the control, TFLOP/s (SPEC's count) and peak
scratch, and whether two calls of each design gave the same bits.
"""

import argparse
import statistics

from mqa_bwd import launch
from mqa_bwd.bench import (SHAPES, flops, peak_scratch_bytes, prepared_wrapper_call, production_inputs, same_bits,
                           time_interleaved)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv32,fleet", help=f"comma-separated shape sets of {sorted(SHAPES)}")
    parser.add_argument("--designs", default="fixed,shards", help="comma-separated wrapper.DKV_DESIGNS")
    parser.add_argument("--repeats", type=int, default=10)
    a = parser.parse_args()
    designs = a.designs.split(",")
    for shape in [s for name in a.shapes.split(",") for s in SHAPES[name]]:
        args = production_inputs(**shape)
        calls = {"atomic control": prepared_wrapper_call(args, launch.TileLangLauncher(False))}
        for design in designs:
            calls[design] = prepared_wrapper_call(args, launch.TileLangLauncher(True), design)
        times = time_interleaved(calls, warmup=2, repeats=a.repeats)
        control = statistics.median(times["atomic control"])
        work = flops(shape["B"], shape["S"], shape["H"], shape["L"], 576, 512)
        print(shape)
        print(f"  {'design':<16} {'ms':>8} {'min':>8} {'/control':>9} {'TFLOP/s':>8} {'scratch GiB':>12} {'same bits':>10}")
        for name, call in calls.items():
            ms = statistics.median(times[name])
            stable = "" if name == "atomic control" else str(same_bits(call(), call()))
            print(f"  {name:<16} {ms:>8.2f} {min(times[name]):>8.2f} {ms / control:>9.3f} {work / ms / 1e9:>8.1f} "
                  f"{peak_scratch_bytes(call) / 2**30:>12.2f} {stable:>10}")


if __name__ == "__main__":
    main()
