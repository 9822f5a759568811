"""The pytest plugin of the property suite (registered as the ``pytest11`` entry point "mqa_bwd").

The suite itself, ``properties/test_properties.py``, ships in the package:
``pytest --pyargs properties`` or ``mqa-bwd check`` run it wherever the
package is installed.

Options (``pytest --help``, group "mqa-bwd properties"):

  --impl module:function   the implementation under test (default: ours)
  --backend NAME           passed as backend= (default: the implementation's default_backend())
  --repeats N              determinism: calls per example (default 20)
  --processes N            process_determinism: fresh processes per example (default 2)
  --heads LO-HI            restrict the head counts the strategies draw
  --mqa-profile NAME       Hypothesis profile: ci, dev, fuzz, repro ($MQA_PROFILE)
  --replay CASE            run only this case (JSON text, or a case/failure file)
  --summary-json PATH      per-property verdicts, example counts, seconds, and how often each
                           sub-check (a Verdict's findings: memory_safety's guard bands, read
                           bands, denormal canary, bounds) held and failed
  --failures-dir DIR       where failing cases are saved (default .mqa-failures/ in the working directory),
                           and each failed property's report, as reports/NAME.txt: its first failing case
                           when found, the whole report when the property ends
  --mqa-domain TEXT        what the implementation supports (mqa_bwd.contract.Domain text); the fields
                           given replace those its ``domain`` attribute declares; 'spec': all of SPEC
  --mqa-buckets            shapes from a small fixed set (one compile per bucket for a JIT kernel)
  --mqa-minutes-per-property M
                           end a property that has found nothing after M minutes (it passes, saying so)
  --mqa-known-failures FILE
                           the known-failure ledger (properties/ledger.py): expected failures, strict
  --mqa-no-outside-probe   do not probe the implementation just outside its domain

A property test is written as::

    @property_test("agreement")
    def test_property_agreement(case, mqa):
        mqa.check("agreement", case)

``property_test`` draws cases with the strategies (or takes the --replay
case) and replays the saved regression cases first, as explicit examples
(those inside the domain; the determinism property also replays a case where
atomics collide first). ``mqa.check`` runs the property; on failure it raises
with the report and a REPRO line (one command replaying exactly that case and
property, domain included), and the plugin saves the case as JSON in the
failures folder.

At the end of a run whose domain is not the whole SPEC domain, the
implementation is probed once just outside each of the domain's boundaries
(properties/outside.py, in a child process); the findings are a section of
the terminal summary and ``outside_domain`` in the summary JSON, never a
failure of a property.
"""

import collections
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import shlex
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mqa_bwd.files import write_atomic, write_json_atomic

from . import checks, ledger, observed, profiles, strategies
from .case import Case
from .target import OURS, Target, declared_domain

#: The replayed regressions: shipped with the suite, replayed first on every run.
#: A failing case lands in the failures folder; ``mqa-bwd promote FILE`` moves it here.
REGRESSIONS_DIR = Path(__file__).resolve().parent / "regressions"
#: Where failing cases go unless --failures-dir says otherwise (relative to the working directory).
DEFAULT_FAILURES_DIR = Path(".mqa-failures")
#: The first line of reports/NAME.txt while a property's first failing case is all there is (the test
#: has not ended: Hypothesis may still be shrinking it).
FIRST_FAILURE_HEADER = ("first failing case found, not shrunk: the property's test had not ended when "
                        "this was written (a run stopped while shrinking leaves it)")
#: The suite as pytest --pyargs names it, wherever the package is installed.
SUITE_MODULE = "properties.test_properties"
#: Markers the suite and the project's tests use, registered here so that an
#: installed suite runs under --strict-markers from any directory.
MARKERS = (
    "gpu: needs a CUDA GPU (Hopper for the TileLang kernels)",
    "slow: long-running; select with -m slow",
    "determinism: bitwise run-to-run reproducibility",
    "paddle: needs paddlepaddle",
    "experiments: variants kept only to time against (experiments/); not in the default run",
    "wheel: builds the wheel and runs the gate from a fresh virtualenv (.ci/run); not in the default run",
)
DEFAULT_REPEATS = 20
DEFAULT_PROCESSES = 2


