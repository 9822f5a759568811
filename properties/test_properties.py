"""The properties of the backward (properties/checks.py), one test each.

Each test draws cases with Hypothesis (profile from --mqa-profile or
$MQA_PROFILE; ci by default), replays the saved regressions first, and runs
its property against the implementation chosen with --impl / --backend.
A failure prints the property's report and a REPRO line that replays exactly
that case. ``test_property_determinism_at_scale`` is one production-shape call
rerun and compared bitwise, on a GPU backend only: its own line in the
summary.
"""

import pytest

from properties.plugin import at_scale_test, property_test


@property_test("agreement")
def test_property_agreement(case, mqa):
    mqa.check("agreement", case)


@pytest.mark.determinism
@property_test("determinism")
def test_property_determinism(case, mqa):
    mqa.check("determinism", case)


@pytest.mark.determinism
@at_scale_test("determinism")
def test_property_determinism_at_scale(mqa):
    mqa.check_at_scale("determinism")


@pytest.mark.determinism
@property_test("process_determinism")
def test_property_process_determinism(case, mqa):
    mqa.check("process_determinism", case)


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
@property_test("invariance")
def test_property_invariance(case, mqa):
    mqa.check("invariance", case)


@pytest.mark.determinism
@property_test("slot_order")
def test_property_slot_order(case, mqa):
    mqa.check("slot_order", case)
