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
  --failures-dir DIR       where failing cases are saved (default .mqa-failures/ in the working directory)

A property test is written as::

    @property_test("agreement")
    def test_property_agreement(case, mqa):
        mqa.check("agreement", case)

``property_test`` draws cases with the strategies (or takes the --replay
case) and replays the saved regression cases first, as explicit examples.
``mqa.check`` runs the property; on failure it raises with the report and a
REPRO line (one command replaying exactly that case and property), and the
plugin saves the case as JSON in the failures folder.
"""

import collections
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

from mqa_bwd.files import write_json_atomic

from . import checks, profiles, strategies
from .case import Case
from .target import OURS, Target

#: The replayed regressions: shipped with the suite, replayed first on every run.
#: A failing case lands in the failures folder; ``mqa-bwd promote FILE`` moves it here.
REGRESSIONS_DIR = Path(__file__).resolve().parent / "regressions"
#: Where failing cases go unless --failures-dir says otherwise (relative to the working directory).
DEFAULT_FAILURES_DIR = Path(".mqa-failures")
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
                 regressions_dir: Path = REGRESSIONS_DIR):
        self.target, self.options, self.space, self.profile = target, options, space, profile
        self.replay, self.failures_dir, self.regressions_dir = replay, failures_dir, regressions_dir
        self.current_item = None
        self.cases_run = collections.Counter()  # nodeid -> examples run
        #: nodeid -> {finding: Counter(held=n, failed=m)}: each example's sub-checks (Verdict.findings)
        self.findings_run = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
        self.failures = {}  # nodeid -> [(property, case, report)] of the examples Hypothesis reports

    def __repr__(self) -> str:  # Hypothesis prints the test's arguments: keep the fixture's line short
        return f"<mqa harness: {self.target.spec} backend={self.target.backend} profile={self.profile}>"

    def check(self, name: str, case: Case) -> None:
        __tracebackhide__ = True  # the report is the message; the harness's frames are noise
        nodeid = self.current_item.nodeid if self.current_item is not None else name
        self.cases_run[nodeid] += 1
        verdict = checks.run_property(name, self.target, case, self.options)
        for finding, held in verdict.findings.items():
            if held is not None:
                self.findings_run[nodeid][finding]["held" if held else "failed"] += 1
        if verdict.ok:
            return
        report = (f"property {name} FAILS for {self.target.spec} (backend {self.target.backend})\n"
                  f"case: {checks.describe_case(case)}\n{verdict.report}")
        if _is_final_example():
            self.failures.setdefault(nodeid, []).append((name, case, report))
        raise PropertyFailure(f"{report}\nREPRO: {self.repro_command(name, case)}")

    def repro_command(self, name: str, case: Case) -> str:
        words = ["python", "-m", "pytest", "-p", "no:xdist", "--pyargs", f"{SUITE_MODULE}::test_property_{name}",
                 "--replay", case.to_json(), "--backend", str(self.target.backend)]
        if self.target.spec != OURS:
            words += ["--impl", self.target.spec]
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
        return write_json_atomic(path, record)  # a reader never sees half a file


_HARNESS: Harness | None = None


def harness() -> Harness:
    """The configured harness; outside pytest, one with the defaults."""
    global _HARNESS
    if _HARNESS is None:
        _HARNESS = _build(None, None, DEFAULT_REPEATS, None, None, None, DEFAULT_FAILURES_DIR, DEFAULT_PROCESSES)
    return _HARNESS


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
    replayed on a GPU backend keeps its shape and indices at 576/512."""
    if space.widths == "production" and (case.d_k, case.d_v) not in strategies.PRODUCTION_WIDTHS:
        return case.replace(d_k=strategies.PRODUCTION_WIDTHS[0][0], d_v=strategies.PRODUCTION_WIDTHS[0][1])
    return case


def _case_strategy():
    h = harness()
    if h.replay is not None:
        return st.just(h.replay)
    return strategies.cases(h.space)


