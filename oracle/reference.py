"""NumPy reference for the sparse absorbed-MQA forward and backward (docs/SPEC.md).

Everything works on blocks of query rows of one batch entry: the kv rows a
block selects are gathered into a [rows, L, Dk] array whose size is bounded by
``_BLOCK_BYTES``, so memory never scales with S*H*L*Dk.
"""

from __future__ import annotations

import numbers

import ml_dtypes
import numpy as np

__all__ = ["forward", "backward", "backward_bf16_baseline"]

# Working-set target per block of query rows (gathered kv plus the per-slot
# dkv contributions and the [rows, H, L] score-sized temporaries).
_BLOCK_BYTES = 24 << 20

_LOG2E = float(np.log2(np.e))
_BF16 = ml_dtypes.bfloat16


# --------------------------------------------------------------------------
# input checking


def _float_array(name, x, ndim):
    if x is None:
        raise ValueError(f"{name} must be an array, got None")
    a = np.asarray(x)
    try:
        ml_dtypes.finfo(a.dtype)  # numpy floats and ml_dtypes floats; ints/bools raise
    except (ValueError, TypeError):
        raise ValueError(f"{name} must have a floating dtype, got {a.dtype}") from None
    if a.dtype.kind == "c":
        raise ValueError(f"{name} must be real, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {a.shape}")
    if 0 in a.shape:
        raise ValueError(f"{name} must have no empty dimension, got shape {a.shape}")
    return a


def _index_array(token_indices, shape):
    if token_indices is None:
        raise ValueError("token_indices must be an integer array, got None")
    idx = np.asarray(token_indices)
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"token_indices must have an integer dtype, got {idx.dtype}")
    if idx.ndim != 3 or idx.shape[:2] != shape or idx.shape[2] == 0:
        raise ValueError(
            f"token_indices must have shape [B, S, L] = [{shape[0]}, {shape[1]}, L>=1], "
            f"got {idx.shape}"
        )
    return idx


def _check_shape(name, a, expected):
    if a.shape != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {a.shape}")


def _scale(sm_scale):
    if isinstance(sm_scale, (bool, np.bool_)) or not isinstance(sm_scale, numbers.Real):
        raise ValueError(f"sm_scale must be a real number, got {sm_scale!r}")
    s = float(sm_scale)
    if not np.isfinite(s):
        raise ValueError(f"sm_scale must be finite, got {s}")
    return s


def _sink(attn_sink, H, dt):
    """The per-head sink as a [H] array of dt; -inf everywhere when None."""
    if attn_sink is None:
        return np.full(H, -np.inf, dtype=dt)
    a = _float_array("attn_sink", attn_sink, 1)
    _check_shape("attn_sink", a, (H,))
    a = a.astype(dt)
    if np.isnan(a).any() or np.isposinf(a).any():
        raise ValueError("attn_sink must not hold NaN or +inf")
    return a


def _precision(precision):
    if precision in ("float32", np.float32):
        return np.dtype(np.float32)
    if precision in ("float64", np.float64):
        return np.dtype(np.float64)
    raise ValueError(f"precision must be 'float32' or 'float64', got {precision!r}")


def _check_common(q, kv, token_indices):
    q = _float_array("q", q, 4)
    kv = _float_array("kv", kv, 3)
    B, S, H, Dk = q.shape
    if kv.shape[0] != B:
        raise ValueError(f"kv batch {kv.shape[0]} does not match q batch {B}")
    if kv.shape[2] != Dk:
        raise ValueError(f"kv width {kv.shape[2]} does not match q width Dk={Dk}")
    idx = _index_array(token_indices, (B, S))
    return q, kv, idx


# --------------------------------------------------------------------------
# shared machinery


