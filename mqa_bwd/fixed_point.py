"""The fixed-point dKV accumulator: why it cannot overflow, and its scales.

The deterministic design adds every per-slot dKV contribution c into an int64
accumulator as ``rint(c * 2**k_j)``, where ``k_j`` is one exponent per kv row
j. Integer addition is associative and commutative, so the sum has the same
bits whatever order the atomics land in: determinism without scratch that
grows with S or L (the accumulator is [B*S_kv, Dk] int64).

The range proof. For query row r and head h, take the maxima of what the
kernel reads: ``mq_rh = max_d |q[r,h,d]|``, ``mdo_rh = max_d |dO[r,h,d]|``,
``Delta_rh``, and per kv row ``mv_j = max_d |kv[j, :Dv]|``. Then

    |dP_j|  <= Dv * mdo_rh * mv_j               (dP_j = <dO_rh, kv_j[:Dv]>)
    |dS_j|  <= P_j * sm_scale * (|dP_j| + |Delta_rh|)
    |dS_j * q_d + P_j * dO_d| <= P_j * (mv_j * a_rh + b_rh),
        a_rh = sm_scale * Dv * mdo_rh * mq_rh,   b_rh = sm_scale * |Delta_rh| * mq_rh + mdo_rh.

Summed over the slots of (r, h) pointing at j, that is at most
``m_rh * (mv_j * a_rh + b_rh)`` with ``m_rh = sum_j P_j`` the softmax mass.
Only the rows of kv row j's own batch element b reach it. If every (r, h)
there has ``m_rh * a_rh <= MASS_LIMIT * a_max`` and ``m_rh * b_rh <=
MASS_LIMIT * b_max`` (maxima over the rows and heads of b), every partial sum
of kv row j's column, over any subset of its contributions, is at most

    bound_j = N_b * MASS_LIMIT * (mv_j * a_max + b_max),

N_b being the number of (row, head) pairs of b with a_rh or b_rh nonzero (the
others contribute exactly zero; so do rows with no valid slot, which are left
out). The scales are per batch element and heads of zeros change nothing, so
a batch element's dKV has the same bits alone or in a batch, and with or
without zero heads appended, for every input the proof covers.

With the forward's lse, m_rh <= 1 (the sink takes the rest), so the condition
holds with room; a head with q = dO = 0 (a padding head, whatever its lse)
contributes nothing and is exempt. The kernel checks ``m_rh <=
allowance[r, h] = MASS_LIMIT * min(a_max / a_rh, b_max / b_rh)`` for every
row and head, and that no mass is NaN, and flags the row otherwise; every
kv row of a flagged row's batch element then comes back NaN (the proof of
that element no longer holds; the others' still does), never silently
wrong. The bf16 roundings of P and dS (unit roundoff 2**-8 each) and the
fp32 products inflate the bound by about 2%. A cluster of head groups adds
one contribution per slot and column, the fp32 sum over all its heads (one
GEMM chain): still a sum of the (row, head) terms above, with fp32
roundings. ``k_j`` is the largest exponent with ``bound_j * 2**k_j <= 2**61``, so
every partial sum, with its per-contribution integer rounding (at most 1/2
each), stays below 2**62 < 2**63.

The proof is exact arithmetic; the kernel computes dP, dS and the partial sums
in fp32, which must not overflow (an infinite contribution would convert to a
saturated integer). The plan bounds those intermediates too and poisons (NaN
scale) every referenced kv row of a batch element where any could reach
FP32_SAFE = 2**100: inputs beyond bf16 training magnitudes (~1e30).

Precision: a contribution is rounded to a multiple of ``2**-k_j``, at most
``2**-60 * bound_j``, that is ``2**-60 * N_b * MASS_LIMIT`` times the largest
single (row, head) term bound: 2**-42 of it at the dsv32 shape (N_b = 2**18),
far below float32 rounding. Exponents are capped at FP32_MAX_EXPONENT so that
2**k_j is a normal float32 (only dKV below ~2**-60 of unit scale loses bits to
the cap). A row whose bound is not finite (a non-finite input it is read
with) or needs an exponent below -FP32_MAX_EXPONENT gets a NaN scale and comes
back NaN. Rows no slot points at get nothing added and stay exactly 0,
whatever their values.

The maxima are exact reductions (max has no rounding and no order), and
everything else is evaluated in float64 with elementwise operations, so the scales are
the same bits on every run, whatever the chunking or the device's scheduling.

The lanes (the wide tile's deterministic design, kernels/wide.py). Half the bytes
of int64 adds: two columns share one 64-bit word as two signed 32-bit lanes (columns
q and q + 8 of a warp's 16, the pair one thread of the kernel holds; their place is
kernels.config.lane_word_columns),
``lo + 2**32 * hi`` with ``lo`` sign-extended, and the words are added mod
2**64. Their sum is ``sum(lo) + 2**32 * sum(hi)`` mod 2**64 whatever the order
and however the partial sums wrapped, so each lane decodes exactly
(``decode_lane_words``) when its final sum lies in [-2**31, 2**31). The plan's
proof bounds partial sums at 2**61, far above real sums, so every launch of the
design, lanes or int64, adds at one lower scale, ``lanes_scale`` = the plan's
times 2**(LANES_GAIN - 30) (partial sums then stay below 2**48 in int64), and
each call proves the lanes' fit: each kv row's Bound sums, over its slots'
contributions, a ceiling of the largest |scaled value| among that contribution's columns: the
bf16 one step above its upper 16 bits (the kernel keeps two such peaks a register; a NaN or inf
counts as 2**40: it fails). Bound < LANE_LIMIT = 2**31 bounds every column's
final |sum| below 2**31. Where every row's bound holds, the decoded lanes join
the int64 accumulator; where any fails, the wide launches are redone with int64
adds of the same integers. Both give the same integer sums, so a call's bits do
not depend on which ran, and heads of zeros appended to a call (which can turn
an int64 launch into a lanes one) change nothing. The price is resolution: a
contribution is rounded to 2**(30 - LANES_GAIN) of the plan's quantum, at most
2**-46 * bound_j at LANES_GAIN = 16: 2**-28 of the largest single (row, head)
term bound at the dsv32 shape, where dKV's error against float64 stays that of
the fp32 atomics (docs/performance-log.md).
"""

