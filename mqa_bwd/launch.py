"""The launch contract shared by the TileLang kernels and the CPU tile model.

A ``Launcher`` is what the host wrapper drives: one method per kernel, each
taking exactly the tensors the kernel takes (torch tensors, on the launcher's
device). The wrapper never computes a gradient itself; it lays out inputs and
launches. Scratch, outputs and padded copies are allocated through
``empty``, ``zeros`` and ``zeros_together``; small index and layout tensors
made by torch ops (slots, Lse2, the reference plan's fixed-point scales) are not.

Instrumentation is injected: a launcher built with ``instruments``
(``mqa_bwd.contract.Instruments``) allocates through its ``allocate`` where
set and counts "allocations", "launches" and "launch:<kernel>" in it, so that
a test can prove that a rejected call launched and allocated nothing.
"""

import dataclasses
import functools

import torch

from . import fixed_point
from . import kernels as K
from . import layout
from .contract import Instruments


#: The float dtype zeros_together fills each element width through: one multi-tensor fill for every
#: width that is whole 4-byte words.
_FILL_VIEW = {2: torch.float16, 4: torch.float32, 8: torch.float32}


class Launcher:
    """Base class: allocation and accounting. Subclasses implement the kernels."""

    name = "abstract"
    device = torch.device("cpu")
    #: True: the deterministic dKV designs (int64 fixed point; lanes on the wide tile). False: fp32 atomics.
    deterministic = True
    #: Poison value for uninitialised floating allocations (None: leave as is).
    poison = None

    #: The injected instruments (None: allocate with torch, count nothing).
    instruments: Instruments | None = None
    #: The scale every deterministic launch rounds at, as bits of resolution over the plan's
    #: proof (fixed_point.lanes_scale): a configuration, so that a test can take the wide
    #: tile's lanes where the default would redo them in int64, and back.
    lanes_gain: int = K.LANES_GAIN
    #: The last deterministic wide call's [1] int32 redo flag on the device (1: a bound failed
    #: and its wide launches were redone in int64, to the same bits); None before any.
    #: Reading it synchronises.
    lanes_redone = None

    def __init__(self, instruments: Instruments | None = None, lanes_gain: int | None = None):
        if instruments is not None and not isinstance(instruments, Instruments):
            raise ValueError(f"instruments: expected a mqa_bwd.Instruments or None, got {type(instruments).__name__}")
        self.instruments = instruments
        if lanes_gain is not None:
            self.lanes_gain = fixed_point.check_lanes_gain(lanes_gain)

    def _count(self, what: str) -> None:
        if self.instruments is not None:
            self.instruments.count(what)

    def _allocate(self, shape, dtype):
        self._count("allocations")
        if self.instruments is not None and self.instruments.allocate is not None:
            return self.instruments.allocate(shape, dtype, self.device)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def empty(self, shape, dtype):
        t = self._allocate(shape, dtype)
        if self.poison is not None and t.is_floating_point():
            t.fill_(self.poison)
        return t

    def zeros(self, shape, dtype):
        return self._allocate(shape, dtype).zero_()

    def zeros_together(self, *specs) -> list:
        """A zeroed tensor of each (shape, dtype) of ``specs``, each its own allocation (guard
        bands keep one around each), zeroed by one multi-tensor fill: the wrapper zeroes several
        buffers before its main launch, where each fill is a launch of host time. The fill goes
        through float32 views of every buffer whose elements are whole 4-byte words (zero bits
        either way: torch's CUDA multi-tensor zero takes only floating dtypes in some releases),
        float16 views of 2-byte ones; anything else is zeroed by itself."""
        tensors = [self._allocate(shape, dtype) for shape, dtype in specs]
        groups: dict = {}
        for t in tensors:
            as_float = _FILL_VIEW.get(t.element_size())
            if as_float is None or not t.is_contiguous():
                t.zero_()
            else:
                groups.setdefault(as_float, []).append((t if t.dim() else t.view(1)).view(as_float))
        for views in groups.values():
            torch._foreach_zero_(views)
        return tensors

    def launched(self, kernel: str) -> None:
        self._count("launches")
        self._count(f"launch:{kernel}")

    def note_lanes_redone(self, failed) -> None:
        """Keep a call's redo flag (lanes_redone), and hand it to the instruments."""
        self.lanes_redone = failed
        if self.instruments is not None:
            self.instruments.note_redone(failed)

    def check_widths(self, d_k: int, d_v: int) -> None:
        """Raise ValueError for widths this launcher cannot build."""

    # Kernels: see mqa_bwd.kernels for the contract of each.
    def slot_keys(self, indices, keys, row0, S, S_kv, nkv):
        """keys [n, L] int32: the sort keys of the indices [n, L] (int32 or int64) of query rows
        row0 .. row0 + n (layout.slot_keys). Here the reference."""
        self.launched("slot_keys")
        keys.copy_(layout.slot_keys(indices, row0, S, S_kv, nkv))

    def place_slots(self, ordered, slots, nkv):
        """slots [n, Lp] int32 from the ordered keys [n, L] (layout.place_slots). Here the reference."""
        self.launched("place_slots")
        layout.place_slots(ordered, slots, nkv)

    def rotate_walks(self, slots, row0, S):
        """slots [n, Lp] int32 of the query rows row0 .. row0 + n, placed in the canonical order,
        rotated in place (layout.rotate_walks). Here the reference, on the slots' device: it
        follows place_slots where a row is too long for sorted_slots' one CTA."""
        self.launched("rotate_walks")
        slots.copy_(layout.rotate_walks(slots, row0, S))

    def row_blocks(self, slots, nkv, row_blocks):
        """row_blocks [R] int32: each row of slots [R, Lp]'s count of the wide tile's blocks
        (kernels.WIDE_SLOTS slots) up to its last valid slot (layout.row_blocks). Here the reference."""
        self.launched("row_blocks")
        row_blocks.copy_(layout.row_blocks(slots, nkv, K.WIDE_SLOTS))

    def sorted_slots(self, indices, slots, row_blocks, row0, S, S_kv, nkv, marks=None):
        """slots [n, Lp] int32 of the query rows row0 .. row0 + n from their indices [n, L] (int32
        or int64, Lp <= kernels.SORT_CAPACITY): slot_keys, canonical_order, place_slots and
        rotate_walks in one step, with no keys in memory, and row_blocks [n] int32, what
        Launcher.row_blocks writes for those slots. With ``marks`` (referenced [NKV], and
        live_row [n], q [n, HQ, Dk] and peak_q [n, HQ] of these rows), the same launch also does
        mark_slots' work for them. Here the reference (layout's four steps and row_blocks,
        fixed_point.mark_slots)."""
        self.launched("sorted_slots")
        layout.place_slots(layout.canonical_order(layout.slot_keys(indices, row0, S, S_kv, nkv)), slots, nkv)
        slots.copy_(layout.rotate_walks(slots, row0, S))
        row_blocks.copy_(layout.row_blocks(slots, nkv, K.WIDE_SLOTS))
        if marks is not None:
            fixed_point.mark_slots(slots, *marks)

    def delta(self, out, grad_out, lse, sink, lse2, delta, dsink_rows, peak_do=None):
        """From the padded lse [R, H] and sink [H] (f32, natural log): lse2 [R, H], the kernels'
        base-2, sink-inclusive lse, poisoned where the input is bad (layout.lse_base2); then Delta
        and DSinkRows [R, H] (layout.sink_rows) from out and grad_out and those. With peak_do (the
        fixed-point design), also peak_do [R, H] int32: fixed_point.magnitude_bits of grad_out
        (max |dO| as bf16 bits)."""
        raise NotImplementedError

    def main_bwd(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, *, config, sm_scale, heads=None, head_base=0,
                 row_scale=None, allowance=None, flag=None, bound=None, gate=None, claims=None, row_blocks=None):
        """One launch of the kernel ``config`` (kernels.MainConfig, chosen by
        kernels.main_launches) over ``config.groups`` consecutive groups of ``heads``
        heads from ``head_base`` of the [R, HQ, ...] tensors q, grad_out, lse2,
        delta, dq (and allowance). The kernel's tile is ``config.heads`` rows per
        group's CTA, whatever ``heads`` is (SPEC); ``heads`` defaults to HQ.
        ``row_scale`` [NKV] f32, ``allowance`` [R, HQ] f32 and ``flag`` [R] i32:
        the fixed and lanes accumulations only. A launch of two groups sums each
        slot's dKV contribution over all their heads before its add; the wide
        tile's launch of several 64-head tiles (config.tiles) adds each tile's.

        Accumulation "lanes" (the wide tile): dkv is [NKV, Dk / 2] int64 words,
        row_scale the lanes' (fixed_point.lanes_scale) and ``bound`` [NKV] int64 the
        per-row proof the launch adds to. ``gate`` [1] int32: a wide "fixed" launch (the
        lanes' redo) and a lanes corrections launch do nothing unless gate[0] is nonzero
        (None: they run); a lanes launch sets gate[0] to 1 wherever it flags a row for its
        corrections (fixed_point.FLAG_MAGIC; None: it sets a word of its own).
        ``claims`` [1] int32, zeroed: the wide launch's count of the items its CTAs claimed
        (kernels/wide.py; None: one of its own, a fill more). ``row_blocks`` [R] int32: the wide
        launch's blocks a row, Launcher.row_blocks of ``indices`` (None: its own, a launch more)."""
        raise NotImplementedError

    def dsink_reduce(self, dsink_rows, dsink):
        raise NotImplementedError

    def mark_slots(self, slots, referenced, live_row, q, peak_q):
        """The fixed-point plan's marks (referenced [NKV] and live_row [R] int32, zeroed by the
        caller: 1 where a valid slot names the kv row, and for a row with a valid slot) and its
        maxima of q [R, HQ, Dk]: peak_q [R, HQ] int32, fixed_point.magnitude_bits of q."""
        raise NotImplementedError

    def plan(self, query, grad_out, delta, kv, referenced, live_row, sm_scale, peak_q, peak_do, plan_peaks=None):
        """(row_scale [NKV] f32, allowance [R, H] f32): the fixed-point plan
        (fixed_point.plan) of the H = query.shape[2] real heads, from the delta
        launch's Delta and maxima of dO (delta, peak_do [R, HQ], HQ >= H), the
        slot marks and their maxima of q (peak_q [R, HQ]) and the kv rows [NKV, W]
        (their first Dv = grad_out.shape[3] columns are the value part the plan
        bounds), with row_scale the one every deterministic launch rounds at: the
        plan's at this launcher's lanes_gain (fixed_point.lanes_scale). Here in torch
        ops, the reference; a launcher may run it as kernels, with the same bits, reducing
        its per-batch peaks into ``plan_peaks`` [B, kernels.PLAN_SLOTS] int64, zeroed by
        the caller (None: a buffer of its own, a fill more)."""
        H, d_v = query.shape[2], grad_out.shape[3]
        row_scale, allowance = fixed_point.plan(query, grad_out, delta[:, :H], kv[:, :d_v], referenced, live_row, sm_scale,
                                                max_q=fixed_point.bits_to_bf16(peak_q[:, :H]),
                                                max_do=fixed_point.bits_to_bf16(peak_do[:, :H]))
        return fixed_point.lanes_scale(row_scale, self.lanes_gain), allowance

    def lanes_failed(self, bound, failed):
        """failed [1] int32, zeroed by the caller: 1 where some kv row's bound [NKV] int64 reached
        LANE_LIMIT (fixed_point.lanes_failed: the lanes' int64 redo runs). Here the reference."""
        self.launched("lanes_failed")
        failed.copy_(fixed_point.lanes_failed(bound))

    def poisoned_batches(self, row_flags, poisoned):
        """poisoned [B] int32, zeroed by the caller: 1 for a batch element one of whose query rows
        row_flags [R] (R = B * S) flags a mass (fixed_point.poisoned_batches). Here the reference."""
        self.launched("poisoned_batches")
        poisoned.copy_(fixed_point.poisoned_batches(row_flags, poisoned.shape[0]))

    def zero_gated(self, acc, gate):
        """acc [NKV, Dk] int64 zeroed where gate [1] int32 is set, left as it is where not, with no
        host synchronisation. Here the reference."""
        self.launched("zero_gated")
        acc.masked_fill_(gate.view(1, 1).expand_as(acc) != 0, 0)

    def cast_bf16(self, src, dst):
        raise NotImplementedError

    def fixed_to_bf16(self, acc, row_scale, poisoned, dst):
        """dst [NKV, Dk] bf16 = acc / row_scale, with row_scale NaN for the batch elements set in
        poisoned [B] (fixed_point.poison_batches)."""
        raise NotImplementedError

    def lanes_to_bf16(self, acc, words, failed, row_scale, poisoned, dst, acc_summed=True):
        """fixed_to_bf16 of acc [NKV, Dk] int64 with the lanes' words [NKV, Dk / 2] joined where
        ``failed`` [1] int32 is 0 (fixed_point.join_lanes). ``acc_summed`` False is the caller's
        word that acc is zero unless ``failed`` is set (every launch added in lanes; acc holds
        only the redo's sums), so that a launcher may skip reading it. Here the reference, which
        joins into acc in place (scratch the call drops); a launcher may fuse both, with the same
        bits."""
        if not acc_summed:  # what acc holds where the redo did not run is not read: zeros
            acc.masked_fill_(failed.view(1, 1).expand_as(acc) == 0, 0)
        fixed_point.join_lanes(acc, words, failed)
        self.fixed_to_bf16(acc, row_scale, poisoned, dst)


