"""Declared domains, buckets, collision cases, the outside-domain probe and the known-failure ledger.

On the CPU model, with the stand-in kernels of tests/domain_fakes.py (ours
behind an ``assert`` on what they support). The default selection runs the
pieces in this process (seconds); the runs of the whole suite through
``mqa-bwd check`` are marked slow; the H200 checks of the atomic control are
marked gpu.
"""

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from mqa_bwd import cli, fuzz
from mqa_bwd.contract import Domain
from properties import checks, ledger, outside, plugin, profiles, strategies
from properties.case import Case
from properties.target import Target

from hopper import NEEDS_HOPPER

ROOT = Path(__file__).resolve().parents[1]
FAKES = "domain_fakes"
#: A domain that restricts every field at once.
NARROW = Domain(heads=(16, 64), heads_multiple=16, topk_min=64, topk_multiple=64, widths=((32, 16),), batch_max=1,
                sink="required", invalid_indices=("minus_one",), causal_indices=True)


def draws(strategy, n: int = 120) -> list:
    """The first ``n`` derandomized draws of ``strategy``, without running anything on them."""
    seen = []

    @settings(derandomize=True, max_examples=n, database=None, phases=(Phase.generate,), deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        seen.append(case)

    collect()
    return seen


def fake(name: str, **load) -> Target:
    return Target.load(f"{FAKES}:{name}", "model", **load)


# ---------------------------------------------------------------------------
# The domain as data
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("domain", [Domain(), Domain(heads=(2, 128)), Domain(topk_multiple=64), NARROW,
                                    Domain(invalid_indices=(), frameworks=("torch",), batch_max=3, heads=(8, 8))])
def test_the_text_form_reads_back_to_the_same_domain(domain):
    text = domain.to_text()
    assert Domain.parse(text) == domain
    assert (text == "spec") == domain.is_spec


def test_text_replaces_the_declared_fields_it_names():
    declared = Domain(heads=(2, 128), topk_multiple=64)
    assert Domain.parse("topk_multiple=1", base=declared) == Domain(heads=(2, 128))
    assert Domain.parse("sink=required", base=declared) == Domain(heads=(2, 128), topk_multiple=64, sink="required")
    assert Domain.parse("spec", base=declared) == Domain()
    assert Domain.parse("heads=4,widths=576x512+512x512,causal_indices=yes").widths == ((576, 512), (512, 512))


@pytest.mark.parametrize("text, words", [("heads=0-4", ["domain.heads"]), ("colour=red", ["unknown field", "colour"]),
                                         ("heads", ["field=value"]), ("widths=576", ["widths", "DKxDV"]),
                                         ("sink=maybe", ["domain.sink"]), ("invalid_indices=minus_two", ["minus_two"]),
                                         ("heads=2,heads=3", ["twice"])])
def test_a_bad_domain_text_is_a_value_error_naming_the_field(text, words):
    with pytest.raises(ValueError) as err:
        Domain.parse(text)
    assert str(err.value).startswith("--domain: ") and all(w in str(err.value) for w in words), err.value


def test_violations_name_each_field_the_dimensions_break():
    why = NARROW.violations(batch=2, heads=81, topk=32, widths=(64, 32), sink=False, invalid_indices={"s_kv"},
                            causal=False, framework="torch")
    for field in ("heads=16-64", "heads_multiple=16", "topk_min=64", "topk_multiple=64", "widths=32x16",
                  "batch_max=1", "sink=required", "invalid_indices=minus_one", "causal_indices=yes"):
        assert any(field in w for w in why), (field, why)
    assert NARROW.contains(batch=1, heads=32, topk=128, widths=(32, 16), sink=True, invalid_indices={"minus_one"},
                           causal=True, framework="torch")
    assert Domain().contains(batch=9, heads=1, topk=1, widths=(16, 16), sink=False, invalid_indices={"s_kv"})


# ---------------------------------------------------------------------------
# Drawing inside the domain
# ---------------------------------------------------------------------------


def _indices_obey(case: Case, domain: Domain) -> None:
    """What the case's tensors really hold, against what ``dimensions`` said of them."""
    idx = case.indices().astype(np.int64)
    valid = (idx >= 0) & (idx < case.S_kv)
    if domain.causal_indices:
        limit = np.arange(case.S)[None, :, None] + case.S_kv - case.S
        assert not (valid & (idx > limit)).any(), case
    if domain.invalid_indices == ("minus_one",):
        assert set(np.unique(idx[~valid]).tolist()) <= {-1}, case


@pytest.mark.parametrize("domain", [Domain(topk_multiple=64), Domain(heads=(2, 128)), NARROW,
                                    Domain(invalid_indices=(), causal_indices=True, sink="unsupported")])
@pytest.mark.parametrize("collisions", [False, True])
def test_every_case_drawn_is_inside_the_domain(domain, collisions):
    space = strategies.Space(domain=domain)
    drawn = draws(strategies.cases(space, collisions=collisions))
    for case in drawn:
        assert strategies.in_domain(case, domain), (domain.violations(**strategies.dimensions(case)), case)
        _indices_obey(case, domain)
    assert len(set(drawn)) > len(drawn) // 2  # still drawing, not one case again and again
    if not domain.heads_multiple > 1 and not domain.topk_min > 1:
        assert len({c.H for c in drawn}) > 5 and len({c.L for c in drawn}) > 2


def test_the_explicit_cases_are_inside_the_domain_and_start_with_collisions():
    space = strategies.Space(domain=NARROW)
    first, *saved = plugin.explicit_cases("determinism", space)
    assert first == strategies.collision_case(space) and first.duplicates and first.cancelling_rows
    full = strategies.collision_case(strategies.Space())
    assert full.S * full.L / full.S_kv >= 1024  # contributions per kv row
    for case in [first, *saved, strategies.scale_case(space), outside.base_case(space)]:
        assert strategies.in_domain(case, NARROW), case
    everything = plugin.explicit_cases("memory_safety", strategies.Space())
    assert any(c.H == 8 for c in everything)  # the #1784 regression (H=8) ...
    assert not any(c.H == 8 for c in plugin.explicit_cases("memory_safety", strategies.Space(domain=NARROW)))  # ... not here


def test_a_domain_that_leaves_no_head_count_is_refused():
    with pytest.raises(ValueError, match="heads: --heads 1-8 and the domain"):
        strategies.Space(heads=(1, 8), domain=Domain(heads=(16, 128)))
    with pytest.raises(ValueError, match="frameworks"):
        strategies.Space(domain=Domain(frameworks=("paddle",)))


@pytest.mark.parametrize("domain", [Domain(), Domain(topk_multiple=64), NARROW])
def test_bucket_mode_draws_shapes_only_from_its_buckets_and_varies_the_rest(domain):
    space = strategies.Space(domain=domain)
    space = strategies.Space(domain=domain, buckets=strategies.default_buckets(space))
    assert 1 <= len(space.buckets) <= len(strategies.BUCKET_TEMPLATES["small"])
    drawn = draws(strategies.cases(space, collisions=True), 200)
    shapes = {(c.B, c.S, c.S_kv, c.H, c.L, c.d_k, c.d_v) for c in drawn}
    assert shapes <= set(space.buckets) and len(shapes) == len(space.buckets)
    assert len(set(drawn)) > 100
    for field, at_least in (("seed", 10), ("sink", 2), ("duplicates", 2), ("cancelling_rows", 2), ("invalid", 2),
                            ("empty_rows", 2)):
        assert len({getattr(c, field) for c in drawn}) >= at_least, field
    if not domain.causal_indices:
        assert {c.pattern for c in drawn} == {"random", "causal"}
    assert all(c.block_h is None and c.dkv_buf_bytes is None for c in drawn)  # a configuration is a compile too
    assert all(strategies.in_domain(c, domain) for c in drawn)


def test_a_bucket_outside_the_domain_is_refused():
    with pytest.raises(ValueError, match="buckets: .*outside the domain"):
        strategies.Space(domain=Domain(topk_multiple=64), buckets=((1, 4, 16, 16, 32, 16, 16),))


# ---------------------------------------------------------------------------
# The fakes: inside their domain every property holds; outside, the assert
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["topk_multiple_of_64", "more_than_one_head"])
def test_inside_its_domain_every_property_holds_for_an_asserting_kernel(name):
    target = fake(name)
    assert target.domain_source == "declared" and not target.domain.is_spec
    case = draws(strategies.cases(strategies.Space(domain=target.domain)), 2)[1]
    for prop in checks.PROPERTY_NAMES:
        verdict = checks.run_property(prop, target, case, checks.Options(repeats=3))
        assert verdict.ok, verdict.report


