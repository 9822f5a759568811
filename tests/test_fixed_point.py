"""The fixed-point dKV design: its range proof checked in float64, its scales,
and what it does when the proof's assumption or its inputs fail.

The range proof (mqa_bwd.fixed_point) says: scaled by its row's 2**k, the sum
of the absolute values of every contribution to a dKV element is at most
2**61, so no partial sum of the int64 accumulator can overflow, in any order.
Here that sum is computed exactly as the maths defines it (float64, from the
case's own inputs) and compared with the scales the wrapper would use.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from mqa_bwd import fixed_point, wrapper
from mqa_bwd.model import ModelLauncher
from properties.case import Case, to_framework
from properties.strategies import Space, cases

ARGS = ("query", "kv", "out", "grad_out", "lse", "attn_sink", "token_indices", "sm_scale")


def _f64(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def abs_contribution_sums(host: dict) -> np.ndarray:
    """[B*S_kv, Dk]: sum over every (row, head, valid slot) of |sm_scale*dl*q| + |p*dO| (first Dv)."""
    q, kv, out, do = (_f64(host[k]) for k in ("query", "kv", "out", "grad_out"))
    lse, idx, scale = _f64(host["lse"]), np.asarray(host["token_indices"], np.int64), float(host["sm_scale"])
    B, S, H, Dk = q.shape
    S_kv, Dv = kv.shape[1], do.shape[-1]
    sink = np.full(H, -np.inf) if host["attn_sink"] is None else _f64(host["attn_sink"])
    total = np.zeros((B, S_kv, Dk))
    for b in range(B):
        for s in range(S):
            valid = (idx[b, s] >= 0) & (idx[b, s] < S_kv)
            rows = idx[b, s][valid]
            if rows.size == 0:
                continue
            k = kv[b, rows]  # [n, Dk]
            logits = scale * q[b, s] @ k.T  # [H, n]
            p = np.exp(logits - np.logaddexp(lse[b, s], sink)[:, None])
            delta = (out[b, s] * do[b, s]).sum(-1)  # [H]
            dl = p * (do[b, s] @ k[:, :Dv].T - delta[:, None])
            per_slot = np.abs(scale * dl).T @ np.abs(q[b, s])  # [n, Dk], summed over heads
            per_slot[:, :Dv] += p.T @ np.abs(do[b, s])
            np.add.at(total[b], rows, per_slot)
    return total.reshape(B * S_kv, Dk)


def scales_for(host: dict) -> torch.Tensor:
    """The row scales the wrapper computes for these inputs (Delta as the delta kernel does)."""
    t = to_framework(host)
    B, S, H, _ = t["query"].shape
    delta = (t["out"].float() * t["grad_out"].float()).sum(-1).reshape(B * S, H)
    kv = t["kv"].reshape(-1, t["kv"].shape[-1])
    scales, _ = fixed_point.plan(t["query"], t["grad_out"], delta, kv[:, : t["grad_out"].shape[-1]], host["sm_scale"])
    return scales


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(Space(heads=(1, 40))))
def test_scaled_absolute_sums_stay_below_2_to_61(case):
    host = case.inputs()
    scales = scales_for(host).double().numpy()
    sums = abs_contribution_sums(host)
    assert np.isfinite(scales).all()
    scaled = sums * scales[:, None]
    worst = np.unravel_index(np.argmax(scaled), scaled.shape) if scaled.size else None
    assert scaled.max(initial=0.0) <= 2.0**61, (
        f"kv row {worst[0]} column {worst[1]}: sum |c| = {sums[worst]:.6g} scaled by 2**{math.log2(scales[worst[0]]):.0f} "
        f"is 2**{math.log2(scaled[worst]):.2f} > 2**61\nREPRO: {case.to_json()}"
    )


def test_scales_are_the_largest_powers_of_two_that_fit():
    bounds = torch.tensor([1.0, 3.0, 2.0**61, 2.0**61 * 1.5, 2.0**62, 1e-10, 1e30, 0.0], dtype=torch.float64)
    scales = fixed_point.row_scales(bounds).double()
    assert torch.all(torch.frexp(scales).mantissa == 0.5), "not powers of two"
    normal = bounds[:-1]
    assert torch.all(normal * scales[:-1] <= 2.0**61)
    assert torch.all(normal * scales[:-1] * 2 > 2.0**61), "a larger power of two would still fit"
    assert scales[-1] == 2.0**fixed_point.FP32_MAX_EXPONENT  # nothing to hold: the cap


def test_tiny_bounds_are_capped_to_a_normal_float32_scale():
    scales = fixed_point.row_scales(torch.tensor([1e-300], dtype=torch.float64))
    assert scales.dtype == torch.float32 and float(scales[0]) == 2.0**fixed_point.FP32_MAX_EXPONENT


@pytest.mark.parametrize("bound", [math.inf, math.nan, 1e300])
def test_unrepresentable_bounds_give_a_nan_scale(bound):
    assert torch.isnan(fixed_point.row_scales(torch.tensor([bound], dtype=torch.float64))).all()


# -- the design on the CPU tile model -----------------------------------------


def _run(host, design="fixed"):
    inputs = to_framework(host)
    return wrapper.backward_with(ModelLauncher(), *[inputs[k] for k in ARGS], dkv_design=design)


def _case():
    return Case(B=1, S=6, S_kv=40, H=5, L=9, d_k=32, d_v=16, sink="random", seed=11)


def test_an_lse_that_leaves_too_much_softmax_mass_poisons_dkv_not_dq():
    host = _case().inputs()
    dq, dkv, dsink = _run(host)
    assert torch.isfinite(dkv.float()).all()
    bad = dict(host, lse=host["lse"].copy())
    bad["lse"][0, 2, 3] -= 1.0  # one head of one row now has softmax mass ~e > MASS_LIMIT
    dq2, dkv2, dsink2 = _run(bad)
    assert torch.isnan(dkv2.float()).all(), "dKV was computed past the range proof's assumption"
    assert torch.isfinite(dq2.float()).all() and torch.isfinite(dsink2).all()


def test_a_nan_lse_poisons_dkv_instead_of_dropping_its_contributions():
    # NaN contributions would convert to integers silently; the NaN mass flags them.
    host = _case().inputs()
    bad = dict(host, lse=host["lse"].copy())
    bad["lse"][0, 1, 0] = np.nan
    _, dkv, _ = _run(bad)
    assert torch.isnan(dkv.float()).all()


def test_a_head_with_zero_q_and_grad_out_may_have_any_mass():
    host = _case().inputs()
    host = dict(host, query=host["query"].copy(), grad_out=host["grad_out"].copy(), lse=host["lse"].copy())
    host["query"][:, :, 4] = 0
    host["grad_out"][:, :, 4] = 0
    host["lse"][:, :, 4] = -30.0  # mass exp(30) per slot: harmless, the head contributes nothing
    fixed, slots = _run(host), _run(host, "slots")
    assert torch.isfinite(fixed[1].float()).all()
    assert torch.equal(fixed[0], slots[0])


def test_a_non_finite_kv_row_poisons_only_its_own_dkv_row():
    host = _case().inputs()
    referenced = set(np.asarray(host["token_indices"]).reshape(-1).tolist())
    spare = next(j for j in range(40) if j not in referenced)
    dq, dkv, _ = _run(host)
    bad = dict(host, kv=host["kv"].copy())
    bad["kv"][0, spare, 0] = np.inf
    dq2, dkv2, _ = _run(bad)
    assert torch.isnan(dkv2[0, spare].float()).all()
    others = [j for j in range(40) if j != spare]
    assert torch.equal(dkv2[0, others], dkv[0, others]) and torch.equal(dq2, dq)
