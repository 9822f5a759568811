"""The invariance property's three sub-checks, each caught in a deliberately coupled implementation.

Each bad implementation is ours with one coupling added: a batch element's dkv
mixed with another element's, a head's d_attn_sink mixed with another head's,
dkv's bits following the scratch budget (mqa_bwd.mutants.budget_rounds_chunks).
The property must fail it through that sub-check alone, and hold for ours on
the same case.
"""

import pytest
import torch

from mqa_bwd import edge, mutants, wrapper
from properties import checks
from properties.case import Case
from properties.target import Target

#: Two batch elements, five heads (a proper subset to call alone), the implementation's budget.
CASE = Case(B=2, S=3, S_kv=9, H=5, L=5, d_k=32, d_v=16, sink="random", seed=5)


@pytest.fixture(scope="module")
def ours():
    return Target.load(None, "model")


def _mixed_with_the_next(x, dim: int):
    """x plus 1/64 of its neighbour along ``dim``, in x's dtype: bf16 bits that follow the neighbour."""
    t = edge.to_torch(x, "output")
    mixed = (t.float() + t.roll(1, dims=dim).float() / 64).to(t.dtype)
    return edge.from_torch(mixed, edge.framework_of(x))


def batch_elements_share_dkv(*args, **kwargs):
    """Ours, with each batch element's dkv mixed with the previous element's."""
    dq, dkv, dsink = wrapper.mqa_latent_sparse_bwd(*args, **kwargs)
    if dkv.shape[0] < 2:
        return dq, dkv, dsink  # alone: nothing to mix with
    return dq, _mixed_with_the_next(dkv, 0), dsink


def heads_share_the_sink_gradient(*args, **kwargs):
    """Ours, with each head's d_attn_sink mixed with the previous head's."""
    dq, dkv, dsink = wrapper.mqa_latent_sparse_bwd(*args, **kwargs)
    if dsink.shape[0] < 2:
        return dq, dkv, dsink
    return dq, dkv, _mixed_with_the_next(dsink, 0)


@pytest.mark.parametrize("coupled, broken", [
    (batch_elements_share_dkv, "batch"),
    (heads_share_the_sink_gradient, "heads"),
    (mutants.budget_rounds_chunks, "budget"),
], ids=lambda x: getattr(x, "__name__", x))
def test_invariance_catches_each_coupling_by_its_own_sub_check(ours, coupled, broken):
    held = checks.invariance(ours, CASE)
    assert held.ok and held.findings == {"batch": True, "heads": True, "budget": True}, held.report
    verdict = checks.invariance(ours.with_function(coupled, coupled.__name__), CASE)
    assert not verdict.ok
    want = {"batch": True, "heads": True, "budget": True, broken: False}
    assert verdict.findings == want, verdict.report