@pytest.mark.parametrize("name, assert_text", [("topk_multiple_of_64", "% 64 == 0"), ("more_than_one_head", "!= 1")])
def test_over_the_whole_spec_domain_the_assert_fails_the_properties(name, assert_text):
    target = fake(name, domain="spec")
    assert target.domain.is_spec and target.domain_source == "spec"
    first = draws(strategies.cases(strategies.Space()), 1)[0]  # H=1, L=1: the simplest case
    verdict = checks.run_property("agreement", target, first)
    assert not verdict.ok and "AssertionError" in verdict.report and "domain_fakes.py" in verdict.report


@pytest.mark.parametrize("name, behaviour, words", [
    ("topk_multiple_of_64", "assert", ["L=65", "domain_fakes.py", "% 64 == 0", "top-k must be a multiple of 64"]),
    ("more_than_one_head", "assert", ["H=1", "domain_fakes.py", "query.shape[2] != 1"]),
    ("rejects_one_head", "rejected", ["H=1", "names query"]),
])
def test_just_outside_the_domain_the_probe_says_what_the_kernel_does(name, behaviour, words):
    target = fake(name)
    (probe,) = outside.boundary_probes(strategies.Space(domain=target.domain))
    finding = outside.run_probe(target, probe)
    assert finding.behaviour == behaviour and finding.right == (behaviour == "rejected"), finding
    assert all(w in finding.line() for w in words), finding.line()