class PropertyFailure(AssertionError):
    """A property does not hold for a case (the message is the report and the REPRO line)."""


class Harness:
    """One pytest process's view of the suite: what is tested, how, and what happened.

    A plain class, not a dataclass: Hypothesis prints dataclass arguments
    field by field, and this one is passed to every property test.
    """

    def __init__(self, target: Target, options: checks.Options, space: strategies.Space, profile: str,
                 replay: Case | None = None, failures_dir: Path | None = DEFAULT_FAILURES_DIR,
                 regressions_dir: Path = REGRESSIONS_DIR, minutes_per_property: float | None = None,
                 known_failures: tuple = (), known_failures_path: Path | None = None, outside_probe: bool = True):
        self.target, self.options, self.space, self.profile = target, options, space, profile
        self.replay, self.failures_dir, self.regressions_dir = replay, failures_dir, regressions_dir
        self.minutes_per_property = minutes_per_property
        self.known_failures, self.known_failures_path = tuple(known_failures), known_failures_path
        self.outside_probe = outside_probe
        self.current_item = None
        #: nodeid -> cases run: new inputs Hypothesis tried (properties.observed), not the reruns that
        #: shrink a failure; a call outside Hypothesis (at scale) counts itself
        self.cases_run = collections.Counter()
        self.counts_observed = False  # whether Hypothesis' observations count the cases
        #: nodeid -> {finding: Counter(held=n, failed=m)}: each example's sub-checks (Verdict.findings)
        self.findings_run = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
        self.failures = {}  # nodeid -> [(property, case, report)] of the examples Hypothesis reports
        self.started = {}  # nodeid -> when its test began
        self.failing = set()  # nodeids with a failing case seen: the time budget never ends those
        self.stopped = {}  # nodeid -> why the harness ended its test early (time budget, known failure)
        self.tallies = {}  # nodeid -> ledger.Tally of the entries that apply to it
        self.headlines = {}  # nodeid -> first line of its last failing verdict

    def __repr__(self) -> str:  # Hypothesis prints the test's arguments: keep the fixture's line short
        return f"<mqa harness: {self.target.spec} backend={self.target.backend} profile={self.profile}>"

    def _nodeid(self, name: str) -> str:
        return self.current_item.nodeid if self.current_item is not None else name

    def _end_if_over_budget(self, nodeid: str) -> None:
        """End a test that has used its time budget without a failure: a skip is the one exception
        Hypothesis passes through at once (no shrinking); the report hook makes it a pass."""
        if self.minutes_per_property is None or nodeid in self.failing or not self.cases_run[nodeid]:
            return
        elapsed = time.time() - self.started.get(nodeid, time.time())
        if elapsed >= self.minutes_per_property * 60.0:
            why = (f"time budget of {self.minutes_per_property:g} min used: {self.cases_run[nodeid]} cases "
                   f"in {elapsed:.1f} s, no failure")
            self.stopped[nodeid] = why
            pytest.skip(why)

    def _tally(self, nodeid: str, name: str):
        if nodeid not in self.tallies:
            entries = tuple(e for e in self.known_failures if e.applies_to(self.target.name, self.target.backend, name))
            self.tallies[nodeid] = ledger.Tally(entries) if entries else None
        return self.tallies[nodeid]

    def check(self, name: str, case: Case) -> None:
        __tracebackhide__ = True  # the report is the message; the harness's frames are noise
        nodeid = self._nodeid(name)
        self._end_if_over_budget(nodeid)
        if not (self.counts_observed and _in_hypothesis()):
            self.cases_run[nodeid] += 1
        verdict = checks.run_property(name, self.target, case, self.options)
        for finding, held in verdict.findings.items():
            if held is not None:
                self.findings_run[nodeid][finding]["held" if held else "failed"] += 1
        tally = self._tally(nodeid, name)
        covering = [e for e in tally.entries if e.covers_case(case)] if tally is not None else []
        if verdict.ok:
            if covering:
                tally.held += 1
            return
        headline = (verdict.report or name).splitlines()[0]
        known = next((e for e in covering if e.covers_failure(verdict.findings)), None)
        if known is not None:
            tally.expect(known, case, headline)
            # The whole property is known to fail: nothing more to learn, unless a failure the ledger
            # does not cover is being shrunk (a covered case is then a pass to Hypothesis).
            if not known.filtered and nodeid not in self.failing:
                self.stopped[nodeid] = ledger.KNOWN_FAILURE  # why it stopped: the ledger, not the time budget
                pytest.skip(f"{ledger.KNOWN_FAILURE}: {known.reason}")
            return  # a failure the ledger covers: search on for one it does not
        report = (f"property {name} FAILS for {self.target.spec} (backend {self.target.backend})\n"
                  f"case: {checks.describe_case(case)}\n{verdict.report}")
        repro = f"REPRO: {self.repro_command(name, case)}"
        if nodeid not in self.failing:
            # Shrinking on a GPU can outlast a CI job's time: the first failure found is kept now,
            # and replaced by the whole (shrunk) report when the test ends.
            self.save_report(name, f"{FIRST_FAILURE_HEADER}\n{report}\n{repro}\n")
        self.failing.add(nodeid)
        self.headlines[nodeid] = headline
        if _is_final_example():
            self.failures.setdefault(nodeid, []).append((name, case, report))
        raise PropertyFailure(f"{report}\n{repro}")

    def observe(self, observation) -> None:
        """A Hypothesis observation: one more case of the running test where it is a new input."""
        seen = observed.test_case_kind(observation)
        if seen is not None and seen[0] == "case" and self.current_item is not None:
            self.cases_run[self.current_item.nodeid] += 1

    def check_at_scale(self, name: str) -> None:
        """``name`` on one production-shape case (strategies.scale_case), on a GPU backend only."""
        if self.replay is not None:
            pytest.skip("replaying one case")
        if not self.target.needs_gpu:
            pytest.skip("runs on a GPU backend only (a production shape is too large for the CPU model)")
        self.check(name, strategies.scale_case(self.space))

    def repro_command(self, name: str, case: Case) -> str:
        words = ["python", "-m", "pytest", "-p", "no:xdist", "--pyargs", f"{SUITE_MODULE}::test_property_{name}",
                 "--replay", case.to_json()]
        if self.target.backend is not None:
            words += ["--backend", str(self.target.backend)]
        if self.target.spec != OURS:
            words += ["--impl", self.target.spec]
        if not (self.target.domain.is_spec and declared_domain(self.target.function).is_spec):
            words += ["--mqa-domain", self.target.domain.to_text()]
        if name == "determinism" and self.options.repeats != DEFAULT_REPEATS:
            words += ["--repeats", str(self.options.repeats)]
        if name == "process_determinism" and self.options.processes != DEFAULT_PROCESSES:
            words += ["--processes", str(self.options.processes)]
        return " ".join(shlex.quote(w) for w in words)

    def save_failure(self, name: str, case: Case, report: str) -> Path | None:
        if self.failures_dir is None:
            return None
        self.failures_dir.mkdir(parents=True, exist_ok=True)
        for existing in sorted(self.failures_dir.glob("*.json")):  # a replayed regression is already saved
            try:
                if load_case_text(existing.read_text()) == (case, name):
                    return existing
            except (ValueError, TypeError):
                continue
        path = self.failures_dir / regression_name(name, case)
        record = {"case": case.to_dict(), "property": name, "backend": self.target.backend,
                  "impl": self.target.spec, "report": report}
        if not self.target.domain.is_spec:
            record["domain"] = self.target.domain.to_text()
        return write_json_atomic(path, record)  # a reader never sees half a file

    def save_report(self, name: str, text: str) -> Path | None:
        """A failed property's report in reports/NAME.txt of the failures folder: its first failing
        case as soon as it is found, then the test's whole report as pytest gives it when the
        test ends. pytest prints it only when the session ends, so a run stopped after a failure
        (a CI timeout, often while Hypothesis shrinks) would lose it, and a failure that is no
        case's verdict (an exception, a Hypothesis error) saves no case to replay."""
        if self.failures_dir is None:
            return None
        reports = self.failures_dir / "reports"
        reports.mkdir(parents=True, exist_ok=True)
        return write_atomic(reports / f"{name}.txt", lambda tmp: Path(tmp).write_text(text), durable=False)


