"""How much of the fixed-point accumulator's range real dKV uses (CPU or GPU).

    python benchmarks/fixed_point_headroom.py [--S 256] [--S_kv 512] [--H 64] [--L 128] [--device cpu]

The deterministic design adds every (query row, slot) contribution to dKV as
an integer, rint(c * 2**k_j), with one exponent per kv row j chosen before
the backward from a bound on every partial sum (mqa_bwd.fixed_point). The
adds are int64, and they are the deterministic call's extra cost (issue 6):
narrower sums, such as two 32-bit lanes per 64-bit add or int32 adds, would
halve it, at 31 bits of range instead of 62. This study measures, per kv row
j of production inputs (bench.production_inputs, scaled down), how far each
bound stands above what the row's sums reach, in powers of two:

  plan      the plan's bound (N_b * MASS_LIMIT * (mv_j * a_max + b_max)):
            what the int64 design scales by
  per-slot  sum over the row's contributions of sum_h (mv_j * a_rh + b_rh):
            also rigorous (P <= 1), computable before the backward from the
            indices and the plan's maxima, and tighter
  |c| sum   max over columns of sum |c|: what bounds every partial sum of
            the row, known only after the contributions are computed (what
            an optimistic scale's overflow check would add up)

against max |dKV_j|, the largest final sum of the row. With B bits of range
under a bound, a contribution is rounded to bound * 2**-B, so the resolution
relative to the row's largest value is 2**(headroom - B): the printed
"resolution at 31 bits" column. The contributions are computed here in
float64 from the bf16 inputs, as the oracle's maths (SPEC), one row block at
a time.

It then measures what a scale from the data would give at its best
(``narrow_precision``): per kv row, the power of two that puts the row's sum
over contributions of max_d |c| (what a check must prove) in [2**(B-1),
2**B), known in advance here (a real design must guess it and check: issue 6's
fp32 fast path). The sums of the rounded contributions are exact integers,
so only the rounding is measured: dKV's relative L2 distance from the float64
sum of the same (fp32) contributions, and the share of its bf16 values that
differ from that sum's.
The int64 design (the plan's scale, 61 bits) and a plain fp32 sum in slot
order (an order of the control's atomics) are printed for comparison.

Last (``plan_lanes``), the 32-bit lanes of branch exp/fixed-lanes with the
plan's scales lowered by ``shift`` bits: a kv row's lane sums at most n terms
(n: its references), each at most 2**(k-1), with k = 32 - bit_length(n_max -
1); a contribution above 2**(k-2) takes the slow overflow path. Per shift:
the share of contributions that large and of the slots with one, and the
rounding error as above. More shift: fewer slow adds, coarser sums.

``checked_lanes`` (also ``--checked-lanes`` alone, a query-row block at a
time, so that it runs at production shapes on a GPU): the same lanes summed
mod 2**64, where a pair of lane sums decodes exactly whenever each *final*
sum fits 32 signed bits, however the partial sums wrap (``pack_pairs``,
``unpack_pairs``). No contribution needs a range test then, only a check
after the fact: per kv row, sum over its contributions of max_d |v| below
2**31 (the bound a kernel would add up beside the lanes). Per shift of the
plan's scales: the share of kv rows failing that check, the largest bound,
whether the decoded words equal the integer sums on the rows that pass, and
the rounding error as above, with an fp32 sum in slot order for comparison.
``sampled_offset`` (``--sampled-offset``, ``--temperature``): how well every
e-th query row predicts the largest bound, that is the shift to choose,
before the backward; q scaled up before the forward concentrates P.
``bound_excess`` (``--bound-excess``): how much looser two cheaper forms of
the check are (a max per warp and block; a bound from P and dS).
"""

import argparse
import functools
import math

import torch

from mqa_bwd import fixed_point
from mqa_bwd.bench import production_inputs

LANE_BITS = 31  # a signed 32-bit lane's range (the int64 design uses 61, fixed_point.PARTIAL_SUM_BITS)
MAX_LANE_BITS = 23  # exp/fixed-lanes' cap on k: its rounding trick is exact below 2**22
D_V = 512  # production_inputs' value width