def test_ours_under_a_narrow_domain_is_found_to_handle_more():
    target = Target.load(None, "model", domain="heads=2-128")
    (probe,) = outside.boundary_probes(strategies.Space(domain=target.domain))
    assert outside.run_probe(target, probe).behaviour == "accepted_agrees"


def test_the_probes_cross_every_boundary_once_and_stay_inside_the_rest():
    narrow = dataclasses.replace(NARROW, heads=(32, 64), frameworks=("torch",))
    space = strategies.Space(domain=narrow, frameworks=("torch", "paddle"))
    probes = outside.boundary_probes(space)
    crossed = {p.boundary for p in probes}
    assert crossed == {"heads", "heads_multiple", "topk_min", "topk_multiple", "widths", "batch_max", "sink",
                       "invalid_indices", "causal_indices", "frameworks"}
    for p in probes:
        why = narrow.violations(**strategies.dimensions(p.case))
        assert why, p
        if p.boundary not in ("topk_min",):  # below topk_min=64 no multiple of 64 is left
            assert len(why) == 1, (p.label, why)
    assert outside.boundary_probes(strategies.Space()) == []


def test_a_crashing_kernel_is_reported_as_crashed_and_the_next_probe_still_runs(tmp_path, monkeypatch):
    (tmp_path / "crashing_fake.py").write_text(
        "import os, signal\n"
        "from mqa_bwd import mqa_latent_sparse_bwd\n"
        "from mqa_bwd.contract import Domain\n"
        "def bwd(*args, **kw):\n"
        "    if args[6].shape[-1] % 64:\n"
        "        os.kill(os.getpid(), signal.SIGSEGV)\n"
        "    if args[0].shape[2] < 16:\n"
        "        raise ValueError('query: at least 16 heads')\n"
        "    return mqa_latent_sparse_bwd(*args, **kw)\n"
        "bwd.domain = Domain(heads=(16, 128), topk_multiple=64)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    target = Target.load("crashing_fake:bwd", "model")
    findings = outside.probe_outside(target, strategies.Space(domain=target.domain))
    assert [(f.boundary, f.behaviour) for f in findings] == [("heads", "rejected"), ("topk_multiple", "crashed")]
    assert "SIGSEGV" in findings[1].detail


# ---------------------------------------------------------------------------
# Determinism where atomics collide
# ---------------------------------------------------------------------------


def test_the_atomic_model_fails_determinism_on_its_first_case():
    """The plugin's determinism test, as the ci profile runs it: explicit cases first, then collisions."""
    space = strategies.Space()
    target = Target.load(None, "model-atomic")
    tried, failed_at = [], []

    def run(case):
        tried.append(case)
        verdict = checks.run_property("determinism", target, case, checks.Options(repeats=4))
        if not verdict.ok and not failed_at:
            failed_at.append((len(tried), verdict.report))
        assert verdict.ok

    test = given(case=strategies.cases(space, collisions=True))(run)
    for case in reversed(plugin.explicit_cases("determinism", space)):
        test = example(case=case)(test)
    with pytest.raises(AssertionError):
        settings(profiles.PROFILES["ci"], max_examples=5, phases=(Phase.explicit, Phase.generate))(test)()
    assert failed_at and failed_at[0][0] <= 1, [checks.describe_case(c) for c in tried]
    head = failed_at[0][1].splitlines()[0]
    assert "DIFFERS in dkv (first divergence: run 1 at (" in head and "distinct results in 4 runs" in head, head


def test_ours_is_bitwise_on_the_collision_case():
    case = strategies.collision_case(strategies.Space())
    verdict = checks.run_property("determinism", Target.load(None, "model"), case, checks.Options(repeats=3))
    assert verdict.ok and verdict.report.splitlines()[0].endswith("bitwise identical"), verdict.report


def test_the_production_shape_probe_fits_the_domain_and_waits_for_a_gpu():
    case = strategies.scale_case(strategies.Space(widths="production"))
    assert (case.S, case.S_kv, case.H, case.L, case.d_k, case.d_v) == (512, 1024, 64, 256, 576, 512)
    fitted = strategies.scale_case(strategies.Space(domain=Domain(heads=(2, 48), topk_multiple=96, sink="required")))
    assert (fitted.H, fitted.L) == (48, 288) and fitted.sink != "none"
    h = plugin.Harness(Target.load(None, "model"), checks.Options(), strategies.Space(), "ci")
    with pytest.raises(pytest.skip.Exception, match="runs on a GPU backend only"):
        h.check_at_scale("determinism")


# ---------------------------------------------------------------------------
# The harness: time budgets, REPRO lines, the ledger
# ---------------------------------------------------------------------------


def _harness(target: Target, **kwargs) -> plugin.Harness:
    return plugin.Harness(target, checks.Options(repeats=2), strategies.Space(domain=target.domain), "ci",
                          failures_dir=None, **kwargs)


def _report(outcome: str, longrepr=None) -> pytest.TestReport:
    return pytest.TestReport("t::x", ("t.py", 1, "x"), {}, outcome, longrepr, "call", user_properties=[])


ITEM = types.SimpleNamespace(nodeid="t::x", path=Path("t.py"), location=("t.py", 1, "x"))
SMALL = Case(H=3, L=5, sink="random", seed=3)
NO_SINK = SMALL.replace(sink="none")


def _run(h: plugin.Harness, prop: str, *cases) -> pytest.TestReport:
    """Run ``cases`` through ``h.check`` as one test (nodeid t::x) and settle its report."""
    h.cases_run.clear()
    h.current_item = ITEM
    h.started["t::x"] = time.time()
    outcome, longrepr = "passed", None
    try:
        for case in cases:
            h.check(prop, case)
    except pytest.skip.Exception as skip:
        outcome, longrepr = "skipped", ("t.py", 1, str(skip))
    except plugin.PropertyFailure as failure:
        outcome, longrepr = "failed", str(failure)
    report = _report(outcome, longrepr)
    plugin._settle(report, ITEM, h)
    return report


def test_a_time_budget_ends_a_quiet_property_as_a_pass_but_never_a_failing_one():
    h = _harness(Target.load(None, "model"), minutes_per_property=1e-6)
    report = _run(h, "output_contract", SMALL, SMALL, SMALL)
    assert report.passed and h.cases_run["t::x"] == 1
    assert any(k == "mqa_budget" and "1 cases" in v for k, v in report.user_properties)
    h = _harness(fake("topk_multiple_of_64", domain="spec"), minutes_per_property=1e-6)
    assert _run(h, "output_contract", SMALL, SMALL).failed  # the first case fails: no budget ends it


def test_repro_lines_carry_the_domain():
    case = Case()
    assert "--mqa-domain" not in _harness(Target.load(None, "model")).repro_command("agreement", case)
    for target, text in ((fake("more_than_one_head"), "heads=2-128"), (fake("more_than_one_head", domain="spec"), "spec"),
                         (Target.load(None, "model", domain="sink=required"), "sink=required")):
        words = shlex.split(_harness(target).repro_command("agreement", case))
        assert words[words.index("--mqa-domain") + 1] == text


def _ledger(tmp_path, *entries, suffix=".toml") -> Path:
    path = tmp_path / f"known{suffix}"
    if suffix == ".toml":
        def toml(v):
            return "{ " + ", ".join(f"{k} = {toml(x)}" for k, x in v.items()) + " }" if isinstance(v, dict) else json.dumps(v)

        path.write_text("".join("[[known_failure]]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in e.items())
                                for e in entries))
    else:
        path.write_text(json.dumps({"known_failure": list(entries)}))
    return path


WRONG = f"{FAKES}:wrong_dq_with_sink"


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_covered_failure_is_xfail_with_its_reason(tmp_path, suffix):
    path = _ledger(tmp_path, {"impl": WRONG, "property": "agreement", "reason": "dq is off with a sink",
                              "findings": ["dq"]}, suffix=suffix)
    h = _harness(Target.load(WRONG, "model"), known_failures=ledger.load(path))
    report = _run(h, "agreement", NO_SINK, SMALL, SMALL)
    assert report.skipped and h.cases_run["t::x"] == 2  # ended at the first covered failure
    assert report.wasxfail.startswith("known failure (known") and "dq is off with a sink" in report.wasxfail
    # The fuzz driver reads the same reason back from the worker's report (fuzz.py's progress record).
    reported = fuzz.TestProgress("t::x", outcome="skipped", reason=str(report.longrepr[2]))
    assert fuzz.is_known_failure(reported) and not fuzz.is_known_failure(dataclasses.replace(reported, reason="x"))


def test_the_check_table_shows_a_ledger_reason_whole_whatever_it_contains(tmp_path, monkeypatch):
    # The reason and the ledger's name hold what the xfail text separates its parts with; the check
    # table gets the pieces as the suite's summary JSON carries them, never parsed back from that text.
    from mqa_bwd.console import verdict_cells

    reason = "fp32 atomics | see the notes (cuDNN): dkv order; case {B: 1} only"
    path = _ledger(tmp_path, {"impl": WRONG, "property": "agreement", "reason": reason, "findings": ["dq"]})
    path = path.rename(tmp_path / "known (v2): cudnn.toml")
    h = _harness(Target.load(WRONG, "model"), known_failures=ledger.load(path))
    report = _run(h, "agreement", SMALL)
    report.user_properties.append(("mqa_property", "agreement"))
    config = types.SimpleNamespace(_mqa_summary={})
    monkeypatch.setattr(plugin, "_CONFIG_FOR_REPORTS", config)
    monkeypatch.setattr(plugin, "_HARNESS", h)
    plugin.pytest_runtest_logreport(report)
    result = json.loads(json.dumps(plugin.summary(config)))["properties"]["agreement"]  # as mqa-bwd check reads it
    headline = checks.run_property("agreement", h.target, SMALL, h.options).report.splitlines()[0]
    assert result["verdict"] == "xfail"
    assert verdict_cells(result) == ("known failure", f"{reason} | seen in 1 case(s); first: {headline}")
    assert result["known_failure"]["reason"] == reason


def test_a_failure_the_entry_does_not_cover_is_still_a_failure(tmp_path):
    path = _ledger(tmp_path, {"impl": WRONG, "property": "agreement", "reason": "dkv is off", "findings": ["dkv"]})
    report = _run(_harness(Target.load(WRONG, "model"), known_failures=ledger.load(path)), "agreement", SMALL)
    assert report.failed and "dq: MISMATCH" in report.longrepr


def test_a_covered_case_does_not_end_the_shrinking_of_an_uncovered_failure(tmp_path):
    path = _ledger(tmp_path, {"impl": WRONG, "property": "agreement", "reason": "dq", "findings": ["dq"]})
    h = _harness(Target.load(WRONG, "model"), known_failures=ledger.load(path))
    h.current_item = ITEM
    h.failing.add(ITEM.nodeid)  # as after an uncovered failure, while Hypothesis shrinks it
    h.check("agreement", SMALL)  # covered: returns (a pass to Hypothesis) instead of ending the test
    assert ITEM.nodeid not in h.stopped and h.tallies[ITEM.nodeid].expected == 1


def test_a_filtered_entry_searches_on_and_xfails_only_its_cases(tmp_path):
    path = _ledger(tmp_path, {"impl": WRONG, "property": "agreement", "reason": "with a random sink",
                              "case": {"sink": ["random"]}})
    h = _harness(Target.load(WRONG, "model"), known_failures=ledger.load(path))
    report = _run(h, "agreement", SMALL, NO_SINK, SMALL)
    assert report.skipped and hasattr(report, "wasxfail") and h.cases_run["t::x"] == 3
    assert "seen in 2 case(s)" in report.wasxfail
    h = _harness(Target.load(WRONG, "model"), known_failures=ledger.load(path))
    assert _run(h, "agreement", SMALL, SMALL.replace(sink="neg_1e30")).failed  # outside the filter: a failure


def test_an_entry_whose_property_holds_is_an_unexpected_pass(tmp_path):
    path = _ledger(tmp_path, {"impl": f"{FAKES}:ours", "property": "determinism", "reason": "thought to use atomics"},
                   {"impl": "someone.else:bwd", "property": "agreement", "reason": "not this one"})
    h = _harness(Target.load(f"{FAKES}:ours", "model"), known_failures=ledger.load(path))
    report = _run(h, "determinism", SMALL, NO_SINK)
    assert report.failed and report.longrepr.startswith("[XPASS(strict)]") and "2 case(s)" in report.longrepr
    assert _run(h, "agreement", SMALL).passed  # the other entry is someone else's


def test_a_non_strict_entry_whose_property_holds_is_a_note_not_a_failure(tmp_path):
    path = _ledger(tmp_path, {"impl": f"{FAKES}:ours", "property": "determinism", "reason": "atomics, on some runs",
                              "strict": False})
    h = _harness(Target.load(f"{FAKES}:ours", "model"), known_failures=ledger.load(path))
    report = _run(h, "determinism", SMALL, NO_SINK)
    assert report.passed
    assert any("known failure not seen (strict = false)" in str(v) for k, v in report.user_properties if k == "mqa_note")
    with pytest.raises(ValueError, match="strict is true or false"):
        ledger.load(_ledger(tmp_path, {"impl": "a:b", "property": "agreement", "reason": "r", "strict": "no"}))


def test_an_entry_that_covers_no_case_decides_nothing(tmp_path):
    path = _ledger(tmp_path, {"impl": f"{FAKES}:ours", "property": "agreement", "reason": "only at H=128",
                              "domain": "heads=128"})
    report = _run(_harness(Target.load(f"{FAKES}:ours", "model"), known_failures=ledger.load(path)), "agreement", SMALL)
    assert report.passed and any("not exercised" in v for k, v in report.user_properties if k == "mqa_note")


@pytest.mark.parametrize("entry, words", [
    ({"impl": "a:b", "property": "agreement"}, ["entry 1", "reason is required", "must say why"]),
    ({"impl": "a:b", "property": "agreement", "reason": "  "}, ["reason is required"]),
    ({"impl": "a:b", "property": "speed", "reason": "x"}, ["property 'speed'"]),
    ({"impl": "a:b", "property": "agreement", "reason": "x", "colour": "red"}, ["unknown field", "colour"]),
    ({"impl": "a:b", "property": "agreement", "reason": "x", "domain": "heads=0"}, ["domain", "heads"]),
    ({"impl": "a:b", "property": "agreement", "reason": "x", "case": {"size": 3}}, ["size", "not Case fields"]),
])
def test_a_bad_ledger_entry_is_refused_naming_it(tmp_path, entry, words):
    with pytest.raises(ValueError) as err:
        ledger.load(_ledger(tmp_path, entry))
    assert str(err.value).startswith("--mqa-known-failures: ") and all(w in str(err.value) for w in words), err.value


def test_the_cudnn_ledger_the_readme_points_to_is_a_valid_ledger():
    entries = ledger.load(ROOT / "docs" / "known-failures-cudnn.toml")
    assert {e.impl for e in entries} == {"mqa_bwd.cudnn:cudnn_backward"}
    (determinism,) = [e for e in entries if e.property == "determinism"]
    assert determinism.findings == ("dkv", "d_attn_sink") and not determinism.filtered
    assert determinism.covers_failure({"dq": True, "dkv": False, "d_attn_sink": False})
    assert not determinism.covers_failure({"dq": False, "dkv": False, "d_attn_sink": True})  # dq drifting is news
    (rejection,) = [e for e in entries if e.property == "rejection"]
    assert rejection.covers_failure({"lse NaN at one (row, head)": False, "kv width != Dk": True})
    assert not rejection.covers_failure({"lse NaN at one (row, head)": False, "kv width != Dk": False})  # news


def test_the_command_line_refuses_a_bad_domain_or_ledger_before_running(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:
        cli.main(["check", "--backend", "model", "--domain", "colour=red"])
    assert done.value.code == 2 and "argument --domain: unknown field 'colour'" in capsys.readouterr().err
    bad = _ledger(tmp_path, {"impl": "a:b", "property": "agreement"})
    assert cli.main(["check", "--backend", "model", "--known-failures", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--known-failures" in err and "reason is required" in err


def test_the_check_table_says_why_and_the_findings_follow_it():
    import io

    from rich.console import Console

    from mqa_bwd.console import print_outside_domain, verdict_cells

    xfail = {"verdict": "xfail", "known_failure": {
        "source": "k.toml, entry 1", "reason": "atomics", "case": {"B": 1},
        "seen": "seen in 2 case(s); first: determinism ...: DIFFERS in dkv (first divergence: run 1 at (0, 1, 2); "
                "9 distinct results in 20 runs)"}}
    verdict, note = verdict_cells(xfail)
    assert verdict == "known failure" and note.startswith("atomics | seen in 2") and "9 distinct" in note
    assert "case {" not in note
    assert verdict_cells({"verdict": "pass", "budget": "3 cases"}) == ("pass (time budget)", "3 cases")
    assert verdict_cells({"verdict": "fail", "notes": ["dq: MISMATCH"]}) == ("fail", "dq: MISMATCH")
    assert verdict_cells({"verdict": "fail", "notes": "dq: MISMATCH"}) == ("fail", "dq: MISMATCH")  # not "d"
    out = io.StringIO()
    target = fake("more_than_one_head")
    (probe,) = outside.boundary_probes(strategies.Space(domain=target.domain))
    finding = outside.run_probe(target, probe)
    print_outside_domain(Console(file=out, width=300), {"domain": {"text": "heads=2-128", "source": "declared"},
                                                        "outside_domain": [finding.as_dict()]})
    text = out.getvalue()
    assert "just outside the domain heads=2-128 (declared)" in text and "BAD  H=1, below heads=2-128" in text


def test_an_impl_that_does_not_pick_a_backend_is_given_none():
    args = types.SimpleNamespace(impl=f"{FAKES}:more_than_one_head", backend=None)
    assert cli._resolve_target(args) == (None, args.impl, False)  # no GPU here
    assert cli._resolve_target(types.SimpleNamespace(impl=None, backend=None))[0] == "model"
    words = shlex.split(_harness(Target.load(f"{FAKES}:more_than_one_head")).repro_command("agreement", Case()))
    assert "--backend" not in words


def test_the_fuzz_wrapper_declares_the_domain_of_what_it_runs(monkeypatch):
    from mqa_bwd.contract import OURS

    monkeypatch.setenv(fuzz.ENV_TARGET, f"{FAKES}:more_than_one_head")
    target = Target.load(fuzz.GUARD, "model")
    assert target.domain == Domain(heads=(2, 128)) and target.name == f"{FAKES}:more_than_one_head"
    monkeypatch.setenv(fuzz.ENV_TARGET, "model")
    target = Target.load(fuzz.GUARD, "model")
    assert target.domain.is_spec and target.name == OURS


def test_the_check_command_passes_the_options_on():
    command = fuzz.build_pytest_command(
        "suite.py", profile="ci", summary_json="s.json", domain="heads=2-128", buckets=True, minutes_per_property=2,
        known_failures="k.toml", outside_probe=False)
    text = " ".join(command)
    for words in ("--mqa-domain heads=2-128", "--mqa-buckets", "--mqa-minutes-per-property 2.0",
                  "--mqa-known-failures k.toml", "--mqa-no-outside-probe"):
        assert words in text


# ---------------------------------------------------------------------------
# The whole suite through mqa-bwd check (slow: each is a full run on the CPU model)
# ---------------------------------------------------------------------------


def _check(tmp_path, *argv, profile="dev"):
    summary = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "mqa_bwd", "check", "--backend", "model", "--profile", profile,
                          "--minutes-per-property", "0.02", "--failures-dir", str(tmp_path / "f"),
                          "--summary-json", str(summary), *argv], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    return run, (json.loads(summary.read_text()) if summary.exists() else None)


@pytest.mark.slow
def test_check_holds_inside_a_declared_domain_and_reports_the_assert_once(tmp_path):
    run, summary = _check(tmp_path, "--impl", f"{FAKES}:topk_multiple_of_64")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    verdicts = {name: r["verdict"] for name, r in summary["properties"].items()}
    assert set(verdicts.values()) == {"pass", "skip"} and verdicts["determinism_at_scale"] == "skip", verdicts
    assert summary["domain"] == {"text": "topk_multiple=64", "source": "declared"}
    (finding,) = summary["outside_domain"]
    assert finding["behaviour"] == "assert" and "% 64 == 0" in finding["text"] and not finding["right"]
    assert "just outside the domain topk_multiple=64" in run.stdout and "% 64 == 0" in run.stdout


@pytest.mark.slow
def test_check_without_the_domain_fails_as_before_with_the_domain_in_the_repro_line(tmp_path):
    # ci: derandomized, so its first case is the simplest one (H=1)
    run, summary = _check(tmp_path, "--impl", f"{FAKES}:more_than_one_head", "--domain", "spec", "-k", "agreement",
                          profile="ci")
    assert run.returncode == 1, run.stdout[-4000:]
    assert summary["properties"]["agreement"]["verdict"] == "fail" and "outside_domain" not in summary
    repro = [line.split("REPRO: ", 1)[1] for line in run.stdout.splitlines() if "REPRO: " in line]
    assert repro and "--mqa-domain spec" in repro[-1] and "AssertionError" in run.stdout


@pytest.mark.slow
def test_check_reports_a_known_failure_and_fails_an_unexpected_pass(tmp_path):
    known = _ledger(tmp_path, {"impl": WRONG, "property": "agreement", "reason": "dq is off with a sink",
                               "findings": ["dq"]},
                    {"impl": WRONG, "property": "output_contract", "reason": "no, it does not fail"})
    run, summary = _check(tmp_path, "--impl", WRONG, "--known-failures", str(known), "-k",
                          "agreement or output_contract", profile="ci")
    assert run.returncode == 1, run.stdout[-4000:]
    props = summary["properties"]
    assert props["agreement"]["verdict"] == "xfail"
    assert props["agreement"]["known_failure"]["reason"] == "dq is off with a sink"
    assert props["output_contract"]["verdict"] == "fail" and "XPASS(strict)" in props["output_contract"]["notes"][0]
    assert "known failure" in run.stdout and "dq is off with a sink" in run.stdout


# ---------------------------------------------------------------------------
# On the H200: the atomic control must fail determinism at once
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@NEEDS_HOPPER
def test_the_atomic_control_fails_determinism_on_the_first_collision_cases():
    target = Target.load(None, "tilelang-atomic")
    space = strategies.Space(widths="production")
    tried = []
    for case in plugin.explicit_cases("determinism", space)[:1] + draws(strategies.collision_cases(space), 3):
        tried.append(case)
        if not checks.run_property("determinism", target, case, checks.Options(repeats=10)).ok:
            break
    else:
        pytest.fail(f"the atomic control held on {len(tried)} collision cases")
    assert len(tried) <= 2, [checks.describe_case(c) for c in tried]


@pytest.mark.gpu
@NEEDS_HOPPER
@pytest.mark.slow
@pytest.mark.parametrize("backend, bitwise", [("tilelang", True), ("tilelang-atomic", False)])
def test_the_production_shape_probe(backend, bitwise):
    case = strategies.scale_case(strategies.Space(widths="production"))
    verdict = checks.run_property("determinism", Target.load(None, backend), case, checks.Options(repeats=10))
    assert verdict.ok == bitwise, verdict.report
    if not bitwise:
        assert "dkv (first divergence" in verdict.report.splitlines()[0], verdict.report
