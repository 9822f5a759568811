"""CPU tile model of the TileLang kernels (``backend="model"``).

Each method takes exactly what the kernel takes and keeps the kernel's launch
contract: the tile it derives from the shapes it is handed (the main backward
moves ``main_tile_heads(H)`` head rows whatever H is), the rows it reads and
writes, the points where it rounds to bf16 (P and dS before the products, dQ
and dKV at the end) and its explicit reduction orders (d_sink rows in increasing
order; the fixed-point dKV sums are order-free). Products inside one tile are done in
fp32 by torch and are not bit-identical to the tensor cores; everything the
wrapper controls is.

Every tensor a kernel touches is bounds-checked: touching a row outside it
raises ``TileBoundsError`` naming the kernel, the tensor and the row. That is
how the CPU catches the #1784 bug: hand the main backward 8 heads and it asks
for head row 8 of Q.

``ModelLauncher(deterministic=False)`` is the model of the atomic control: it
adds the dKV contributions in a fresh random order on every call, as
contending atomics do, so the determinism property can be seen to catch it
without a GPU.
"""

import dataclasses
import random

import numpy as np
import torch

from . import kernels as K
from . import fixed_point
from .fixed_point import magnitude_bits
from .contract import BoundsError
from .kernels.reductions import DSINK_GROUPS
from .kernels.config import lane_word_columns
from .kernels.wide import BOUND_CAP
from .launch import Launcher
from . import layout
from .layout import lse_base2, sink_rows


class TileBoundsError(BoundsError):
    """A kernel touched a row outside a tensor."""

    def __init__(self, kernel: str, tensor: str, row: int, extent: int, axis: str = "row", first: int = 0):
        self.kernel, self.tensor, self.row, self.extent = kernel, tensor, row, extent
        super().__init__(f"{kernel}: {tensor} {axis} {row} is outside [{first}, {extent})")


#: Slots one wgmma step (k16) adds into dQ's accumulator.
DQ_STEP = 16


def _check_rows(kernel, tensor, t: torch.Tensor, axis: int, first: int, end: int, axis_name="row"):
    """The kernel touches indices [first, end) of axis ``axis`` of ``t``."""
    extent = t.shape[axis]
    if first < 0:
        raise TileBoundsError(kernel, tensor, first, extent, axis_name)
    if end > extent:
        raise TileBoundsError(kernel, tensor, extent, extent, axis_name)


def _check_index_rows(kernel, tensor, t: torch.Tensor, rows: torch.Tensor):
    """The kernel touches the rows listed in ``rows`` (axis 0) of ``t``."""
    if rows.numel() == 0:
        return
    bad = (rows < 0) | (rows >= t.shape[0])
    if bool(bad.any()):
        row = int(rows[bad].reshape(-1)[0])
        raise TileBoundsError(kernel, tensor, row, t.shape[0])


def _shape_is(kernel, tensor, t, shape):
    if tuple(t.shape) != tuple(shape):
        # A launch with mismatched buffers would read or write past one of them.
        raise TileBoundsError(kernel, f"{tensor} (shape {tuple(t.shape)}, launch expects {tuple(shape)})", 0, 0)


def _marks_shaped(kernel, slots, referenced, live_row, q, peak_q):
    """The slot marks' buffers fit the rows of ``slots`` (mark_slots, sorted_marks)."""
    _shape_is(kernel, "LiveRow", live_row, (slots.shape[0],))
    _shape_is(kernel, "Q", q, (slots.shape[0], q.shape[1], q.shape[2]))
    _shape_is(kernel, "PeakQ", peak_q, q.shape[:2])


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def float_to_int64_rn(x: np.ndarray) -> np.ndarray:
    """PTX cvt.rni.s64.f32: round half to even, NaN -> 0, out of range -> INT64_MIN / INT64_MAX."""
    r = np.rint(np.asarray(x, dtype=np.float64))
    big = 2.0**63
    inside = np.where(np.isnan(r) | (r >= big) | (r < -big), 0.0, r).astype(np.int64)
    info = np.iinfo(np.int64)
    return np.where(r >= big, info.max, np.where(r < -big, info.min, inside)).astype(np.int64)


