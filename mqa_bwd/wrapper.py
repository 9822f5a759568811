"""Host wrapper: ``mqa_latent_sparse_bwd`` as docs/SPEC.md defines it.

Order of work, which the properties rely on:
  1. framework edge: paddle tensors become torch tensors (DLPack, zero-copy;
     ``mqa_bwd.edge``), detached (tensors that require grad are read as they
     are; the backward itself is not differentiated, and runs under no_grad);
  2. validation, all of it, before any allocation or launch (ValueError naming
     the argument, in the caller's framework's names), the scratch budget
     included (``Problem.scratch``);
  3. layout: rows flattened, heads zero-padded to the group width, slots padded
     with -1 to the kernel's slot block, invalid indices of every kind mapped
     to -1, kv rows addressed globally (b * S_kv + index);
  4. launches through a ``Launcher`` (TileLang on a GPU, the tile model on a CPU);
  5. results sliced back to H and handed back in the caller's framework.

dKV is deterministic by construction on the deterministic launchers: every
contribution is rounded to an integer at one fixed-point scale per kv row and
added with integer atomics, whose sum has the same bits in any order
(``mqa_bwd.fixed_point`` holds the range proof): into an int64 accumulator, or,
on the wide tile, into two 32-bit lanes a word, with an int64 redo of the same
integers where a lane's bound fails. The atomic control adds fp32 with atomics.

The main kernel reads each head group in place from the [R, H_padded, ...]
tensors (a head offset per launch): no per-group copies. What else grows with
S: the int32 slot layout [R, Lp] (built a bounded number of slots at a time),
a few floats or flags per (row, head) or row (Lse2, Delta, the d_sink rows,
the fixed-point allowance, row flags and row marks), and the zero-padded
copies of q, out and grad_out when H is not a multiple of the group width:
``Problem.scratch`` lists them, ``scratch_bytes`` sums them, and a
``dkv_buf_bytes`` below that sum is refused (nothing here is chunked).

A NaN or +inf lse or sink is poisoned on the device, never checked on the
host (``layout.lse_base2``; docs/SPEC.md, "Bad input").

The steps a test may replace (a mutant, the #1784 reproduction) are the fields
of ``Steps``; ``backward(..., steps=...)`` runs with them, and the public
function with ``STEPS``.
"""

import dataclasses
import functools
import math
import numbers
from typing import Callable, NamedTuple

import torch

from . import edge
from . import kernels as K
from . import launch as L
from . import layout
from .contract import BACKENDS, BLOCK_H_CHOICES

