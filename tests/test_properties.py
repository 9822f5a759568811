"""The properties of the backward (properties/checks.py), one test each.

Each test draws cases with Hypothesis (profile from --mqa-profile or
$MQA_PROFILE; ci by default), replays the saved regressions first, and runs
its property against the implementation chosen with --impl / --backend.
A failure prints the property's report and a REPRO line that replays exactly
that case.
"""

import pytest

from properties.plugin import harness, property_test


def _cpu_model_on_avx512() -> bool:
    if harness().replay is not None:
        return False  # a replay shows the truth about its one case, known bug or not
    if not str(harness().target.backend).startswith("model"):
        return False
    import torch

    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


# mqa_bwd bug, reported to the owner of mqa_bwd/ (not fixed here: that folder is not ours to edit).
# On an AVX-512 CPU, torch's elementwise exp2 / logaddexp give results that depend on where an
# element falls in the vector loop (a 32-float vectorised body, a scalar tail that differs by
# 1 ulp). The CPU model's delta kernel (model.py, ModelLauncher.delta: exp2(Sink2 - Lse2) on the
# [R, Hp] tile) and the wrapper's Lse2 (wrapper.py, run: logaddexp(lse, sink) on [R, Hp]) run on
# the padded head count Hp, so a head's d_attn_sink (and through Lse2 its P) changes with how many
# other heads are in the call. The cases in tests/regressions/ (replayed first) show it; the same
# calls are bitwise head-independent under ATEN_CPU_CAPABILITY=avx2, and the GPU kernels compute
# these per element.
CPU_HEAD_COUNT_BUG = pytest.mark.xfail(
    condition=_cpu_model_on_avx512(),
    strict=True,
    reason="mqa_bwd CPU model on AVX-512: d_attn_sink of a head depends on the padded head count "
    "(torch exp2/logaddexp vector-tail rounding in ModelLauncher.delta and wrapper.run's Lse2)",
)


@property_test("agreement")
def test_property_agreement(case, mqa):
    mqa.check("agreement", case)


@pytest.mark.determinism
@property_test("determinism")
def test_property_determinism(case, mqa):
    mqa.check("determinism", case)


@CPU_HEAD_COUNT_BUG
@property_test("pad_heads_inert")
def test_property_pad_heads_inert(case, mqa):
    mqa.check("pad_heads_inert", case)


@property_test("output_contract")
def test_property_output_contract(case, mqa):
    mqa.check("output_contract", case)


@property_test("rejection")
def test_property_rejection(case, mqa):
    mqa.check("rejection", case)


@property_test("memory_safety")
def test_property_memory_safety(case, mqa):
    mqa.check("memory_safety", case)


@pytest.mark.determinism
@CPU_HEAD_COUNT_BUG
@property_test("invariance")
def test_property_invariance(case, mqa):
    mqa.check("invariance", case)