def property_test(name: str):
    """Turn ``fn(case, mqa)`` into the Hypothesis test of property ``name``."""
    if name not in checks.PROPERTIES:
        raise ValueError(f"property_test: unknown property {name!r}")

    def decorate(fn):
        test = given(case=st.deferred(_case_strategy))(fn)
        h = harness()
        if name in checks.SPAWNING:  # seconds an example: a few of them (the profile's other settings kept)
            test = settings(max_examples=profiles.SPAWNING_EXAMPLES[h.profile])(test)
        if h.replay is None:
            # Explicit examples run before anything is generated: the saved
            # regressions are always replayed first.
            for case in reversed(regression_cases(name, h.regressions_dir)):
                test = example(case=_in_space_widths(case, h.space))(test)
        test._mqa_property = name
        return test

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


def _build(impl, backend, repeats, heads, profile, replay, failures_dir, processes=DEFAULT_PROCESSES) -> Harness:
    target = Target.load(impl, backend)
    space = strategies.Space(
        heads=strategies.parse_heads(heads) if heads else (1, strategies.MAX_HEADS),
        widths="production" if target.needs_gpu else "small",
        frameworks=("torch", "paddle") if _paddle_can_reach(target.device) else ("torch",),
    )
    return Harness(target=target, options=checks.Options(repeats=repeats, processes=processes), space=space,
                   profile=profile or "ci",
                   replay=replay, failures_dir=failures_dir)


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
        _HARNESS = _build(opt.impl, opt.backend, opt.repeats, opt.heads, profile, replay, failures_dir, opt.processes)
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    profiles.load(profile)
    config._mqa_summary = {}  # property -> {"outcomes": [...], "cases": n, "seconds": t}


def pytest_report_header(config):
    h = harness()
    return [f"mqa-bwd properties: impl {h.target.spec}, backend {h.target.backend} on {h.target.device}, "
            f"profile {h.profile}, repeats {h.options.repeats}, heads {h.space.heads[0]}-{h.space.heads[1]}, "
            f"widths {h.space.widths}, frameworks {'/'.join(h.space.frameworks)}"
            + (", replaying one case" if h.replay is not None else "")]


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
    try:
        yield
    finally:
        h.current_item = None


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
    for prop, case, text in h.failures.pop(item.nodeid, []):
        if report.failed:
            path = h.save_failure(prop, case, text)
            if path is not None:
                report.sections.append(("mqa-bwd failing case saved", f"{path}\n"))


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
                                                  "findings": {}})
    entry["seconds"] += float(report.duration or 0.0)
    entry["cases"] += int(props.get("mqa_cases", 0))
    for finding, counts in json.loads(props.get("mqa_findings", "{}")).items():
        total = entry["findings"].setdefault(finding, {"held": 0, "failed": 0})
        for state, n in counts.items():
            total[state] += n
    if hasattr(report, "wasxfail"):
        entry["outcomes"].append("fail")  # a known failure is still a property that does not hold
        entry["xfail"] = report.wasxfail
    elif report.failed:
        entry["outcomes"].append("fail")
    elif report.skipped:
        entry["outcomes"].append("skip")
    elif report.when == "call":
        entry["outcomes"].append("pass")


_CONFIG_FOR_REPORTS = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    global _CONFIG_FOR_REPORTS
    _CONFIG_FOR_REPORTS = session.config
    session.config._mqa_started = time.time()


def summary(config) -> dict:
    h = harness()
    properties = {}
    for name, entry in sorted(config._mqa_summary.items()):
        outcomes = entry["outcomes"]
        verdict = "fail" if "fail" in outcomes else "pass" if "pass" in outcomes else "skip"
        properties[name] = {"verdict": verdict, "cases": entry["cases"], "seconds": round(entry["seconds"], 3),
                            "findings": entry["findings"]}
        if entry["xfail"]:
            properties[name]["known_failure"] = entry["xfail"]
    return {"properties": properties, "backend": h.target.backend, "impl": h.target.spec, "profile": h.profile,
            "repeats": h.options.repeats}


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if _is_worker(config) or not config.option.summary_json:
        return
    path = Path(config.option.summary_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary(config), indent=1, sort_keys=True) + "\n")