def float_to_int32_rn(x: np.ndarray) -> np.ndarray:
    """PTX cvt.rni.s32.f32 (CUDA __float2int_rn): half to even, NaN -> 0, saturating; as int64."""
    r = np.nan_to_num(np.rint(np.asarray(x, dtype=np.float64)))  # NaN -> 0, +-inf -> +-float max
    info = np.iinfo(np.int32)
    return np.clip(r, info.min, info.max).astype(np.int64)


def lane_words(ints: np.ndarray) -> np.ndarray:
    """[n, C] lane integers -> [n, C / 2] uint64 words lo + 2**32 hi, lo sign-extended (mod 2**64),
    in the kernel's layout (kernels.config.lane_word_columns; fixed_point.decode_lane_words)."""
    columns = np.array(lane_word_columns(ints.shape[1]), dtype=np.int64)
    values = ints.astype(np.int64)
    lo = np.ascontiguousarray(values[:, columns[:, 0]]).view(np.uint64)
    hi = np.ascontiguousarray(values[:, columns[:, 1]]).view(np.uint64)
    return lo + (hi << np.uint64(32))


#: fma(x, s, MAGIC) has the bits MAGIC_BITS + rint(x s) wherever |x s| <= 2**22 (kernels/wide.py, ws_magic_word).
MAGIC = np.float64(1.5 * 2**23)
MAGIC_BITS = np.uint64(0x4B400000)


def magic_words(scaled: np.ndarray) -> np.ndarray:
    """[n, C] fp32 scaled values -> [n, C / 2] uint64 words as the lanes launch forms them (wide.py,
    ws_magic_word): each value's bits after fma(x, s, 1.5 * 2**23) (the fp64 sum is exact where
    the result can be an integer's, and rounds to the float32 one elsewhere), the two lanes' bits
    as lo + 2**32 hi less 0x4b400000 each, mod 2**64. lane_words' where every |value| <= 2**22."""
    columns = np.array(lane_word_columns(scaled.shape[1]), dtype=np.int64)
    with np.errstate(invalid="ignore", over="ignore"):
        bits = (scaled.astype(np.float64) + MAGIC).astype(np.float32).view(np.uint32).astype(np.uint64)
    lo, hi = bits[:, columns[:, 0]], bits[:, columns[:, 1]]
    return lo + (hi << np.uint64(32)) - (MAGIC_BITS + (MAGIC_BITS << np.uint64(32)))


def beyond_magic(scaled: np.ndarray) -> np.ndarray:
    """[n] bool: contributions (rows of fp32 ``scaled``) with a value past the FFMA rounding's range
    (|value| >= 2**22, or NaN), whose query row a lanes launch flags (fixed_point.FLAG_MAGIC)."""
    with np.errstate(invalid="ignore"):
        return ~(np.abs(scaled.astype(np.float32)).max(axis=1) < np.float32(fixed_point.MAGIC_RANGE))