def _block_rows(L, H, Dk, itemsize):
    # Per query row: gathered kv and its dkv contributions (L x Dk each), the
    # score-sized temporaries (H x L), the q and dq rows (H x Dk).
    per_row = itemsize * (2 * L * Dk + 6 * H * L + 2 * H * Dk)
    return max(1, _BLOCK_BYTES // per_row)


def _gather(kv_b, idx_blk, S_kv):
    """Valid mask [R, L] and gathered kv rows [R, L, Dk], zero in invalid slots.

    Invalid slots are zeroed rather than left pointing at row 0, so that no
    value of an unselected kv row (even inf or NaN) can reach a result.
    """
    valid = (idx_blk >= 0) & (idx_blk < S_kv)
    safe = np.where(valid, idx_blk, 0).astype(np.intp)
    K = kv_b[safe]
    if not valid.all():
        K[~valid] = 0
    return valid, safe, K


def _logits(qb, K, valid, scale):
    """sm_scale * <q, k_j> as [R, H, L], -inf in invalid slots."""
    raw = np.matmul(qb, K.transpose(0, 2, 1))
    raw *= raw.dtype.type(scale)
    np.copyto(raw, -np.inf, where=~valid[:, None, :])
    return raw


def _finite_or_zero(x):
    return np.where(np.isfinite(x), x, 0)


def _scatter_rows(dkv_b, safe, valid, C):
    """dkv_b[safe[r, j]] += C[r, j] over valid (r, j), in a fixed order.

    Contributions are stably sorted by destination row and summed segment by
    segment (np.add.reduceat, sequential), so the bits never depend on timing.
    """
    Dk = C.shape[-1]
    pos = np.flatnonzero(valid.reshape(-1))
    if pos.size == 0:
        return
    keys = safe.reshape(-1)[pos]
    order = np.argsort(keys, kind="stable")
    pos = pos[order]
    keys = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    sums = np.add.reduceat(C.reshape(-1, Dk)[pos], starts, axis=0)
    dkv_b[keys[starts]] += sums


# --------------------------------------------------------------------------
# forward


def forward(q, kv, token_indices, attn_sink, sm_scale, d_v, *, precision="float32"):
    """Sparse MQA forward with an optional per-head sink (docs/SPEC.md).

    Returns (out [B,S,H,Dv], lse [B,S,H]); lse is natural-log and excludes the
    sink, -inf for a row with no valid slot (whose out is 0).
    """
    dt = _precision(precision)
    q, kv, idx = _check_common(q, kv, token_indices)
    B, S, H, Dk = q.shape
    S_kv = kv.shape[1]
    L = idx.shape[2]
    if isinstance(d_v, (bool, np.bool_)) or not isinstance(d_v, numbers.Integral):
        raise ValueError(f"d_v must be an integer, got {d_v!r}")
    Dv = int(d_v)
    if not 1 <= Dv <= Dk:
        raise ValueError(f"d_v must satisfy 1 <= d_v <= Dk={Dk}, got {Dv}")
    scale = _scale(sm_scale)
    sink = _sink(attn_sink, H, dt)

    out = np.empty((B, S, H, Dv), dtype=dt)
    lse = np.empty((B, S, H), dtype=dt)
    R = _block_rows(L, H, Dk, dt.itemsize)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for b in range(B):
            kv_b = kv[b].astype(dt)
            for s0 in range(0, S, R):
                s1 = min(S, s0 + R)
                valid, _, K = _gather(kv_b, idx[b, s0:s1], S_kv)
                logit = _logits(q[b, s0:s1].astype(dt), K, valid, scale)
                m = _finite_or_zero(logit.max(axis=-1))
                e = np.exp(logit - m[..., None])
                row_lse = m + np.log(e.sum(axis=-1))  # -inf when nothing is valid
                z = _finite_or_zero(np.logaddexp(row_lse, sink))
                p = np.exp(logit - z[..., None])
                out[b, s0:s1] = np.matmul(p, K[:, :, :Dv])
                lse[b, s0:s1] = row_lse
    return out, lse


# --------------------------------------------------------------------------
# backward


def _round_bf16(x):
    return x.astype(_BF16).astype(np.float32)


def _backward(q, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, dt, bf16):
    q, kv, idx = _check_common(q, kv, token_indices)
    B, S, H, Dk = q.shape
    S_kv = kv.shape[1]
    L = idx.shape[2]
    out = _float_array("out", out, 4)
    if out.shape[:3] != (B, S, H):
        raise ValueError(f"out must have shape [B, S, H, Dv] = [{B}, {S}, {H}, Dv], got {out.shape}")
    Dv = out.shape[3]
    if Dv > Dk:
        raise ValueError(f"out width Dv={Dv} must not exceed Dk={Dk}")
    grad_out = _float_array("grad_out", grad_out, 4)
    _check_shape("grad_out", grad_out, out.shape)
    lse = _float_array("lse", lse, 3)
    _check_shape("lse", lse, (B, S, H))
    if np.isnan(lse).any() or np.isposinf(lse).any():
        raise ValueError("lse must not hold NaN or +inf")
    scale = _scale(sm_scale)
    sink = _sink(attn_sink, H, dt)

    def load(x):
        # bf16 baseline: every bf16 input of the kernel is rounded first.
        return _round_bf16(x) if bf16 else x.astype(dt)

    dq = np.empty((B, S, H, Dk), dtype=dt)
    dkv = np.zeros((B, S_kv, Dk), dtype=dt)
    d_sink = np.zeros(H, dtype=dt)
    R = _block_rows(L, H, Dk, dt.itemsize)
    scale_t = dt.type(scale)
    log2e = dt.type(_LOG2E)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for b in range(B):
            kv_b = load(kv[b])
            for s0 in range(0, S, R):
                s1 = min(S, s0 + R)
                valid, safe, K = _gather(kv_b, idx[b, s0:s1], S_kv)
                qb = load(q[b, s0:s1])
                dob = load(grad_out[b, s0:s1])
                delta = np.einsum("rhd,rhd->rh", load(out[b, s0:s1]), dob)
                lse_tot = np.logaddexp(lse[b, s0:s1].astype(dt), sink)  # sink-inclusive
                lse_safe = _finite_or_zero(lse_tot)
                if bf16:
                    # The kernel's base-2 form: P = exp2(score*sm_scale*log2e - Lse2).
                    raw = np.matmul(qb, K.transpose(0, 2, 1))
                    np.copyto(raw, -np.inf, where=~valid[:, None, :])
                    p = np.exp2(raw * dt.type(scale * _LOG2E) - (lse_safe * log2e)[..., None])
                    p_sink = np.exp2(sink * log2e - lse_safe * log2e)
                else:
                    p = np.exp(_logits(qb, K, valid, scale) - lse_safe[..., None])
                    p_sink = np.exp(sink - lse_safe)
                dp = np.matmul(dob, K[:, :, :Dv].transpose(0, 2, 1))
                ds = p * (dp - delta[..., None]) * scale_t  # gradient of the scaled score
                if bf16:
                    p = _round_bf16(p)
                    ds = _round_bf16(ds)
                dq[b, s0:s1] = np.matmul(ds, K)
                C = np.matmul(ds.transpose(0, 2, 1), qb)
                C[:, :, :Dv] += np.matmul(p.transpose(0, 2, 1), dob)
                _scatter_rows(dkv[b], safe, valid, C)
                # A row with no valid slot has zero gradients, the sink's included.
                has_valid = valid.any(axis=1)[:, None]
                d_sink -= np.where(has_valid, p_sink * delta, 0).sum(axis=0)
    if bf16:
        dq = _round_bf16(dq)
        dkv = _round_bf16(dkv)
    return dq, dkv, d_sink


def backward(q, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, precision="float32"):
    """Gradients of sum(out * grad_out) w.r.t. q, kv and attn_sink (docs/SPEC.md).

    ``lse`` is the forward's natural-log, sink-exclusive lse. Returns
    (dq [B,S,H,Dk], dkv [B,S_kv,Dk], d_attn_sink [H]) in ``precision``;
    d_attn_sink is zeros when attn_sink is None.
    """
    dt = _precision(precision)
    return _backward(q, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, dt, bf16=False)


def backward_bf16_baseline(q, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale):
    """The backward as a bf16 kernel computes it: the tolerance yardstick.

    q, kv, out, grad_out are rounded to bf16; products accumulate in fp32; P
    and dS are rounded to bf16 before their matrix products, dq and dkv at the
    end. Returns float32 arrays (dq and dkv hold bf16-exact values).
    """
    return _backward(
        q, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, np.dtype(np.float32), bf16=True
    )
