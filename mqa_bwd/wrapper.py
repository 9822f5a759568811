"""Host wrapper: ``mqa_latent_sparse_bwd`` as SPEC.md defines it.

Order of work, which the properties rely on:
  1. framework edge: paddle tensors become torch tensors (DLPack, zero-copy);
  2. validation, all of it, before any allocation or launch (ValueError naming
     the argument);
  3. layout: rows flattened, heads zero-padded to the group width, slots padded
     with -1 to the kernel's slot block, invalid indices of every kind mapped
     to -1, kv rows addressed globally (b * S_kv + index);
  4. launches through a ``Launcher`` (TileLang on a GPU, the tile model on a CPU);
  5. results sliced back to H and handed back in the caller's framework.

dKV is deterministic by construction on the deterministic launchers. The
default design ("fixed") adds every contribution into an int64 fixed-point
accumulator with integer atomics, whose sum has the same bits in any order
(``mqa_bwd.fixed_point`` holds the range proof). The older designs keep fp32:
"slots" writes each query row's per-slot contributions to scratch and
``dkv_reduce`` adds them per kv row in the order of a CSR built from the
indices alone; "shards" gives each shard of query rows its own buffer, written
in a fixed row order and folded in shard order. Scratch is bounded by
``dkv_buf_bytes`` (query rows in chunks, or shards per launch), and every
budget gives bitwise identical dq, dkv and d_attn_sink.

The main kernel reads each head group in place from the [R, H_padded, ...]
tensors (a head offset per launch): no per-group copies. What else grows with
S: the int32 slot layout [R, Lp] (built a bounded number of slots at a time),
a few floats or flags per (row, head) or row (Lse2, Delta, the d_sink rows,
the fixed-point allowance, row flags and row marks), the "slots" design's
int64 CSR keys, and the zero-padded copies of q, out and grad_out when H is
not a multiple of the group width.
"""

import dataclasses
import math
import numbers

import torch

from . import fixed_point
from . import kernels as K
from . import launch as L

