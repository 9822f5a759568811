"""How much room the lanes' scale leaves, and what each bit of gain buys (GPU).

    python benchmarks/lanes_margin.py [--shapes dsv32,fleet] [--gains 8,10,12,14,16,18] [--temperatures 1,4]
        [--indices uniform]

The wide tile rounds every dKV contribution at the plan's scale times
2**(gain - 30) (fixed_point.lanes_scale) and sums, per kv row, a Bound on
every partial sum; the lanes hold while the largest Bound stays below 2**31.
Per shape (bench.production_inputs; q times T before the forward concentrates
P), per gain: log2 of the largest Bound, the bits left below 2**31 and below
2**24 (what an fp32 sum of integers would have: exact below 2**24), whether
the call took the int64 redo, the share of query rows with a value past the
lanes' FFMA rounding (2**22), which their corrections launch runs again
(kernels/wide.py), and dkv's relative L2 error against the float64
reference, with the atomic control's beside it (issue 30's standard: at most
1.1x the control's).
"""

import argparse
import math

import torch

from mqa_bwd import bench, fixed_point, launch, wrapper


class BoundRecorder(launch.TileLangLauncher):
    """The deterministic launcher, keeping the last lanes launch's Bound and row flags."""

    bound = flag = None

    def main_bwd(self, *args, bound=None, flag=None, **kw):
        if bound is not None:
            self.bound, self.flag = bound, flag
        super().main_bwd(*args, bound=bound, flag=flag, **kw)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv32,fleet")
    parser.add_argument("--gains", default="8,10,12,14,16,18")
    parser.add_argument("--temperatures", default="1")
    parser.add_argument("--indices", default="uniform", choices=bench.INDEX_PATTERNS)
    a = parser.parse_args()
    gains = [int(g) for g in a.gains.split(",")]
    for shape in [s for name in a.shapes.split(",") for s in bench.SHAPES[name]]:
        for temperature in [float(t) for t in a.temperatures.split(",")]:
            args = bench.production_inputs(**shape, temperature=temperature, indices=a.indices)
            outputs = {"atomic": wrapper.backward_with(launch.TileLangLauncher(False), *args)}
            found = {}
            for gain in gains:
                launcher = BoundRecorder(True, lanes_gain=gain)
                outputs[gain] = wrapper.backward_with(launcher, *args)
                largest = float(launcher.bound.max()) if launcher.bound is not None else math.nan
                corrected = (float(((launcher.flag & fixed_point.FLAG_MAGIC) != 0).float().mean())
                             if launcher.flag is not None else math.nan)
                found[gain] = (math.log2(largest) if largest > 0 else -math.inf, int(launcher.lanes_redone.item())
                               if launcher.lanes_redone is not None else -1, corrected)
            errors = bench.oracle_errors(args, outputs)
            control = errors["atomic"]["dkv"]
            print(f"{bench.describe(shape)} T={temperature:g}, {a.indices} indices: atomic dkv err {control:.4e}")
            print("  gain  log2(max Bound)  bits below 2^31  below 2^24  redone  rows corrected  dkv err  /atomic")
            for gain in gains:
                log_bound, redone, corrected = found[gain]
                err = errors[gain]["dkv"]
                print(f"  {gain:4d}  {log_bound:15.2f}  {31 - log_bound:15.2f}  {24 - log_bound:10.2f}  {redone:6d}"
                      f"  {100 * corrected:13.2f}%  {err:.4e}  {err / control:.4f}")
            del outputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
