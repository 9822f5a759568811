"""The deterministic path with and without head-group clusters, against the
atomic control (GPU only): whole calls, interleaved in one process.

    python benchmarks/cluster_ab.py [--shapes dsv32,fleet] [--repeats 7]

"fixed C<=1" launches every 32-head group alone (one fixed-point add per
group, slot and column); "fixed C<=2" runs pairs of groups as one cluster
whose CTAs swap P and dS and add dKV summed over both groups (half the adds;
the wrapper's default); "fixed C<=4" clusters of up to four groups (a quarter).
Each deterministic variant is also rerun once and compared bit for bit, and
every output's relative L2 distance from "fixed C<=1" is printed: the
clusters move dKV's rounding points (one fp32 GEMM chain over the cluster's
heads), nothing else.
"""

import argparse
import statistics

from mqa_bwd import kernels, launch
from mqa_bwd.bench import SHAPES, production_inputs, rel_l2, same_bits, timed_wrapper_call

VARIANTS = (("fixed C<=1", True, 1), ("fixed C<=2", True, 2), ("fixed C<=4", True, 4), ("atomic", False, 1))


def timed_call(args, deterministic: bool, largest_cluster: int):
    """(ms, outputs) of one whole call with clusters of at most ``largest_cluster`` groups."""
    default = kernels.MAX_CLUSTER
    kernels.MAX_CLUSTER = largest_cluster
    try:
        return timed_wrapper_call(args, launch.TileLangLauncher(deterministic))
    finally:
        kernels.MAX_CLUSTER = default


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv32,fleet")
    parser.add_argument("--repeats", type=int, default=7)
    a = parser.parse_args()
    for name in a.shapes.split(","):
        for shape in SHAPES[name]:
            args = production_inputs(**shape)
            outs = {}
            for label, deterministic, largest in VARIANTS:
                outs[label] = timed_call(args, deterministic, largest)[1]
                if deterministic:
                    again = timed_call(args, deterministic, largest)[1]
                    print(f"{shape} {label}: rerun bitwise {same_bits(outs[label], again)}")
            times = {label: [] for label, _, _ in VARIANTS}
            for _ in range(a.repeats):
                for label, deterministic, largest in VARIANTS:
                    times[label].append(timed_call(args, deterministic, largest)[0])
            base = statistics.median(times["atomic"])
            ref = outs["fixed C<=1"]
            for label, t in times.items():
                rel = [rel_l2(x, y) for x, y in zip(outs[label], ref)]
                print(f"   {label:<11} median {statistics.median(t):7.2f} ms  min {min(t):7.2f}  "
                      f"/atomic {statistics.median(t) / base:.3f}  rel L2 vs C<=1 (dq, dkv, dsink) "
                      + ", ".join(f"{x:.1e}" for x in rel))


if __name__ == "__main__":
    main()