_GATES_OPEN: dict = {}


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """The SMs of ``device``: the persistent wide tile's CTAs, one an SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _gate_open(device: torch.device) -> torch.Tensor:
    """A [1] int32 one on ``device``: the Gate of a wide launch that always runs (kernels read it,
    never write it), made once rather than a launch on every call: by a blocking copy, so that it
    is ready for every stream. While a CUDA graph is being captured that copy cannot run, and a
    tensor made in the capture belongs to the graph's memory: that call gets one of its own."""
    gate = _GATES_OPEN.get(device)
    if gate is None:
        if torch.cuda.is_current_stream_capturing():
            return torch.ones((1,), dtype=torch.int32, device=device)
        gate = _GATES_OPEN[device] = torch.ones((1,), dtype=torch.int32).to(device)
    return gate


class TileLangLauncher(Launcher):
    """Launches the compiled TileLang kernels on the current CUDA device.

    wide_tile: MainConfig fields the wide tile's launches take in place of their defaults, e.g.
    {"wg0_chunks": 4}: two variants of a kernel are two configurations, timed side by side
    (benchmarks/config_ab.py)."""

    name = "tilelang"

    def __init__(self, deterministic: bool = True, device=None, instruments: Instruments | None = None,
                 lanes_gain: int | None = None, wide_tile: dict | None = None):
        super().__init__(instruments, lanes_gain)
        self.wide_tile = dict(wide_tile or {})
        # tiles is how much of the call a launch covers (kernels.main_launches), not how a tile runs.
        fields = {f.name for f in dataclasses.fields(K.MainConfig)} - {"heads", "d_k", "d_v", "accumulate", "cluster", "tiles"}
        if not set(self.wide_tile) <= fields:
            raise ValueError(f"wide_tile: {sorted(set(self.wide_tile) - fields)} are not the wide tile's fields {sorted(fields)}")
        # Every wide launch it can make, checked here rather than at the first one (the defaults
        # are valid by construction: every public call builds a launcher, on the host's critical path).
        for d_k, d_v in K.GPU_WIDTHS if self.wide_tile else ():
            try:
                K.require_wide_widths(dataclasses.replace(K.MainConfig(K.WIDE_HEADS, d_k, d_v, "lanes"), **self.wide_tile))
            except ValueError as e:
                raise ValueError(f"wide_tile: {e}") from None
        self.deterministic = deterministic
        self.name = "tilelang" if deterministic else "tilelang-atomic"
        self.device = torch.device(device if device is not None else "cuda")

    def check_widths(self, d_k, d_v):
        if (d_k, d_v) not in K.GPU_WIDTHS:
            raise ValueError(
                f"query: width Dk={d_k} with Dv={d_v} cannot be built by the TileLang kernel; "
                f"supported (Dk, Dv): {list(K.GPU_WIDTHS)}"
            )

    def row_blocks(self, slots, nkv, row_blocks):
        kernel = K.small_kernel("row_blocks")
        self.launched("row_blocks")
        kernel(slots, row_blocks, int(nkv))

    def slot_keys(self, indices, keys, row0, S, S_kv, nkv):
        kernel = K.small_kernel("slot_keys", str(indices.dtype).removeprefix("torch."))
        self.launched("slot_keys")
        kernel(indices, keys, int(row0), int(S), int(S_kv), int(nkv))

    def place_slots(self, ordered, slots, nkv):
        kernel = K.small_kernel("place_slots")
        self.launched("place_slots")
        kernel(ordered, slots, int(nkv))

    def sorted_slots(self, indices, slots, row_blocks, row0, S, S_kv, nkv, marks=None):
        if not indices.shape[1] <= slots.shape[1] <= K.SORT_CAPACITY:  # a CTA would leave the tail unwritten
            raise ValueError(f"slots: rows of {slots.shape[1]} slots for {indices.shape[1]} indices; sorted_slots "
                             f"takes L <= Lp <= {K.SORT_CAPACITY}")
        if row_blocks.shape != (slots.shape[0],):  # a CTA a row writes its count
            raise ValueError(f"row_blocks: shape {tuple(row_blocks.shape)}, sorted_slots writes ({slots.shape[0]},)")
        dtype, items = str(indices.dtype).removeprefix("torch."), K.sort_items(slots.shape[1])
        self.launched("sorted_slots")
        if marks is None:
            K.small_kernel("sorted_slots", dtype, items)(indices, slots, row_blocks, int(row0), int(S), int(S_kv),
                                                         int(nkv), int(nkv).bit_length())
            return
        referenced, live_row, q, peak_q = marks
        if referenced.shape != (nkv,):  # the kernel marks it at any key below nkv
            raise ValueError(f"referenced: shape {tuple(referenced.shape)}, sorted_slots marks ({nkv},)")
        K.small_kernel("sorted_marks", dtype, items, q.shape[2])(indices, slots, row_blocks, referenced, live_row, q, peak_q,
                                                                 int(row0), int(S), int(S_kv), int(nkv), int(nkv).bit_length())

    def delta(self, out, grad_out, lse, sink, lse2, delta, dsink_rows, peak_do=None):
        self.launched("delta")
        if peak_do is None:
            K.small_kernel("delta", out.shape[2])(out, grad_out, lse, sink, lse2, delta, dsink_rows)
        else:
            K.small_kernel("delta_max", out.shape[2])(out, grad_out, lse, sink, lse2, delta, dsink_rows, peak_do)

    def main_bwd(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, *, config, sm_scale, heads=None, head_base=0,
                 row_scale=None, allowance=None, flag=None, bound=None, gate=None, claims=None, row_blocks=None):
        if config.wide and self.wide_tile:
            config = dataclasses.replace(config, **self.wide_tile)
        kernel = K.compiled(config)
        if row_scale is None:  # the atomic kernel never touches them; the signature is shared
            row_scale = torch.empty((kv.shape[0],), dtype=torch.float32, device=kv.device)
            allowance = lse2  # the right shape, never read
            flag = torch.empty((q.shape[0],), dtype=torch.int32, device=kv.device)
        if config.wide:  # Bound (the lanes only) and Gate (set by the lanes, read by the corrections and the redo)
            if bound is None:
                bound = torch.empty((kv.shape[0],), dtype=torch.int64, device=kv.device)
            if gate is None:  # the lanes launch writes it: never the shared open gate
                sets_gate = config.accumulate == "lanes" and not config.corrections
                gate = torch.zeros((1,), dtype=torch.int32, device=kv.device) if sets_gate else _gate_open(kv.device)
            if claims is None:
                claims = torch.zeros((1,), dtype=torch.int32, device=kv.device)
            if row_blocks is None:
                row_blocks = torch.empty((q.shape[0],), dtype=torch.int32, device=kv.device)
                self.row_blocks(indices[: q.shape[0]], kv.shape[0], row_blocks)
            last = (bound, gate, config.tiles, min(q.shape[0] * config.tiles, _sm_count(kv.device)), claims, row_blocks)
        else:
            # The narrow kernels' last two arguments (shard_base, n_shards) are unused by the kept
            # configurations; they stay in the signature so that the generated code is unchanged.
            last = (0, 1)
        self.launched("main_bwd")
        kernel(q, kv, grad_out, indices, lse2, delta, dq, dkv, row_scale, allowance, flag, float(sm_scale),
               int(head_base), *last)

    def dsink_reduce(self, dsink_rows, dsink):
        kernel = K.small_kernel("dsink_reduce")
        self.launched("dsink_reduce")
        kernel(dsink_rows, dsink)

    def plan(self, query, grad_out, delta, kv, referenced, live_row, sm_scale, peak_q, peak_do, plan_peaks=None):
        # Three launches (kernels.plan_program) where the torch ops took some 80
        # kernels and their copies in and out of a CUDA graph; the first also takes
        # max |kv| of the referenced rows (MV), a torch reduction's launch less on
        # the host's path to the main launch.
        B, S, H = query.shape[:3]
        NKV, d_v = kv.shape[0], grad_out.shape[3]
        R, S_kv, scale = B * S, NKV // B, abs(float(sm_scale))
        kv = kv.contiguous()  # the wrapper's rows already are: whole rows of 16-byte loads
        # Through the launcher's allocator: the injected one where given, poisoned where asked.
        peaks = self.zeros((B, K.PLAN_SLOTS), torch.int64) if plan_peaks is None else plan_peaks
        mv = self.empty((NKV,), torch.bfloat16)
        allowance = self.empty((R, H), torch.float32)
        row_scale = self.empty((NKV,), torch.float32)
        inputs = (peak_q, peak_do, delta, live_row, mv, referenced, peaks)
        self.launched("plan")
        K.small_kernel("plan", "terms")(peak_q, peak_do, delta, live_row, kv, mv, referenced, peaks, S, H, S_kv, d_v,
                                        scale * d_v, scale)
        K.small_kernel("plan", "peaks")(*inputs, allowance, S, H, S_kv, d_v, scale * d_v, scale, fixed_point.MASS_LIMIT)
        # The lanes' gain is a power of two the last stage multiplies by (fixed_point.lanes_scale's product,
        # the same bits): no launch of its own.
        K.small_kernel("plan", "scales")(mv, referenced, peaks, row_scale, S_kv, d_v, fixed_point.MASS_LIMIT, fixed_point.FP32_SAFE,
                                         fixed_point.lanes_factor(self.lanes_gain))
        return row_scale, allowance

    def mark_slots(self, slots, referenced, live_row, q, peak_q):
        kernel = K.small_kernel("mark_slots", q.shape[2])
        self.launched("mark_slots")
        kernel(slots, referenced, live_row, q, peak_q)

    def cast_bf16(self, src, dst):
        kernel = K.small_kernel("cast_bf16", src.shape[1])
        self.launched("cast_bf16")
        kernel(src, dst)

    def lanes_failed(self, bound, failed):
        kernel = K.small_kernel("lanes_failed")
        self.launched("lanes_failed")
        kernel(bound, failed)

    def poisoned_batches(self, row_flags, poisoned):
        kernel = K.small_kernel("poisoned_batches")
        self.launched("poisoned_batches")
        kernel(row_flags, poisoned, row_flags.shape[0] // poisoned.shape[0])

    def zero_gated(self, acc, gate):
        kernel = K.small_kernel("zero_gated", acc.shape[1])
        self.launched("zero_gated")
        kernel(acc, gate)

    def fixed_to_bf16(self, acc, row_scale, poisoned, dst):
        kernel = K.small_kernel("fixed_to_bf16", acc.shape[1])
        self.launched("fixed_to_bf16")
        kernel(acc, row_scale, poisoned, dst, acc.shape[0] // poisoned.shape[0])

    def lanes_to_bf16(self, acc, words, failed, row_scale, poisoned, dst, acc_summed=True):
        kernel = K.small_kernel("lanes_to_bf16", acc.shape[1])
        self.launched("lanes_to_bf16")
        kernel(acc, words, failed, row_scale, poisoned, dst, acc.shape[0] // poisoned.shape[0], int(acc_summed))
