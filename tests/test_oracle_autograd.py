"""The NumPy oracle against a second, independent oracle: the forward written in
Paddle (CPU, float64) and differentiated by ``paddle.grad``.

The cases come from Hypothesis: shapes, index patterns (every kind of invalid
index, duplicates, rows with no valid slot), sinks (None, -inf, -1e30, finite,
large) and input dtypes are all drawn, not picked.
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import oracle

pytestmark = pytest.mark.paddle
paddle = pytest.importorskip("paddle")

INT32_MIN = np.iinfo(np.int32).min
INT32_MAX = np.iinfo(np.int32).max


# --------------------------------------------------------------------------
# the independent oracle


def _exp(x):
    """exp that gives exactly 0 below -700. Paddle 3.3's CPU float64 exp
    returns about 5.6e-309 for -inf and other very negative inputs, which
    would leave a row with no valid slot a nonzero softmax weight."""
    keep = x > -700.0
    return paddle.where(keep, paddle.exp(paddle.where(keep, x, paddle.zeros_like(x))), paddle.zeros_like(x))


def paddle_forward(q, kv, idx, sink, scale, d_v):
    """Softmax with the sink as an extra, value-less column; rows normalised
    with a detached max. Returns (out, lse) as paddle tensors."""
    B, S, H, Dk = q.shape
    S_kv = kv.shape[1]
    L = idx.shape[2]
    valid_np = (idx >= 0) & (idx < S_kv)
    flat = np.where(valid_np, idx, 0).astype(np.int64) + (np.arange(B) * S_kv)[:, None, None]
    K = paddle.gather(kv.reshape([B * S_kv, Dk]), paddle.to_tensor(flat.reshape(-1)))
    K = K.reshape([B, S, L, Dk])
    logits = scale * paddle.matmul(q, K, transpose_y=True)  # [B, S, H, L]
    valid = paddle.to_tensor(np.broadcast_to(valid_np[:, :, None, :], (B, S, H, L)).copy())
    masked = paddle.where(valid, logits, paddle.full_like(logits, -np.inf))

    def finite_or_zero(x):
        x = x.detach()  # a shift only: every result is invariant to it
        return paddle.where(paddle.isfinite(x), x, paddle.zeros_like(x))

    m_valid = masked.max(axis=-1, keepdim=True)
    m = m_valid if sink is None else paddle.maximum(m_valid, sink.reshape([1, 1, H, 1]))
    m = finite_or_zero(m)
    e = _exp(masked - m)
    z = e.sum(axis=-1, keepdim=True)
    if sink is not None:
        z = z + _exp(sink.reshape([1, 1, H, 1]) - m)
    z = paddle.where(z > 0, z, paddle.ones_like(z))
    out = paddle.matmul(e / z, K[:, :, :, :d_v])
    # lse excludes the sink, so it has its own shift.
    m_valid = finite_or_zero(m_valid)
    lse = (paddle.log(_exp(masked - m_valid).sum(axis=-1, keepdim=True)) + m_valid).squeeze(-1)
    return out, lse


def paddle_reference(case):
    """(out, lse, dq, dkv, d_sink) in float64 NumPy, from autograd."""
    q = paddle.to_tensor(case["q"].astype(np.float64), stop_gradient=False)
    kv = paddle.to_tensor(case["kv"].astype(np.float64), stop_gradient=False)
    sink_np = case["sink"]
    sink = None if sink_np is None else paddle.to_tensor(sink_np.astype(np.float64), stop_gradient=False)
    out, lse = paddle_forward(q, kv, case["idx"], sink, case["scale"], case["d_v"])
    dout = paddle.to_tensor(case["grad_out"].astype(np.float64))
    inputs = [q, kv] + ([sink] if sink is not None else [])
    grads = paddle.grad([out], inputs, grad_outputs=[dout], allow_unused=True)
    H = case["q"].shape[2]
    d_sink = np.zeros(H) if sink is None else grads[2].numpy()
    return out.numpy(), lse.numpy(), grads[0].numpy(), grads[1].numpy(), d_sink


# --------------------------------------------------------------------------
# drawn cases


@st.composite
def cases(draw, in_dtypes=(np.float64, np.float32, ml_dtypes.bfloat16)):
    B = draw(st.integers(1, 2))
    S = draw(st.integers(1, 4))
    S_kv = draw(st.integers(1, 6))
    H = draw(st.integers(1, 4))
    L = draw(st.integers(1, 7))
    Dk = draw(st.integers(1, 9))
    d_v = draw(st.integers(1, Dk))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    dt = draw(st.sampled_from(in_dtypes))
    idx_dtype = draw(st.sampled_from([np.int32, np.int64]))

    # Indices: valid rows (duplicates are frequent with small S_kv) mixed with
    # every kind of invalid value; some rows entirely invalid.
    p_invalid = draw(st.sampled_from([0.0, 0.2, 0.5, 0.9]))
    invalid_kinds = np.array([-1, -2, INT32_MIN, S_kv, S_kv + 3, INT32_MAX], dtype=np.int64)
    idx = rng.integers(0, S_kv, size=(B, S, L))
    bad = rng.random((B, S, L)) < p_invalid
    idx = np.where(bad, rng.choice(invalid_kinds, size=(B, S, L)), idx)
    if draw(st.booleans()):
        idx[rng.integers(B), rng.integers(S)] = rng.choice(invalid_kinds, size=L)
    idx = idx.astype(idx_dtype)

    # Sink: None or per-head values from every regime.
    sink_kind = draw(st.sampled_from(["none", "finite", "mixed"]))
    if sink_kind == "none":
        sink = None
    elif sink_kind == "finite":
        sink = rng.normal(0.0, 2.0, size=H)
    else:
        sink = rng.choice(np.array([-np.inf, -1e30, -3.0, 0.5, 4.0, 30.0, 1e4]), size=H)

    scale = draw(st.sampled_from([Dk**-0.5, 0.1, 1.0]))
    amp = draw(st.sampled_from([0.5, 1.0, 2.0]))
    q = (amp * rng.standard_normal((B, S, H, Dk))).astype(dt)
    kv = (amp * rng.standard_normal((B, S_kv, Dk))).astype(dt)
    grad_out = rng.standard_normal((B, S, H, d_v)).astype(dt)
    if sink is not None:
        sink = sink.astype(np.float32 if dt != np.float64 else np.float64)
    return dict(q=q, kv=kv, idx=idx, sink=sink, scale=scale, d_v=d_v, grad_out=grad_out)


def term_scales(case):
    """For each output, the magnitude of the terms it sums: the same maths
    with every factor replaced by its absolute value (float64, plain NumPy).
    Rounding noise is proportional to this, not to the result, so it is the
    floor below which "relative to the largest magnitude" stops meaning
    anything (e.g. dq is exactly 0 when all of a row's slots name one kv row,
    and both oracles then return pure rounding noise)."""
    q, kv = case["q"].astype(np.float64), case["kv"].astype(np.float64)
    dO, idx, d_v = case["grad_out"].astype(np.float64), case["idx"], case["d_v"]
    B, S, H, Dk = q.shape
    valid = (idx >= 0) & (idx < kv.shape[1])
    safe = np.where(valid, idx, 0)
    K = kv[np.arange(B)[:, None, None], safe] * valid[..., None]  # [B, S, L, Dk]
    vmask = valid[:, :, None, :]
    logit = np.where(vmask, case["scale"] * np.einsum("bshd,bsld->bshl", q, K), -np.inf)
    sink = np.full(H, -np.inf) if case["sink"] is None else case["sink"].astype(np.float64)
    m = np.maximum(logit.max(-1), sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e, e_sink = np.exp(logit - m[..., None]), np.exp(sink - m)
    z = e.sum(-1) + e_sink
    z = np.where(z > 0, z, 1.0)
    p, p_sink = e / z[..., None], e_sink / z
    absV = np.abs(K[..., :d_v])
    A_out = np.einsum("bshl,bsld->bshd", p, absV)
    A_lse = np.where(vmask, np.abs(logit), 0.0).max(-1) + 1.0
    delta = np.einsum("bshd,bshd->bsh", A_out, np.abs(dO))
    w = p * (np.einsum("bshd,bsld->bshl", np.abs(dO), absV) + delta[..., None])
    A_dq = abs(case["scale"]) * np.einsum("bshl,bsld->bshd", w, np.abs(K))
    per_slot = abs(case["scale"]) * np.einsum("bshl,bshd->bsld", w, np.abs(q))
    per_slot[..., :d_v] += np.einsum("bshl,bshd->bsld", p, np.abs(dO))
    A_dkv = np.zeros_like(kv)
    for b in range(B):
        np.add.at(A_dkv[b], safe[b][valid[b]], per_slot[b][valid[b]])
    A_sink = (p_sink * delta).sum((0, 1))
    return dict(out=A_out, lse=A_lse, dq=A_dq, dkv=A_dkv, d_sink=A_sink)


def check(name, got, ref, scale, tol, unit):
    """max |got - ref| <= tol * (largest |ref|), except where the largest |ref|
    is itself below the rounding noise of its terms: there the bound is
    64 unit roundoffs of the largest term (see term_scales)."""
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, name
    # lse is -inf exactly where a row has no valid slot; nothing else is non-finite.
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref), err_msg=name)
    fin = np.isfinite(ref)
    assert np.isfinite(got[fin]).all(), name
    err = np.max(np.abs(got[fin] - ref[fin]), initial=0.0)
    mag = np.max(np.abs(ref[fin]), initial=0.0)
    noise = 64 * unit * np.max(scale[fin] if scale.shape == ref.shape else scale, initial=0.0)
    assert err <= max(tol * mag, noise), f"{name}: max err {err:.3g}, largest |ref| {mag:.3g}, noise floor {noise:.3g}"


def check_all(got, ref, case, tol, unit):
    scales = term_scales(case)
    for name, g, r in zip(("out", "lse", "dq", "dkv", "d_sink"), got, ref):
        check(name, g, r, scales[name], tol, unit)


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------
# tests

EPS64 = np.finfo(np.float64).eps / 2
EPS32 = np.finfo(np.float32).eps / 2


@SETTINGS
@given(cases())
def test_float64_agrees_with_paddle_autograd(case):
    ref = paddle_reference(case)
    ref_out, ref_lse = ref[0], ref[1]
    out, lse = oracle.forward(
        case["q"], case["kv"], case["idx"], case["sink"], case["scale"], case["d_v"], precision="float64"
    )
    # The backward is fed the independent oracle's out and lse, not its own.
    grads = oracle.backward(
        case["q"], case["kv"], ref_out, case["grad_out"], ref_lse, case["sink"], case["idx"], case["scale"],
        precision="float64",
    )
    assert all(x.dtype == np.float64 for x in (out, lse) + grads)
    check_all((out, lse) + grads, ref, case, tol=1e-10, unit=EPS64)


@SETTINGS
@given(cases(in_dtypes=(np.float32, ml_dtypes.bfloat16)))
def test_float32_default_agrees_with_paddle_autograd(case):
    ref = paddle_reference(case)
    # The default-mode pipeline end to end: its own float32 out and lse.
    out, lse = oracle.forward(case["q"], case["kv"], case["idx"], case["sink"], case["scale"], case["d_v"])
    grads = oracle.backward(case["q"], case["kv"], out, case["grad_out"], lse, case["sink"], case["idx"], case["scale"])
    assert all(x.dtype == np.float32 for x in (out, lse) + grads)
    check_all((out, lse) + grads, ref, case, tol=1e-5, unit=EPS32)


def test_comparison_is_not_vacuous():
    """The check can fail: an lse off by 1e-7 is caught in every gradient in
    float64, and float32 results do not pass the float64 bound."""
    rng = np.random.default_rng(7)
    case = dict(
        q=rng.standard_normal((1, 3, 2, 5)), kv=rng.standard_normal((1, 4, 5)),
        idx=np.array([[[0, 1, 3], [2, 2, -1], [3, 0, 1]]], dtype=np.int32),
        sink=np.array([0.3, -1.0]), scale=0.5, d_v=4, grad_out=rng.standard_normal((1, 3, 2, 4)),
    )
    ref = paddle_reference(case)
    fwd = oracle.forward(case["q"], case["kv"], case["idx"], case["sink"], case["scale"], 4, precision="float64")

    def bwd(lse, precision="float64"):
        return oracle.backward(
            case["q"], case["kv"], ref[0], case["grad_out"], lse, case["sink"], case["idx"], case["scale"],
            precision=precision,
        )

    good = bwd(ref[1])
    check_all(fwd + good, ref, case, tol=1e-10, unit=EPS64)
    bad = bwd(ref[1] + 1e-7)
    for i in range(3):
        with pytest.raises(AssertionError):
            check_all(fwd + tuple(bad[j] if j == i else good[j] for j in range(3)), ref, case, 1e-10, EPS64)
    with pytest.raises(AssertionError):
        check_all(fwd + bwd(ref[1], "float32"), ref, case, tol=1e-10, unit=EPS64)