def probabilities(q, kv, out, grad_out, lse, sink, idx, sm_scale, d_v):
    """(P, dS [S, H, L], Delta [S, H]) of batch element 0, in float64 (SPEC's maths)."""
    q0, kv0, o0, do0 = (t[0].double() for t in (q, kv, out, grad_out))
    lse0, idx0 = lse[0].double(), idx[0].long()
    H = q0.shape[1]
    keys = kv0[idx0]  # [S, L, Dk]
    logits = torch.einsum("shd,sld->shl", q0, keys) * sm_scale
    p = torch.exp(logits - torch.logaddexp(lse0, sink.double().view(1, H)).unsqueeze(-1))
    delta = (o0 * do0).sum(-1)  # [S, H]
    dp = torch.einsum("shd,sld->shl", do0, keys[..., :d_v])
    return p, p * (dp - delta.unsqueeze(-1)) * sm_scale, delta


def slot_contributions(q0, do0, p, ds, d_v):
    """c [S, L, Dk] = sum_h dS[r, h, l] q[r, h] + P[r, h, l] dO[r, h] (dO on the first d_v
    columns), from batch element 0's q and dO in float64 and probabilities' P and dS."""
    c = torch.einsum("shl,shd->sld", ds, q0)
    c[..., :d_v] += torch.einsum("shl,shd->sld", p, do0)
    return c


def contributions(q, kv, out, grad_out, lse, sink, idx, sm_scale, d_v):
    """(c [S, L, Dk], A [S], B [S], Delta [S, H] float32) of batch element 0, in float64:
    c as slot_contributions, A[r] = sum_h a_rh and B[r] = sum_h b_rh (a contribution to kv
    row j is at most mv_j * A[r] + B[r] in every column)."""
    q0, do0 = q[0].double(), grad_out[0].double()
    p, ds, delta = probabilities(q, kv, out, grad_out, lse, sink, idx, sm_scale, d_v)
    c = slot_contributions(q0, do0, p, ds, d_v)
    # The plan's per-(row, head) quantities (fixed_point's docstring): a_rh, b_rh.
    mq, mdo = q0.abs().amax(-1), do0.abs().amax(-1)
    a, b = fixed_point.term_coefficients(mq, mdo, delta.abs(), sm_scale, d_v)
    return c, a.sum(-1), b.sum(-1), delta.float()


@functools.lru_cache(maxsize=1)
def study_case(S: int, S_kv: int, H: int, L: int, seed: int = 0, device: str = "cpu") -> tuple:
    """(inputs, contributions) of the study at one shape: production_inputs' tuple and
    contributions' (c, A, B, Delta). The last shape is kept: main's three studies
    share one computation of the contributions (minutes at S=1024)."""
    inputs = production_inputs(1, S, S_kv, H, L, seed=seed, device=device)
    q, kv, out, grad_out, lse, sink, idx, sm_scale = inputs
    return inputs, contributions(q, kv, out, grad_out, lse, sink, idx, sm_scale, D_V)


def summed(S: int, S_kv: int, H: int, L: int, seed: int = 0, device: str = "cpu") -> tuple:
    """(flat kv row of each contribution, the contributions [S*L, Dk] as fp32 values in
    float64, their float64 sum per kv row, the int64 plan's row scales) of study_case. The
    kernel's contributions are fp32: every design sums these, so they are the reference."""
    (q, kv, _, grad_out, _, _, idx, sm_scale), (c, _, _, delta) = study_case(S, S_kv, H, L, seed, device)
    flat, rows = idx[0].long().reshape(-1), c.reshape(-1, c.shape[-1]).float().double()
    exact = torch.zeros((S_kv, c.shape[-1]), dtype=torch.float64, device=c.device).index_add_(0, flat, rows)
    return flat, rows, exact, plan_scales(q, kv, grad_out, delta, flat, sm_scale, D_V).double()


def add_in_slot_order(acc: torch.Tensor, flat: torch.Tensor, rows: torch.Tensor, L: int) -> None:
    """acc (fp32) += rows in fp32, one query row's L slots at a time, in order: an order of the
    control's atomics."""
    for i in range(0, rows.shape[0], L):
        acc.index_add_(0, flat[i : i + L], rows[i : i + L].float())


def error(got: torch.Tensor, exact: torch.Tensor) -> tuple:
    """(dKV's rel L2 from the float64 sum, share of its bf16 values that differ from that sum's)."""
    return (float((got - exact).norm() / exact.norm()),
            float((got.float().bfloat16() != exact.float().bfloat16()).float().mean()))


def plan_scales(q, kv, grad_out, delta, flat, sm_scale, d_v):
    """The int64 design's row scales 2**k_j (fixed_point.plan) for batch element 0, whose
    slots name the kv rows ``flat`` (every query row live)."""
    S, S_kv = q.shape[1], kv.shape[1]
    referenced = torch.zeros(S_kv, dtype=torch.int32, device=q.device)
    referenced[flat] = 1
    live_row = torch.ones(S, dtype=torch.int32, device=q.device)
    row_scale, _ = fixed_point.plan(q, grad_out, delta, kv[0, :, :d_v], referenced, live_row, sm_scale)
    return row_scale


