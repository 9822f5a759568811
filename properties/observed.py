"""Hypothesis' test cases as they run: which are new inputs tried, which re-run a failure.

One rule for the two counts of a property's cases, so that they agree: the
suite's plugin (the ``cases`` of the summary and of check's table) and
``mqa_bwd.fuzz`` (the live progress of check and fuzz). A case is a new
input tried; shrinking a failure, explaining it and replaying it at the end
run the property again on the same failure, and are not cases.
"""

import contextlib

#: Hypothesis phases whose test cases are new inputs tried (not shrinks or replays of a failure).
SEARCH_PHASES = ("explicit", "reuse", "generate", "target")


def test_case_kind(observation) -> tuple | None:
    """(kind, failed) of a Hypothesis observation: kind "case" (a new input tried), "shrink" (the
    same failure again: shrinking, explaining, the final replay) or "gave_up" (rejected by a filter);
    None for an observation that is no test case."""
    if isinstance(observation, dict):
        if observation.get("type") != "test_case":
            return None
        status, phase = observation.get("status"), (observation.get("metadata") or {}).get("phase")
        how = observation.get("how_generated")
    else:
        if getattr(observation, "type", None) != "test_case":
            return None
        status, phase = observation.status, getattr(observation.metadata, "phase", None)
        how = getattr(observation, "how_generated", None)
    # An explicit example (a replayed regression) names no phase, only how it was generated.
    explicit = how == "explicit example"
    kind = "gave_up" if status == "gave_up" else ("case" if phase in SEARCH_PHASES or explicit else "shrink")
    return kind, status == "failed"


@contextlib.contextmanager
def watching(callback):
    """``callback(observation)`` for every Hypothesis observation (on this thread, where Hypothesis
    has the callback API) while the block runs; yields whether it could be registered: without
    observability nothing can be counted this way. Observability costs every Hypothesis test, so
    the plugin turns it on for a property test only, not for every test of a session it is loaded
    into; the fuzz driver's workers, which run nothing else, for their whole run."""
    try:
        from hypothesis.internal import observability
    except ImportError:  # pragma: no cover - Hypothesis without observability
        yield False
        return
    if hasattr(observability, "remove_observability_callback"):
        add, remove = observability.add_observability_callback, observability.remove_observability_callback
    elif hasattr(observability, "TESTCASE_CALLBACKS"):  # pragma: no cover - Hypothesis before the callback API
        add, remove = observability.TESTCASE_CALLBACKS.append, observability.TESTCASE_CALLBACKS.remove
    else:  # pragma: no cover
        yield False
        return
    coverage = getattr(observability, "OBSERVABILITY_COLLECT_COVERAGE", None)
    if coverage is not None:  # coverage collection is what observability costs on Python <= 3.11
        observability.OBSERVABILITY_COLLECT_COVERAGE = False
    add(callback)
    try:
        yield True
    finally:
        remove(callback)
        if coverage is not None:
            observability.OBSERVABILITY_COLLECT_COVERAGE = coverage
