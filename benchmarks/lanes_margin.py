"""How much room the lanes' scale leaves, and what each bit of gain buys (GPU).

    python benchmarks/lanes_margin.py [--shapes dsv32,fleet] [--gains 8,10,12,14,16,18] [--temperatures 1,4]

The wide tile rounds every dKV contribution at the plan's scale times
2**(gain - 30) (fixed_point.lanes_scale) and sums, per kv row, a Bound on
every partial sum; the lanes hold while the largest Bound stays below 2**31.
Per shape (bench.production_inputs; q times T before the forward concentrates
P), per gain: log2 of the largest Bound, the bits left below 2**31 and below
2**24 (what an fp32 sum of integers would have: exact below 2**24), whether
the call took the int64 redo, and dkv's relative L2 error against the float64
reference, with the atomic control's beside it (issue 30's standard: at most
1.1x the control's).
"""

import argparse
import math

import torch

from mqa_bwd import bench, launch, wrapper


class BoundRecorder(launch.TileLangLauncher):
    """The deterministic launcher, keeping the last lanes launch's Bound tensor."""

    bound = None

    def main_bwd(self, *args, bound=None, **kw):
        if bound is not None:
            self.bound = bound
        super().main_bwd(*args, bound=bound, **kw)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv32,fleet")
    parser.add_argument("--gains", default="8,10,12,14,16,18")
    parser.add_argument("--temperatures", default="1")
    a = parser.parse_args()
    gains = [int(g) for g in a.gains.split(",")]
    for shape in [s for name in a.shapes.split(",") for s in bench.SHAPES[name]]:
        for temperature in [float(t) for t in a.temperatures.split(",")]:
            args = bench.production_inputs(**shape, temperature=temperature)
            outputs = {"atomic": wrapper.backward_with(launch.TileLangLauncher(False), *args)}
            found = {}
            for gain in gains:
                launcher = BoundRecorder(True, lanes_gain=gain)
                outputs[gain] = wrapper.backward_with(launcher, *args)
                largest = float(launcher.bound.max()) if launcher.bound is not None else math.nan
                found[gain] = (math.log2(largest) if largest > 0 else -math.inf, int(launcher.lanes_redone.item())
                               if launcher.lanes_redone is not None else -1)
            errors = bench.oracle_errors(args, outputs)
            control = errors["atomic"]["dkv"]
            print(f"{bench.describe(shape)} T={temperature:g}: atomic dkv err {control:.4e}")
            print("  gain  log2(max Bound)  bits below 2^31  below 2^24  redone  dkv err  /atomic")
            for gain in gains:
                log_bound, redone = found[gain]
                err = errors[gain]["dkv"]
                print(f"  {gain:4d}  {log_bound:15.2f}  {31 - log_bound:15.2f}  {24 - log_bound:10.2f}  {redone:6d}"
                      f"  {err:.4e}  {err / control:.4f}")
            del outputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