BLOCK_H_CHOICES = (16, 32)
DEFAULT_DKV_BUF_BYTES = 4 << 30
PAD_SINK = -1e30
INT32_MAX = 2**31 - 1
# The shard design: at most MAX_SHARDS fp32 dKV shards, together at most
# SHARD_SCRATCH_BYTES, fixed so that the reduction order depends on the shapes
# alone, never on the budget (nor on the GPU). A shard is walked by one
# two-CTA cluster; 66 of them fill the 132 SMs of an H100 or H200 in one wave.
MAX_SHARDS = 66
SHARD_SCRATCH_BYTES = 2 << 30
# The default deterministic design: int64 fixed-point atomics (see
# mqa_bwd.fixed_point). The per-slot and per-shard designs stay as
# alternatives to measure against. See benchmarks/profile_stages.py.
DEFAULT_DKV_DESIGN = "fixed"
DKV_DESIGNS = ("fixed", "shards", "slots")


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
    dkv_buf_bytes: int
    #: False reproduces the #1784 wrapper for the CPU model's self-test: a head
    #: count below block_h goes to the kernel as one group of H heads, unpadded.
    pad_heads: bool = True
    #: How the deterministic path reduces dKV (DKV_DESIGNS); None: DEFAULT_DKV_DESIGN.
    dkv_design: str | None = None

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

    @property
    def padded_slots(self) -> int:
        return -(-self.L // K.BLOCK_SLOTS) * K.BLOCK_SLOTS

    @property
    def rows(self) -> int:
        return self.B * self.S

    @property
    def slot_row_bytes(self) -> int:
        """Scratch bytes one query row needs for its per-slot dKV contributions."""
        return self.padded_slots * self.d_k * 4

    @property
    def rows_per_chunk(self) -> int:
        return max(1, min(self.rows, self.dkv_buf_bytes // self.slot_row_bytes))

    @property
    def shard_bytes(self) -> int:
        """One fp32 dKV shard: every kv row of every batch element."""
        return self.B * self.S_kv * self.d_k * 4

    @property
    def fixed_bytes(self) -> int:
        """The int64 fixed-point dKV accumulator: every kv row of every batch element.
        Like the fp32 accumulator of the other designs, it is output-sized, not
        scratch that grows with the query rows, so dkv_buf_bytes does not bound it."""
        return self.B * self.S_kv * self.d_k * 8

    @property
    def shards(self) -> int:
        return max(1, min(MAX_SHARDS, self.rows, SHARD_SCRATCH_BYTES // self.shard_bytes))

    @property
    def shards_per_launch(self) -> int:
        return max(1, min(self.shards, self.dkv_buf_bytes // self.shard_bytes))

    @property
    def design(self) -> str:
        """How the deterministic path reduces dKV:
        "fixed"  int64 fixed-point atomics into one [NKV, Dk] accumulator, one
                 power-of-two scale per kv row (order-free integer sums);
        "slots"  per-slot scratch for a chunk of query rows, reduced per kv row
                 in CSR order (sorted by kv row, then flat slot position);
        "shards" query rows split over fixed shards, each one fp32 dKV buffer
                 with one writer, folded in shard order (scratch independent of S).
        """
        return self.dkv_design or DEFAULT_DKV_DESIGN


# ---------------------------------------------------------------------------
# Framework edge
# ---------------------------------------------------------------------------


def _framework(x) -> str | None:
    if isinstance(x, torch.Tensor):
        return "torch"
    mod = type(x).__module__ or ""
    if mod.startswith("paddle"):
        return "paddle"
    return None


def _to_torch(name, x):
    fw = _framework(x)
    if fw == "torch":
        return x
    if fw == "paddle":
        return torch.from_dlpack(x)
    raise ValueError(f"{name}: expected a torch or paddle tensor, got {type(x).__name__}")


def _from_torch(t: torch.Tensor, framework: str):
    if framework == "torch":
        return t
    import paddle

    return paddle.utils.dlpack.from_dlpack(t.contiguous())


# ---------------------------------------------------------------------------
# Validation (no allocation, no launch)
# ---------------------------------------------------------------------------


def _require_rank(name, t, rank, dims):
    if t.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank} [{dims}], got shape {tuple(t.shape)}")


def _require_shape(name, t, expected, dims):
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} [{dims}], got {tuple(t.shape)}")


def _require_dtype(name, t, dtype):
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def check_sm_scale(sm_scale) -> None:
    """sm_scale must be a finite positive real number (a huge int overflows float: also rejected)."""
    try:
        ok = not isinstance(sm_scale, bool) and isinstance(sm_scale, numbers.Real) and math.isfinite(sm_scale) and sm_scale > 0
    except OverflowError:
        ok = False
    if not ok:
        raise ValueError(f"sm_scale: expected a finite positive number, got {sm_scale!r}")


def validate(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, block_h, dkv_buf_bytes, launcher,
             dkv_design=None):
    """Check every argument; return the Problem. Raises ValueError naming the argument.

    ``dkv_design`` forces the deterministic dKV design (tests and benchmarks)."""
    for name, t in (("query", query), ("kv", kv), ("out", out), ("grad_out", grad_out)):
        _require_dtype(name, t, torch.bfloat16)
    _require_rank("query", query, 4, "B,S,H,Dk")
    B, S, H, d_k = query.shape
    _require_rank("kv", kv, 3, "B,S_kv,Dk")
    if kv.shape[0] != B:
        raise ValueError(f"kv: batch {kv.shape[0]} != query batch {B}")
    if kv.shape[2] != d_k:
        raise ValueError(f"kv: width {kv.shape[2]} != query width Dk={d_k}")
    S_kv = kv.shape[1]
    _require_rank("out", out, 4, "B,S,H,Dv")
    d_v = out.shape[3]
    _require_shape("out", out, (B, S, H, d_v), "B,S,H,Dv")
    _require_rank("grad_out", grad_out, 4, "B,S,H,Dv")
    _require_shape("grad_out", grad_out, (B, S, H, d_v), "B,S,H,Dv")
    if d_v > d_k:
        raise ValueError(f"out: value width Dv={d_v} exceeds Dk={d_k}")
    _require_rank("lse", lse, 3, "B,S,H")
    _require_shape("lse", lse, (B, S, H), "B,S,H")
    _require_dtype("lse", lse, torch.float32)
    if attn_sink is not None:
        _require_rank("attn_sink", attn_sink, 1, "H")
        _require_shape("attn_sink", attn_sink, (H,), "H")
        _require_dtype("attn_sink", attn_sink, torch.float32)
    _require_rank("token_indices", token_indices, 3, "B,S,L")
    if token_indices.dtype.is_floating_point or token_indices.dtype.is_complex or token_indices.dtype == torch.bool:
        raise ValueError(f"token_indices: expected an integer dtype, got {token_indices.dtype}")
    if tuple(token_indices.shape[:2]) != (B, S):
        raise ValueError(f"token_indices: expected shape ({B}, {S}, L) [B,S,L], got {tuple(token_indices.shape)}")
    L_ = token_indices.shape[2]
    for name, n in (("query", B), ("query", S), ("query", H), ("query", d_k), ("kv", S_kv), ("out", d_v), ("token_indices", L_)):
        if n < 1:
            raise ValueError(f"{name}: every dimension must be >= 1, got {n}")
    if d_k % 16 or d_v % 16:
        raise ValueError(f"query: widths must be multiples of 16, got Dk={d_k}, Dv={d_v}")
    launcher.check_widths(d_k, d_v)

    check_sm_scale(sm_scale)

    if block_h is None:
        block_h = 32 if H % 32 == 0 else 16
    elif isinstance(block_h, bool) or not isinstance(block_h, numbers.Integral) or block_h not in BLOCK_H_CHOICES:
        raise ValueError(
            f"block_h: must be one of {BLOCK_H_CHOICES} (the widths for which the kernel's own head tile "
            f"equals the group width), got {block_h!r}"
        )

    if dkv_buf_bytes is None:
        dkv_buf_bytes = DEFAULT_DKV_BUF_BYTES
    elif isinstance(dkv_buf_bytes, bool) or not isinstance(dkv_buf_bytes, numbers.Integral) or dkv_buf_bytes <= 0:
        raise ValueError(f"dkv_buf_bytes: expected a positive integer, got {dkv_buf_bytes!r}")

    if dkv_design not in (None,) + DKV_DESIGNS:
        raise ValueError(f"dkv_design: one of {DKV_DESIGNS}, got {dkv_design!r}")
    problem = Problem(B, S, S_kv, H, L_, d_k, d_v, int(block_h), int(dkv_buf_bytes), dkv_design=dkv_design)
    if launcher.deterministic and problem.design == "slots" and problem.slot_row_bytes > problem.dkv_buf_bytes:
        raise ValueError(
            f"dkv_buf_bytes: {dkv_buf_bytes} cannot hold one query row's slot scratch "
            f"({problem.slot_row_bytes} bytes = padded L {problem.padded_slots} x Dk {d_k} x 4)"
        )
    if launcher.deterministic and problem.design == "shards" and problem.shard_bytes > problem.dkv_buf_bytes:
        raise ValueError(
            f"dkv_buf_bytes: {dkv_buf_bytes} cannot hold one dKV shard "
            f"({problem.shard_bytes} bytes = B*S_kv {B * S_kv} x Dk {d_k} x 4)"
        )
    if problem.padded_slots > K.MAX_SLOTS_PER_ROW:
        raise ValueError(f"token_indices: top-k L = {L_} pads to {problem.padded_slots} slots a row, "
                         f"more than the kernels' {K.MAX_SLOTS_PER_ROW}")
    if problem.rows * problem.padded_slots > INT32_MAX:
        raise ValueError(f"token_indices: B*S*L = {problem.rows * problem.padded_slots} slots exceed int32 addressing")
    if B * S_kv > INT32_MAX:
        raise ValueError(f"kv: B*S_kv = {B * S_kv} rows exceed int32 addressing")

    device = query.device
    for name, t in (("kv", kv), ("out", out), ("grad_out", grad_out), ("lse", lse), ("attn_sink", attn_sink), ("token_indices", token_indices)):
        if t is not None and t.device != device:
            raise ValueError(f"{name}: on {t.device}, but query is on {device}")
    if device != launcher.device and not (device.type == launcher.device.type == "cuda"):
        raise ValueError(f"query: on {device}, but backend {launcher.name!r} runs on {launcher.device}")
    return problem


# ---------------------------------------------------------------------------
# Layout and launches
# ---------------------------------------------------------------------------


def _pad_heads(x: torch.Tensor, padded: int, value: float, launcher) -> torch.Tensor:
    """[R, H, ...] -> [R, padded, ...], pad heads filled with ``value``."""
    H = x.shape[1]
    if H == padded:
        return x.contiguous()
    y = launcher.empty((x.shape[0], padded) + tuple(x.shape[2:]), x.dtype)
    y[:, :H] = x
    y[:, H:] = value
    return y


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


#: The slot layout is built this many slots at a time, so its int64
#: temporaries stay bounded whatever S and L.
INDEX_STEP = 1 << 24


def global_slots(token_indices: torch.Tensor, p: Problem) -> torch.Tensor:
    """[B,S,L] any integer -> [R, Lp] int32: b*S_kv + index when 0 <= index < S_kv, else -1."""
    flat = token_indices.reshape(p.rows, p.L)
    slots = torch.full((p.rows, p.padded_slots), -1, dtype=torch.int32, device=flat.device)
    step = max(1, INDEX_STEP // p.L)  # rows per step, at least one
    for r0 in range(0, p.rows, step):
        rows = slice(r0, min(p.rows, r0 + step))
        idx = flat[rows].to(torch.int64)
        valid = (idx >= 0) & (idx < p.S_kv)
        batch = torch.arange(rows.start, rows.stop, device=idx.device, dtype=torch.int64) // p.S
        # B*S_kv < 2**31 (validated), so every valid global row fits int32.
        slots[rows, : p.L] = torch.where(valid, idx + (batch * p.S_kv).view(-1, 1), -1)
    return slots


@dataclasses.dataclass
class SlotCSR:
    """Valid slots sorted by (kv row, flat slot position r*Lp + j): the fixed dKV reduction order."""

    keys: torch.Tensor  # int64, sorted: kv_row * (R*Lp) + position
    slot_of_entry: torch.Tensor  # int32 flat slot position of each entry
    span: int  # R * Lp

    @classmethod
    def build(cls, slots: torch.Tensor) -> "SlotCSR":
        flat = slots.reshape(-1).to(torch.int64)
        span = flat.numel()
        position = torch.nonzero(flat >= 0).reshape(-1)
        # Keys are unique (positions are), so every correct sort gives the same order.
        keys, _ = torch.sort(flat[position] * span + position)
        return cls(keys=keys, slot_of_entry=(keys % span).to(torch.int32), span=span)

    def bounds(self, nkv: int, first_position: int, end_position: int):
        """Entry ranges [lo, hi) per kv row for slot positions in [first, end)."""
        rows = torch.arange(nkv, device=self.keys.device, dtype=torch.int64) * self.span
        lo = torch.searchsorted(self.keys, rows + first_position)
        hi = torch.searchsorted(self.keys, rows + end_position)
        return lo.to(torch.int32), hi.to(torch.int32)


def run(p: Problem, query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, launcher: L.Launcher):
    """Lay out, launch, and return (dq, dkv, d_sink) as torch tensors on the launcher's device."""
    R, Hp, G, bh, Lp = p.rows, p.padded_heads, p.groups, p.group_width, p.padded_slots
    NKV = p.B * p.S_kv
    f32 = torch.float32

    q = _pad_heads(query.reshape(R, p.H, p.d_k), Hp, 0.0, launcher)
    o = _pad_heads(out.reshape(R, p.H, p.d_v), Hp, 0.0, launcher)
    do = _pad_heads(grad_out.reshape(R, p.H, p.d_v), Hp, 0.0, launcher)
    lse_p = _pad_heads(lse.reshape(R, p.H).to(f32), Hp, 0.0, launcher)
    if attn_sink is None:
        sink = torch.full((p.H,), -math.inf, dtype=f32, device=query.device)
    else:
        sink = attn_sink.to(f32)
    sink_p = _pad_heads(sink.reshape(1, p.H), Hp, PAD_SINK, launcher).reshape(Hp)

    # Kernel convention: base 2, sink-inclusive. A row with no valid slot
    # (lse = -inf) has zero gradients, the sink's too: Lse2 = +inf there makes
    # both P and p_sink exactly 0, with or without a sink, and never NaN.
    lse2 = per_head(lambda lse_h, sink_h: torch.logaddexp(lse_h, sink_h) * K.LOG2E, lse_p, sink_p)
    lse2 = torch.where(lse_p == -math.inf, torch.full_like(lse2, math.inf), lse2).contiguous()
    sink2 = (sink_p * K.LOG2E).contiguous()
    kv2 = kv.reshape(NKV, p.d_k).contiguous()
    slots = global_slots(token_indices, p)

    delta = launcher.empty((R, Hp), f32)
    dsink_rows = launcher.empty((R, Hp), f32)
    fixed = launcher.deterministic and p.design == "fixed"
    if fixed:  # the same launch also reduces the maxima of |q| and |dO| the fixed-point plan needs
        peak_q, peak_do = launcher.empty((R, Hp), torch.int32), launcher.empty((R, Hp), torch.int32)
        launcher.delta(o, do, lse2, sink2, delta, dsink_rows, q, peak_q, peak_do)
    else:
        launcher.delta(o, do, lse2, sink2, delta, dsink_rows)

    # Every launch reads its head group in place (head_base): no per-group copies.
    dq = launcher.empty((R, Hp, p.d_k), torch.bfloat16)
    dkv_acc = None if fixed else launcher.zeros((NKV, p.d_k), f32)

    def group(g):
        return {"sm_scale": sm_scale, "heads": bh, "head_base": g * bh}

    if not launcher.deterministic:
        # Two 32-head groups run as one 64-head CTA (kernels.runs_wide), as in the fixed design.
        for g, size in K.cluster_launches(G, mode="atomic", heads=bh):
            launcher.main_bwd(q, kv2, do, slots, lse2, delta, dq, dkv_acc, mode="atomic", **group(g), cluster=size)
    elif p.design == "fixed":
        referenced = launcher.zeros((NKV,), torch.int32)
        live_row = launcher.zeros((R,), torch.int32)
        launcher.mark_slots(slots, referenced, live_row)
        row_scale, allowance = launcher.plan(query, grad_out, delta, kv2[:, : p.d_v], referenced, live_row, sm_scale,
                                             peak_q, peak_do)
        # Padding heads (q = dO = 0) contribute nothing: no limit on their mass.
        allowance = _pad_heads(allowance, Hp, math.inf, launcher)
        row_flags = launcher.zeros((R,), torch.int32)
        dkv_fixed = launcher.zeros((NKV, p.d_k), torch.int64)
        # Consecutive head groups run as one cluster per query row, whose CTAs
        # swap P and dS tiles and each add a column share of dKV summed over
        # all the cluster's heads: fewer fixed-point adds.
        for g, size in K.cluster_launches(G):
            launcher.main_bwd(
                q, kv2, do, slots, lse2, delta, dq, dkv_fixed, mode="fixed", **group(g),
                row_scale=row_scale, allowance=allowance, flag=row_flags, cluster=size,
            )
        row_scale = fixed_point.poison_flagged(row_scale, row_flags, p.B)
    elif p.design == "shards":
        # Shard s owns query rows s, s + n, s + 2n, ...; a launch runs shards
        # [c0, c1) (as many as the budget holds), then folds them in shard order.
        n, per = p.shards, p.shards_per_launch
        shard_buf = launcher.empty((per, NKV, p.d_k), f32)
        for c0 in range(0, n, per):
            c1 = min(n, c0 + per)
            buf = shard_buf[: c1 - c0]
            buf.zero_()
            for g, size in K.cluster_launches(G, mode="shard"):
                launcher.main_bwd(
                    q, kv2, do, slots, lse2, delta, dq, buf, mode="shard", **group(g), shard_base=c0, n_shards=n,
                    cluster=size,
                )
            launcher.shard_fold(buf, dkv_acc)
    else:
        csr = SlotCSR.build(slots)
        chunk = p.rows_per_chunk
        slot_buf = launcher.empty((chunk, Lp, p.d_k), f32)
        for r0 in range(0, R, chunk):
            r1 = min(R, r0 + chunk)
            buf = slot_buf[: r1 - r0]
            for g in range(G):
                launcher.main_bwd(
                    q[r0:r1], kv2, do[r0:r1], slots[r0:r1], lse2[r0:r1], delta[r0:r1], dq[r0:r1], buf,
                    mode="write" if g == 0 else "accumulate", **group(g),
                )
            lo, hi = csr.bounds(NKV, r0 * Lp, r1 * Lp)
            launcher.dkv_reduce(buf.view((r1 - r0) * Lp, p.d_k), csr.slot_of_entry, lo, hi, dkv_acc, r0 * Lp)

    dsink = launcher.empty((Hp,), f32)
    launcher.dsink_reduce(dsink_rows, dsink)
    dkv = launcher.empty((NKV, p.d_k), torch.bfloat16)
    if fixed:
        launcher.fixed_to_bf16(dkv_fixed, row_scale, dkv)
    else:
        launcher.cast_bf16(dkv_acc, dkv)

    dq = dq[:, : p.H].reshape(p.B, p.S, p.H, p.d_k).contiguous()  # a copy only when heads were padded
    return dq, dkv.view(p.B, p.S_kv, p.d_k), dsink[: p.H].contiguous()


def backward_with(launcher: L.Launcher, query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *,
                  block_h=None, dkv_buf_bytes=None, dkv_design=None):
    """Validate, then run on a given launcher; torch tensors in and out.

    The public function below, tests and benchmarks all go through here;
    ``dkv_design`` forces the deterministic design (see ``Problem.design``).
    """
    p = validate(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, block_h, dkv_buf_bytes,
                 launcher, dkv_design=dkv_design)
    return run(p, query, kv, out, grad_out, lse, attn_sink, token_indices, float(sm_scale), launcher)


def mqa_latent_sparse_bwd(
    query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None, dkv_buf_bytes=None, backend=None
):
    """Backward of sparse absorbed MQA with an attention sink. See SPEC.md.

    Returns (dq [B,S,H,Dk] bf16, dkv [B,S_kv,Dk] bf16, d_attn_sink [H] fp32) in
    the caller's framework and on its device.
    """
    from .backends import get_launcher

    framework = _framework(query)
    named = {
        "query": query, "kv": kv, "out": out, "grad_out": grad_out, "lse": lse, "token_indices": token_indices,
    }
    tensors = {name: _to_torch(name, x) for name, x in named.items()}
    sink = None if attn_sink is None else _to_torch("attn_sink", attn_sink)
    launcher = get_launcher(backend, tensors["query"].device)
    dq, dkv, dsink = backward_with(
        launcher, tensors["query"], tensors["kv"], tensors["out"], tensors["grad_out"], tensors["lse"], sink,
        tensors["token_indices"], sm_scale, block_h=block_h, dkv_buf_bytes=dkv_buf_bytes,
    )
    return tuple(_from_torch(t, framework) for t in (dq, dkv, dsink))
