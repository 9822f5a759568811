"""Run the property suite through pytest, with live progress and crash-safe case records.

Two halves, one module, because both sides must agree on the files between them:

* The driver (``run_suite``, used by ``mqa-bwd check`` and ``mqa-bwd fuzz``)
  starts pytest in a child process group, with pytest-xdist when asked (one
  worker per GPU, pinned with ``CUDA_VISIBLE_DEVICES`` through xdist's
  ``--tx popen//env:...`` specs), reads the progress the workers write, and
  stops the run at its deadline.
* The pytest plugin (this module, loaded with ``-p mqa_bwd.fuzz``; inert unless
  the driver set ``MQA_PROGRESS_DIR``) counts Hypothesis test cases per
  property (through Hypothesis' observability callbacks) and writes a small
  progress file per process.

Crash safety (``fuzz``): the property suite calls ``guarded`` as its
implementation (``--impl mqa_bwd.fuzz:guarded``); ``guarded`` writes the call's
inputs as a capture (``mqa_bwd.capture``) *before* running the real target,
and deletes that record when the call returns. The risky part runs in an
xdist worker process: if it dies (an illegal memory access, an abort), its
record stays behind, and the driver renames it ``crash-*.safetensors``, a
file ``mqa-bwd repro`` replays. A CUDA fault that surfaces as a Python
exception leaves the device context unusable, so ``guarded`` keeps the record
and ends the worker; xdist starts a fresh one on the same GPU.

Time budget (``fuzz --minutes``): each worker gives each property an equal
share of the time left; when a property's share is used up (after at least
one case) with no failure seen, ``guarded`` ends that test with a skip whose
reason says so (a skip is the one exception Hypothesis passes through without
shrinking). A property that has failed keeps running until Hypothesis has
shrunk the failure. (``check --minutes-per-property`` is a fixed budget per
property instead, kept by the suite's own plugin: properties/plugin.py.)
"""

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .contract import SPEC_ARGS as _SPEC_ARGS
from .files import write_json_atomic as _write_json_atomic

ENV_PROGRESS = "MQA_PROGRESS_DIR"  # where each process writes its progress file
ENV_DEADLINE = "MQA_FUZZ_DEADLINE"  # epoch seconds: the end of the time budget
ENV_TARGET = "MQA_FUZZ_TARGET"  # what guarded() runs: a backend name or module:function
ENV_RECORDS = "MQA_FUZZ_RECORDS"  # where guarded() writes its in-flight records

GUARD = "mqa_bwd.fuzz:guarded"
PROPERTY_PREFIX = "test_property_"
WRITE_INTERVAL_S = 0.5


def property_name(nodeid: str) -> str:
    """'properties/test_properties.py::test_property_oracle[x]' -> 'oracle[x]'."""
    name = nodeid.split("::")[-1]
    return name[len(PROPERTY_PREFIX):] if name.startswith(PROPERTY_PREFIX) else name


# ===========================================================================
# Worker side: the pytest plugin
# ===========================================================================


