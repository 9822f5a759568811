"""How many CTAs add into one kv row at once, walk by walk: the slot layout's part in the L2's load (CPU).

    python benchmarks/walk_overlap.py [--shapes dsv32,fleet] [--indices uniform,distinct,indexer] [--sms 132]

The main kernel's CTAs take (query row, head group) items in order and start together, so the
first wave runs neighbouring rows side by side. If they kept pace, at each step every CTA would
add one 32-slot block of its row into dKV. This counts, for each step of a sample of such
waves, the adds that land on each kv row. It prints two numbers. One is the adds per distinct
kv row a step. The other is the add-weighted multiplicity: the number of CTAs adding into the kv
row an average add goes to. Both are given for the ascending walk (the canonical order alone)
and for the rotated one (layout.rotate_walks, the product's). The CTAs do not keep pace
exactly, so these are upper bounds of how concentrated the adds are. The L2 counters
(l2_counters.py) say what the concentration costs.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mqa_bwd import bench, layout  # noqa: E402
from mqa_bwd.kernels.config import WALK_BLOCK, WIDE_HEADS  # noqa: E402


def walks(shape: dict, pattern: str, seed: int) -> dict:
    """{"ascending": slots, "rotated": slots}, each [S, L] int32, of one batch element's rows."""
    S, S_kv, L = shape["S"], shape["S_kv"], shape["L"]
    if L % WALK_BLOCK:
        raise ValueError(f"--shapes: L = {L} is not a multiple of the walk's block ({WALK_BLOCK})")
    indices = bench.draw_indices(1, S, S_kv, L, pattern, torch.Generator().manual_seed(seed))[0]
    keys = layout.slot_keys(indices, 0, S, S_kv, S_kv)
    ascending = torch.empty((S, L), dtype=torch.int32)
    layout.place_slots(layout.canonical_order(keys), ascending, S_kv)
    return {"ascending": ascending, "rotated": layout.rotate_walks(ascending, 0, S)}


def overlap(slots: torch.Tensor, groups: int, sms: int, waves: int) -> tuple:
    """(adds per distinct kv row a step, add-weighted multiplicity) over ``waves`` waves spread over
    the rows: a wave is ``sms`` items, ``groups`` head groups of each row (each adds the row's slots)."""
    rows_a_wave = max(1, sms // groups)
    S, L = slots.shape
    starts = torch.linspace(0, S - rows_a_wave, waves).long().unique().tolist()
    adds = distinct = weighted = 0
    for first in starts:
        blocks = slots[first:first + rows_a_wave].view(rows_a_wave, L // WALK_BLOCK, WALK_BLOCK)
        for step in range(blocks.shape[1]):
            rows = blocks[:, step].reshape(-1)
            rows = rows[rows >= 0]
            if rows.numel() == 0:
                continue
            counts = torch.unique(rows, return_counts=True)[1] * groups
            adds += int(counts.sum())
            distinct += counts.numel()
            weighted += int((counts * counts).sum())  # each add weighted by its kv row's count
    return adds / max(distinct, 1), weighted / max(adds, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="dsv32,fleet", help="bench shape names (mqa_bwd.bench.SHAPES)")
    parser.add_argument("--indices", default=",".join(bench.INDEX_PATTERNS), help="index patterns")
    parser.add_argument("--sms", type=int, default=132, help="CTAs that run at once (an H100's and H200's SMs)")
    parser.add_argument("--waves", type=int, default=8, help="waves sampled, spread over the rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shapes = [s for name in args.shapes.split(",") for s in bench.SHAPES[name]]
    patterns = args.indices.split(",")
    for pattern in patterns:
        bench.check_index_pattern(pattern)
    print(f"{args.sms} CTAs at once, {args.waves} waves sampled; per step: adds per distinct kv row / "
          "add-weighted multiplicity")
    print("| shape | indices | ascending | rotated |")
    print("|---|---|---|---|")
    for shape in shapes:
        groups = shape["H"] // WIDE_HEADS
        for pattern in patterns:
            cells = [overlap(slots, groups, args.sms, args.waves)
                     for slots in walks(shape, pattern, args.seed).values()]
            label = f"S={shape['S']} S_kv={shape['S_kv']} H={shape['H']} L={shape['L']}"
            print(f"| {label} | {pattern} | " + " | ".join(f"{a:.2f} / {m:.2f}" for a, m in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
