"""Where the lanes' rounding by FFMA stops being exact: the rows a corrections launch runs (CPU or GPU).

    python benchmarks/magic_range.py [--shapes 4096:8192:2048,512:2048:512] [--H 64]
        [--temperatures 1,4,16] [--indices uniform] [--rows 96] [--device cpu]

The wide tile's lanes launch rounds each dKV contribution at the lanes' scale by one FFMA, exact
while every |scaled value| is below 2**22 (kernels/wide.py, ws_magic_word); a query row with a
larger one is run a second time, by the corrections launch. Per shape S:S_kv:L (B = 1;
bench.production_inputs, q times T before the forward), from the plan's row scales at the default
gain (fixed_point.plan, lanes_scale) and the contributions of sampled query rows, each 64-head
tile's sum over its heads with P and dS in bf16 as the kernels' GEMMs take them: log2 of the
largest |scaled value| and the share of the sampled rows with one at or past 2**22. No kernel
runs: the forward and the contributions are torch ops (the CPU by default, some 40 s a shape at
S = 4096). benchmarks/lanes_margin.py counts the same rows from the kernels' own flags, on the GPU.
"""

import argparse
import math

import torch

from mqa_bwd import bench, fixed_point
from mqa_bwd.kernels import WIDE_HEADS as TILE_HEADS  # the lanes' tile: a contribution sums its heads


def row_peaks(args, rows, gain: int = fixed_point.LANES_GAIN) -> torch.Tensor:
    """[len(rows)] float64: per sampled query row (of batch element 0), the largest |contribution
    x row scale| over its valid slots, columns and 64-head tiles, at the lanes' scale of ``gain``.
    ``args``: bench.production_inputs' tuple, H a multiple of TILE_HEADS."""
    q, kv, out, grad_out, lse, sink, idx, sm_scale = args
    B, S, H, d_k = q.shape
    d_v, S_kv = grad_out.shape[3], kv.shape[1]
    if H % TILE_HEADS:
        raise ValueError(f"H: {H}, the lanes' tiles take a multiple of {TILE_HEADS} heads")
    R, NKV = B * S, B * S_kv
    delta = (out.float() * grad_out.float()).sum(-1).reshape(R, H)
    flat = idx.reshape(B, S, -1).long() + (torch.arange(B, device=idx.device) * S_kv).view(B, 1, 1)
    flat = torch.where((idx >= 0) & (idx < S_kv), flat, -1).reshape(R, -1)
    valid = flat >= 0
    referenced = torch.zeros(NKV, dtype=torch.int32, device=q.device)
    referenced[flat[valid]] = 1
    live_row = valid.any(1).to(torch.int32)
    keys_all = kv.reshape(NKV, d_k).float()
    row_scale, _ = fixed_point.plan(q, grad_out, delta, keys_all[:, :d_v].bfloat16(), referenced, live_row, sm_scale)
    scale = fixed_point.lanes_scale(row_scale, gain).double()
    peaks = []
    for r in rows:
        slots = flat[r][valid[r]]
        keys = keys_all[slots]
        total = torch.logaddexp(lse.reshape(R, H)[r].float(), sink.float())
        peak = 0.0
        for h0 in range(0, H, TILE_HEADS):
            heads = slice(h0, h0 + TILE_HEADS)
            qr, dor = q.reshape(R, H, d_k)[r, heads].float(), grad_out.reshape(R, H, d_v)[r, heads].float()
            p = torch.exp(qr @ keys.T * sm_scale - total[heads, None])
            ds = p * (dor @ keys[:, :d_v].T - delta[r, heads, None]) * sm_scale
            contrib = ds.bfloat16().float().T @ qr
            contrib[:, :d_v] += p.bfloat16().float().T @ dor
            if slots.numel():
                peak = max(peak, float((contrib.abs().amax(1).double() * scale[slots]).max()))
        peaks.append(peak)
    return torch.tensor(peaks, dtype=torch.float64)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096:8192:2048,512:2048:512", help="S:S_kv:L, comma-separated")
    parser.add_argument("--H", type=int, default=64)
    parser.add_argument("--temperatures", default="1,4,16")
    parser.add_argument("--indices", default="uniform", choices=bench.INDEX_PATTERNS)
    parser.add_argument("--rows", type=int, default=96, help="query rows sampled evenly over S")
    parser.add_argument("--device", default="cpu")
    a = parser.parse_args()
    print(f"H={a.H}, {a.indices} indices, the default gain {fixed_point.LANES_GAIN}; the FFMA is exact below 2^22")
    print("  S      S_kv   L      T     log2(largest |value|)  rows at or past 2^22")
    for shape in a.shapes.split(","):
        S, S_kv, L = (int(x) for x in shape.split(":"))
        for temperature in [float(t) for t in a.temperatures.split(",")]:
            args = bench.production_inputs(1, S, S_kv, a.H, L, device=a.device, indices=a.indices,
                                           temperature=temperature)
            rows = torch.linspace(0, S - 1, min(a.rows, S)).long().unique().tolist()
            peaks = row_peaks(args, rows)
            largest = float(peaks.max())
            beyond = int((peaks >= fixed_point.MAGIC_RANGE).sum())
            print(f"  {S:<6d} {S_kv:<6d} {L:<6d} {temperature:<5g} {math.log2(largest) if largest > 0 else -math.inf:21.2f}"
                  f"  {beyond}/{len(rows)}")


if __name__ == "__main__":
    main()
