"""How many dKV adds a CTA would save by summing g consecutive query rows on chip (CPU).

    python benchmarks/merge_share.py [--shapes dsv32,fleet] [--indices uniform,indexer] [--groups 2,4,8,16]
    python benchmarks/merge_share.py --capture step1234-rank3.safetensors [--groups ...]

Every design measured so far adds each (query row, valid slot) contribution to the L2 once. A CTA
that takes g consecutive query rows of a batch element and sums their contributions to a kv row
before adding would add each distinct kv row of the group once. Per shape and index pattern (the
bench's own draws, bench.draw_indices, seed 0) or per captured call (its token_indices), this
prints the overlap with the previous row (bench.index_overlap) and, for each g, the share of the
adds left: distinct valid kv rows summed over the groups, over the valid slots. A share s at g
also prices the merge: over a group's union, dKV's GEMMs take g * s times their FLOPs, since each
row's P and dS are zero where it names no slot.
"""

import argparse
import sys

from mqa_bwd import bench


def merged_share(idx, rows_a_group: int) -> float:
    """Distinct valid kv rows (index >= 0) of each group of ``rows_a_group`` consecutive query
    rows of a batch element, summed over the groups, over the valid slots of ``idx`` [B, S, L].
    A kv row named twice within one query row counts once, as one row's slots would merge too."""
    import torch

    if rows_a_group < 1:
        raise ValueError(f"rows_a_group: must be >= 1, got {rows_a_group}")
    B, S, L = idx.shape
    valid = int((idx >= 0).sum())
    if valid == 0:
        return 0.0
    groups = -(-S // rows_a_group)
    padded = torch.full((B, groups * rows_a_group, L), -1, dtype=torch.int64, device=idx.device)
    padded[:, :S] = idx.to(torch.int64)
    ordered = padded.view(B, groups, rows_a_group * L).sort(dim=-1).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    return int((first & (ordered >= 0)).sum()) / valid


def _rows(label, idx, group_sizes):
    cells = [f"{merged_share(idx, g):.3f}" for g in group_sizes]
    return f"| {label} | {bench.index_overlap(idx):.3f} | " + " | ".join(cells) + " |"


def main(argv=None):
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="dsv32,fleet", help="named shape sets (bench.SHAPES)")
    p.add_argument("--indices", default="uniform,indexer", help="index patterns (bench.INDEX_PATTERNS)")
    p.add_argument("--groups", default="2,4,8,16", help="query rows a group, comma-separated")
    p.add_argument("--capture", action="append", default=[], metavar="FILE",
                   help="a captured call (mqa_bwd.capture); its indices instead of the bench's draws")
    a = p.parse_args(argv)
    group_sizes = [int(g) for g in a.groups.split(",")]
    print("| indices | overlap with the previous row | " + " | ".join(f"g = {g}" for g in group_sizes) + " |")
    print("|---|---|" + "---|" * len(group_sizes))
    if a.capture:
        from mqa_bwd import capture

        for path in a.capture:
            idx = torch.as_tensor(capture.load(path).inputs["token_indices"])
            print(_rows(path, idx, group_sizes))
        return 0
    shapes = {(s["S"], s["S_kv"], s["L"]) for name in a.shapes.split(",") for s in bench.SHAPES[name]}
    for S, S_kv, L in sorted(shapes):
        for pattern in a.indices.split(","):
            idx = bench.draw_indices(1, S, S_kv, L, pattern, torch.Generator().manual_seed(0))
            print(_rows(f"{pattern}, S={S} S_kv={S_kv} L={L}", idx, group_sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
