"""The launch contract shared by the TileLang kernels and the CPU tile model.

A ``Launcher`` is what the host wrapper drives: one method per kernel, each
taking exactly the tensors the kernel takes (torch tensors, on the launcher's
device). The wrapper never computes a gradient itself; it lays out inputs and
launches. Scratch, outputs and padded copies are allocated through
``empty``/``zeros`` (counted, guard-banded under ``GuardBands``); small index
and layout tensors made by torch ops (slots, CSR, Lse2, the reference plan's
fixed-point scales) are not.

``COUNTERS`` counts launches and allocations across every launcher, so that a
test can prove that a rejected call launched and allocated nothing.
"""

import collections
import threading

import torch

from . import fixed_point
from . import kernels as K

COUNTERS = collections.Counter()
_lock = threading.Lock()
_guards = threading.local()


def _count(what: str) -> None:
    with _lock:
        COUNTERS[what] += 1


class Launcher:
    """Base class: allocation and accounting. Subclasses implement the kernels."""

    name = "abstract"
    device = torch.device("cpu")
    #: True: a deterministic dKV design (fixed-point, slots or shards). False: fp32 atomics.
    deterministic = True
    #: Poison value for uninitialised floating allocations (None: leave as is).
    poison = None

    def _allocate(self, shape, dtype):
        _count("allocations")
        bands = getattr(_guards, "active", None)
        if bands is not None:
            return bands.allocate(shape, dtype, self.device)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def empty(self, shape, dtype):
        t = self._allocate(shape, dtype)
        if self.poison is not None and t.is_floating_point():
            t.fill_(self.poison)
        return t

    def zeros(self, shape, dtype):
        return self._allocate(shape, dtype).zero_()

    def launched(self, kernel: str) -> None:
        _count("launches")
        _count(f"launch:{kernel}")

    def check_widths(self, d_k: int, d_v: int) -> None:
        """Raise ValueError for widths this launcher cannot build."""

    # Kernels: see mqa_bwd.kernels for the contract of each.
    def delta(self, out, grad_out, lse2, sink2, delta, dsink_rows, q=None, peak_q=None, peak_do=None):
        """Delta and DSinkRows; with q (the fixed-point design), also peak_q and peak_do
        [R, H] int32: fixed_point.magnitude_bits of q and grad_out (max |x| as bf16 bits)."""
        raise NotImplementedError

    def main_bwd(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, *, sm_scale, mode, heads=None, head_base=0,
                 shard_base=0, n_shards=1, row_scale=None, allowance=None, flag=None, cluster=1):
        """One head group: ``heads`` heads from ``head_base`` of the [R, HQ, ...] tensors q,
        grad_out, lse2, delta, dq (and allowance). The kernel's tile is
        ``main_tile_heads(heads)`` rows, whatever ``heads`` is (SPEC); ``heads``
        defaults to HQ. ``row_scale`` [NKV] f32, ``allowance`` [R, HQ] f32 and
        ``flag`` [R] i32: "fixed" mode only. ``cluster`` > 1 (kernels.MODE_MAX_CLUSTER:
        "fixed" up to 4, "shard" 2): that many consecutive groups from ``head_base``
        as one thread block cluster, each slot's dKV contribution summed over
        all their heads before its add."""
        raise NotImplementedError

    def shard_fold(self, dkv_shards, dkv_acc):
        raise NotImplementedError

    def dkv_reduce(self, dkv_slot, slot_of_entry, entry_lo, entry_hi, dkv_acc, slot_base):
        raise NotImplementedError

    def dsink_reduce(self, dsink_rows, dsink):
        raise NotImplementedError

    def mark_slots(self, slots, referenced, live_row):
        raise NotImplementedError

    def plan(self, query, grad_out, delta, kv_v, referenced, live_row, sm_scale, peak_q, peak_do):
        """(row_scale [NKV] f32, allowance [R, H] f32): the fixed-point plan
        (fixed_point.plan) of the H = query.shape[2] real heads, from the delta
        launch's Delta and maxima (delta, peak_q, peak_do [R, HQ], HQ >= H) and
        the slot marks. Here in torch ops, the reference; a launcher may run it
        as kernels, with the same bits."""
        H = query.shape[2]
        return fixed_point.plan(query, grad_out, delta[:, :H], kv_v, referenced, live_row, sm_scale,
                                max_q=fixed_point.bits_to_bf16(peak_q[:, :H]), max_do=fixed_point.bits_to_bf16(peak_do[:, :H]))

    def cast_bf16(self, src, dst):
        raise NotImplementedError

    def fixed_to_bf16(self, acc, row_scale, dst):
        raise NotImplementedError


