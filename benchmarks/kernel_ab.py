"""A kernel change against another version of mqa_bwd/kernels.py, whole calls
interleaved in one process (GPU only).

    git show main:mqa_bwd/kernels.py > ab/kernels_main.py     # where git is (not on the device)
    python benchmarks/kernel_ab.py --against ab/kernels_main.py [ab/kernels_b.py ...] [--shapes dsv32,fleet] [--repeats 7]

Each design (the deterministic default and the atomic control) runs with this
tree's kernels and with each other file's (labelled by its name), through
the same wrapper; the launcher compiles through whichever module is current.
For the deterministic design it also prints whether each other version gives
the same bits as this tree (a change that only moves work around must), and
whether this tree's kernels give the same bits on a rerun.
"""

import argparse
import os
import statistics

from mqa_bwd import kernels
from mqa_bwd.bench import (SHAPES, call_with_kernels, load_kernels_module, production_inputs, rel_l2, same_bits,
                           time_with_kernels)

DESIGNS = (("fixed", True), ("atomic", False))


class WithFallback:
    """``module`` (another kernels.py), except that kernel kinds it does not build
    (it predates them) compile from this tree's kernels."""

    def __init__(self, module):
        self.module = module
        self.missing = sorted({c[0] for c in kernels.gpu_configs()} - {c[0] for c in module.gpu_configs()})

    def __getattr__(self, name):
        return getattr(self.module, name)

    def compiled(self, kind, *key):
        return (kernels if kind in self.missing else self.module).compiled(kind, *key)

    # Launch rules of a kernels.py that predates the 64-head tile: every launch
    # is a cluster of the kernel it names, and the atomic mode has no pairs.
    def main_kernel_key(self, heads, d_k, d_v, mode, cluster=1):
        if hasattr(self.module, "main_kernel_key"):
            return self.module.main_kernel_key(heads, d_k, d_v, mode, cluster)
        return (heads, d_k, d_v, mode) + ((cluster,) if cluster > 1 else ())

    def cluster_launches(self, groups, largest=None, mode="fixed", heads=None):
        if hasattr(self.module, "runs_wide"):
            return self.module.cluster_launches(groups, largest, mode, heads)
        if mode == "fixed":
            return self.module.cluster_launches(groups, largest)
        if mode not in getattr(self.module, "MODE_MAX_CLUSTER", {}):
            return [(g, 1) for g in range(groups)]
        return self.module.cluster_launches(groups, largest, mode)


def agreement(mine, theirs, label: str) -> str:
    """``label``'s bit equality with this tree's outputs; where they differ (a change
    that reorders sums may), the relative L2 distance of dq, dkv and d_attn_sink."""
    if same_bits(mine, theirs):
        return f"{label} True"
    distances = " ".join(f"{name} {rel_l2(y, x):.1e}" for name, x, y in zip(("dq", "dkv", "dsink"), mine, theirs))
    return f"{label} False (rel L2: {distances})"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, nargs="+", help="other versions of mqa_bwd/kernels.py")
    parser.add_argument("--shapes", default="dsv32,fleet")
    parser.add_argument("--repeats", type=int, default=7)
    a = parser.parse_args()
    versions = {"this tree": kernels}
    for path in a.against:
        label = os.path.splitext(os.path.basename(path))[0]
        if label in versions:
            raise SystemExit(f"--against: two files named {label}")
        versions[label] = WithFallback(load_kernels_module(path, "--against"))
        if versions[label].missing:
            print(f"{path} has no {', '.join(versions[label].missing)}: this tree's is used for it")
    variants = [(design, deterministic, label) for design, deterministic in DESIGNS for label in versions]
    width = max(map(len, versions))
    for name in a.shapes.split(","):
        for shape in SHAPES[name]:
            args = production_inputs(**shape)
            outs = {(d, v): call_with_kernels(args, versions[v], det)[1] for d, det, v in variants}
            rerun = call_with_kernels(args, kernels, True)[1]
            same = ", ".join(agreement(outs[("fixed", "this tree")], outs[("fixed", v)], v) for v in versions if v != "this tree")
            print(f"{shape}: fixed bits equal to this tree's: {same}; "
                  f"rerun bitwise: {same_bits(outs[('fixed', 'this tree')], rerun)}")
            times = time_with_kernels(args, {(d, v): (versions[v], det) for d, det, v in variants}, a.repeats)
            control = statistics.median(times[("atomic", "this tree")])
            for (d, v), t in times.items():
                m = statistics.median(t)
                print(f"   {d:<7} {v:<{width}} median {m:7.2f} ms  min {min(t):7.2f}  /atomic (this tree) {m / control:.3f}")


if __name__ == "__main__":
    main()