def headroom(S: int, S_kv: int, H: int, L: int, seed: int = 0, device: str = "cpu") -> dict:
    """{bound name: log2(bound_j / max|dKV_j|) per kv row j that receives a nonzero sum},
    and "contributions": the mean number of contributions a kv row receives."""
    (q, kv, _, grad_out, _, _, idx, sm_scale), (c, a_row, b_row, delta) = study_case(S, S_kv, H, L, seed, device)
    flat = idx[0].long().reshape(-1)
    dkv = torch.zeros((S_kv, c.shape[-1]), dtype=torch.float64, device=c.device).index_add_(0, flat, c.reshape(-1, c.shape[-1]))
    abs_sum = torch.zeros_like(dkv).index_add_(0, flat, c.abs().reshape(-1, c.shape[-1]))
    mv = kv[0, :, :D_V].double().abs().amax(-1)  # [S_kv]
    per_slot = torch.zeros(S_kv, dtype=torch.float64, device=c.device).index_add_(
        0, flat, (mv[flat].view(S, L) * a_row.view(-1, 1) + b_row.view(-1, 1)).reshape(-1))

    # 2**61 / 2**k_j: within 2x above the plan's bound
    plan_bound = 2.0 ** fixed_point.PARTIAL_SUM_BITS / plan_scales(q, kv, grad_out, delta, flat, sm_scale, D_V).double()

    referenced = torch.zeros(S_kv, dtype=torch.bool, device=c.device)
    referenced[flat] = True
    rows = referenced & (dkv.abs().amax(-1) > 0)
    peak = dkv.abs().amax(-1)[rows]
    bounds = {"plan": plan_bound[rows], "per-slot": per_slot[rows], "|c| sum": abs_sum.amax(-1)[rows]}
    return {name: torch.log2(bound / peak) for name, bound in bounds.items()} | {"contributions": S * L / int(rows.sum())}


def data_scale(need: torch.Tensor, bits: int) -> torch.Tensor:
    """Per row, the power of two that puts ``need`` (float64, >= 0) in [2**(bits - 1), 2**bits); 1 where need is 0."""
    _, e = torch.frexp(need)  # 2**(e - 1) <= need < 2**e
    return torch.where(need > 0, torch.ldexp(torch.ones_like(need), bits - e), 1.0)


def narrow_precision(S: int, S_kv: int, H: int, L: int, bits=(24, 31), seed: int = 0, device: str = "cpu") -> dict:
    """{name: (rel L2 of dKV from the float64 sum, share of bf16 values that differ)} for fixed
    point with a per-row scale from the data at each of ``bits``, the int64 plan ("int64") and an
    fp32 sum in slot order ("fp32")."""
    flat, rows, exact, plan = summed(S, S_kv, H, L, seed, device)

    def fixed_sum(scale):  # scale [S_kv] float64, powers of two: exact integer sums, then scaled back
        ints = torch.round(rows * scale[flat].view(-1, 1))
        return torch.zeros_like(exact).index_add_(0, flat, ints) / scale.view(-1, 1)

    found = {}
    need = torch.zeros(S_kv, dtype=torch.float64, device=rows.device).index_add_(0, flat, rows.abs().amax(-1))
    for b in bits:
        found[f"data {b}-bit"] = fixed_sum(data_scale(need, b))
    found["int64"] = fixed_sum(plan)
    fp32 = torch.zeros(exact.shape, dtype=torch.float32, device=rows.device)
    add_in_slot_order(fp32, flat, rows, L)
    found["fp32"] = fp32.double()
    return {name: error(got, exact) for name, got in found.items()}


def plan_lanes(S: int, S_kv: int, H: int, L: int, shifts=(10, 11, 12), seed: int = 0, device: str = "cpu") -> dict:
    """{shift: (share of contributions above 2**(k-2), share of slots with one, dKV rel L2 from
    float64, share of bf16 values that differ)} for the plan's scales times 2**-shift, one launch."""
    flat, rows, exact, plan = summed(S, S_kv, H, L, seed, device)
    k = min(MAX_LANE_BITS, 32 - (int(torch.bincount(flat).max()) - 1).bit_length())
    found = {}
    for shift in shifts:
        scale = plan * 2.0**-shift
        v = torch.round(rows * scale[flat].view(-1, 1))
        large = v.abs() > 2.0 ** (k - 2)
        got = torch.zeros_like(exact).index_add_(0, flat, v) / scale.view(-1, 1)
        found[shift] = (float(large.double().mean()), float(large.any(-1).double().mean())) + error(got, exact)
    return found