class TileLangLauncher(Launcher):
    """Launches the compiled TileLang kernels on the current CUDA device."""

    name = "tilelang"

    def __init__(self, deterministic: bool = True, device=None):
        self.deterministic = deterministic
        self.name = "tilelang" if deterministic else "tilelang-atomic"
        self.device = torch.device(device if device is not None else "cuda")

    def check_widths(self, d_k, d_v):
        if (d_k, d_v) not in K.GPU_WIDTHS:
            raise ValueError(
                f"query: width Dk={d_k} with Dv={d_v} cannot be built by the TileLang kernel; "
                f"supported (Dk, Dv): {list(K.GPU_WIDTHS)}"
            )

    def delta(self, out, grad_out, lse2, sink2, delta, dsink_rows, q=None, peak_q=None, peak_do=None):
        self.launched("delta")
        if q is None:
            K.compiled("delta", out.shape[2])(out, grad_out, lse2, sink2, delta, dsink_rows)
        else:
            K.compiled("delta_max", q.shape[2], out.shape[2])(out, grad_out, lse2, sink2, delta, dsink_rows, q, peak_q, peak_do)

    def main_bwd(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, *, sm_scale, mode, heads=None, head_base=0,
                 shard_base=0, n_shards=1, row_scale=None, allowance=None, flag=None, cluster=1):
        key = K.main_kernel_key(heads or q.shape[1], q.shape[2], grad_out.shape[2], mode, cluster)
        kernel = K.compiled("main_bwd", *key)
        if row_scale is None:  # other modes never touch them; the signature is shared
            row_scale = torch.empty((kv.shape[0],), dtype=torch.float32, device=kv.device)
            allowance = lse2  # the right shape, never read
            flag = torch.empty((q.shape[0],), dtype=torch.int32, device=kv.device)
        self.launched("main_bwd")
        kernel(q, kv, grad_out, indices, lse2, delta, dq, dkv, row_scale, allowance, flag, float(sm_scale),
               int(head_base), int(shard_base), int(n_shards))

    def shard_fold(self, dkv_shards, dkv_acc):
        kernel = K.compiled("shard_fold", dkv_shards.shape[2])
        self.launched("shard_fold")
        kernel(dkv_shards, dkv_acc)

    def dkv_reduce(self, dkv_slot, slot_of_entry, entry_lo, entry_hi, dkv_acc, slot_base):
        kernel = K.compiled("dkv_reduce", dkv_slot.shape[1])
        self.launched("dkv_reduce")
        kernel(dkv_slot, slot_of_entry, entry_lo, entry_hi, dkv_acc, int(slot_base))

    def dsink_reduce(self, dsink_rows, dsink):
        kernel = K.compiled("dsink_reduce")
        self.launched("dsink_reduce")
        kernel(dsink_rows, dsink)

    def plan(self, query, grad_out, delta, kv_v, referenced, live_row, sm_scale, peak_q, peak_do):
        # Three launches (kernels.plan_program) where the torch ops took some 80
        # kernels and their copies in and out of a CUDA graph.
        B, S, H = query.shape[:3]
        NKV, d_v = kv_v.shape
        R, S_kv, scale = B * S, NKV // B, abs(float(sm_scale))
        mv = fixed_point.max_abs(kv_v)
        # Through the launcher's allocator: guard-banded under GuardBands, poisoned where asked.
        peaks = self.zeros((B, K.PLAN_SLOTS), torch.int64)
        allowance = self.empty((R, H), torch.float32)
        row_scale = self.empty((NKV,), torch.float32)
        inputs = (peak_q, peak_do, delta, live_row, mv, referenced, peaks)
        self.launched("plan")
        K.compiled("plan", "terms")(*inputs, S, H, S_kv, scale * d_v, scale)
        K.compiled("plan", "peaks")(*inputs, allowance, S, H, S_kv, d_v, scale * d_v, scale, fixed_point.MASS_LIMIT)
        K.compiled("plan", "scales")(mv, referenced, peaks, row_scale, S_kv, d_v, fixed_point.MASS_LIMIT, fixed_point.FP32_SAFE)
        return row_scale, allowance

    def mark_slots(self, slots, referenced, live_row):
        kernel = K.compiled("mark_slots")
        self.launched("mark_slots")
        kernel(slots, referenced, live_row)

    def cast_bf16(self, src, dst):
        kernel = K.compiled("cast_bf16", src.shape[1])
        self.launched("cast_bf16")
        kernel(src, dst)

    def fixed_to_bf16(self, acc, row_scale, dst):
        kernel = K.compiled("fixed_to_bf16", acc.shape[1])
        self.launched("fixed_to_bf16")
        kernel(acc, row_scale, dst)


class GuardBands:
    """Every allocation sits inside a larger one whose margins hold a byte pattern.

    Used as a context manager around a call: all launcher allocations made
    inside it (scratch, outputs, padded copies) get guard bands, and ``check``
    compares every margin byte for byte. Inputs can be placed the same way with
    ``place``.
    """

    PATTERN = 0xA5

    def __init__(self, margin_bytes: int = 4096):
        self.margin = margin_bytes
        self.regions = []  # (label, backing uint8 tensor, start, end)

    def allocate(self, shape, dtype, device, label=None):
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize * int(torch.Size(shape).numel())
        backing = torch.full((nbytes + 2 * self.margin,), self.PATTERN, dtype=torch.uint8, device=device)
        inner = backing[self.margin : self.margin + nbytes].view(dtype).view(shape)
        self.regions.append((label or f"allocation #{len(self.regions)} {tuple(shape)} {dtype}", backing, self.margin, self.margin + nbytes))
        return inner

    def place(self, t: torch.Tensor, label: str) -> torch.Tensor:
        """A copy of ``t`` inside a guard-banded allocation."""
        inner = self.allocate(tuple(t.shape), t.dtype, t.device, label)
        inner.copy_(t)
        return inner

    def violations(self):
        """[(label, side, first bad byte offset, bad byte count)] for every damaged margin."""
        bad = []
        for label, backing, start, end in self.regions:
            for side, band in (("before", backing[:start]), ("after", backing[end:])):
                wrong = torch.nonzero(band != self.PATTERN).reshape(-1)
                if wrong.numel():
                    bad.append((label, side, int(wrong[0]), int(wrong.numel())))
        return bad

    def __enter__(self):
        self._previous = getattr(_guards, "active", None)
        _guards.active = self
        return self

    def __exit__(self, *exc):
        _guards.active = self._previous
        return False
