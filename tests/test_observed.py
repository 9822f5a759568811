"""properties.observed: which of Hypothesis' test cases are new inputs, which re-run a failure."""

import pytest
from hypothesis import Phase, example, given, settings, strategies as st

from properties import observed


def _kinds_seen(test) -> list:
    seen = []
    with observed.watching(lambda o: seen.append(observed.test_case_kind(o))) as registered:
        assert registered
        try:
            test()
        except AssertionError:
            pass  # a failing test: its shrinks are what is counted
    return [k for k in seen if k is not None]


def test_an_explicit_example_and_each_generated_input_are_cases():
    @settings(max_examples=5, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate])
    @given(st.integers())
    @example(7)  # as the suite replays a regression
    def passes(x):
        pass

    assert _kinds_seen(passes) == [("case", False)] * 6


def test_the_reruns_that_shrink_a_failure_are_not_cases():
    @settings(max_examples=50, derandomize=True, database=None)
    @given(st.integers(min_value=0))
    def fails_above_ten(x):
        assert x <= 10

    kinds = _kinds_seen(fails_above_ten)
    generated = [k for k in kinds if k[0] == "case"]
    shrinks = [k for k in kinds if k[0] == "shrink"]
    assert generated and ("case", True) in generated  # the search found the failure
    assert shrinks and ("shrink", True) in shrinks  # and shrinking re-ran it


def test_observability_is_off_again_after_the_block():
    hypothesis_observability = pytest.importorskip("hypothesis.internal.observability")
    before = hypothesis_observability.observability_enabled()
    with observed.watching(lambda o: None):
        assert hypothesis_observability.observability_enabled()
    assert hypothesis_observability.observability_enabled() == before