_HARNESS: Harness | None = None


def harness() -> Harness:
    """The configured harness; outside pytest, one with the defaults."""
    global _HARNESS
    if _HARNESS is None:
        _HARNESS = _build(None, None, DEFAULT_REPEATS, None, None, None, DEFAULT_FAILURES_DIR, DEFAULT_PROCESSES)
    return _HARNESS


def _in_hypothesis() -> bool:
    """Is this call inside a Hypothesis test case (not a plain call, as the at-scale probe's)?"""
    try:
        from hypothesis.control import current_build_context

        current_build_context()
        return True
    except Exception:  # noqa: BLE001 - no build context: a plain call
        return False


def _is_final_example() -> bool:
    """Is Hypothesis replaying the example it will report (not shrinking)? True outside Hypothesis."""
    try:
        from hypothesis.control import current_build_context

        return bool(getattr(current_build_context(), "is_final", True))
    except Exception:  # noqa: BLE001 - no build context: a plain call
        return True


# ---------------------------------------------------------------------------
# Regression cases and the test decorator
# ---------------------------------------------------------------------------


def load_case_text(text: str) -> tuple:
    """JSON of a Case, or of a failure record ({"case": ..., "property": ...}) -> (Case, property or None)."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    if "case" in data:
        return Case.from_dict(data["case"]), data.get("property")
    return Case.from_dict(data), None


def regression_name(prop: str | None, case: Case) -> str:
    """The file name of a saved case: its property (or "all") and a hash of both."""
    key = f"{prop}\n{case.to_json()}" if prop else case.to_json()
    return f"{prop or 'all'}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def regression_cases(name: str, directory: Path = REGRESSIONS_DIR) -> list:
    """The saved cases of one property (a record without a property applies to all), in file order."""
    found = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            case, prop = load_case_text(path.read_text())
        except (ValueError, TypeError) as err:
            raise ValueError(f"regression case {path}: {err}") from None
        if prop in (None, name):
            found.append(case)
    return found


def _in_space_widths(case: Case, space) -> Case:
    """A saved case at the widths the target builds: a CPU-width regression
    replayed on a GPU backend (or on a domain of other widths) keeps its shape
    and indices at the first width there (576/512)."""
    choices = space.width_choices()
    if (space.widths == "production" or space.domain.widths) and (case.d_k, case.d_v) not in choices:
        return case.replace(d_k=choices[0][0], d_v=choices[0][1])
    return case


def explicit_cases(name: str, space: strategies.Space, directory: Path = REGRESSIONS_DIR) -> list:
    """The cases property ``name`` replays before generating any, in order: for determinism the
    collision case first; then the saved regressions inside the domain."""
    first = [strategies.collision_case(space)] if name == "determinism" else []
    saved = [_in_space_widths(c, space) for c in regression_cases(name, directory)]
    return first + [c for c in saved if strategies.in_domain(c, space.domain)]


def _case_strategy(name: str):
    h = harness()
    if h.replay is not None:
        return st.just(h.replay)
    return strategies.cases(h.space, collisions=name == "determinism")


def property_test(name: str):
    """Turn ``fn(case, mqa)`` into the Hypothesis test of property ``name``."""
    if name not in checks.PROPERTIES:
        raise ValueError(f"property_test: unknown property {name!r}")

    def decorate(fn):
        test = given(case=st.deferred(lambda: _case_strategy(name)))(fn)
        h = harness()
        if name in checks.SPAWNING:  # each example starts processes: a few of them (the profile's other settings kept)
            test = settings(max_examples=profiles.SPAWNING_EXAMPLES[h.profile])(test)
        if h.replay is None:
            # Explicit examples run before anything is generated, the last one
            # applied first: so these run in explicit_cases' order.
            for case in reversed(explicit_cases(name, h.space, h.regressions_dir)):
                test = example(case=case)(test)
        test._mqa_property = name
        return test

    return decorate


def at_scale_test(name: str):
    """Mark ``fn(mqa)`` as the production-shape probe of property ``name`` (its own line in the
    summary: '<name>_at_scale'); it calls ``mqa.check_at_scale(name)``."""
    if name not in checks.PROPERTIES:
        raise ValueError(f"at_scale_test: unknown property {name!r}")

    def decorate(fn):
        fn._mqa_property = f"{name}_at_scale"
        return fn

    return decorate


# ---------------------------------------------------------------------------
# pytest hooks
# ---------------------------------------------------------------------------


def pytest_addoption(parser):
    group = parser.getgroup("mqa-bwd properties")
    group.addoption("--impl", default=None, metavar="MODULE:FUNCTION",
                    help=f"implementation under test, any function with the SPEC signature (default: {OURS})")
    group.addoption("--backend", default=None, metavar="NAME",
                    help="passed as backend= to the implementation (default: its default_backend(), if it has one)")
    group.addoption("--repeats", type=int, default=DEFAULT_REPEATS, metavar="N",
                    help=f"determinism: calls per example, compared bitwise (default {DEFAULT_REPEATS})")
    group.addoption("--processes", type=int, default=DEFAULT_PROCESSES, metavar="N",
                    help=f"process_determinism: fresh processes per example (default {DEFAULT_PROCESSES})")
    group.addoption("--heads", default=None, metavar="LO-HI", help="restrict the head counts the strategies draw")
    group.addoption("--mqa-profile", default=None, metavar="NAME",
                    help=f"Hypothesis profile: {', '.join(profiles.PROFILES)} (else ${profiles.ENV_VAR}, else ci)")
    group.addoption("--replay", default=None, metavar="CASE",
                    help="run only this case: Case JSON, or a path to a case or failure file")
    group.addoption("--summary-json", default=None, metavar="PATH", help="write per-property verdicts as JSON")
    group.addoption("--failures-dir", default=None, metavar="DIR",
                    help=f"save failing cases here as JSON (default: {DEFAULT_FAILURES_DIR}/)")
    group.addoption("--mqa-domain", default=None, metavar="TEXT",
                    help="what the implementation supports, e.g. heads=2-128,topk_multiple=64,sink=required: "
                         "these fields replace those its domain attribute declares ('spec': all of SPEC)")
    group.addoption("--mqa-buckets", action="store_true", default=False,
                    help="draw shapes from a small fixed set of buckets (a JIT kernel compiles once per bucket); "
                         "values, indices and sinks still vary")
    group.addoption("--mqa-minutes-per-property", type=float, default=None, metavar="M",
                    help="end each property after M minutes without a failure (it passes, saying how many cases)")
    group.addoption("--mqa-known-failures", default=None, metavar="FILE",
                    help="known-failure ledger (TOML or JSON): covered failures are xfail, an unexpected pass fails")
    group.addoption("--mqa-no-outside-probe", action="store_true", default=False,
                    help="do not probe the implementation just outside its domain at the end of the run")


def _paddle_can_reach(device: str) -> bool:
    if importlib.util.find_spec("paddle") is None:
        return False
    if device == "cpu":
        return True
    try:
        import paddle

        return bool(paddle.is_compiled_with_cuda())
    except Exception:  # noqa: BLE001 - a broken paddle install is "no paddle"
        return False


def _build(impl, backend, repeats, heads, profile, replay, failures_dir, processes=DEFAULT_PROCESSES, *, domain=None,
           buckets=False, minutes_per_property=None, known_failures=None, outside_probe=True) -> Harness:
    target = Target.load(impl, backend, domain)
    space = strategies.Space(
        heads=strategies.parse_heads(heads) if heads else (1, strategies.MAX_HEADS),
        widths="production" if target.needs_gpu else "small",
        frameworks=("torch", "paddle") if _paddle_can_reach(target.device) else ("torch",),
        domain=target.domain,
    )
    if buckets:
        space = dataclasses.replace(space, buckets=strategies.default_buckets(space))
    if minutes_per_property is not None and not minutes_per_property > 0:
        raise ValueError(f"--mqa-minutes-per-property: expected a positive number, got {minutes_per_property}")
    entries = ledger.load(known_failures) if known_failures else ()
    return Harness(target=target, options=checks.Options(repeats=repeats, processes=processes), space=space,
                   profile=profile or "ci", replay=replay, failures_dir=failures_dir,
                   minutes_per_property=minutes_per_property, known_failures=entries,
                   known_failures_path=Path(known_failures) if known_failures else None, outside_probe=outside_probe)


def _replay_option(value: str) -> Case:
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value)
        if not path.is_file():
            raise pytest.UsageError(f"--replay: {value!r} is neither Case JSON nor a file")
        text = path.read_text()
    try:
        return load_case_text(text)[0]
    except (ValueError, TypeError) as err:
        raise pytest.UsageError(f"--replay: not a case: {err}") from None


def _one_thread_per_worker(config) -> None:
    """In a pytest-xdist worker, run torch's CPU kernels on one thread.

    Each worker already has a core; torch's default OpenMP pool (one thread
    per core) makes the workers spin-wait against each other, which measured
    10x slower on this suite's CPU model at -n 2. Children a worker starts
    (command-line tests) inherit the setting through OMP_NUM_THREADS.
    """
    if not hasattr(config, "workerinput"):
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    except (ImportError, ValueError):
        pass


def pytest_configure(config):
    global _HARNESS
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    _one_thread_per_worker(config)
    opt = config.option
    replay = _replay_option(opt.replay) if opt.replay else None
    try:
        profile = profiles.chosen(opt.mqa_profile or ("repro" if replay is not None and not os.environ.get(profiles.ENV_VAR) else None))
        if opt.repeats < 2:
            raise ValueError(f"--repeats: need at least 2 calls to compare, got {opt.repeats}")
        if opt.processes < 1:
            raise ValueError(f"--processes: need at least 1 fresh process, got {opt.processes}")
        failures_dir = (Path(opt.failures_dir) if opt.failures_dir else DEFAULT_FAILURES_DIR).resolve()
        _HARNESS = _build(opt.impl, opt.backend, opt.repeats, opt.heads, profile, replay, failures_dir,
                          opt.processes, domain=opt.mqa_domain, buckets=opt.mqa_buckets,
                          minutes_per_property=opt.mqa_minutes_per_property, known_failures=opt.mqa_known_failures,
                          outside_probe=not opt.mqa_no_outside_probe)
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    profiles.load(profile)
    config._mqa_summary = {}  # property -> {"outcomes": [...], "cases": n, "seconds": t, ...}
    config._mqa_outside = None  # the outside-domain findings, once probed


def pytest_report_header(config):
    h = harness()
    lines = [f"mqa-bwd properties: impl {h.target.spec}, backend {h.target.backend} on {h.target.device}, "
             f"profile {h.profile}, repeats {h.options.repeats}, heads {h.space.heads[0]}-{h.space.heads[1]}, "
             f"widths {h.space.widths}, frameworks {'/'.join(h.space.frameworks)}"
             + (", replaying one case" if h.replay is not None else "")]
    lines.append(f"mqa-bwd domain: {h.target.domain} ({h.target.domain_source})")
    if h.space.buckets:
        lines.append("mqa-bwd buckets (B,S,S_kv,H,L,Dk,Dv): " + " ".join(",".join(map(str, b)) for b in h.space.buckets))
    if h.minutes_per_property is not None:
        lines.append(f"mqa-bwd time budget: {h.minutes_per_property:g} min per property")
    if h.known_failures_path is not None:
        mine = [e for e in h.known_failures if e.impl == h.target.name]
        lines.append(f"mqa-bwd known failures: {h.known_failures_path} ({len(mine)} of {len(h.known_failures)} "
                     f"entries for {h.target.name})")
    return lines


def pytest_collection_modifyitems(config, items):
    h = harness()
    why_not = h.target.unavailable()
    for item in items:
        if getattr(getattr(item, "obj", None), "_mqa_property", None) is None:
            continue
        if h.target.needs_gpu:
            item.add_marker(pytest.mark.gpu)
        if why_not:
            item.add_marker(pytest.mark.skip(reason=why_not))


@pytest.fixture(scope="session")
def mqa():
    """The harness: ``mqa.check(property, case)``."""
    return harness()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    h = harness()
    h.current_item = item
    h.started[item.nodeid] = time.time()
    # Count a property test's cases from Hypothesis' observations (properties.observed): the harness
    # cannot tell a new input from a rerun that shrinks a failure, but the phase each names can.
    counting = observed.watching(h.observe) if "mqa" in getattr(item, "fixturenames", ()) \
        else contextlib.nullcontext(False)
    try:
        with counting as h.counts_observed:
            yield
    finally:
        h.current_item = None
        h.counts_observed = False


def _settle(report, item, h: Harness) -> None:
    """The call report as the harness decided it: a test it ended for its time budget passed; one
    whose failures the ledger covers is xfail; a ledger entry whose property held is a failure."""
    nodeid = item.nodeid
    stopped = h.stopped.pop(nodeid, None)
    if stopped is not None and report.skipped:
        report.outcome, report.longrepr = "passed", None
        if stopped != ledger.KNOWN_FAILURE:
            report.user_properties.append(("mqa_budget", stopped))
    tally = h.tallies.pop(nodeid, None)
    if tally is not None and report.passed:
        if tally.expected:
            report.outcome = "skipped"
            report.wasxfail = tally.xfail_reason()
            report.longrepr = (str(item.path), item.location[1] or 0, report.wasxfail)
            report.user_properties.append(("mqa_known_failure", json.dumps(tally.known_failure())))
        elif tally.held and tally.strict:
            report.outcome, report.longrepr = "failed", tally.xpass_message()
            report.user_properties.append(("mqa_note", tally.xpass_message()))
        elif tally.held:
            report.user_properties.append(("mqa_note", "known failure not seen (strict = false): held on all "
                                                       f"{tally.held} case(s) the entry covers"))
        else:
            report.user_properties.append(("mqa_note", "known-failure entry not exercised: no case drawn was "
                                                       "inside its filter"))
    headline = h.headlines.pop(nodeid, None)
    if headline and report.failed:
        report.user_properties.append(("mqa_note", headline))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    name = getattr(getattr(item, "obj", None), "_mqa_property", None)
    if name is None:
        return
    h = harness()
    report.user_properties.append(("mqa_property", name))
    if call.when != "call":
        return
    report.user_properties.append(("mqa_cases", h.cases_run.get(item.nodeid, 0)))
    report.user_properties.append(("mqa_findings", json.dumps(h.findings_run.pop(item.nodeid, {}))))
    _settle(report, item, h)
    for prop, case, text in h.failures.pop(item.nodeid, []):
        if report.failed:
            path = h.save_failure(prop, case, text)
            if path is not None:
                report.sections.append(("mqa-bwd failing case saved", f"{path}\n"))
    if report.failed:
        path = h.save_report(name, report.longreprtext)
        if path is not None:
            report.sections.append(("mqa-bwd failure report saved", f"{path}\n"))


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    config = _CONFIG_FOR_REPORTS
    if config is None or _is_worker(config):
        return
    props = dict(report.user_properties)
    name = props.get("mqa_property")
    if name is None:
        return
    entry = config._mqa_summary.setdefault(name, {"outcomes": [], "cases": 0, "seconds": 0.0, "xfail": None,
                                                  "findings": {}, "notes": [], "budget": None})
    entry["seconds"] += float(report.duration or 0.0)
    entry["cases"] += int(props.get("mqa_cases", 0))
    add_finding_counts(entry["findings"], json.loads(props.get("mqa_findings", "{}")))
    if props.get("mqa_note") and props["mqa_note"] not in entry["notes"]:
        entry["notes"].append(props["mqa_note"])
    if props.get("mqa_budget"):
        entry["budget"] = props["mqa_budget"]
    if hasattr(report, "wasxfail") and report.skipped:
        entry["outcomes"].append("xfail")  # does not hold, as the ledger says: not a failure of the run
        known = props.get("mqa_known_failure")  # absent only for an xfail of pytest's own, not the ledger's
        entry["xfail"] = json.loads(known) if known else {"reason": report.wasxfail}
    elif report.failed:
        entry["outcomes"].append("fail")
    elif report.skipped:
        entry["outcomes"].append("skip")
        if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:  # (path, line, "Skipped: why")
            entry["skip_reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.when == "call":
        entry["outcomes"].append("pass")


def add_finding_counts(total: dict, counts: dict, key=None) -> dict:
    """Add ``counts`` ({sub-check: {"held": n, "failed": m}}, the summary's ``findings``) into
    ``total``, under ``key(sub-check)`` where given (to count several sub-checks as one)."""
    for finding, states in counts.items():
        into = total.setdefault(key(finding) if key else finding, {"held": 0, "failed": 0})
        for state in into:
            into[state] += states.get(state, 0)
    return total


_CONFIG_FOR_REPORTS = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    global _CONFIG_FOR_REPORTS
    _CONFIG_FOR_REPORTS = session.config
    session.config._mqa_started = time.time()


def summary(config) -> dict:
    """What ``mqa-bwd check`` reads: per property a verdict (pass, fail, xfail: a known failure,
    skip, with its skip_reason, stopped: an interrupt came while its test ran), cases, seconds and
    notes; the domain, and what was found just outside it."""
    h = harness()
    properties = {}
    for name, entry in sorted(config._mqa_summary.items()):
        outcomes = entry["outcomes"]
        # A test that was set up and never reported its call: an interrupt (a signal) stopped it.
        verdict = next((v for v in ("fail", "xfail", "pass", "skip") if v in outcomes), "stopped")
        properties[name] = {"verdict": verdict, "cases": entry["cases"], "seconds": round(entry["seconds"], 3),
                            "findings": entry["findings"]}
        if entry["xfail"]:
            properties[name]["known_failure"] = entry["xfail"]
        if entry.get("notes"):
            properties[name]["notes"] = entry["notes"]
        if entry.get("budget"):
            properties[name]["budget"] = entry["budget"]
        if verdict == "skip" and entry.get("skip_reason"):
            properties[name]["skip_reason"] = entry["skip_reason"]
    result = {"properties": properties, "backend": h.target.backend, "impl": h.target.spec, "profile": h.profile,
              "repeats": h.options.repeats,
              "domain": {"text": h.target.domain.to_text(), "source": h.target.domain_source}}
    if h.space.buckets:
        result["buckets"] = [dict(zip(strategies.BUCKET_FIELDS, b)) for b in h.space.buckets]
    if h.minutes_per_property is not None:
        result["minutes_per_property"] = h.minutes_per_property
    if h.known_failures_path is not None:
        result["known_failures"] = str(h.known_failures_path)
    outside = getattr(config, "_mqa_outside", None)
    if outside is not None:
        result["outside_domain"] = [f.as_dict() for f in outside]
    return result


def _probe_outside(config) -> None:
    """Probe just outside the domain, once per run (the controller's job under xdist)."""
    h = harness()
    if (h.replay is not None or not h.outside_probe or h.target.domain.is_spec or not config._mqa_summary
            or h.target.unavailable()):
        return
    from . import outside

    config._mqa_outside = outside.probe_outside(h.target, h.space)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if _is_worker(config) or not hasattr(config, "_mqa_summary"):
        return
    _probe_outside(config)
    if not config.option.summary_json:
        return
    path = Path(config.option.summary_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary(config), indent=1, sort_keys=True) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    findings = getattr(config, "_mqa_outside", None)
    if not findings:
        return
    h = harness()
    terminalreporter.write_sep("=", f"mqa-bwd: just outside the domain {h.target.domain} ({h.target.domain_source})")
    for f in findings:
        terminalreporter.write_line(("ok    " if f.right else "NOTE  ") + f.line())
