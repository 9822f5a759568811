"""The agreement tolerance (properties/compare.py): twice the bf16 baseline's max error plus a
float32 floor of 1e-5 x max(max |reference|, 1), pinned at its boundary with numbers chosen
here, and through the agreement property with an implementation that misses by a little."""

import numpy as np
import pytest
import torch

from mqa_bwd import wrapper
from properties import checks
from properties.case import Case, expected
from properties.compare import compare
from properties.target import Target


@pytest.mark.parametrize("want, baseline_err, tolerance", [
    # |reference| <= 1: the floor is 1e-5; 2 x 0.01 + 1e-5.
    ([0.5, -1.0, 0.25, 0.0], 0.01, 0.02001),
    # max |reference| = 8: the floor scales with it, 8e-5; 2 x 0.004 + 8e-5.
    ([8.0, -3.0, 0.5, 2.0], 0.004, 0.00808),
])
def test_an_error_just_under_the_tolerance_passes_and_just_over_fails(want, baseline_err, tolerance):
    want = np.array(want)
    baseline = want.copy()
    baseline[0] += baseline_err  # the baseline's max error, on another element than the output's
    for error, ok in ((tolerance * (1 - 1e-4), True), (tolerance * (1 + 1e-4), False)):
        got = want.copy()
        got[2] -= error
        result = compare("dq", got, want, baseline)
        assert result.ok is ok, result.report()
        assert result.baseline_err == pytest.approx(baseline_err, rel=1e-12)
        assert result.tolerance == pytest.approx(tolerance, rel=1e-12)
        assert result.mismatched == (0 if ok else 1)


CASE = Case(B=1, S=4, S_kv=16, H=8, L=8, d_k=32, d_v=16, sink="random", seed=3)


def _dq_missing_by(times: float):
    """Ours with one dq element set ``times`` the bf16 baseline's max dq error away from the float64
    oracle on CASE: the element nearest zero, where bf16 holds the offset to 2**-8 of itself."""
    (dq64, _, _), (dq_baseline, _, _) = expected(CASE.inputs())
    baseline_err = float(np.max(np.abs(dq_baseline - dq64)))
    where = int(np.argmin(np.abs(dq64)))

    def near_miss(*args, **kwargs):
        dq, dkv, dsink = wrapper.mqa_latent_sparse_bwd(*args, **kwargs)
        moved = dq.float().flatten()
        moved[where] = float(dq64.flat[where]) + times * baseline_err
        return moved.reshape(dq.shape).to(torch.bfloat16), dkv, dsink

    return near_miss


@pytest.mark.parametrize("times, holds", [(1.5, True), (3.0, False)])
def test_agreement_fails_a_dq_three_baseline_errors_off_and_passes_one_and_a_half(times, holds):
    ours = Target.load(None, "model")
    assert checks.agreement(ours, CASE).ok
    verdict = checks.agreement(ours.with_function(_dq_missing_by(times), f"dq_off_by_{times}"), CASE)
    assert verdict.ok is holds, verdict.report
    assert verdict.findings == {"dq": holds, "dkv": True, "d_attn_sink": True}, verdict.report