PAD_SINK = -1e30
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Problem:
    B: int
    S: int
    S_kv: int
    H: int
    L: int
    d_k: int
    d_v: int
    block_h: int
    #: The caller's scratch budget; None: no bound.
    dkv_buf_bytes: int | None
    #: False reproduces the #1784 wrapper for the CPU model's self-test: a head
    #: count below block_h goes to the kernel as one group of H heads, unpadded.
    pad_heads: bool = True

    @property
    def group_width(self) -> int:
        if not self.pad_heads and self.H < self.block_h:
            return self.H
        return self.block_h

    @property
    def groups(self) -> int:
        return -(-self.H // self.group_width)

    @property
    def padded_heads(self) -> int:
        return self.groups * self.group_width

    @functools.cached_property  # asked for a dozen times a call, on the host's critical path
    def slot_block(self) -> int:
        """What the top-k is padded to: the largest slot block of the call's launches (both
        designs pair the same groups, so either's launches say it)."""
        return max(config.slot_block for _, config in K.main_launches(self.groups, self.group_width, self.d_k, self.d_v))

    @property
    def padded_slots(self) -> int:
        return -(-self.L // self.slot_block) * self.slot_block

    @property
    def sorts_in_one_step(self) -> bool:
        """Whether a row's slots fit one CTA of the kernel that builds the canonical slot layout
        in one launch (kernels.SORT_CAPACITY): then no sort keys are kept (global_slots)."""
        return self.padded_slots <= K.SORT_CAPACITY

    @property
    def rows(self) -> int:
        return self.B * self.S

    @property
    def fixed_bytes(self) -> int:
        """The int64 fixed-point dKV accumulator: every kv row of every batch element.
        Like the atomic control's fp32 accumulator, it is output-sized, not scratch
        that grows with the query rows, so dkv_buf_bytes does not bound it (nor the
        lanes' words and bounds, half of it and one int64 a kv row, on a wide call)."""
        return self.B * self.S_kv * self.d_k * 8

    def has_wide_launch(self, deterministic: bool = True) -> bool:
        """Whether a main launch of the call runs the wide tile (it takes the rows' block counts)."""
        return any(config.wide for _, config in K.main_launches(self.groups, self.group_width, self.d_k, self.d_v,
                                                                  deterministic))

    def scratch(self, deterministic: bool = True) -> dict:
        """{buffer: bytes} of every buffer ``run`` keeps that grows with the query rows
        R = B*S, other than the outputs it returns: what dkv_buf_bytes bounds.

        For contiguous inputs (torch's reshape copies a non-contiguous one). Not in
        it: what does not grow with S (the dKV accumulator, per-kv-row scales and
        marks, per-head vectors) and the sort's temporaries (bounded by INDEX_STEP
        slots, as the slot layout's sort keys are where it keeps them)."""
        R, H, Hp, Lp = self.rows, self.H, self.padded_heads, self.padded_slots
        padded = Hp != H
        f32 = i32 = 4
        parts = {}
        if padded:  # zero-padded copies on the head axis (pad_heads)
            parts["query, heads padded"] = R * Hp * self.d_k * 2
            parts["out, heads padded"] = R * Hp * self.d_v * 2
            parts["grad_out, heads padded"] = R * Hp * self.d_v * 2
            parts["lse, heads padded"] = R * Hp * f32
        parts["Lse2"] = R * Hp * f32
        parts["slot layout"] = R * Lp * i32
        if not self.sorts_in_one_step:
            parts["slot sort keys"] = min(R, max(1, INDEX_STEP // self.L)) * self.L * i32  # one step's
        parts["Delta"] = R * Hp * f32
        parts["d_sink rows"] = R * Hp * f32
        if self.has_wide_launch(deterministic) or self.sorts_in_one_step:  # the fused layout writes them anyway
            parts["row blocks"] = R * i32
        if deterministic:
            parts["peak |q|"] = R * Hp * i32
            parts["peak |dO|"] = R * Hp * i32
            parts["live-row marks"] = R * i32
            parts["allowance"] = R * H * f32
            if padded:
                parts["allowance, heads padded"] = R * Hp * f32
            parts["row flags"] = R * i32
        if padded:  # dq over the padded heads; the caller gets a sliced copy
            parts["dq, heads padded"] = R * Hp * self.d_k * 2
        return parts

    def scratch_bytes(self, deterministic: bool = True) -> int:
        return sum(self.scratch(deterministic).values())


def scratch_bytes(B, S, S_kv, H, L, d_k, d_v, block_h=None, backend=None) -> int:
    """The least ``dkv_buf_bytes`` a call of these dimensions accepts: the bytes of
    scratch it keeps that grow with the query rows (``Problem.scratch`` lists them).

    ``backend``: the fixed-point design (None, "tilelang", "model") or the atomic
    control ("tilelang-atomic", "model-atomic"), which keeps fewer per-row buffers.
    """
    for name, n in (("B", B), ("S", S), ("S_kv", S_kv), ("H", H), ("L", L), ("d_k", d_k), ("d_v", d_v)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"{name}: expected a positive integer, got {n!r}")
    block_h = check_block_h(block_h, H)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    deterministic = backend not in ("tilelang-atomic", "model-atomic")
    problem = Problem(int(B), int(S), int(S_kv), int(H), int(L), int(d_k), int(d_v), block_h, None)
    return problem.scratch_bytes(deterministic)


def check_block_h(block_h, H: int) -> int:
    """The head-group width: ``block_h`` checked, or the default for H heads (None)."""
    if block_h is None:
        return 32 if H % 32 == 0 else 16
    if isinstance(block_h, bool) or not isinstance(block_h, numbers.Integral) or block_h not in BLOCK_H_CHOICES:
        raise ValueError(
            f"block_h: must be one of {BLOCK_H_CHOICES} (the widths for which the kernel's own head tile "
            f"equals the group width) or None, got {block_h!r}"
        )
    return int(block_h)


def check_dkv_buf_bytes(dkv_buf_bytes) -> int | None:
    if dkv_buf_bytes is not None and (isinstance(dkv_buf_bytes, bool) or not isinstance(dkv_buf_bytes, numbers.Integral)
                                      or dkv_buf_bytes <= 0):
        raise ValueError(f"dkv_buf_bytes: expected a positive integer or None, got {dkv_buf_bytes!r}")
    return None if dkv_buf_bytes is None else int(dkv_buf_bytes)


def problem_of(B, S, S_kv, H, L, d_k, d_v, block_h, dkv_buf_bytes) -> "Problem":
    """The Problem of checked dimensions, with block_h and dkv_buf_bytes checked and the
    kernels' limits on L and on int32 addressing; ValueError naming the argument."""
    problem = Problem(B, S, S_kv, H, L, d_k, d_v, check_block_h(block_h, H), check_dkv_buf_bytes(dkv_buf_bytes))
    if problem.padded_slots > K.MAX_SLOTS_PER_ROW:
        raise ValueError(f"token_indices: top-k L = {L} pads to {problem.padded_slots} slots a row, "
                         f"more than the kernels' {K.MAX_SLOTS_PER_ROW}")
    if problem.rows * problem.padded_slots > INT32_MAX:
        raise ValueError(f"token_indices: B*S*L = {problem.rows * problem.padded_slots} slots exceed int32 addressing")
    if B * S_kv > INT32_MAX:
        raise ValueError(f"kv: B*S_kv = {B * S_kv} rows exceed int32 addressing")
    return problem


def require_lanes_addressing(problem: "Problem", design) -> None:
    """ValueError naming kv where a deterministic call (``design`` True) has wide launches, whose
    lanes address a kv row by an unsigned 32-bit offset (kernels/wide.py), and B*S_kv*d_k exceeds
    kernels.LANES_ADDRESSABLE. The atomic control and the 32-head kernels have no such limit."""
    p = problem
    if not design or not any(c.accumulate == "lanes" for _, c in K.main_launches(p.groups, p.group_width, p.d_k, p.d_v)):
        return
    if p.B * p.S_kv * p.d_k > K.LANES_ADDRESSABLE:
        raise ValueError(f"kv: B*S_kv*d_k = {p.B * p.S_kv * p.d_k} exceeds {K.LANES_ADDRESSABLE}, what the deterministic "
                         "wide tile's 32-bit row offsets address")


# ---------------------------------------------------------------------------
# Validation (no allocation, no launch)
# ---------------------------------------------------------------------------
#
# Validation sees torch tensors (the edge converted a paddle caller's), but its
# messages speak the caller's framework: ``framework`` names dtypes and devices
# as the caller wrote them (edge.dtype_name, edge.device_name).


def _require_rank(name, t, rank, dims):
    if t.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank} [{dims}], got rank {t.dim()} (shape {tuple(t.shape)})")


def _require_dim(name, t, axis, dim, want, source):
    """Dimension ``axis`` (called ``dim``) of ``t`` must equal ``source``'s, ``want``."""
    if t.shape[axis] != want:
        raise ValueError(f"{name}: dimension {axis} ({dim}) is {t.shape[axis]}, {source}'s {dim} is {want}")


def _require_positive(name, axis, dim, n):
    if n < 1:
        raise ValueError(f"{name}: dimension {axis} ({dim}) is {n}; every dimension must be >= 1")


def _require_width(name, dim, n):
    """Dk and Dv: multiples of 16, the widths the kernels build."""
    if n % 16:
        raise ValueError(f"{name}: dimension 3 ({dim}) is {n}, not a multiple of 16 (the kernels' widths)")


def _require_same_device(query, query_name, named, framework):
    """Every tensor of ``named`` ((name, tensor or None), ...) on query's device."""
    for name, t in named:
        if t is not None and t.device != query.device:
            raise ValueError(f"{name}: on {edge.device_name(t.device, framework)}, "
                             f"but {query_name} is on {edge.device_name(query.device, framework)}")


def require_dtype(name, t, dtype, framework="torch"):
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {edge.dtype_name(dtype, framework)}, "
                         f"got {edge.dtype_name(t.dtype, framework)}")


def check_sm_scale(sm_scale) -> None:
    """sm_scale must be a finite positive real number (a huge int overflows float: also rejected)."""
    try:
        ok = not isinstance(sm_scale, bool) and isinstance(sm_scale, numbers.Real) and math.isfinite(sm_scale) and sm_scale > 0
    except OverflowError:
        ok = False
    if not ok:
        raise ValueError(f"sm_scale: expected a finite positive number, got {sm_scale!r}")


def validate_forward_inputs(query, kv, attn_sink, token_indices, sm_scale, *, steps=None, framework="torch",
                            query_name="query") -> tuple:
    """Check the arguments the forward and the backward share (query, kv, attn_sink,
    token_indices, sm_scale); return (B, S, S_kv, H, L, d_k). Raises ValueError naming the
    argument (and, for a shape, the dimension), in ``framework``'s names.

    ``query_name``: what the caller calls query (``mqa_bwd.autograd``'s op calls it q).
    The dtype checks go through ``steps.require_dtype`` (None: STEPS), as in ``validate``."""
    steps = STEPS if steps is None else steps
    q = query_name
    for name, t in ((q, query), ("kv", kv)):
        steps.require_dtype(name, t, torch.bfloat16, framework)
    _require_rank(q, query, 4, "B,S,H,Dk")
    B, S, H, d_k = query.shape
    _require_rank("kv", kv, 3, "B,S_kv,Dk")
    _require_dim("kv", kv, 0, "B", B, q)
    _require_dim("kv", kv, 2, "Dk", d_k, q)
    S_kv = kv.shape[1]
    if attn_sink is not None:
        _require_rank("attn_sink", attn_sink, 1, "H")
        _require_dim("attn_sink", attn_sink, 0, "H", H, q)
        steps.require_dtype("attn_sink", attn_sink, torch.float32, framework)
    _require_rank("token_indices", token_indices, 3, "B,S,L")
    if token_indices.dtype.is_floating_point or token_indices.dtype.is_complex or token_indices.dtype == torch.bool:
        raise ValueError(f"token_indices: expected an integer dtype, got {edge.dtype_name(token_indices.dtype, framework)}")
    for axis, dim, want in ((0, "B", B), (1, "S", S)):
        _require_dim("token_indices", token_indices, axis, dim, want, q)
    L_ = token_indices.shape[2]
    for name, axis, dim, n in ((q, 0, "B", B), (q, 1, "S", S), (q, 2, "H", H), (q, 3, "Dk", d_k),
                               ("kv", 1, "S_kv", S_kv), ("token_indices", 2, "L", L_)):
        _require_positive(name, axis, dim, n)
    _require_width(q, "Dk", d_k)
    check_sm_scale(sm_scale)
    _require_same_device(query, q, (("kv", kv), ("attn_sink", attn_sink), ("token_indices", token_indices)),
                         framework)
    return B, S, S_kv, H, L_, d_k


def validate(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, block_h, dkv_buf_bytes, launcher,
             steps=None, framework="torch", *, design):
    """Check every argument; return the Problem. Raises ValueError naming the argument
    (and, for a shape, the dimension), in ``framework``'s names ("torch" or "paddle").

    ``design``: whose scratch a ``dkv_buf_bytes`` must cover, as ``Launcher.deterministic``
    says it (True: the fixed-point design, False: the atomic control); None: no design of
    ours (a peer that borrows this validation, mqa_bwd.cudnn, keeps scratch of its own and
    checks its budget itself). The dtype checks go through ``steps.require_dtype``
    (``steps``: the call's Steps, None: STEPS), so that a replaced check is the one every
    dtype goes through."""
    steps = STEPS if steps is None else steps
    B, S, S_kv, H, L_, d_k = validate_forward_inputs(query, kv, attn_sink, token_indices, sm_scale, steps=steps,
                                                     framework=framework)
    for name, t in (("out", out), ("grad_out", grad_out)):
        steps.require_dtype(name, t, torch.bfloat16, framework)
    _require_rank("out", out, 4, "B,S,H,Dv")
    for axis, dim, want in ((0, "B", B), (1, "S", S), (2, "H", H)):
        _require_dim("out", out, axis, dim, want, "query")
    d_v = out.shape[3]
    _require_rank("grad_out", grad_out, 4, "B,S,H,Dv")
    for axis, dim, want in ((0, "B", B), (1, "S", S), (2, "H", H)):
        _require_dim("grad_out", grad_out, axis, dim, want, "query")
    _require_dim("grad_out", grad_out, 3, "Dv", d_v, "out")
    if d_v > d_k:
        raise ValueError(f"out: dimension 3 (Dv) is {d_v}, more than query's Dk {d_k}")
    _require_rank("lse", lse, 3, "B,S,H")
    for axis, dim, want in ((0, "B", B), (1, "S", S), (2, "H", H)):
        _require_dim("lse", lse, axis, dim, want, "query")
    steps.require_dtype("lse", lse, torch.float32, framework)
    _require_positive("out", 3, "Dv", d_v)
    _require_width("out", "Dv", d_v)
    launcher.check_widths(d_k, d_v)

    problem = problem_of(B, S, S_kv, H, L_, d_k, d_v, block_h, dkv_buf_bytes)
    require_lanes_addressing(problem, design)

    _require_same_device(query, "query", (("out", out), ("grad_out", grad_out), ("lse", lse)), framework)
    device = query.device
    if device != launcher.device and not (device.type == launcher.device.type == "cuda"):
        raise ValueError(f"query: on {edge.device_name(device, framework)}, but backend {launcher.name!r} runs on "
                         f"{edge.device_name(launcher.device, framework)}")

    # The budget bounds the scratch that grows with the query rows (SPEC). The
    # fixed design has no chunked variant, so a budget below what it needs is refused.
    if design is not None and problem.dkv_buf_bytes is not None:
        require_budget(problem.dkv_buf_bytes, problem.scratch_bytes(design), problem.rows, "mqa_bwd.scratch_bytes")
    return problem


def require_budget(dkv_buf_bytes, need: int, rows: int, source: str) -> None:
    """ValueError naming dkv_buf_bytes, with the least it accepts, when a budget is below the
    ``need`` bytes of scratch ``rows`` query rows keep (``source`` says what lists them)."""
    if dkv_buf_bytes is not None and dkv_buf_bytes < need:
        raise ValueError(f"dkv_buf_bytes: {dkv_buf_bytes} is below the {need} bytes of scratch this call needs "
                         f"(B*S = {rows} query rows; {source} lists them); pass at least {need}, or None for no bound")


# ---------------------------------------------------------------------------
# Layout and launches
# ---------------------------------------------------------------------------


def pad_heads(x: torch.Tensor, padded: int, value: float, launcher) -> torch.Tensor:
    """[R, H, ...] -> [R, padded, ...], pad heads filled with ``value``."""
    H = x.shape[1]
    if H == padded:
        return x.contiguous()
    y = launcher.empty((x.shape[0], padded) + tuple(x.shape[2:]), x.dtype)
    y[:, :H] = x
    y[:, H:] = value
    return y


class RowTerms(NamedTuple):
    """What the Delta launch gives every later launch, [R, Hp] unless said (padded heads)."""

    lse2: torch.Tensor  # the kernels' lse: base 2, sink-inclusive, poisoned where the input is bad
    delta: torch.Tensor  # rowsum(O * dO)
    dsink_rows: torch.Tensor  # each row's term of d_attn_sink
    peak_do: torch.Tensor | None  # max |dO| as bf16 bits, for the fixed-point plan (None: the atomic design)


def row_terms(out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor,
              launcher: L.Launcher) -> RowTerms:
    """The row terms from the padded out, grad_out [R, Hp, Dv], lse [R, Hp] and sink [Hp] (f32,
    natural log), in one launch (Launcher.delta; layout.lse_base2 defines Lse2 and how bad input
    is poisoned there, on the device)."""
    R, Hp = lse.shape
    f32 = torch.float32
    terms = RowTerms(launcher.empty((R, Hp), f32), launcher.empty((R, Hp), f32), launcher.empty((R, Hp), f32),
                     launcher.empty((R, Hp), torch.int32) if launcher.deterministic else None)
    launcher.delta(out, grad_out, lse.contiguous(), sink.contiguous(), *terms[:3], peak_do=terms.peak_do)
    return terms


#: The slot layout is built this many slots at a time, so its temporaries
#: (int64 indices, the sort's permutation) stay bounded whatever S and L.
INDEX_STEP = 1 << 24


#: The order global_slots lays each row's slots out in (layout.canonical_order defines it; the
#: launchers' one-step slot layout sorts to it too).
canonical_order = layout.canonical_order


def caller_order(rows: torch.Tensor) -> torch.Tensor:
    """The identity ``order`` of global_slots: each row's slots as the caller gave them."""
    return rows


def global_slots(token_indices: torch.Tensor, problem: "Problem", launcher: L.Launcher,
                 order: Callable = canonical_order, marks: tuple | None = None,
                 row_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """[B,S,L] any integer -> [R, Lp] int32: b*S_kv + index when 0 <= index < S_kv, else -1,
    each row's slots in ``order`` (the canonical order; caller_order keeps the caller's):
    the launcher's slot keys (layout.slot_keys), ordered, placed (layout.place_slots), then
    each row's walk rotated (layout.rotate_walks), at most INDEX_STEP slots at a time; in the
    canonical order, where a row fits one CTA of the kernel that fuses the four
    (Problem.sorts_in_one_step), that kernel's launch a step.

    ``marks``: the fixed-point plan's (referenced [NKV], live_row [R], q [R, Hp, Dk], peak_q
    [R, Hp]; Launcher.mark_slots), filled from the slots by the fused launches, else by a
    mark_slots launch after the layout. ``row_blocks`` [R] int32: each row's count of the wide
    tile's blocks (Launcher.row_blocks), written by the fused launches, else by a row_blocks
    launch after the layout (the fused kernel writes the counts wherever it runs: without
    ``row_blocks``, beside the slots, in their allocation)."""
    p = problem
    flat = token_indices.reshape(p.rows, p.L)
    nkv = p.B * p.S_kv
    step = max(1, INDEX_STEP // p.L)  # rows per step, at least one
    fused = order is canonical_order and p.sorts_in_one_step
    if fused and row_blocks is None:  # the counts the kernel writes anyway, in the slots' allocation
        both = launcher.empty((p.rows * (p.padded_slots + 1),), torch.int32)
        slots, row_blocks = both[: p.rows * p.padded_slots].view(p.rows, p.padded_slots), both[p.rows * p.padded_slots:]
    else:
        slots = launcher.empty((p.rows, p.padded_slots), torch.int32)
    keys = None if fused else launcher.empty((min(step, p.rows), p.L), torch.int32)
    whole = step >= p.rows  # one step: the tensors themselves, no slices (host time before the main launch)
    for r0 in range(0, p.rows, step):
        r1 = min(p.rows, r0 + step)
        part, step_slots = (flat, slots) if whole else (flat[r0:r1], slots[r0:r1])
        if str(part.dtype).removeprefix("torch.") not in K.SLOT_INDEX_DTYPES:
            part = part.to(torch.int64)
        if fused:
            step_marks = marks if whole or marks is None else (marks[0], *(m[r0:r1] for m in marks[1:]))
            launcher.sorted_slots(part.contiguous(), step_slots, row_blocks if whole else row_blocks[r0:r1], r0, p.S,
                                  p.S_kv, nkv, step_marks)
            continue
        step_keys = keys if whole else keys[: r1 - r0]
        launcher.slot_keys(part.contiguous(), step_keys, r0, p.S, p.S_kv, nkv)
        launcher.place_slots(order(step_keys), step_slots, nkv)
        launcher.rotate_walks(step_slots, r0, p.S)
    if not fused:
        if marks is not None:
            launcher.mark_slots(slots, *marks)
        if row_blocks is not None:
            launcher.row_blocks(slots, nkv, row_blocks)
    return slots


@dataclasses.dataclass(frozen=True)
class Steps:
    """The wrapper's replaceable steps, each a plain function (the real ones: STEPS).

    validate(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, block_h,
             dkv_buf_bytes, launcher, steps, framework, *, design) -> Problem
    require_dtype(name, t, dtype, framework)      ValueError unless t.dtype == dtype
    pad_heads(x, padded, value, launcher) -> x    [R, H, ...] -> [R, padded, ...]
    row_terms(out, grad_out, lse, sink, launcher) -> RowTerms   Lse2 (base 2, sink-inclusive),
                                                  Delta, the sink rows and, for the fixed-point
                                                  design, max |dO| (padded tensors)
    global_slots(token_indices, problem, launcher, marks=None, row_blocks=None) -> slots [R, Lp]
                                                  int32 global kv rows or -1, each row in the
                                                  canonical order; with marks, the plan's slot
                                                  marks too; with row_blocks, the rows' block counts
    """

    validate: Callable
    require_dtype: Callable
    pad_heads: Callable
    row_terms: Callable
    global_slots: Callable


STEPS = Steps(validate=validate, require_dtype=require_dtype, pad_heads=pad_heads, row_terms=row_terms,
              global_slots=global_slots)


def run(p: Problem, query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, launcher: L.Launcher,
        steps: Steps = STEPS):
    """Lay out, launch, and return (dq, dkv, d_sink) as torch tensors on the launcher's device."""
    R, Hp, G, bh = p.rows, p.padded_heads, p.groups, p.group_width
    NKV = p.B * p.S_kv
    f32 = torch.float32

    q = steps.pad_heads(query.reshape(R, p.H, p.d_k), Hp, 0.0, launcher)
    o = steps.pad_heads(out.reshape(R, p.H, p.d_v), Hp, 0.0, launcher)
    do = steps.pad_heads(grad_out.reshape(R, p.H, p.d_v), Hp, 0.0, launcher)
    lse_p = steps.pad_heads(lse.reshape(R, p.H).to(f32), Hp, 0.0, launcher)
    if attn_sink is None:
        sink = torch.full((p.H,), -math.inf, dtype=f32, device=query.device)
    else:
        sink = attn_sink.to(f32)
    sink_p = steps.pad_heads(sink.reshape(1, p.H), Hp, PAD_SINK, launcher).reshape(Hp)

    # The delta launch, the longest before the main one, goes first: the GPU works through it
    # while the host lays out the slots and the plan. For the fixed-point design the same launch
    # also reduces the maxima of |dO| its plan needs.
    lse2, delta, dsink_rows, peak_do = steps.row_terms(o, do, lse_p, sink_p, launcher)
    fixed = launcher.deterministic

    kv2 = kv.reshape(NKV, p.d_k).contiguous()
    # Consecutive head groups run as one launch where a kernel for the pair exists
    # (kernels.main_launches): the fixed cluster of two 16-head groups, whose CTAs
    # swap P and dS tiles and each add a column share of dKV summed over both
    # groups' heads, and the wide tile of two 32-head groups: fewer adds.
    launches = K.main_launches(G, bh, p.d_k, p.d_v, launcher.deterministic)
    marks = None
    if fixed:
        lanes = [(g, config) for g, config in launches if config.accumulate == "lanes"]
        # What the fixed design zeroes before its main launch, one fill an element width: the plan's
        # slot marks (they and the maxima of q come with the slot layout), the plan's per-batch
        # peaks (a launcher that runs it as kernels reduces into them), the row flags and the
        # call's flags (the poisoned batch elements; the lanes' failed bound and their inexact
        # rounding, which open the redo and the corrections launches), the wide
        # tile's words and per-row bounds, and the int64 accumulator where an int64 launch adds to
        # it (where every launch adds in lanes, it is only the redo's: zeroed only where the redo
        # runs, after the lanes launches), and a claim counter for each main launch (its lanes
        # launches' corrections and redo too).
        zeroed = {"referenced": ((NKV,), torch.int32), "live_row": ((R,), torch.int32), "row_flags": ((R,), torch.int32),
                  "claims": ((len(launches) + 2 * len(lanes),), torch.int32), "poisoned": ((p.B,), torch.int32),
                  "plan_peaks": ((p.B, K.PLAN_SLOTS), torch.int64)}
        if lanes:
            zeroed.update(words=((NKV, p.d_k // 2), torch.int64), bound=((NKV,), torch.int64), failed=((1,), torch.int32),
                          inexact=((1,), torch.int32))
        if len(lanes) < len(launches):
            zeroed["dkv_fixed"] = ((NKV, p.d_k), torch.int64)
        buffers = dict(zip(zeroed, launcher.zeros_together(*zeroed.values())))
        referenced, live_row, row_flags = buffers["referenced"], buffers["live_row"], buffers["row_flags"]
        words, bound, dkv_fixed = buffers.get("words"), buffers.get("bound"), buffers.get("dkv_fixed")
        poisoned, failed, inexact = buffers["poisoned"], buffers.get("failed"), buffers.get("inexact")
        counters = iter(buffers["claims"].split(1))
        peak_q = launcher.empty((R, Hp), torch.int32)
        marks = (referenced, live_row, q, peak_q)
    # The wide tile's blocks of each row, counted once for all its launches with the slot layout:
    # its warpgroup 0 reads a row's count where it would otherwise scan the row's slots at each
    # row's change.
    row_blocks = launcher.empty((R,), torch.int32) if p.has_wide_launch(launcher.deterministic) else None
    slots = steps.global_slots(token_indices, p, launcher, marks=marks, row_blocks=row_blocks)

    # Every launch reads its head groups in place (head_base): no per-group copies.
    dq = launcher.empty((R, Hp, p.d_k), torch.bfloat16)
    # Each launch has a counter of its own for the items its CTAs claim (kernels/wide.py: a persistent
    # CTA takes the next item when it frees), zeroed with the call's other buffers.
    if not fixed:
        dkv_acc, claims = launcher.zeros_together(((NKV, p.d_k), f32), ((len(launches),), torch.int32))
        for (g, config), counter in zip(launches, claims.split(1)):
            launcher.main_bwd(q, kv2, do, slots, lse2, delta, dq, dkv_acc, config=config, sm_scale=sm_scale, heads=bh,
                              head_base=g * bh, claims=counter, row_blocks=row_blocks)
    else:
        # One scale for every launch, lanes or int64 (the plan's at the launcher's lanes_gain), so
        # that a contribution is the same integer whichever kernel adds it (fixed_point, "The lanes").
        row_scale, allowance = launcher.plan(query, grad_out, delta, kv2, referenced, live_row, sm_scale, peak_q, peak_do,
                                             plan_peaks=buffers["plan_peaks"])
        # Padding heads (q = dO = 0) contribute nothing: no limit on their mass.
        allowance = steps.pad_heads(allowance, Hp, math.inf, launcher)
        common = dict(sm_scale=sm_scale, heads=bh, row_scale=row_scale, allowance=allowance, flag=row_flags,
                      row_blocks=row_blocks)
        for g, config in launches:
            in_lanes = config.accumulate == "lanes"
            launcher.main_bwd(q, kv2, do, slots, lse2, delta, dq, words if in_lanes else dkv_fixed, config=config,
                              head_base=g * bh, bound=bound if in_lanes else None, gate=inexact if in_lanes else None,
                              claims=next(counters), **common)
        for g, config in lanes:
            # The rows where the lanes' rounding by FFMA may have been inexact (a value past its range:
            # most rows where a kv row has few contributions, none at the bench shapes), run again for
            # their words' corrections; a launch that reads a flag a row, and ends at once where no
            # lanes launch flagged a row (inexact).
            launcher.main_bwd(q, kv2, do, slots, lse2, delta, dq, words, config=K.lanes_corrections(config),
                              head_base=g * bh, bound=bound, gate=inexact, claims=next(counters), **common)
        if lanes:
            launcher.lanes_failed(bound, failed)
            if dkv_fixed is None:
                # Only the redo adds to it, and the cast reads it only where the redo ran: zeroed there.
                dkv_fixed = launcher.empty((NKV, p.d_k), torch.int64)
                launcher.zero_gated(dkv_fixed, failed)
            # The redo launches on every call and does nothing unless a bound failed (no host
            # synchronisation): then it adds the same integers in int64 and the lanes are
            # dropped, else the lanes join dkv_fixed (in the cast below). Both give the same
            # sums, the same bits.
            launcher.note_lanes_redone(failed)
            for g, config in lanes:
                launcher.main_bwd(q, kv2, do, slots, lse2, delta, dq, dkv_fixed, config=K.lanes_redo(config),
                                  head_base=g * bh, gate=failed, claims=next(counters), **common)
        # The batch elements a mass check flagged, after every launch that checks: the cast makes their dKV NaN.
        launcher.poisoned_batches(row_flags, poisoned)

    dsink = launcher.empty((Hp,), f32)
    launcher.dsink_reduce(dsink_rows, dsink)
    dkv = launcher.empty((NKV, p.d_k), torch.bfloat16)
    if not fixed:
        launcher.cast_bf16(dkv_acc, dkv)
    elif lanes:
        # Where every launch added in lanes, dkv_fixed holds only the redo's sums: read where it ran.
        launcher.lanes_to_bf16(dkv_fixed, words, failed, row_scale, poisoned, dkv, acc_summed=len(lanes) < len(launches))
    else:
        launcher.fixed_to_bf16(dkv_fixed, row_scale, poisoned, dkv)

    dq = dq[:, : p.H].reshape(p.B, p.S, p.H, p.d_k).contiguous()  # a copy only when heads were padded
    return dq, dkv.view(p.B, p.S_kv, p.d_k), dsink[: p.H].contiguous()


def backward_with(launcher: L.Launcher, query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *,
                  block_h=None, dkv_buf_bytes=None, steps: Steps = STEPS, framework="torch"):
    """Validate, then run on a given launcher; torch tensors in and out. ``framework``:
    whose names the error messages use (the caller's, before the edge converted it)."""
    # The launcher is ours, so its design says what scratch the budget must cover.
    p = steps.validate(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, block_h, dkv_buf_bytes,
                       launcher, steps=steps, framework=framework, design=launcher.deterministic)
    return run(p, query, kv, out, grad_out, lse, attn_sink, token_indices, float(sm_scale), launcher, steps)


def backward(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None, dkv_buf_bytes=None,
             backend=None, instruments=None, steps: Steps = STEPS):
    """mqa_latent_sparse_bwd with its steps given (``steps``; the public function: STEPS)."""
    from .backends import get_launcher

    framework, tensors = torch_inputs(query, kv, out, grad_out, lse, attn_sink, token_indices)
    # The launcher checks ``instruments``; building one allocates nothing.
    launcher = get_launcher(backend, tensors[0].device, instruments)
    with torch.no_grad():
        dq, dkv, dsink = backward_with(launcher, *tensors, sm_scale, block_h=block_h, dkv_buf_bytes=dkv_buf_bytes,
                                       steps=steps, framework=framework)
    return tuple(edge.from_torch(t, framework) for t in (dq, dkv, dsink))


def torch_inputs(query, kv, out, grad_out, lse, attn_sink, token_indices) -> tuple:
    """(the caller's framework, the seven tensors as torch tensors in SPEC's order).

    The backward is not itself differentiated: tensors that require grad are read
    through detached views (the same memory), and nothing is recorded."""
    framework = edge.framework_of(query)
    named = {"query": query, "kv": kv, "out": out, "grad_out": grad_out, "lse": lse, "attn_sink": attn_sink,
             "token_indices": token_indices}
    for name, x in named.items():
        # The outputs come back in query's framework: a tensor of the other one would get answers
        # in a framework it was not given in.
        other = edge.framework_of(x)
        if other in ("torch", "paddle") and framework in ("torch", "paddle") and other != framework:
            raise ValueError(f"{name}: a {other} tensor, but query is a {framework} tensor: pass every tensor "
                             f"in one framework")
    tensors = tuple(None if name == "attn_sink" and x is None
                    else edge.to_torch(x, name, accept=("torch", "paddle")).detach() for name, x in named.items())
    return framework, tensors


def mqa_latent_sparse_bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None,
                          dkv_buf_bytes=None, backend=None, instruments=None):
    """Backward of sparse absorbed MQA with an attention sink. See docs/SPEC.md.

    Returns (dq [B,S,H,Dk] bf16, dkv [B,S_kv,Dk] bf16, d_attn_sink [H] fp32) in
    the caller's framework and on its device. ``instruments`` (an Instruments):
    where the call's allocations come from, and its launch and allocation counts.
    """
    return backward(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, block_h=block_h,
                    dkv_buf_bytes=dkv_buf_bytes, backend=backend, instruments=instruments)


def _default_backend() -> str:
    from .backends import default_backend

    return default_backend()


def _backend_unavailable(backend) -> str | None:
    from .backends import unavailable

    return unavailable(backend)


# The harness's seam (mqa_bwd.contract): which backend a call without one gets, and why one cannot run here.
mqa_latent_sparse_bwd.default_backend = _default_backend
mqa_latent_sparse_bwd.backend_unavailable = _backend_unavailable
