"""The fixed-point dKV design: its range proof checked in float64, its scales,
and what it does when the proof's assumption or its inputs fail.

The range proof (mqa_bwd.fixed_point) says: scaled by its row's 2**k, the sum
of the absolute values of every contribution to a dKV element is at most
2**61, so no partial sum of the int64 accumulator can overflow, in any order.
Here that sum is computed exactly as the maths defines it (float64, from the
case's own inputs) and compared with the scales the wrapper would use.
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from mqa_bwd import fixed_point
from mqa_bwd.model import ModelLauncher, float_to_int64_rn
from properties.case import Case, to_framework
from properties.checks import bitwise_difference
from properties.strategies import Space, cases

from model_calls import call_model, slots_by_hand


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
    d_v = t["grad_out"].shape[-1]
    slots = torch.from_numpy(slots_by_hand(host["token_indices"], host["kv"].shape[1], host["token_indices"].shape[2],
                                           walk_block=None))
    referenced, live_row = torch.zeros(kv.shape[0], dtype=torch.int32), torch.zeros(B * S, dtype=torch.int32)
    q = t["query"].reshape(B * S, H, -1)
    ModelLauncher().mark_slots(slots, referenced, live_row, q, torch.empty((B * S, H), dtype=torch.int32))
    scales, _ = fixed_point.plan(t["query"], t["grad_out"], delta, kv[:, :d_v], referenced, live_row, host["sm_scale"])
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


def tight_inputs(rows: int, d_k=32, d_v=16, slots=4, mq=2.0, mdo=1.0, mv=1.5, mo=0.5, sm_scale=0.125) -> dict:
    """Inputs on which the bound is attained: every slot of every row points at
    kv row 0 (so the softmax mass is exactly 1 and all of it lands there),
    |dP| = Dv * mdo * mv (kv aligned with dO), Delta = -Dv * mo * mdo (out
    against dO), and every |q| and |dO| at its maximum."""
    bf16 = ml_dtypes.bfloat16
    sign = np.where(np.arange(d_v) % 3 == 0, -1.0, 1.0)
    q = np.full((1, rows, 1, d_k), mq) * np.where(np.arange(d_k) % 2, 1.0, -1.0)
    grad_out = np.broadcast_to(mdo * sign, (1, rows, 1, d_v))
    out = np.broadcast_to(-mo * sign, (1, rows, 1, d_v))
    kv = np.zeros((1, 1, d_k))
    kv[0, 0, :d_v] = mv * sign
    logit = sm_scale * float((q[0, 0, 0] * kv[0, 0]).sum())
    return dict(
        query=q.astype(bf16), kv=kv.astype(bf16), out=np.ascontiguousarray(out).astype(bf16),
        grad_out=np.ascontiguousarray(grad_out).astype(bf16),
        lse=np.full((1, rows, 1), logit + math.log(slots), np.float32), attn_sink=None,
        token_indices=np.zeros((1, rows, slots), np.int32), sm_scale=sm_scale,
    )


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("mq", [2.0, 0.0], ids=["dS-dominated", "q=0: P*dO only"])
def test_the_bound_is_tight_within_a_factor_of_two(rows, mq):
    # bound * 2**k is in (2**60, 2**61]; here the true sum is bound / MASS_LIMIT,
    # so a bound too small or too large by 2x or more (a dropped Delta,
    # sm_scale, Dv, dO or row count) leaves this window.
    host = tight_inputs(rows, mq=mq)
    scaled = abs_contribution_sums(host)[0, :16].max() * float(scales_for(host)[0])
    assert 2.0**60 / fixed_point.MASS_LIMIT < scaled <= 2.0**61, f"2**{math.log2(scaled):.3f}"


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


def _case():
    return Case(B=1, S=6, S_kv=40, H=5, L=9, d_k=32, d_v=16, sink="random", seed=11)


def test_an_lse_that_leaves_too_much_softmax_mass_poisons_dkv_not_dq():
    host = _case().inputs()
    dq, dkv, dsink = call_model(to_framework(host))
    assert torch.isfinite(dkv.float()).all()
    bad = dict(host, lse=host["lse"].copy())
    bad["lse"][0, 2, 3] -= 10.0  # one head of one row now has e**10 times its softmax mass
    dq2, dkv2, dsink2 = call_model(to_framework(bad))
    assert torch.isnan(dkv2.float()).all(), "dKV was computed past the range proof's assumption"
    assert torch.isfinite(dq2.float()).all() and torch.isfinite(dsink2).all()


def test_a_flag_poisons_only_its_own_batch_element():
    # The scales are per batch element, so a broken proof in one leaves the others exact.
    host = Case(B=2, S=6, S_kv=40, H=5, L=9, d_k=32, d_v=16, sink="random", seed=11).inputs()
    _, dkv, _ = call_model(to_framework(host))
    bad = dict(host, lse=host["lse"].copy())
    bad["lse"][1, 2, 3] -= 10.0
    _, dkv2, _ = call_model(to_framework(bad))
    assert torch.isnan(dkv2[1].float()).all()
    assert torch.isfinite(dkv[0].float()).all() and bitwise_difference("dkv[0]", dkv2[0], dkv[0]) is None


def test_a_nan_lse_poisons_dkv_instead_of_dropping_its_contributions():
    # NaN contributions would convert to integers silently; the NaN mass flags them.
    host = _case().inputs()
    bad = dict(host, lse=host["lse"].copy())
    bad["lse"][0, 1, 0] = np.nan
    _, dkv, _ = call_model(to_framework(bad))
    assert torch.isnan(dkv.float()).all()


def test_a_head_with_zero_q_and_grad_out_may_have_any_mass():
    host = _case().inputs()
    host = dict(host, query=host["query"].copy(), grad_out=host["grad_out"].copy())
    host["query"][:, :, 4] = 0
    host["grad_out"][:, :, 4] = 0
    huge = dict(host, lse=host["lse"].copy())
    huge["lse"][:, :, 4] = -30.0  # mass exp(30) per slot: harmless, the head contributes nothing
    reference, result = call_model(to_framework(host))[1], call_model(to_framework(huge))[1]
    assert torch.isfinite(result.float()).all() and bitwise_difference("dkv", result, reference) is None


def test_non_finite_kv_rows_poison_dkv_only_when_read():
    host = _case().inputs()
    referenced = sorted(set(np.asarray(host["token_indices"]).reshape(-1).tolist()) & set(range(40)))
    spare = next(j for j in range(40) if j not in referenced)
    used = referenced[0]
    dq, dkv, _ = call_model(to_framework(host))
    bad = dict(host, kv=host["kv"].copy())
    bad["kv"][0, spare, 0] = np.inf  # nobody reads it: its dkv stays exactly 0 (SPEC)
    bad["kv"][0, spare, 20] = np.nan
    dq2, dkv2, _ = call_model(to_framework(bad))
    assert torch.count_nonzero(dkv2[0, spare].float()) == 0
    assert bitwise_difference("dkv", dkv2, dkv) is None and bitwise_difference("dq", dq2, dq) is None
    bad["kv"][0, used, 1] = np.inf
    _, dkv3, _ = call_model(to_framework(bad))
    assert torch.isnan(dkv3[0, used].float()).all()


def test_finite_inputs_that_overflow_fp32_poison_instead_of_saturating():
    # kv ~1e19 and dO ~1e18: dP and dS overflow fp32 in the kernel, where
    # integer conversion would saturate and wrap into a finite wrong answer.
    # q is tiny, so the logits and the softmax mass stay ordinary: only the
    # fp32 guard of the plan can catch this, not the kernel's mass check.
    host = tight_inputs(2, mq=2.0**-60, mdo=2.0**66, mv=2.0**63, mo=0.0)
    assert torch.isnan(scales_for(host)[0])
    assert torch.isfinite(scales_for(tight_inputs(2, mq=2.0**-60, mdo=2.0**30, mv=2.0**30, mo=0.0))[0])
    _, dkv, _ = call_model(to_framework(host))
    assert torch.isnan(dkv[0, 0].float()).all()


def test_a_row_with_no_valid_slot_may_hold_anything():
    host = _case().inputs()
    host = dict(host, query=host["query"].copy(), token_indices=host["token_indices"].copy())
    host["token_indices"][0, 3] = -1  # row 3 reads nothing
    dq, dkv, _ = call_model(to_framework(host))
    host["query"][0, 3, 1, 5] = np.nan
    dq2, dkv2, _ = call_model(to_framework(host))
    assert torch.isfinite(dkv2.float()).all() and bitwise_difference("dkv", dkv2, dkv) is None


def test_magnitude_bits_are_the_exact_maxima_nan_included():
    # The delta kernel's integer max of bf16 magnitude bits, read back as bf16:
    # max |x| exactly, signed zeros, subnormals, infinities and NaN included.
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(40, 3, 33, generator=g) * torch.logspace(-40, 38, 33)).bfloat16()
    x[0, 0, 5], x[1, 1, 0], x[2, 2, 32] = float("nan"), float("-inf"), float("inf")
    x[3, 0] = -0.0
    x[4, 1] = torch.tensor(-1e-40).bfloat16()  # subnormal
    x[5, 2, 7] = float("nan")
    x[5, 2, 8] = float("inf")  # NaN wins over inf, as in max_abs
    got = fixed_point.bits_to_bf16(fixed_point.magnitude_bits(x))
    want = fixed_point.max_abs(x)
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert fixed_point.magnitude_bits(x[:, :, :0]).eq(0).all()


def _plan_inputs(poison=None):
    """(q, do, delta, kv_v, referenced, live_row) of two batch elements, with a non-finite
    input where ``poison`` says (batch element 1's NaNs; an inf in query row 4, which has no
    valid slot)."""
    g = torch.Generator().manual_seed(11)
    B, S, H, Dk, Dv, NKV = 2, 5, 3, 24, 16, 14
    q = torch.randn(B, S, H, Dk, generator=g).bfloat16()
    do = torch.randn(B, S, H, Dv, generator=g).bfloat16()
    if poison == "nan_q":
        q[1, 2, 0, 5] = float("nan")
    elif poison == "inf_do":
        do[0, 4, 2, 1] = float("inf")
    elif poison == "nan_do":
        do[1, 0, 1, 3] = float("nan")
    kv_v = torch.randn(NKV, Dv, generator=g).bfloat16()
    delta = torch.randn(B * S, H, generator=g)
    referenced, live_row = (torch.arange(NKV) % 3 != 0).to(torch.int32), (torch.arange(B * S) != 4).to(torch.int32)
    return q, do, delta, kv_v, referenced, live_row


@pytest.mark.parametrize("poison", [None, "nan_q", "inf_do", "nan_do"])
def test_the_plan_from_reduced_maxima_equals_the_plan_from_the_tensors(poison):
    # The wrapper hands the plan the delta kernel's maxima of |q| and |dO| (bf16
    # from magnitude bits; fp32 works too) instead of the tensors' own: the same
    # row scales and allowances, bit for bit, non-finite inputs included.
    q, do, delta, kv_v, referenced, live_row = _plan_inputs(poison)
    B, S, H = q.shape[:3]
    want = fixed_point.plan(q, do, delta, kv_v, referenced, live_row, 0.125)
    from_bits = [fixed_point.bits_to_bf16(fixed_point.magnitude_bits(x).reshape(B * S, H)) for x in (q, do)]
    as_fp32 = [fixed_point.max_abs(x).float().reshape(B * S, H) for x in (q, do)]
    for form, (max_q, max_do) in (("bf16 from bits", from_bits), ("fp32", as_fp32)):
        got = fixed_point.plan(q, do, delta, kv_v, referenced, live_row, 0.125, max_q=max_q, max_do=max_do)
        for name, a, b in zip(("row_scale", "allowance"), got, want):
            assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0)) and torch.equal(a.isnan(), b.isnan()), (form, name)
    # The NaNs sit in batch element 1; the inf in query row 4, which has no valid slot.
    marked = referenced.view(B, -1) != 0
    poisoned = [bool(got[0].view(B, -1)[b][marked[b]].isnan().all()) for b in range(B)]
    assert poisoned == ([False, True] if poison in ("nan_q", "nan_do") else [False, False])


@pytest.mark.parametrize("gain", [0, fixed_point.LANES_GAIN, 30])
def test_a_launchers_plan_gives_the_scale_its_launches_round_at(gain):
    # Launcher.plan returns the plan's row scales times 2**(lanes_gain - 30), the scale every
    # deterministic launch rounds at (the TileLang plan's last kernel multiplies by it), NaN
    # where the plan's is NaN, and the plan's allowances as they are.
    q, do, delta, kv_v, referenced, live_row = _plan_inputs("nan_q")
    B, S, H = q.shape[:3]
    peaks = [fixed_point.magnitude_bits(x).reshape(B * S, H) for x in (q, do)]
    row_scale, allowance = ModelLauncher(lanes_gain=gain).plan(q, do, delta, kv_v, referenced, live_row, 0.125, *peaks)
    plan_scale, plan_allowance = fixed_point.plan(q, do, delta, kv_v, referenced, live_row, 0.125)
    assert row_scale.isnan().any() and torch.equal(row_scale.isnan(), plan_scale.isnan())
    assert torch.equal(row_scale.nan_to_num(-1.0), (plan_scale * 2.0 ** (gain - 30)).nan_to_num(-1.0))
    assert torch.equal(allowance.nan_to_num(-1.0), plan_allowance.nan_to_num(-1.0))
    assert torch.equal(allowance.isnan(), plan_allowance.isnan())


def test_the_wrapper_plans_from_the_scales_of_its_own_inputs(monkeypatch):
    # The wrapper's plan gets the delta launch's maxima (H = 5 pads to 16
    # heads; the plan sees the real 5): the same scales as planning from
    # query and grad_out directly.
    host = _case().inputs()
    seen = []
    real_plan = fixed_point.plan
    monkeypatch.setattr(fixed_point, "plan", lambda *a, **k: seen.append((a, k)) or real_plan(*a, **k))
    call_model(to_framework(host))
    (args, kwargs), = seen
    assert kwargs["max_q"] is not None and kwargs["max_do"] is not None
    got = real_plan(*args, **kwargs)
    want = real_plan(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    query, grad_out = args[:2]
    assert torch.equal(kwargs["max_q"].reshape(query.shape[:3]), fixed_point.max_abs(query))
    assert torch.equal(kwargs["max_do"].reshape(grad_out.shape[:3]), fixed_point.max_abs(grad_out))


def test_the_model_converts_like_ptx_cvt_rni_s64_f32():
    x = np.array([0.5, 1.5, -2.5, np.nan, np.inf, -np.inf, 2.0**63, -(2.0**63), 2.0**62], np.float32)
    info = np.iinfo(np.int64)
    want = [0, 2, -2, 0, info.max, info.min, info.max, info.min, 2**62]
    assert float_to_int64_rn(x).tolist() == want