class _Progress:
    """One process's view: cases per test, outcomes, and its time slices."""

    def __init__(self, directory: Path, worker: str, deadline: float | None, workers: int):
        self.directory, self.worker, self.deadline, self.workers = directory, worker, deadline, workers
        self.path = directory / f"{worker}-{os.getpid()}.json"
        self.tests = {}
        self.current = None
        self.items = 0
        self.started = 0
        self.slice_end = None
        self.failure_seen = False
        self.last_write = 0.0

    def record(self, nodeid: str) -> dict:
        return self.tests.setdefault(nodeid, {"cases": 0, "failed_cases": 0, "shrink_steps": 0, "gave_up": 0,
                                              "outcome": None, "reason": "", "seconds": 0.0})

    def begin(self, nodeid: str) -> None:
        self.current, self.failure_seen = nodeid, False
        self.record(nodeid)["started"] = time.time()
        if self.deadline is not None:
            share = max(1, math.ceil(self.items / max(1, self.workers)))
            left = max(1, share - self.started)
            now = time.time()
            self.slice_end = now + max(0.0, self.deadline - now) / left
        self.started += 1
        self.write(force=True)

    def end(self) -> None:
        self.current = None
        self.slice_end = None
        self.write(force=True)

    def observe(self, observation) -> None:
        from properties.observed import test_case_kind

        seen = test_case_kind(observation)
        if seen is None or self.current is None:
            return
        kind, failed = seen
        rec = self.record(self.current)
        rec[{"gave_up": "gave_up", "case": "cases", "shrink": "shrink_steps"}[kind]] += 1
        if failed:
            rec["failed_cases"] += 1
            self.failure_seen = True
        self.write()

    def outcome(self, report) -> None:
        rec = self.record(report.nodeid)
        crashed = report.failed and "crashed while running" in str(report.longrepr or "")
        if report.when == "call" or report.failed or report.skipped:
            if rec["outcome"] in (None, "passed") or crashed:
                rec["outcome"] = "crashed" if crashed else report.outcome
            rec["seconds"] += float(getattr(report, "duration", 0.0) or 0.0)
            cases = dict(report.user_properties).get("mqa_cases")
            if report.when == "call" and isinstance(cases, int) and self.worker != "controller":
                # The suite's own count, which its summary and check's table show: the same rule
                # (properties.observed), plus a property's calls outside Hypothesis (at scale).
                rec["cases"] = cases
            if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
                rec["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
        self.write(force=True)

    def slice_over(self) -> bool:
        """Time to end the current property: its share is used, it has run a case, and nothing failed."""
        if self.slice_end is None or self.current is None or self.failure_seen:
            return False
        return time.time() >= self.slice_end and self.record(self.current)["cases"] > 0

    def write(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self.last_write < WRITE_INTERVAL_S:
            return
        self.last_write = now
        _write_json_atomic(self.path, {"worker": self.worker, "pid": os.getpid(), "current": self.current,
                                       "tests": self.tests, "updated": now})


_PROGRESS: _Progress | None = None
_WATCHING = contextlib.ExitStack()  # the progress's observation callback, while pytest runs


def pytest_configure(config):
    global _PROGRESS
    directory = os.environ.get(ENV_PROGRESS)
    if not directory:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER") or ("controller" if _is_xdist_controller(config) else "main")
    deadline = os.environ.get(ENV_DEADLINE)
    _PROGRESS = _Progress(Path(directory), worker, float(deadline) if deadline else None,
                          int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    if worker != "controller":
        from properties.observed import watching

        # For the worker's whole run (it runs only the suite); without observability (old
        # Hypothesis) no live case counts.
        _WATCHING.enter_context(watching(_PROGRESS.observe))
    _PROGRESS.write(force=True)


def pytest_unconfigure(config):
    _WATCHING.close()


def _is_xdist_controller(config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "tx", None) or getattr(config.option, "numprocesses", None))


def pytest_collection_finish(session):
    if _PROGRESS is not None:  # after -k and --deselect: the tests this process may run
        _PROGRESS.items = len(session.items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _PROGRESS is None or _PROGRESS.worker == "controller":
        return (yield)
    _PROGRESS.begin(item.nodeid)
    try:
        return (yield)
    finally:
        _PROGRESS.end()


def pytest_runtest_logreport(report):
    if _PROGRESS is not None:
        _PROGRESS.outcome(report)


# ===========================================================================
# Worker side: the crash-recording implementation
# ===========================================================================


_FATAL_DEVICE_ERRORS = ("illegal memory access", "unspecified launch failure", "misaligned address",
                        "an illegal instruction", "CUDA error: device-side assert", "hardware exception")
_target_cache = {}
_calls = [0]


def _target():
    spec = os.environ.get(ENV_TARGET) or None
    if spec not in _target_cache:
        import functools

        from .repro import import_function
        from .wrapper import mqa_latent_sparse_bwd

        if spec is None:
            _target_cache[spec] = mqa_latent_sparse_bwd
        elif ":" in spec:
            _target_cache[spec] = import_function(spec, ENV_TARGET)
        else:  # a backend name: the call's own backend= (if the suite passes one) still wins
            _target_cache[spec] = functools.partial(mqa_latent_sparse_bwd, backend=spec)
    return _target_cache[spec]


def _describe(value):
    shape = getattr(value, "shape", None)
    return {"type": type(value).__name__, "shape": None if shape is None else [int(n) for n in shape],
            "dtype": str(getattr(value, "dtype", "")), "repr": repr(value)[:200] if shape is None else None}


def _record_call(args, kwargs):
    """Write this call's inputs before it runs; return the record's path (None outside a fuzz run)."""
    directory = os.environ.get(ENV_RECORDS)
    if not directory:
        return None
    from . import capture

    _calls[0] += 1
    named = dict(zip(_SPEC_ARGS, args))
    named.update({k: v for k, v in kwargs.items() if k in _SPEC_ARGS})
    options = {k: v for k, v in kwargs.items() if k not in _SPEC_ARGS and k != "instruments"}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    target = os.environ.get(ENV_TARGET)
    meta = {"property": _PROGRESS.current if _PROGRESS else None, "worker": worker, "pid": os.getpid(),
            "call": _calls[0], "record": capture.CALL_RECORD}
    if target:  # named as failure files name it, so that repro replays on what crashed
        meta["impl" if ":" in target else "backend"] = target
    for key, value in options.items():
        meta[key] = value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
    stem = Path(directory) / f"inflight-{worker}-{os.getpid()}"
    try:
        return capture.write(stem.with_suffix(".safetensors"), named, meta, durable=False, check=False)
    except Exception as e:  # not even tensors: keep a description, which is still evidence of what crashed
        meta["unrecordable"] = f"{type(e).__name__}: {e}"
        meta["arguments"] = {k: _describe(v) for k, v in named.items()}
        path = stem.with_suffix(".json")
        _write_json_atomic(path, meta)
        return path


def _is_fatal_device_error(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in _FATAL_DEVICE_ERRORS)


def _synchronize(result) -> None:
    """Let an asynchronous device fault surface inside the call that caused it."""
    if not isinstance(result, (tuple, list)):
        return
    for t in result:
        device = getattr(t, "device", None)
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch

            torch.cuda.synchronize(device)
            return


def guarded(*args, **kwargs):
    """The SPEC call, run on the fuzz target with its inputs recorded first (see the module doc)."""
    if _PROGRESS is not None and _PROGRESS.slice_over():
        cases = _PROGRESS.record(_PROGRESS.current)["cases"]
        pytest.skip(f"fuzz time slice used up after {cases} cases with no failure")
    record = _record_call(args, kwargs)
    try:
        result = _target()(*args, **kwargs)
        _synchronize(result)
    except BaseException as error:
        if record is not None and _is_fatal_device_error(error):
            crash = record.with_name(record.name.replace("inflight-", "crash-", 1))
            os.replace(record, crash)
            sys.stderr.write(f"\nmqa-bwd fuzz: fatal device error, inputs saved as {crash}; ending this worker "
                             f"so that the next one starts with a clean device context\n{error}\n")
            sys.stderr.flush()
            os._exit(70)
        if record is not None:
            record.unlink(missing_ok=True)
        raise
    if record is not None:
        record.unlink(missing_ok=True)
    return result


def _target_takes_instruments() -> bool:
    from properties.target import takes_instruments

    return takes_instruments(_target())


def _target_domain():
    from properties.target import declared_domain

    return declared_domain(_target(), ENV_TARGET)


def _target_spec() -> str:
    from .contract import OURS

    spec = os.environ.get(ENV_TARGET) or ""
    return spec if ":" in spec else OURS


#: guarded forwards instruments= exactly when the function it runs takes them, declares the domain
#: that function declares, and names it (for the known-failure ledger and the outside-domain probe).
guarded.takes_instruments = _target_takes_instruments
guarded.domain = _target_domain
guarded.tested_spec = _target_spec


# ===========================================================================
# Driver side
# ===========================================================================


def is_known_failure(progress) -> bool:
    """Did the suite report this test as a failure the known-failure ledger covers?"""
    from properties.ledger import KNOWN_FAILURE

    return progress.outcome == "skipped" and progress.reason.startswith(KNOWN_FAILURE)


@dataclasses.dataclass
class TestProgress:
    nodeid: str
    cases: int = 0
    failed_cases: int = 0
    shrink_steps: int = 0
    outcome: str | None = None  # passed / failed / skipped / crashed; None while running or never started
    reason: str = ""
    seconds: float = 0.0
    running: bool = False

    @property
    def name(self) -> str:
        return property_name(self.nodeid)


def read_progress(directory: Path) -> dict:
    """Merge every process's progress file: nodeid -> TestProgress."""
    merged = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        alive = _alive(data.get("pid"))
        for nodeid, rec in data.get("tests", {}).items():
            tp = merged.setdefault(nodeid, TestProgress(nodeid))
            tp.cases += rec.get("cases", 0)
            tp.failed_cases += rec.get("failed_cases", 0)
            tp.shrink_steps += rec.get("shrink_steps", 0)
            outcome = rec.get("outcome")
            # The controller's report of a crashed worker outranks everything; a failure outranks a pass.
            rank = {None: 0, "passed": 1, "skipped": 1, "failed": 2, "crashed": 3}
            if rank.get(outcome, 0) > rank.get(tp.outcome, 0) or (tp.outcome is None and outcome):
                tp.outcome = outcome
                tp.reason = rec.get("reason", "") or tp.reason
            tp.seconds = max(tp.seconds, rec.get("seconds", 0.0))
            if data.get("current") == nodeid:
                if alive:
                    tp.running = True
                    tp.seconds = max(tp.seconds, time.time() - rec.get("started", time.time()))
                elif tp.outcome is None:
                    tp.outcome = "crashed"
    return merged


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def harvest_records(directory: Path, *, final: bool, stalled: bool = False) -> list:
    """Rename in-flight records of dead processes to crash-* (or stalled-*); return the new paths."""
    found = []
    for path in sorted(Path(directory).glob("inflight-*")):
        if path.name.startswith(".") or path.suffix not in (".safetensors", ".json"):
            continue
        pid = path.stem.rsplit("-", 1)[-1]
        if not final and pid.isdigit() and _alive(int(pid)):
            continue
        # A record left after the driver had to stop pytest belongs to a call that did not return.
        prefix = "stalled-" if final and stalled else "crash-"
        target = path.with_name(path.name.replace("inflight-", prefix, 1))
        try:
            os.replace(path, target)
        except FileNotFoundError:  # the call returned just now and removed it
            continue
        found.append(target)
    return found


def count_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def worker_specs(workers: int, gpus: int) -> list:
    """xdist --tx specs: worker i pinned to GPU i mod gpus; no pinning without GPUs."""
    if gpus <= 0:
        return ["popen"] * workers
    return [f"popen//env:CUDA_VISIBLE_DEVICES={i % gpus}" for i in range(workers)]


@dataclasses.dataclass
class SuiteRun:
    command: list
    returncode: int | None
    log_path: Path
    progress: dict
    summary: dict | None
    interrupted: str | None  # why the driver stopped pytest, or None
    records: list  # crash-* / stalled-* paths written during the run
    seconds: float
    signalled: bool = False  # a SIGINT or SIGTERM stopped it, not its time budget


def build_pytest_command(tests, *, profile, summary_json, failures_dir=None, backend=None, impl=None, heads=None,
                         repeats=None, workers=1, gpus=0, xdist=False, seed=None, deselect=(), domain=None,
                         buckets=False, minutes_per_property=None, known_failures=None, outside_probe=True,
                         extra=()) -> list:
    cmd = [sys.executable, "-m", "pytest", str(tests), "-p", "mqa_bwd.fuzz", "-p", "no:cacheprovider",
           "-q", "--tb=short", "-rfEs", "--mqa-profile", profile, "--summary-json", str(summary_json)]
    if failures_dir is not None:  # else the suite's own regressions folder
        cmd += ["--failures-dir", str(failures_dir)]
    if backend:
        cmd += ["--backend", backend]
    if impl:
        cmd += ["--impl", impl]
    if heads:
        cmd += ["--heads", f"{heads[0]}-{heads[1]}"]
    if repeats:
        cmd += ["--repeats", str(repeats)]
    if domain is not None:
        cmd += ["--mqa-domain", domain]
    if buckets:
        cmd += ["--mqa-buckets"]
    if minutes_per_property is not None:
        cmd += ["--mqa-minutes-per-property", repr(float(minutes_per_property))]
    if known_failures is not None:
        cmd += ["--mqa-known-failures", str(known_failures)]
    if not outside_probe:
        cmd += ["--mqa-no-outside-probe"]
    if seed is not None:
        cmd += [f"--hypothesis-seed={seed}"]
    if xdist or workers > 1:
        cmd += ["--dist", "load", "--max-worker-restart", "1000"]
        for spec in worker_specs(workers, gpus):
            cmd += ["--tx", spec]
    else:
        cmd += ["-p", "no:xdist"]
    for nodeid in deselect:
        cmd += ["--deselect", nodeid]
    return cmd + list(extra)


def run_suite(command, *, cwd, progress_dir: Path, records_dir: Path | None, log_path: Path, summary_json: Path,
              env=None, deadline: float | None = None, grace_s: float = 60.0, on_update=None,
              poll_s: float = 0.5) -> SuiteRun:
    """Run one pytest command to its end (or its deadline + grace); report progress as it goes."""
    started = time.time()
    # A run started from inside a pytest-xdist worker (this project's own tests) must not inherit the
    # outer run's worker identity: xdist sets these afresh for the workers it starts.
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith("PYTEST_XDIST_") and k != "PYTEST_CURRENT_TEST"}
    environment.update(env or {})
    environment[ENV_PROGRESS] = str(progress_dir)
    # pytest runs in the suite's folder; the caller's folder stays importable (for --impl module:function).
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, (os.getcwd(), environment.get("PYTHONPATH"))))
    environment.setdefault("PYTHONUNBUFFERED", "1")
    if deadline is not None:
        environment[ENV_DEADLINE] = repr(deadline)
    records = []
    interrupted, signalled = None, False
    proc = None
    with open(log_path, "ab") as log, _signals_stop_the_run():
        try:
            log.write(("$ " + " ".join(map(str, command)) + "\n").encode())
            log.flush()
            proc = subprocess.Popen(command, cwd=cwd, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            while proc.poll() is None:
                time.sleep(poll_s)
                if records_dir is not None:
                    records += harvest_records(records_dir, final=False)
                if on_update is not None:
                    on_update(read_progress(progress_dir), records)
                if deadline is not None and time.time() > deadline + grace_s and interrupted is None:
                    interrupted = f"still running {grace_s:.0f} s after the time budget ended"
                    _stop(proc)
        except KeyboardInterrupt as stop:  # Stopped, or a Ctrl-C where no handler could be set
            interrupted, signalled = getattr(stop, "reason", "interrupted by the user"), True
        finally:
            if proc is not None and proc.poll() is None:
                _stop(proc)
    if records_dir is not None:
        records += harvest_records(records_dir, final=True, stalled=interrupted is not None)
    summary = None
    try:
        summary = json.loads(Path(summary_json).read_text())
    except (OSError, json.JSONDecodeError):
        pass
    progress = read_progress(progress_dir)
    if on_update is not None:
        on_update(progress, records)
    return SuiteRun(list(command), None if proc is None else proc.returncode, log_path, progress, summary, interrupted,
                    records, time.time() - started, signalled)


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while the suite ran (a KeyboardInterrupt, so that code which
    handles Ctrl-C handles both)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.reason = "interrupted by the user" if signum == signal.SIGINT else \
            f"stopped by {signal.Signals(signum).name}"


@contextlib.contextmanager
def _signals_stop_the_run():
    """While pytest runs: SIGINT and SIGTERM raise Stopped once, so that run_suite ends pytest's
    process group before this process ends. pytest runs in a session of its own (so that a
    terminal's Ctrl-C reaches only us, and we can stop it cleanly): nobody else signals it, and
    SIGTERM's default action (what 'timeout' sends) would leave it running, orphaned. Signals
    after the first are ignored, so that a second one cannot cut the clean-up short."""
    import threading

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    received = []

    def handler(signum, frame):
        if not received:
            received.append(signum)
            raise Stopped(signum)

    # A signal this process ignores (as a background job ignores SIGINT) stays ignored.
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _stop(proc, patience_s: float = 20.0) -> None:
    """SIGINT to the whole group (so a worker's call can clean up its record), then SIGKILL; and
    SIGKILL to what is left of the group once pytest itself has ended (a worker stuck in a long
    native call outlives its controller)."""
    for sig, wait in ((signal.SIGINT, patience_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def name_real_target(path: Path, target: str, ours: str = "mqa_bwd:mqa_latent_sparse_bwd") -> bool:
    """Make a failure file written during fuzzing name what was tested, not the recording wrapper.

    ``guarded`` is transparent (it records, then calls the target with the same
    arguments), so the file then says exactly what a direct run would have:
    impl is the target function (ours for a backend) and the REPRO line in the
    report replays on it. Returns whether the file was changed.
    """
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(record, dict) or record.get("impl") != GUARD:
        return False
    real = target if ":" in target else ours
    record["impl"] = real
    record["found_by"] = "mqa-bwd fuzz"
    if isinstance(record.get("report"), str):
        record["report"] = record["report"].replace(GUARD, real)
    _write_json_atomic(Path(path), record)
    return True


def failures_section(log_path: Path, limit_lines: int = 200, name_log: bool = True) -> str:
    """The FAILURES part of a pytest log (where the REPRO lines are), shortened; the note on what
    was cut names the log only with ``name_log`` (a log about to be deleted is no place to look)."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return ""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "= FAILURES =" in line or "= ERRORS =" in line), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if "short test summary info" in lines[i]), len(lines))
    section = lines[start:end]
    if len(section) > limit_lines:
        where = f"in {log_path}" if name_log else "not shown"
        section = section[:limit_lines] + [f"... ({len(section) - limit_lines} more lines {where})"]
    return "\n".join(section)


def log_tail(log_path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