import math

import torch

# The constants the plan kernels compile in live with them (kernels.config), so
# that the kernels import nothing from here: every partial sum of a kv row's
# column stays at or below 2**(PARTIAL_SUM_BITS + 1); 2**k must be a normal
# float32 in the kernel, and 2**-k in the final division. So must the lanes'
# 2**(k + gain - 30): a bound at or above FP32_SAFE poisons its element, so k
# stays above PARTIAL_SUM_BITS - 101 and that exponent above -71 at gain 0.
from .kernels.config import FP32_MAX_EXPONENT, LANE_LIMIT, LANES_GAIN, MASS_LIMIT, PARTIAL_SUM_BITS  # noqa: F401
from .kernels.config import FLAG_MAGIC, FLAG_MASS, MAGIC_RANGE  # noqa: F401  (the row flags' bits, for the host)
from .kernels.config import LANE_GROUP, lane_word_of_column

#: fp32 intermediates of the kernel must stay below this (float32 max is ~2**128).
FP32_SAFE = 2.0**100


def max_abs(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the last axis, in x's dtype (exact: the largest |element|), without an |x| temporary; NaN propagates."""
    if x.shape[-1] == 0:
        return torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    return torch.linalg.vector_norm(x, ord=math.inf, dim=-1)


def magnitude_bits(x: torch.Tensor) -> torch.Tensor:
    """int32 max over the last axis of bf16 x's low 15 bits: max |x| as a bf16 bit pattern.

    bf16 is sign-magnitude, so |x| orders as those bits do, and every NaN
    pattern lies above inf's: the integer max is exact and keeps NaN (what
    the delta kernel computes of dO, and mark_slots of q, for the plan).
    """
    if x.shape[-1] == 0:
        return torch.zeros(x.shape[:-1], dtype=torch.int32, device=x.device)
    return (x.contiguous().view(torch.int16).to(torch.int32) & 0x7FFF).amax(dim=-1)


def mark_slots(slots, referenced, live_row, q, peak_q) -> None:
    """The plan's inputs from a call's slots [R, Lp] and q [R, HQ, Dk], in place: referenced [NKV]
    and live_row [R] int32 (zeroed by the caller) become 1 where a valid slot names the kv row and
    for a row with a valid slot; peak_q [R, HQ] int32 becomes magnitude_bits(q). The reference of
    the kernels that write them (mark_slots, sorted_marks)."""
    peak_q.copy_(magnitude_bits(q))
    valid = (slots >= 0) & (slots < referenced.shape[0])
    referenced[slots[valid].long()] = 1
    live_row[valid.any(dim=1)] = 1


def bits_to_bf16(bits: torch.Tensor) -> torch.Tensor:
    """The bf16 values of magnitude_bits' patterns."""
    return bits.to(torch.int16).view(torch.bfloat16)


def plan(query, grad_out, delta, kv_v, referenced, live_row, sm_scale: float, max_q=None, max_do=None):
    """(row_scale float32 [NKV], allowance float32 [R, H]) of the module docstring.

    query [B, S, H, Dk] and grad_out [B, S, H, Dv] hold the real heads, delta
    [R, H] the Delta the kernel reads for them, kv_v [NKV, Dv] the value part
    of every kv row (NKV = B * S_kv); referenced [NKV] and live_row [R] are the
    mark_slots kernel's marks (nonzero: some valid slot names the kv row; the
    query row has a valid slot). max_q and max_do [R, H], when given, are
    max_abs of query and grad_out already reduced (mark_slots' and the delta
    kernel's; any float dtype holding the exact maxima): the same plan,
    without reading query and grad_out again.

    The three maxima read the large tensors; everything after them works on
    [R, H] and [NKV] values: some 80 small ops. This is the reference (the
    CPU model's plan); on the H200 the TileLang launcher runs the same
    operations as three kernels (kernels.plan_program), with the same bits.
    """
    B, S, H = query.shape[:3]
    mq = max_abs(query) if max_q is None else max_q.reshape(B, S, H)
    mdo = max_abs(grad_out) if max_do is None else max_do.reshape(B, S, H)
    return _plan_small(mq, mdo, max_abs(kv_v), delta, referenced, live_row, B=B, S=S, H=H, d_v=kv_v.shape[1],
                       scale=abs(float(sm_scale)))


def term_coefficients(mq, mdo, abs_delta, scale: float, d_v: int):
    """(a, b) of the module docstring, elementwise: a (row, head)'s contribution to
    kv row j is at most P_j * (mv_j * a + b) in every column."""
    return scale * d_v * mdo * mq, scale * abs_delta * mq + mdo


# Written in few ops (each is a kernel launch on a GPU): per-batch quantities
# are [B, 1] and broadcast against [B, S*H] views, scalars stay Python numbers.
def _plan_small(mq, mdo, mv, delta, referenced, live_row, *, B, S, H, d_v, scale):
    """The plan from the maxima: mq, mdo [B, S, H] and mv [NKV] in the inputs' dtypes."""
    R, NKV = B * S, mv.shape[0]
    # Rows with no valid slot contribute nothing, whatever their values. Only
    # kv rows some slot points at receive anything; the others keep an exact
    # zero whatever their values (scale 1, nothing added).
    referenced = referenced != 0
    live_row = (live_row != 0).view(B, S, 1)
    mq = torch.where(live_row, mq.to(torch.float64), 0.0).view(B, S * H)
    mdo = torch.where(live_row, mdo.to(torch.float64), 0.0).view(B, S * H)
    abs_delta = torch.where(live_row, delta.view(B, S, H).abs().to(torch.float64), 0.0).view(B, S * H)
    a, b = term_coefficients(mq, mdo, abs_delta, scale, d_v)
    a_max = a.amax(dim=1, keepdim=True)  # [B, 1]
    b_max = b.amax(dim=1, keepdim=True)
    live = ((a > 0) | (b > 0)).sum(dim=1, keepdim=True, dtype=torch.float64)  # N_b
    allowance = MASS_LIMIT * torch.minimum(torch.where(a > 0, a_max / a, math.inf), torch.where(b > 0, b_max / b, math.inf))

    mv = torch.where(referenced, mv.to(torch.float64), 0.0).view(B, NKV // B)
    bounds = live * MASS_LIMIT * (mv * a_max + b_max)

    # The proof is exact arithmetic; the kernel's fp32 intermediates (dP, dS,
    # the partial sums) must also stay finite, or an overflow would convert to
    # a saturated integer. A batch element whose peaks could reach FP32_SAFE
    # is poisoned (NaN) instead.
    mv_max = mv.amax(dim=1, keepdim=True)  # [B, 1]
    dp_peak = d_v * mdo.amax(dim=1, keepdim=True) * mv_max
    ds_each = allowance * scale * (d_v * mdo * mv_max + abs_delta)
    ds_peak = torch.where(torch.isinf(allowance), 0.0, ds_each).amax(dim=1, keepdim=True)
    peak = torch.maximum(torch.maximum(dp_peak, ds_peak), bounds.amax(dim=1, keepdim=True))
    unsafe = ~(peak < FP32_SAFE)  # [B, 1]; NaN peaks included
    scales = torch.where(unsafe, math.nan, row_scales(bounds).view(B, NKV // B)).view(NKV)
    scales = torch.where(referenced, scales, 1.0)
    return scales, allowance.to(torch.float32).view(R, H)


def poisoned_batches(row_flags: torch.Tensor, batch: int) -> torch.Tensor:
    """[batch] int32: 1 for a batch element one of whose query rows the kernel flagged, else 0.

    row_flags [R] int32 holds the kernel's per-row flags (R = batch * S): bit 0 (FLAG_MASS) a
    mass over its allowance or NaN; bit 1 is the lanes' rounding's (kernels/wide.py), not a fault.
    """
    return ((row_flags.view(batch, -1) & FLAG_MASS).amax(dim=1) > 0).to(torch.int32)


def poison_batches(row_scale: torch.Tensor, poisoned: torch.Tensor) -> torch.Tensor:
    """row_scale [B * S_kv] with NaN for every kv row of a batch element set in poisoned [B]:
    its dKV is NaN (the casts divide by the scale)."""
    batch = poisoned.shape[0]
    return torch.where(poisoned.view(batch, 1) != 0, math.nan, row_scale.view(batch, -1)).view(-1)


def row_scales(bounds: torch.Tensor) -> torch.Tensor:
    """2**k_j as float32 per kv row (NaN where the row cannot be represented)."""
    # bound = mantissa * 2**e with mantissa in [0.5, 1): the smallest power of
    # two at or above it is 2**(e - 1) when mantissa == 0.5, else 2**e.
    mantissa, e = torch.frexp(bounds)
    k = torch.clamp(PARTIAL_SUM_BITS - (e - (mantissa == 0.5).to(e.dtype)), max=FP32_MAX_EXPONENT)
    k = torch.where(bounds == 0, FP32_MAX_EXPONENT, k)
    bad = ~torch.isfinite(bounds) | (k < -FP32_MAX_EXPONENT)
    scales = torch.ldexp(torch.ones_like(bounds, dtype=torch.float32), k)
    return torch.where(bad, math.nan, scales)


def lanes_scale(row_scale: torch.Tensor, gain: int = LANES_GAIN) -> torch.Tensor:
    """The row scales every deterministic launch rounds at (lanes and int64 alike): the
    plan's times 2**(gain - 30), exact (powers of two). At gain 0 the plan's proof alone
    bounds every partial sum near 2**31; each bit of gain is a bit of resolution, until
    some row's Bound reaches LANE_LIMIT and the wide launches are redone in int64. Gain 30
    is the plan's own scale."""
    return row_scale * lanes_factor(gain)


def lanes_factor(gain: int = LANES_GAIN) -> float:
    """The power of two lanes_scale multiplies the plan's scales by: 2**(gain - 30)."""
    return 2.0 ** (check_lanes_gain(gain) - 30)


def check_lanes_gain(gain) -> int:
    """``gain`` if it is an integer 0 to 30, else a ValueError naming lanes_gain."""
    if isinstance(gain, bool) or not isinstance(gain, int) or not 0 <= gain <= 30:
        raise ValueError(f"lanes_gain: {gain!r} (an integer 0 to 30: the quantum is 2**(30 - gain) of the plan's)")
    return gain


def decode_lane_words(words: torch.Tensor) -> torch.Tensor:
    """[N, C / 2] int64 words (lo + 2**32 hi, summed mod 2**64) -> [N, C] int64 lane sums;
    exact wherever each lane's final sum fits 32 signed bits. Column c is a lane of word
    kernels.config.lane_word_of_column(c), the high one where c % LANE_GROUP >= LANE_GROUP / 2;
    the map is computed on words' device (no copy from the host)."""
    lo = (words << 32) >> 32  # arithmetic shifts: the low lane, sign-extended
    hi = (words - lo) >> 32
    column = torch.arange(2 * words.shape[1], device=words.device)
    word = lane_word_of_column(column, 2 * words.shape[1], torch.where)
    return torch.where(column % LANE_GROUP >= LANE_GROUP // 2, hi[:, word], lo[:, word])


def lanes_failed(bound: torch.Tensor) -> torch.Tensor:
    """[1] int32 on bound's device: 1 where some kv row's Bound reached LANE_LIMIT (the call
    is redone in int64), else 0. No host synchronisation."""
    return (bound >= LANE_LIMIT).any().to(torch.int32).reshape(1)


#: Words join_lanes decodes at a time: its temporaries stay near 50 MiB whatever B * S_kv.
JOIN_STEP = 1 << 20


def join_lanes(acc: torch.Tensor, words: torch.Tensor, failed: torch.Tensor, step_words: int = JOIN_STEP) -> None:
    """acc += the decoded lanes (the same scale) where ``failed`` is 0; nothing where it is 1
    (acc then holds the int64 redo's sums of the same integers). In place, a bounded number of
    kv rows at a time, no host synchronisation."""
    keep = (1 - failed).to(torch.int64)
    step = max(1, step_words // max(1, words.shape[1]))
    for r0 in range(0, words.shape[0], step):
        rows = slice(r0, r0 + step)
        acc[rows] += decode_lane_words(words[rows]) * keep
