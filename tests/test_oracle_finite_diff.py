"""Central finite differences of the float64 forward against the float64 backward.

The backward's contract (docs/SPEC.md) is the gradient of sum(out * grad_out) with
respect to q, kv and attn_sink; lse is an output of the forward, not part of
that loss, so the finite-difference loss uses out only.
"""

import numpy as np
import pytest

import oracle

INT32_MIN = np.iinfo(np.int32).min
STEP = 1e-6


def loss(q, kv, idx, sink, scale, d_v, grad_out):
    out, _ = oracle.forward(q, kv, idx, sink, scale, d_v, precision="float64")
    return float(np.sum(out * grad_out))


def numeric_grad(f, x):
    """Central differences of f with respect to every entry of x (in place)."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        x0 = x[i]
        x[i] = x0 + STEP
        up = f()
        x[i] = x0 - STEP
        down = f()
        x[i] = x0
        g[i] = (up - down) / (2 * STEP)
    return g


def make_case(seed, index_kind, sink_kind):
    rng = np.random.default_rng(seed)
    B, S, S_kv, H, L, Dk, d_v = 2, 3, 5, 3, 4, 6, 4
    q = rng.standard_normal((B, S, H, Dk))
    kv = rng.standard_normal((B, S_kv, Dk))
    grad_out = rng.standard_normal((B, S, H, d_v))
    idx = rng.integers(0, S_kv, size=(B, S, L))
    if index_kind == "duplicates":
        idx[:, :, 1] = idx[:, :, 0]
        idx[0, 0, :] = 2
    elif index_kind == "invalid":
        idx[:, :, -1] = rng.choice([-1, INT32_MIN, S_kv, 2**31 - 1], size=(B, S))
        idx[0, 1, :] = -1  # a row with no valid slot
        idx[1, 2, :2] = [S_kv + 9, -7]
    sinks = {
        "none": None,
        "finite": rng.normal(0.0, 1.0, size=H),
        "mixed": np.array([-np.inf, -1e30, 2.5]),
        "large": np.array([5.0, 3.0, -0.5]),  # p_sink close to 1; gradients still measurable
    }
    return dict(q=q, kv=kv, idx=idx.astype(np.int32), sink=sinks[sink_kind], scale=0.7, d_v=d_v, grad_out=grad_out)


def assert_close(name, analytic, numeric):
    mag = np.max(np.abs(numeric))
    err = np.max(np.abs(analytic - numeric))
    # Central differences: O(STEP**2) truncation, ~1e-12, plus the float64 rounding of each loss
    # (a sum of 72 terms of order 1: ~1e-14) over 2 * STEP, ~1e-9. Measured: at most 1.9e-9 of
    # the largest entry (d_sink, mixed sinks); 1e-8 leaves 5x.
    assert err <= 1e-8 * mag, f"{name}: err {err:.3g}, largest {mag:.3g}"


SINK_KINDS = ["none", "finite", "mixed", "large"]
INDEX_KINDS = ["plain", "duplicates", "invalid"]


@pytest.mark.parametrize("sink_kind", SINK_KINDS)
@pytest.mark.parametrize("index_kind", INDEX_KINDS)
def test_backward_matches_central_differences(index_kind, sink_kind):
    seed = 100 * INDEX_KINDS.index(index_kind) + SINK_KINDS.index(sink_kind)
    c = make_case(seed, index_kind, sink_kind)
    q, kv, sink = c["q"].copy(), c["kv"].copy(), None if c["sink"] is None else c["sink"].copy()

    def f():
        return loss(q, kv, c["idx"], sink, c["scale"], c["d_v"], c["grad_out"])

    out, lse = oracle.forward(q, kv, c["idx"], sink, c["scale"], c["d_v"], precision="float64")
    dq, dkv, dsink = oracle.backward(
        q, kv, out, c["grad_out"], lse, sink, c["idx"], c["scale"], precision="float64"
    )
    assert_close("dq", dq, numeric_grad(f, q))
    assert_close("dkv", dkv, numeric_grad(f, kv))
    if sink is None:
        np.testing.assert_array_equal(dsink, 0.0)
    else:
        finite = np.isfinite(sink)
        num = numeric_grad(f, sink)  # -inf +- STEP is still -inf: derivative 0
        assert_close("d_sink", dsink, np.where(finite, num, 0.0))
    # Non-trivial: the gradients are not all zero (so the comparison can fail).
    assert np.max(np.abs(dq)) > 1e-3 and np.max(np.abs(dkv)) > 1e-3


def test_kv_rows_only_reached_by_invalid_slots_get_zero_gradient():
    c = make_case(seed=3, index_kind="invalid", sink_kind="finite")
    idx = c["idx"].copy()
    idx[idx == 4] = 0  # row 4 of every batch is now referenced by no valid slot
    q, kv = c["q"], c["kv"].copy()
    out, lse = oracle.forward(q, kv, idx, c["sink"], c["scale"], c["d_v"], precision="float64")
    _, dkv, _ = oracle.backward(q, kv, out, c["grad_out"], lse, c["sink"], idx, c["scale"], precision="float64")
    np.testing.assert_array_equal(dkv[:, 4], 0.0)
    num = numeric_grad(lambda: loss(q, kv, idx, c["sink"], c["scale"], c["d_v"], c["grad_out"]), kv)
    np.testing.assert_array_equal(num[:, 4], 0.0)
    assert_close("dkv", dkv, num)
