"""Layout arithmetic shared by the wrapper, the launchers' references and the CPU tile model (below them).

- ``per_head``: a per-head function with the same arithmetic whatever H is;
- ``lse_base2``: the kernels' lse convention and its bad-input rule; ``sink_rows``: each row's
  term of d_attn_sink from it;
- ``slot_keys``, ``canonical_order``, ``place_slots`` and ``rotate_walks``: the slot layout's steps.

The TileLang launcher runs these as kernels with the same results: lse_base2 and sink_rows in
the Delta launch (mqa_bwd.kernels.delta), the slot layout in mqa_bwd.kernels.prologue (the three
slot steps in one where a row fits a CTA, else slot_keys and place_slots around torch's sort);
these are their definitions.
"""

import math

import torch

from .kernels.config import LOG2E, WALK_BLOCK


def per_head(fn, rows: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """fn(rows[:, h], heads[h]) for every head h, as an [R, H] tensor.

    On a CPU, torch's vectorised transcendental functions round an element
    differently in the vector body and in the scalar tail (AVX-512), so a
    head's value would depend on how many heads share the call. One call per
    head makes every head's arithmetic the same whatever H is. GPU kernels
    compute per element already.
    """
    if rows.device.type != "cpu":
        return fn(rows, heads.view(1, -1))
    return torch.stack([fn(rows[:, h].contiguous(), heads[h]) for h in range(rows.shape[1])], dim=1)


def lse_base2(lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The kernels' convention, base 2 and sink-inclusive, from the padded [R, Hp] lse
    and [Hp] sink: Lse2 = logaddexp(lse, sink) * log2(e) per head.

    A row with no valid slot (lse = -inf) has zero gradients, the sink's too:
    Lse2 = +inf there makes both P and p_sink exactly 0, with or without a
    sink, and never NaN.

    Bad input is poisoned here, on the device (checking it on the host would
    cost a synchronisation the caller did not ask for): Lse2[r, h] is NaN where
    lse[r, h] is NaN or +inf, and in every row of head h where sink[h] is NaN or
    +inf (-inf lse included). The kernels then carry the NaN into every output
    the (row, head) reaches: its P and dS are NaN, so its dq is NaN in every
    column where the row has a valid slot, its d_sink row is NaN (so is
    d_attn_sink[h]), its dKV contributions are NaN (the atomic control's kv rows
    that its valid slots name), and its NaN softmax mass flags the row, so the
    fixed design returns its whole batch element's dKV as NaN. docs/SPEC.md, "Bad input".
    """
    lse2 = per_head(lambda lse_h, sink_h: torch.logaddexp(lse_h, sink_h) * LOG2E, lse, sink)
    lse2 = torch.where(lse == -math.inf, math.inf, lse2)
    # x < inf is false for NaN and +inf only (-inf and every finite value compare below it).
    sound = (lse < math.inf) & (sink < math.inf).view(1, -1)
    return torch.where(sound, lse2, math.nan).contiguous()


def sink_rows(lse2: torch.Tensor, sink2: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Each row's term of d_attn_sink, [R, Hp]: -exp2(Sink2[h] - Lse2[r, h]) * Delta[r, h], the
    sink's probability times Delta, from the [Hp] sink in base 2 (Sink2 = sink * log2(e), the
    multiply rounded to fp32 as the Delta kernel rounds it). Per head (per_head), as lse_base2."""
    return (-per_head(lambda lse_h, sink_h: torch.exp2(sink_h - lse_h), lse2, sink2) * delta).contiguous()


def slot_keys(indices: torch.Tensor, row0: int, S: int, S_kv: int, nkv: int) -> torch.Tensor:
    """[n, L] indices of the query rows row0 .. row0 + n (any integer dtype) -> [n, L] int32
    sort keys: b * S_kv + index where 0 <= index < S_kv (b = row // S, the row's batch
    element), else ``nkv`` = B * S_kv, above every valid row, so that invalid slots sort
    last. B * S_kv < 2**31 (validated): every key fits int32. int32 indices are compared as
    they are, any other dtype in int64."""
    work = torch.int32 if indices.dtype == torch.int32 else torch.int64
    idx = indices.to(work)
    valid = (idx >= 0) & (idx < S_kv)
    if nkv > S_kv:  # B > 1; an invalid slot's sum may overflow here: where() drops it
        batch = torch.arange(row0, row0 + idx.shape[0], device=idx.device, dtype=work) // S
        idx = idx + (batch * S_kv).view(-1, 1)
    return torch.where(valid, idx, nkv).to(torch.int32)


def canonical_order(rows: torch.Tensor) -> torch.Tensor:
    """Each row of [n, L] global kv rows ascending (invalid slots, as the largest
    value, last): one layout for every order of the same slots. The kernels sum
    dQ over slot blocks in fp32, and the softmax mass the fixed-point plan
    checks, in slot order; a top-k selector that places its picks with atomic
    counters returns the same set in a different order on every run, and with
    its slots sorted here those sums no longer see that order."""
    return torch.sort(rows, dim=1).values


def place_slots(ordered: torch.Tensor, slots: torch.Tensor, nkv: int) -> None:
    """slots [n, Lp] int32 from the ordered keys [n, L]: a key's kv row, -1 for an invalid
    slot (key ``nkv``) and for the padding columns L .. Lp."""
    L = ordered.shape[1]
    slots[:, :L] = torch.where(ordered == nkv, -1, ordered)
    slots[:, L:] = -1


def rotate_walks(slots: torch.Tensor, row0: int, S: int, block: int = WALK_BLOCK) -> torch.Tensor:
    """slots [n, Lp] of the query rows row0 .. row0 + n, placed in the canonical order (valid
    slots first), with each row's first ``blocks`` blocks of ``block`` slots (up to its last
    valid slot) rotated so that the row's walk starts at block s mod blocks, s = row mod S its
    position in the sequence: sorted block b lands at block (b - start) mod blocks; the rest
    stay. Every tile walks its blocks in slot order, so CTAs that run neighbouring rows at once
    start at different blocks: where the rows' sorted slots name much the same kv rows (an
    indexer's picks), their dKV adds go to different lines at each moment rather than all to
    the same few, which a few L2 slices would serve. The rotation depends on the row's set of
    slots and its position alone, so it keeps the order canonical, and batch, head and budget
    invariant. Lp is a multiple of ``block``: the rotated span stays inside the row."""
    n, Lp = slots.shape
    if Lp % block:
        raise ValueError(f"slots: rows of {Lp} slots, not a multiple of the walk's block ({block})")
    blocks = ((slots >= 0).sum(dim=1, dtype=torch.int64) + block - 1) // block
    span = (blocks * block).view(-1, 1)
    start = torch.remainder(torch.arange(row0, row0 + n, device=slots.device) % S, blocks.clamp(min=1)).view(-1, 1)
    position = torch.arange(Lp, device=slots.device).view(1, -1)
    source = torch.where(position < span, torch.remainder(position + start * block, span.clamp(min=1)), position)
    return torch.gather(slots, 1, source)


def row_blocks(slots: torch.Tensor, nkv: int, block: int) -> torch.Tensor:
    """[n] int32: each row's count of ``block``-slot blocks up to its last valid slot
    (0 <= slot < nkv), 0 for a row with none. Valid slots sort first in the canonical
    order, but a caller's order may interleave them: the count runs to the last."""
    valid = (slots >= 0) & (slots < nkv)
    position = torch.arange(1, slots.shape[1] + 1, device=slots.device, dtype=torch.int32)
    extent = torch.where(valid, position, 0).amax(dim=1) if slots.shape[1] else slots.new_zeros(slots.shape[0])
    return ((extent + block - 1) // block).to(torch.int32)