def pack_pairs(v: torch.Tensor) -> torch.Tensor:
    """int64 words of the column pairs (2p, 2p + 1) of integer-valued v [..., 2n], each
    |v| < 2**31: lo + 2**32 * hi, two's complement; sums of words wrap mod 2**64."""
    lo, hi = v[..., 0::2].long(), v[..., 1::2].long()
    return lo + hi * 2**32


def _signed32(w: torch.Tensor) -> torch.Tensor:
    return ((w & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def unpack_pairs(w: torch.Tensor) -> torch.Tensor:
    """The column pairs of a (wrapped) sum of pack_pairs words: exact where each pair's true
    sums lie in [-2**31, 2**31), whatever the partial sums did."""
    lo = _signed32(w)
    hi = _signed32((w - lo) >> 32)
    return torch.stack((lo, hi), -1).flatten(-2)


def blocked_case(S: int, S_kv: int, H: int, L: int, seed: int = 0, device: str = "cpu", temperature: float = 1.0) -> tuple:
    """(production_inputs' tuple, the int64 plan's row scales) without the contributions, which
    contribution_blocks gives a block of query rows at a time (production shapes fit a GPU).
    ``temperature`` scales q before the forward (out and lse follow): above 1 concentrates P,
    as trained attention does, where the plan (every P at most 1) cannot tell."""
    q, kv, out, grad_out, lse, sink, idx, sm_scale = production_inputs(1, S, S_kv, H, L, seed=seed, device=device,
                                                                       temperature=temperature)
    delta = (out[0].double() * grad_out[0].double()).sum(-1).float()
    plan = plan_scales(q, kv, grad_out, delta, idx[0].long().reshape(-1), sm_scale, D_V).double()
    return (q, kv, out, grad_out, lse, sink, idx, sm_scale), plan


def contribution_blocks(inputs: tuple, rows_per_step: int):
    """Per block of ``rows_per_step`` query rows: (their row indices, the kv row of each slot
    [rows, L], the contributions [rows, L, Dk] as fp32 values in float64)."""
    q, kv, out, grad_out, lse, sink, idx, sm_scale = inputs
    for r0 in range(0, q.shape[1], rows_per_step):
        r = slice(r0, min(q.shape[1], r0 + rows_per_step))
        c, _, _, _ = contributions(q[:, r], kv, out[:, r], grad_out[:, r], lse[:, r], sink, idx[:, r], sm_scale, D_V)
        yield torch.arange(r.start, r.stop, device=q.device), idx[0, r].long(), c.float().double()


def checked_lanes(S: int, S_kv: int, H: int, L: int, shifts=(6, 8, 10), seed: int = 0, device: str = "cpu",
                  rows_per_step: int = 64) -> dict:
    """{shift: (share of kv rows whose bound sum_r max_d |v_r| reaches 2**31, log2 of the largest
    bound, decoded pairs equal the integer sums on every row that passes, dKV rel L2 from
    float64, share of bf16 values that differ)} for the plan's scales times 2**-shift, and
    "fp32": (rel L2, bf16 share) of an fp32 sum in slot order."""
    inputs, plan = blocked_case(S, S_kv, H, L, seed, device)
    Dk = inputs[0].shape[-1]
    zeros = functools.partial(torch.zeros, device=plan.device)
    exact, fp32 = zeros((S_kv, Dk), dtype=torch.float64), zeros((S_kv, Dk), dtype=torch.float32)
    sums = {s: zeros((S_kv, Dk), dtype=torch.float64) for s in shifts}
    words = {s: zeros((S_kv, Dk // 2), dtype=torch.int64) for s in shifts}
    bounds = {s: zeros(S_kv, dtype=torch.float64) for s in shifts}
    for _, kv_rows, c in contribution_blocks(inputs, rows_per_step):
        flat, rows = kv_rows.reshape(-1), c.reshape(-1, Dk)
        exact.index_add_(0, flat, rows)
        add_in_slot_order(fp32, flat, rows, L)
        for s in shifts:
            v = torch.round(rows * (plan[flat] * 2.0**-s).view(-1, 1))
            sums[s].index_add_(0, flat, v)
            bounds[s].index_add_(0, flat, v.abs().amax(-1))
            words[s].index_add_(0, flat, pack_pairs(v.clamp(-(2.0**31), 2.0**31 - 1)))
    found = {}
    for s in shifts:
        passes = bounds[s] < 2.0**31
        decoded = bool((unpack_pairs(words[s][passes]).double() == sums[s][passes]).all())
        found[s] = (float((~passes).double().mean()), math.log2(max(float(bounds[s].max()), 1.0)), decoded) \
            + error(sums[s] / (plan * 2.0**-s).view(-1, 1), exact)
    found["fp32"] = error(fp32.double(), exact)
    return found


def sampled_offset(S: int, S_kv: int, H: int, L: int, every=(16, 64), temperature: float = 1.0, seed: int = 0,
                   device: str = "cpu", rows_per_step: int = 64) -> dict:
    """How well a sample of query rows predicts the lanes' check (checked_lanes) before the
    backward: {"full": log2 of the largest kv row bound sum_r max_d |c_r| * 2**k_j (the plan's
    scale, shift 0), e: log2 of ``e`` times the largest such bound over the query rows r with
    r % e == 0}. The smallest shift whose check passes is about full - 31; a sample that
    predicts it within a bit could set the shift per batch element (blocked_case: temperature)."""
    inputs, plan = blocked_case(S, S_kv, H, L, seed, device, temperature)
    full = torch.zeros(S_kv, dtype=torch.float64, device=plan.device)
    sampled = {e: torch.zeros_like(full) for e in every}
    for query_rows, kv_rows, c in contribution_blocks(inputs, rows_per_step):
        bound = c.abs().amax(-1) * plan[kv_rows]  # [rows, L]: each slot's largest |v| at shift 0
        full.index_add_(0, kv_rows.reshape(-1), bound.reshape(-1))
        for e in every:
            keep = query_rows % e == 0
            sampled[e].index_add_(0, kv_rows[keep].reshape(-1), bound[keep].reshape(-1))
    return {"full": math.log2(float(full.max()))} | {e: math.log2(e * float(sampled[e].max())) for e in every}


#: The wide tile's add sites: the columns each adds (the first chunk, the second chunk's halves, the tail).
ADD_SITES = ((0, 256), (256, 384), (384, 512), (512, 576))


def bound_excess(S: int, S_kv: int, H: int, L: int, seed: int = 0, device: str = "cpu") -> dict:
    """How far two cheaper forms of the lanes' check stand above the per-slot one, in bits:
    {name: (at the largest kv row, least, median and most over rows)} of log2(cheaper bound /
    per-slot bound), where the per-slot bound of kv row j at add site a is the sum over the slots
    naming j of max over a's columns of |c|, and

      group   each slot counted with the largest such max among the 4 slots a warp adds of its
              block (w, w + 8, w + 16, w + 24): one max per lane and block, no per-slot work
      P, dS   sum_h |dS_h| max|q_h| + P_h max|dO_h| per slot (every column, no cancellation
              over the heads): computable before the dKV GEMMs, outside the add loop."""
    if L % 32:
        raise ValueError(f"bound_excess: L={L} must be a multiple of 32 (the kernel's slot blocks)")
    q, kv, out, grad_out, lse, sink, idx, sm_scale = production_inputs(1, S, S_kv, H, L, seed=seed, device=device)
    flat = idx[0].long().reshape(-1)
    p, ds, _ = probabilities(q, kv, out, grad_out, lse, sink, idx, sm_scale, D_V)
    q0, do0 = q[0].double(), grad_out[0].double()
    c = slot_contributions(q0, do0, p, ds, D_V)
    site_max = torch.stack([c[..., a:b].abs().amax(-1) for a, b in ADD_SITES], -1)  # [S, L, sites]
    group = site_max.reshape(S, L // 32, 4, 8, len(ADD_SITES)).amax(2, keepdim=True).expand(
        S, L // 32, 4, 8, len(ADD_SITES)).reshape(S, L, len(ADD_SITES))
    from_p = torch.einsum("shl,sh->sl", ds.abs(), q0.abs().amax(-1)) + torch.einsum("shl,sh->sl", p, do0.abs().amax(-1))

    def per_row(v):  # [S, L, ...] -> [S_kv, ...]
        return torch.zeros((S_kv,) + v.shape[2:], dtype=torch.float64, device=v.device).index_add_(
            0, flat, v.reshape((-1,) + v.shape[2:]))

    tight = per_row(site_max)  # [S_kv, sites]
    found = {}
    for name, loose in (("group", per_row(group)), ("P, dS", per_row(from_p).unsqueeze(-1).expand_as(tight))):
        rows = tight.amax(-1) > 0
        ratio = torch.log2(loose.amax(-1)[rows] / tight.amax(-1)[rows])
        found[name] = (math.log2(float(loose.max() / tight.max())), float(ratio.min()), float(ratio.median()),
                       float(ratio.max()))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, default in (("S", 256), ("S_kv", 512), ("H", 64), ("L", 128), ("seed", 0)):
        parser.add_argument(f"--{key}", type=int, default=default)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checked-lanes", metavar="SHIFTS", help="only checked_lanes, at these shifts (e.g. 6,7,8)")
    parser.add_argument("--sampled-offset", metavar="EVERY", help="only sampled_offset, sampling every EVERY-th query row (e.g. 16,64)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampled_offset: q's scale before the forward")
    parser.add_argument("--bound-excess", action="store_true", help="only bound_excess")
    a = parser.parse_args()
    if a.bound_excess:
        print(f"B=1 S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}: log2(bound / per-slot bound), "
              "at the largest kv row / least / median / most over rows")
        for name, values in bound_excess(a.S, a.S_kv, a.H, a.L, a.seed, a.device).items():
            print(f"  {name:<6} " + " ".join(f"{v:6.2f}" for v in values))
        return
    if a.sampled_offset:
        every = tuple(int(x) for x in a.sampled_offset.split(","))
        found = sampled_offset(a.S, a.S_kv, a.H, a.L, every, a.temperature, a.seed, a.device)
        full = found.pop("full")
        print(f"B=1 S={a.S} S_kv={a.S_kv} H={a.H} L={a.L} temperature {a.temperature}: largest bound 2^{full:.2f} "
              f"(smallest passing shift about {math.ceil(full - 31)})")
        for e, guess in found.items():
            print(f"  every {e:>4}th row: predicts 2^{guess:.2f} ({guess - full:+.2f} bits)")
        return
    if a.checked_lanes:
        shifts = tuple(int(x) for x in a.checked_lanes.split(","))
        found = checked_lanes(a.S, a.S_kv, a.H, a.L, shifts, a.seed, a.device)
        rel, flips = found.pop("fp32")
        print(f"B=1 S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}; fp32 sum in slot order: rel L2 {rel:.2e}, bf16 differ {flips:.3%}")
        print(f"{'shift':<6} {'rows failing':>13} {'log2 max bound':>15} {'decoded exact':>14} {'dKV rel L2':>11} {'bf16 differ':>12}")
        for shift, (failing, top, decoded, rel, flips) in found.items():
            print(f"{shift:<6} {failing:>13.3e} {top:>15.2f} {str(decoded):>14} {rel:>11.2e} {flips:>12.3%}")
        return
    found = headroom(a.S, a.S_kv, a.H, a.L, a.seed, a.device)
    print(f"B=1 S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}: {found.pop('contributions'):.0f} contributions a kv row on average")
    print(f"{'bound':<10} {'log2(bound / max|dKV_j|), quantiles 0 / 50 / 90 / 100 %':<58} resolution at {LANE_BITS} bits (median row)")
    for name, log2_ratio in found.items():
        qs = torch.quantile(log2_ratio, torch.tensor([0.0, 0.5, 0.9, 1.0], dtype=torch.float64, device=log2_ratio.device))
        print(f"{name:<10} " + " / ".join(f"{v:6.1f}" for v in qs.tolist()).ljust(58)
              + f" 2^{math.floor(qs[1].item() - LANE_BITS)} of the row's largest value")
    print(f"{'sums':<14} {'dKV rel L2 from float64':>24} {'bf16 values that differ':>24}")
    for name, (rel, flips) in narrow_precision(a.S, a.S_kv, a.H, a.L, seed=a.seed, device=a.device).items():
        print(f"{name:<14} {rel:>24.2e} {flips:>24.2%}")
    print(f"{'lanes, shift':<14} {'contributions > 2^(k-2)':>24} {'slots with one':>16} {'dKV rel L2':>12} {'bf16 differ':>12}")
    for shift, (large, slots, rel, flips) in plan_lanes(a.S, a.S_kv, a.H, a.L, seed=a.seed, device=a.device).items():
        print(f"{shift:<14} {large:>24.2e} {slots:>16.2e} {rel:>12.2e} {flips:>12.2%}")


if __name__ == "__main__":
    main()