def contribution_bounds(values: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
    """What each contribution (a row of ``values``, fp32, times its slot's power-of-two scale in
    ``scales``; None: 1) adds to its kv row's Bound, as the kernel forms it (wide.py,
    ws_add_bounds): h, the upper 16 bits of max |x| over the columns, times the scale (exact but
    below 2**-126), bounds max |x s| by the bf16 one step above it, so min(ceil(bf16 h + 1),
    2**40); 2**40 where h + 1 is inf or NaN (as for any NaN x, or an inf x at an invalid slot's
    scale, 0), 0 where h is 0 (int64)."""
    with np.errstate(invalid="ignore", over="ignore"):
        peak = np.abs(values.astype(np.float32)).max(axis=1)
        if scales is not None:  # the upper 16 bits of the unscaled peak, scaled
            kept = ((peak.view(np.uint32) >> np.uint32(16)) << np.uint32(16)).view(np.float32)
            peak = kept * np.abs(np.asarray(scales, dtype=np.float32))
    high = peak.view(np.uint32) >> np.uint32(16)  # NaN's bits give 0x7fc0 or more
    value = ((high + np.uint32(1)) << np.uint32(16)).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        bound = np.minimum(np.ceil(value), np.float32(BOUND_CAP))
    bound = np.where(high + 1 >= 0x7F80, BOUND_CAP, bound)
    return np.where(high == 0, 0, bound).astype(np.int64)


class ModelLauncher(Launcher):
    """Runs the kernels' launch contracts on the CPU, bounds-checked."""

    poison = float("nan")
    #: Query rows processed together (the kernel's CTAs are independent per row).
    rows_per_step = 64

    def __init__(self, deterministic: bool = True, instruments=None, lanes_gain: int | None = None):
        super().__init__(instruments, lanes_gain)
        self.deterministic = deterministic
        self.name = "model" if deterministic else "model-atomic"
        self.device = torch.device("cpu")

    # -- delta -------------------------------------------------------------
    def delta(self, out, grad_out, lse, sink, lse2, delta, dsink_rows, peak_do=None):
        self.launched("delta")
        R, H, Dv = out.shape
        for name, t in (("dO", grad_out),):
            _shape_is("delta", name, t, (R, H, Dv))
        for name, t in (("Lse", lse), ("Lse2", lse2), ("Delta", delta), ("DSinkRows", dsink_rows)):
            _shape_is("delta", name, t, (R, H))
        _shape_is("delta", "Sink", sink, (H,))
        lse2.copy_(lse_base2(lse, sink))
        if peak_do is not None:
            _shape_is("delta", "PeakDO", peak_do, (R, H))
            peak_do.copy_(magnitude_bits(grad_out))
        d = (out.to(torch.float32) * grad_out.to(torch.float32)).sum(-1)
        delta.copy_(d)
        dsink_rows.copy_(sink_rows(lse2, sink * K.LOG2E, d))

    # -- main backward -----------------------------------------------------
    def main_bwd(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, *, config, sm_scale, heads=None, head_base=0,
                 row_scale=None, allowance=None, flag=None, bound=None, gate=None, claims=None, row_blocks=None):
        kernel = "main_bwd"
        if not isinstance(config, K.MainConfig):
            raise ValueError(f"config: expected a kernels.MainConfig, got {config!r}")
        self.launched(kernel)
        # The wide tile's (row, tile) items are one persistent grid's, each adding its own 64
        # heads' sums (integer adds, or atomics in no set order): as many launches of one tile.
        one_tile = dataclasses.replace(config, tiles=1)
        if config.wide:
            _check_rows(kernel, "Indices", indices, 0, 0, q.shape[0])  # before counting its rows' blocks
            if row_blocks is None:  # the launcher's own, as the TileLang launcher's
                row_blocks = torch.empty((q.shape[0],), dtype=torch.int32, device=q.device)
                self.row_blocks(indices[: q.shape[0]], kv.shape[0], row_blocks)
            _shape_is(kernel, "RowBlocks", row_blocks, (q.shape[0],))
            # The tile's warpgroup 0 walks RowBlocks[r] blocks of row r, warpgroup 1 the blocks it
            # counts in the row's slots: where the two differ, their handoffs never match and the
            # launch hangs.
            walked = layout.row_blocks(indices[: q.shape[0]], kv.shape[0], config.slot_block)
            if not torch.equal(row_blocks, walked):
                rows = (row_blocks != walked).nonzero().flatten()
                raise RuntimeError(f"main_bwd: RowBlocks[{int(rows[0])}] = {int(row_blocks[rows[0]])} where the row's slots "
                                   f"give {int(walked[rows[0]])} blocks ({rows.numel()} rows differ): the wide tile's "
                                   f"warpgroups would walk different blocks, a hang")
        for tile in range(config.tiles):
            self._main_tile(q, kv, grad_out, indices, lse2, delta, dq, dkv, one_tile, sm_scale, heads,
                            head_base + tile * config.heads, row_scale, allowance, flag, bound, gate)

    def _main_tile(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, config, sm_scale, heads, head_base,
                   row_scale, allowance, flag, bound, gate):
        kernel = "main_bwd"
        heads = heads or q.shape[1]
        mode = config.accumulate
        # A launch covers config.groups groups: the cluster's CTAs, or the wide tile's
        # two halves (one CTA, the same sums over both groups' heads).
        cluster = config.groups
        R, _, Dk = q.shape
        NKV = kv.shape[0]
        Dv = grad_out.shape[2]
        Lp = indices.shape[1]
        BS = config.slot_block
        block_H = config.heads // cluster if config.wide else config.heads  # one group's rows of the tile
        h0, h1 = head_base, head_base + cluster * block_H  # CTA g of a cluster: [h0 + g * block_H, + block_H)
        if Lp % BS:
            raise TileBoundsError(kernel, "Indices", Lp, Lp - Lp % BS, "slot")
        if Lp == 0:
            # The kernel gathers the first slot block before its loop (and the
            # last one's adds follow it): every launch reads at least one block.
            raise RuntimeError(f"main_bwd: {mode} mode needs at least one slot block of {BS} slots, got none")
        # The CTA moves head rows [h0, h0 + block_H) of Q, dO, Lse2 and Delta and
        # stores those rows of dQ, whatever the group is (in the order the kernel
        # touches them). A tile wider than the group reads and writes the next
        # group's rows (#1784), inside the tensor or past its end.
        if block_H > heads:
            end = min(h0 + heads, q.shape[1])
            raise TileBoundsError(kernel, "Q", end, end, "head row", first=h0)
        _check_rows(kernel, "Q", q, 1, h0, h1, "head row")
        _check_rows(kernel, "dO", grad_out, 1, h0, h1, "head row")
        for name, t in (("Indices", indices), ("Lse2", lse2), ("Delta", delta), ("dO", grad_out), ("dQ", dq)):
            _check_rows(kernel, name, t, 0, 0, R)
        _check_rows(kernel, "Lse2", lse2, 1, h0, h1, "head row")
        _check_rows(kernel, "Delta", delta, 1, h0, h1, "head row")
        _check_rows(kernel, "dQ", dq, 1, h0, h1, "head row")
        _shape_is(kernel, "KV", kv, (NKV, Dk))
        _shape_is(kernel, "dKV", dkv, (NKV, Dk // 2) if mode == "lanes" else (NKV, Dk))
        scaled = mode in ("fixed", "lanes")
        if scaled:
            if dkv.dtype != torch.int64:
                raise TileBoundsError(kernel, f"dKV (dtype {dkv.dtype}, {mode} mode expects int64)", 0, 0)
            _shape_is(kernel, "RowScale", row_scale, (NKV,))
            _check_rows(kernel, "Allowance", allowance, 0, 0, R)
            _check_rows(kernel, "Allowance", allowance, 1, h0, h1, "head row")
            _shape_is(kernel, "Flag", flag, (R,))
        if mode == "lanes":
            _shape_is(kernel, "Bound", bound, (NKV,))
        if config.wide and gate is not None:
            _shape_is(kernel, "Gate", gate, (1,))
            if (mode == "fixed" or config.corrections) and int(gate[0]) == 0:
                return  # the lanes' redo where no bound failed, their corrections where no row was flagged
        rows = torch.arange(R)
        group = slice(h0, h1)
        atomic_parts = []
        for s0 in range(0, rows.numel(), self.rows_per_step):
            step = rows[s0 : s0 + self.rows_per_step]
            # Per group of the launch; the dKV contribution of a slot is the fp32
            # sum over the launch's heads, here the groups' partials in group
            # order (the kernels form it in their dKV GEMMs, over all the
            # launch's P and dS, so its last bits may differ from these).
            dq_parts, contrib, masses = [], None, []
            for g in range(cluster):
                tile = slice(h0 + g * block_H, h0 + (g + 1) * block_H)
                dq_g, contrib_g, slot, mass_g = self._rows(
                    q[:, tile], kv, grad_out[:, tile], indices, lse2[:, tile], delta[:, tile], step, sm_scale, Dv, BS
                )
                dq_parts.append(dq_g)
                masses.append(mass_g)
                contrib = contrib_g if contrib is None else contrib + contrib_g
            valid = (slot >= 0) & (slot < NKV)
            if config.corrections:  # only the rows the lanes launch flagged; no dQ, flags or bounds
                flagged = (flag[step] & fixed_point.FLAG_MAGIC) != 0
                keep = valid & flagged.view(-1, 1)
                self._lanes_correct(dkv, slot[keep], contrib[keep], row_scale)
                continue
            dq[step, group] = torch.cat(dq_parts, dim=1)
            mass = torch.cat(masses, dim=1)
            if scaled:
                # As the kernel: row r's CTA flags a mass over its allowance, or a NaN one.
                over = (mass > allowance[step, group]) | torch.isnan(mass)
                flag[step[over.any(dim=1)]] |= fixed_point.FLAG_MASS
            if mode == "fixed":
                self._fixed_add(dkv, slot[valid], contrib[valid], row_scale)
            elif mode == "lanes":
                beyond = self._lanes_add(dkv, bound, slot[valid], contrib[valid], row_scale)
                row_of_slot = step.view(-1, 1).expand_as(slot)[valid]
                flag[row_of_slot[beyond]] |= fixed_point.FLAG_MAGIC
                if gate is not None and bool(beyond.any()):
                    gate[0] = 1  # opens the corrections launch
            else:
                atomic_parts.append((slot[valid], contrib[valid]))
        if mode == "atomic":
            self._atomic_add(dkv, atomic_parts)

    @staticmethod
    def _rows(q, kv, grad_out, indices, lse2, delta, step, sm_scale, Dv, BS):
        """One CTA's work for each query row in ``step``, BS slots a block (the kernel's):
        (dQ bf16, dKV contributions, slots, softmax mass per head in fp32)."""
        n, Hg, Dk = len(step), q.shape[1], q.shape[2]
        NKV, Lp = kv.shape[0], indices.shape[1]
        scale_log2 = float(sm_scale) * K.LOG2E
        qf = q[step].to(torch.float32)
        dof = grad_out[step].to(torch.float32)
        lse_r = lse2[step].view(n, Hg, 1)
        delta_r = delta[step].view(n, Hg, 1)
        slot_all = indices[step].to(torch.int64)
        acc_dq = torch.zeros((n, Hg, Dk), dtype=torch.float32)
        contrib_all = torch.zeros((n, Lp, Dk), dtype=torch.float32)
        mass = torch.zeros((n, Hg), dtype=torch.float32)
        for t in range(Lp // BS):
            slot = slot_all[:, t * BS : (t + 1) * BS]
            valid = (slot >= 0) & (slot < NKV)
            kv_t = torch.zeros((n, BS, Dk), dtype=torch.float32)
            rows_read = slot[valid]
            _check_index_rows("main_bwd", "KV", kv, rows_read)
            kv_t[valid] = kv[rows_read].to(torch.float32)

            score = torch.einsum("rhd,rjd->rhj", qf, kv_t)
            p = torch.where(valid[:, None, :], torch.exp2(score * scale_log2 - lse_r), torch.zeros(()))
            mass += p.sum(-1)
            dp = torch.einsum("rhd,rjd->rhj", dof, kv_t[..., :Dv])
            ds = p * (dp - delta_r) * float(sm_scale)
            p_b, ds_b = _bf16(p), _bf16(ds)  # the kernel's P_s and dS_s
            # dQ as the kernels' wgmma chains add it: DQ_STEP slots at a time into one fp32
            # accumulator, in slot order, whatever the block size (so the 32-slot and the wide
            # tile's 64-slot blocks give the same bits: zero heads appended change nothing).
            for k0 in range(0, BS, DQ_STEP):
                acc_dq += torch.einsum("rhj,rjd->rhd", ds_b[..., k0 : k0 + DQ_STEP], kv_t[:, k0 : k0 + DQ_STEP])
            contrib = torch.einsum("rhj,rhd->rjd", ds_b, qf)
            contrib[..., :Dv] += torch.einsum("rhj,rhd->rjd", p_b, dof)
            contrib_all[:, t * BS : (t + 1) * BS] = contrib
        return acc_dq.to(torch.bfloat16), contrib_all, slot_all, mass

    @staticmethod
    def _fixed_add(acc: torch.Tensor, rows: torch.Tensor, contrib: torch.Tensor, row_scale: torch.Tensor):
        """acc[row] += rint(contribution * RowScale[row]) in int64, as the kernel's
        __float2ll_rn (NaN -> 0, saturating) and red.global.add.u64 (wrapping).
        Integer sums do not depend on the order, so none is modelled."""
        if rows.numel() == 0:
            return
        scaled = (contrib * row_scale[rows].view(-1, 1)).numpy()  # fp32, exact: a power of two
        np.add.at(acc.numpy(), rows.numpy(), float_to_int64_rn(scaled))

    @staticmethod
    def _lanes_add(words: torch.Tensor, bound: torch.Tensor, rows: torch.Tensor, contrib: torch.Tensor,
                   row_scale: torch.Tensor) -> torch.Tensor:
        """The wide tile's lanes (kernels/wide.py): each contribution x = c * RowScale[row] (fp32,
        exact) rounded by FFMA (magic_words: two columns one word, lane_words' layout) and added
        mod 2**64; Bound[row] grows by contribution_bounds: one bound add a slot, as the kernel's
        (a slot lies in one block). Returns, per contribution, whether a value was past the
        rounding's range (beyond_magic): its query row is flagged for the corrections launch."""
        if rows.numel() == 0:
            return torch.zeros((0,), dtype=torch.bool)
        scales = row_scale[rows]
        scaled = (contrib * scales.view(-1, 1)).numpy()  # fp32, exact: a power of two
        np.add.at(words.numpy().view(np.uint64), rows.numpy(), magic_words(scaled))
        np.add.at(bound.numpy(), rows.numpy(), contribution_bounds(contrib.numpy(), scales.numpy()))
        return torch.from_numpy(beyond_magic(scaled))

    @staticmethod
    def _lanes_correct(words: torch.Tensor, rows: torch.Tensor, contrib: torch.Tensor, row_scale: torch.Tensor):
        """The corrections launch: each word's exact value (cvt.rni.s32.f32 of both columns: half to
        even, saturating, NaN -> 0; lane_words) less the lanes launch's magic_words, mod 2**64."""
        if rows.numel() == 0:
            return
        scaled = (contrib * row_scale[rows].view(-1, 1)).numpy()
        np.add.at(words.numpy().view(np.uint64), rows.numpy(), lane_words(float_to_int32_rn(scaled)) - magic_words(scaled))

    @staticmethod
    def _atomic_add(acc: torch.Tensor, parts):
        """fp32 adds of every (kv row, contribution) in a fresh random order."""
        if not parts:
            return
        rows = torch.cat([r for r, _ in parts])
        vals = torch.cat([v for _, v in parts])
        order = list(range(rows.numel()))
        random.SystemRandom().shuffle(order)
        acc_np = acc.numpy()
        rows_np, vals_np = rows.numpy(), vals.numpy()
        for i in order:
            acc_np[rows_np[i]] += vals_np[i]

    # -- slot layout ---------------------------------------------------------------
    def sorted_slots(self, indices, slots, row_blocks, row0, S, S_kv, nkv, marks=None):
        # One CTA holds SORT_CAPACITY keys: the kernel would leave a longer row's tail unwritten.
        if not indices.shape[1] <= slots.shape[1] <= K.SORT_CAPACITY:
            raise TileBoundsError("sorted_slots", f"Slots (a row of {slots.shape[1]} for {indices.shape[1]} indices)",
                                  slots.shape[1], K.SORT_CAPACITY, "slot")
        _shape_is("sorted_slots", "Slots", slots, (indices.shape[0], slots.shape[1]))
        _shape_is("sorted_slots", "RowBlocks", row_blocks, (indices.shape[0],))
        if marks is not None:
            _marks_shaped("sorted_slots", slots, *marks)
            # The kernel marks Referenced at any key below nkv: a shorter buffer would be overrun.
            _shape_is("sorted_slots", "Referenced", marks[0], (nkv,))
        super().sorted_slots(indices, slots, row_blocks, row0, S, S_kv, nkv, marks)

    def row_blocks(self, slots, nkv, row_blocks):
        _shape_is("row_blocks", "RowBlocks", row_blocks, (slots.shape[0],))
        super().row_blocks(slots, nkv, row_blocks)

    # -- slot marks --------------------------------------------------------------
    def mark_slots(self, slots, referenced, live_row, q, peak_q):
        self.launched("mark_slots")
        _marks_shaped("mark_slots", slots, referenced, live_row, q, peak_q)
        fixed_point.mark_slots(slots, referenced, live_row, q, peak_q)

    # -- d_sink reduction ----------------------------------------------------
    def dsink_reduce(self, dsink_rows, dsink):
        self.launched("dsink_reduce")
        _shape_is("dsink_reduce", "DSink", dsink, (dsink_rows.shape[1],))
        # np.add.accumulate is a sequential scan: each group's rows, then the groups, in increasing
        # order (kernels.reductions.dsink_reduce_program).
        rows = dsink_rows.numpy().astype(np.float32)
        total = np.zeros(rows.shape[1], np.float32)
        for g in range(DSINK_GROUPS):
            part = rows[g::DSINK_GROUPS]
            part = np.add.accumulate(part, axis=0, dtype=np.float32)[-1] if part.shape[0] else np.zeros_like(total)
            total = (total + part).astype(np.float32)
        dsink.copy_(torch.from_numpy(np.ascontiguousarray(total)))

    # -- cast ------------------------------------------------------------------
    def cast_bf16(self, src, dst):
        self.launched("cast_bf16")
        _shape_is("cast_bf16", "Dst", dst, tuple(src.shape))
        dst.copy_(src.to(torch.bfloat16))

    def fixed_to_bf16(self, acc, row_scale, poisoned, dst):
        kernel = "fixed_to_bf16"
        self.launched(kernel)
        _shape_is(kernel, "Dst", dst, tuple(acc.shape))
        _shape_is(kernel, "RowScale", row_scale, (acc.shape[0],))
        if poisoned.dim() != 1 or poisoned.shape[0] == 0 or acc.shape[0] % poisoned.shape[0]:
            # The kernel's batch element of kv row k is k // (NKV / B): another B reads the wrong flag.
            raise TileBoundsError(kernel, f"Poisoned (shape {tuple(poisoned.shape)}, B dividing {acc.shape[0]} kv rows)",
                                  0, 0)
        row_scale = fixed_point.poison_batches(row_scale, poisoned)
        value = (acc.to(torch.float64) / row_scale.to(torch.float64).view(-1, 1)).to(torch.float32)
        dst.copy_(value.to(torch.bfloat16))
