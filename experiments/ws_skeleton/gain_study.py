"""How much gain the lanes design has, on the CPU model: the largest gain at which no kv row's
bound fails, against a prediction from the shape alone.

    python -m experiments.ws_skeleton.gain_study [--shapes 64x128x16x64,...] [--temperatures 1,4]

For each shape (S x S_kv x H x L, B = 1) and temperature (q scaled before the forward, which
concentrates P as trained attention does), one call at gain PROBE records every kv row's Bound;
the headroom is PROBE + log2(2^31 / the largest Bound), i.e. the largest gain whose bound still
fits (to within the ceilings, which are small at PROBE). The prediction is the fixed-point
study's: log2(N L / n_max) + 5.1, with N the batch element's (row, head) pairs and n_max the
most valid slots naming one kv row (docs/performance-log.md, 2026-12-01).
"""

import argparse
import math

import torch

from mqa_bwd import bench, wrapper

from .launcher import LANE_LIMIT
from .model import RecordingLanesLauncher

PROBE = 24


def inputs(S, S_kv, H, L, temperature, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn((1, S, H, 576), generator=g) * temperature).bfloat16()
    kv = torch.randn((1, S_kv, 576), generator=g).bfloat16()
    grad_out = torch.randn((1, S, H, 512), generator=g).bfloat16()
    sink = torch.randn((H,), generator=g)
    visible = torch.arange(S) + (S_kv - S) + 1
    idx = (torch.rand((1, S, L), generator=g) * visible.view(1, S, 1)).to(torch.int32)
    sm_scale = 576**-0.5
    out, lse = bench._forward(q, kv, idx, sink, sm_scale, 512)
    return q, kv, out, grad_out, lse, sink, idx, sm_scale


def study(S, S_kv, H, L, temperature):
    args = inputs(S, S_kv, H, L, temperature)
    launcher = RecordingLanesLauncher(PROBE)
    wrapper.backward_with(launcher, *args)
    largest = int(launcher.bound.max())
    headroom = PROBE + math.log2(LANE_LIMIT / largest)
    n_max = int(torch.bincount(args[6].flatten().long(), minlength=S_kv).max())
    predicted = math.log2(S * H * L / n_max) + 5.1
    return headroom, predicted, n_max


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="64x128x16x64,128x256x16x64,256x512x16x128,256x512x16x64,512x1024x16x128")
    parser.add_argument("--temperatures", default="1,4")
    a = parser.parse_args(argv)
    print("shape (S x S_kv x H x L)   T   n_max  headroom  predicted  headroom - predicted")
    for shape in a.shapes.split(","):
        S, S_kv, H, L = (int(x) for x in shape.split("x"))
        for temperature in (float(t) for t in a.temperatures.split(",")):
            headroom, predicted, n_max = study(S, S_kv, H, L, temperature)
            print(f"{shape:26} {temperature:3g} {n_max:6d} {headroom:9.2f} {predicted:10.2f} {headroom - predicted:+9.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
