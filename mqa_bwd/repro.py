"""Replay one call of the backward: is it bitwise reproducible, and is it right?

The flow is one way: a source (a case JSON, a failure file, or a capture from
a training step) gives host inputs; they go to the implementation's framework
and device once; the implementation runs N times; each run's outputs are
compared as bytes with run 0's; run 0 is compared with the float64 oracle by
the tolerance rule of ``properties.compare``; a report comes out.

Per output the report gives: the bitwise verdict, how many distinct results
the N runs produced, the first run that differs from run 0 and the first
element where it does (both values), the largest absolute and ULP distance
from run 0 over all runs, and the error against the oracle. ``against``
replays the same tensors on a second implementation and adds how far the two
are apart, so that "which one drifts, and by how much" has an answer.
"""

import dataclasses
import json
from pathlib import Path

import numpy as np

from . import capture as capture_mod
from . import edge
from .contract import PEERS

from properties.target import OURS, OUTPUT_NAMES, SPEC_ARGS, backend_device  # noqa: F401 (re-exported)

#: The fuzzer's crash-recording wrapper: a failure file naming it means "the backend it wrapped".
FUZZ_GUARD = "mqa_bwd.fuzz:guarded"
#: Above this many multiply-adds the float64 oracle takes minutes on a CPU.
ORACLE_SLOW_MACS = 2e10


# ---------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # "case" or "capture"
    inputs: dict  # host inputs, the layout of Case.inputs()
    case: object = None  # properties.case.Case for case files
    recorded: dict = dataclasses.field(default_factory=dict)  # property, backend, impl, report, ...
    config: dict = dataclasses.field(default_factory=dict)  # the call's block_h / dkv_buf_bytes
    framework: str = "torch"  # what the tensors were handed over in
    #: A fuzz call record of a call that breaks SPEC (capture.Capture.structure_error): the
    #: replay expects the implementation to reject it with a ValueError.
    structure_error: str | None = None

    def describe(self) -> str:
        q = self.inputs["query"]
        B, S, H, d_k = q.shape
        L = self.inputs["token_indices"].shape[2]
        shape = (f"B={B} S={S} S_kv={self.inputs['kv'].shape[1]} H={H} L={L} Dk={d_k} "
                 f"Dv={self.inputs['out'].shape[3]} sink={'none' if self.inputs['attn_sink'] is None else 'yes'}")
        if self.case is not None:
            return f"case {self.case.to_json()} ({shape})"
        return f"capture ({shape})"


def _case_from_dict(path, data: dict):
    from properties.case import Case

    try:
        return Case(**data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"case file {path}: not a valid Case ({e})") from None


def load_source(path) -> Source:
    """A case JSON (bare Case dict or failure file) or a capture, by content."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise ValueError(f"source: cannot read {str(path)!r} ({e.strerror or e})") from None
    if head.lstrip()[:1] == b"{":
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"case file {path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"case file {path}: expected a JSON object")
        recorded = {}
        if "case" in data:  # the harness's failure-file format
            recorded = {k: v for k, v in data.items() if k != "case"}
            data = data["case"]
            if not isinstance(data, dict):
                raise ValueError(f"case file {path}: 'case' is not a JSON object")
        case = _case_from_dict(path, data)
        config = case.call_options() if hasattr(case, "call_options") else {}
        return Source(path=path, kind="case", inputs=case.inputs(), case=case, recorded=recorded, config=config,
                      framework=getattr(case, "framework", "torch"))
    cap = capture_mod.load(path)
    config = {k: cap.meta[k] for k in ("block_h", "dkv_buf_bytes") if cap.meta.get(k) is not None}
    return Source(path=path, kind="capture", inputs=cap.inputs, recorded=dict(cap.meta), config=config,
                  framework=cap.framework, structure_error=cap.structure_error)


# ---------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Implementation:
    label: str
    function: object
    device: str
    framework: str = "torch"
    kwargs: dict = dataclasses.field(default_factory=dict)
    spec: str = OURS  # how a fresh process imports it: "module:function"


def import_function(spec: str, option: str = "--impl"):
    """'package.module:function' -> the callable, imported from the Python path as given."""
    from properties.target import load_function

    return load_function(spec, option)


def resolve(impl=None, backend=None, *, option="--backend", device=None, framework="torch", block_h=None,
            dkv_buf_bytes=None) -> Implementation:
    """What to replay on: ``impl`` ('module:function', None for ours) called with ``backend=``.

    Ours without a backend gets the best one here. A backend this machine
    cannot run is a ValueError naming ``option``.
    """
    from . import backends
    from .wrapper import mqa_latent_sparse_bwd

    config = {k: v for k, v in (("block_h", block_h), ("dkv_buf_bytes", dkv_buf_bytes)) if v is not None}
    if framework not in ("torch", "paddle"):
        raise ValueError(f"--framework: expected 'torch' or 'paddle', got {framework!r}")
    if backend is not None and backend not in backends.BACKENDS:
        raise ValueError(f"{option}: expected one of {backends.BACKENDS}, got {backend!r}")
    if backend is not None and backend.startswith("tilelang") and not backends.hopper_available():
        raise ValueError(f"{option}: {backend!r} needs a Hopper GPU (sm_90) and tilelang; this machine has none "
                         "(the CPU tile model is 'model')")
    if impl in (None, OURS):
        backend = backend or backends.default_backend()
        wanted = backend_device(backend)
        if device is not None and device != wanted:
            raise ValueError(f"--device: backend {backend!r} runs on {wanted}, not {device!r}")
        return Implementation(f"backend {backend!r}", mqa_latent_sparse_bwd, wanted, framework,
                              dict(config, backend=backend), OURS)
    function = import_function(impl, "--impl" if option == "--backend" else option)
    peer_device = _peer_device(function, impl, "--impl" if option == "--backend" else option)
    if peer_device is not None:
        if backend is not None and option == "--backend":
            raise ValueError(f"--backend: {impl} takes no backend= (it is not one of ours), got {backend!r}")
        backend, device = None, device or peer_device
    if device is None:
        device = backend_device(backend)
    kwargs = dict(config, backend=backend) if backend is not None else config
    label = impl + (f" (backend {backend!r})" if backend is not None else "")
    return Implementation(label, function, device, framework, kwargs, impl)


def parse_target(text: str) -> tuple:
    """'--against' text: a backend name -> (None, backend); a peer's name (contract.PEERS, such
    as 'cudnn') or 'module:function' -> (impl, None)."""
    if text in PEERS:
        return PEERS[text], None
    return (text, None) if ":" in text else (None, text)


def _peer_device(function, impl: str, option: str) -> str | None:
    """The device a peer's tensors must be on: the ``device`` its function declares (None: it
    declares none, so it is no peer and takes ``backend=``). A ValueError naming ``option`` when
    the peer cannot run here (its ``backend_unavailable(None)`` says why)."""
    device = getattr(function, "device", None)
    if device is None:
        return None
    ask = getattr(function, "backend_unavailable", None)
    reason = ask(None) if callable(ask) else None
    if reason:
        raise ValueError(f"{option}: {impl} cannot run here: {reason}")
    return device


# ---------------------------------------------------------------------------
# Reruns, compared as bytes
# ---------------------------------------------------------------------------


class RerunTracker:
    """One output's runs: equal bytes are found on the device (no copy); a run that differs
    goes to the host, where the comparison engine (properties.compare.RunTally) measures it."""

    def __init__(self, name):
        from properties.compare import RunTally

        self.stats = RunTally(name)
        self.reference = None

    def add(self, t):
        if self.reference is not None and edge.same_bits(t, self.reference):
            self.stats.add_same()
            return
        if self.reference is None:
            self.reference = t.detach().clone()
        self.stats.add(edge.to_numpy(t))



# ---------------------------------------------------------------------------
# One implementation, N runs
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class RunReport:
    implementation: str
    device: str
    runs_requested: int
    reruns: dict  # output name -> properties.compare.RunTally
    oracle: dict = dataclasses.field(default_factory=dict)  # output name -> properties.compare.Comparison
    problems: list = dataclasses.field(default_factory=list)  # exceptions, wrong dtypes, modified inputs
    run0: tuple = ()  # host NumPy outputs of run 0 (not serialised)
    run0_error: Exception | None = None  # what run 0 raised (not serialised)

    @property
    def bitwise(self) -> bool:
        return all(s.bitwise for s in self.reruns.values()) and len(self.reruns) == len(OUTPUT_NAMES)

    @property
    def ok(self) -> bool:
        return not self.problems and self.bitwise and all(c.ok for c in self.oracle.values())

    @property
    def rejected(self) -> bool:
        """Whether its first run raised a ValueError (the answer to a call that breaks SPEC)."""
        return isinstance(self.run0_error, ValueError)

    def as_dict(self):
        return {
            "implementation": self.implementation,
            "device": self.device,
            "runs": self.runs_requested,
            "ok": self.ok,
            "bitwise": self.bitwise,
            "problems": list(self.problems),
            "outputs": {
                name: dict(
                    self.reruns[name].as_dict() if name in self.reruns else {},
                    oracle=None if name not in self.oracle else {
                        "ok": self.oracle[name].ok,
                        "max_abs_error": self.oracle[name].max_err,
                        "tolerance": self.oracle[name].tolerance,
                        "baseline_error": self.oracle[name].baseline_err,
                        "elements_over_tolerance": self.oracle[name].mismatched,
                        "report": self.oracle[name].report(),
                    },
                )
                for name in OUTPUT_NAMES
            },
        }


_EXPECTED_DTYPES = {"dq": "bfloat16", "dkv": "bfloat16", "d_attn_sink": "float32"}


def run_many(impl: Implementation, host_inputs: dict, runs: int, on_run=None) -> RunReport:
    """Call ``impl`` ``runs`` times on the same device tensors; track each output's bytes."""
    import torch

    from properties.case import to_framework

    from .edge import to_numpy, to_torch

    # Copies: torch.from_numpy shares memory, and an implementation that writes into its inputs must
    # neither change the source for the next implementation nor hide its own write.
    host_inputs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in host_inputs.items()}
    pristine = {k: np.ascontiguousarray(v).tobytes() for k, v in host_inputs.items() if isinstance(v, np.ndarray)}
    args = to_framework(host_inputs, impl.framework, impl.device)
    report = RunReport(impl.label, impl.device, runs, {})
    trackers = {name: RerunTracker(name) for name in OUTPUT_NAMES}
    for run in range(runs):
        try:
            result = impl.function(*[args[k] for k in SPEC_ARGS], **impl.kwargs)
            if not isinstance(result, (tuple, list)) or len(result) != 3:
                raise TypeError(f"expected (dq, dkv, d_attn_sink), got {type(result).__name__}"
                                + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else ""))
            outputs = [to_torch(x, name, accept=("torch", "paddle")) for name, x in zip(OUTPUT_NAMES, result)]
            if impl.device.startswith("cuda"):
                torch.cuda.synchronize()  # an asynchronous fault belongs to this run, not the next
        except Exception as e:  # the implementation's failure is the finding, not a crash of repro
            report.problems.append(f"run {run} raised {type(e).__name__}: {e}")
            if run == 0:
                report.run0_error = e
            break
        for name, t in zip(OUTPUT_NAMES, outputs):
            trackers[name].add(t)
        if run == 0:
            report.run0 = tuple(to_numpy(t) for t in outputs)
            for name, t in zip(OUTPUT_NAMES, outputs):
                got = str(t.dtype).replace("torch.", "")
                if got != _EXPECTED_DTYPES[name]:
                    report.problems.append(f"{name}: dtype {got}, expected {_EXPECTED_DTYPES[name]}")
        if on_run is not None:
            on_run(run)
    report.reruns = {name: tr.stats for name, tr in trackers.items() if tr.stats.runs}
    # A kernel that writes into its inputs drifts from call to call: check they are unchanged.
    for name in SPEC_ARGS:
        if name == "sm_scale" or host_inputs[name] is None:
            continue
        now = np.ascontiguousarray(to_numpy(args[name]))
        if now.tobytes() != pristine[name]:
            report.problems.append(f"{name}: the implementation modified this input")
    return report


def oracle_macs(host_inputs) -> float:
    B, S, H, d_k = host_inputs["query"].shape
    L = host_inputs["token_indices"].shape[2]
    return float(B * S * H * L * (2 * d_k + 2 * host_inputs["out"].shape[3]))


def check_against_oracle(report: RunReport, expected) -> None:
    """Run 0 against the float64 oracle, by the tolerance rule."""
    from properties.compare import compare

    if not report.run0:
        return
    (want, baseline) = expected
    for name, got, w, b in zip(OUTPUT_NAMES, report.run0, want, baseline):
        report.oracle[name] = compare(name, got, w, b)


# ---------------------------------------------------------------------------
# Two implementations on the same tensors
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class CrossStats:
    name: str
    bitwise_equal: bool
    differing_elements: int
    total: int
    max_abs_diff: float
    max_ulp: int
    first_element: tuple | None
    first_values: tuple | None

    def as_dict(self):
        return dataclasses.asdict(self)


def cross_compare(a: RunReport, b: RunReport) -> dict:
    """Run 0 of ``a`` against run 0 of ``b``, output by output."""
    from properties.compare import difference

    result = {}
    if not a.run0 or not b.run0:
        return result
    for name, x, y in zip(OUTPUT_NAMES, a.run0, b.run0):
        if x.shape != y.shape or x.dtype != y.dtype:
            result[name] = CrossStats(name, False, -1, x.size, float("inf"), -1, None,
                                      (f"{tuple(x.shape)} {x.dtype}", f"{tuple(y.shape)} {y.dtype}"))
            continue
        d = difference(x, y)
        result[name] = (CrossStats(name, True, 0, x.size, 0.0, 0, None, None) if d is None else
                        CrossStats(name, False, d.count, x.size, d.max_abs, d.max_ulp, d.first_index, d.first_values))
    return result


# ---------------------------------------------------------------------------
# The whole replay
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class ReproResult:
    source: Source
    primary: RunReport
    other: RunReport | None = None
    cross: dict = dataclasses.field(default_factory=dict)
    oracle_skipped: str | None = None

    @property
    def rejected_as_spec_requires(self) -> bool | None:
        """For a recorded call that breaks SPEC: whether every implementation rejected it with a
        ValueError on its first run (None for a call that does not break SPEC)."""
        if self.source.structure_error is None:
            return None
        return all(r.rejected for r in (self.primary, self.other) if r is not None)

    @property
    def refused(self) -> list:
        """The implementations that refused a call SPEC allows with a ValueError on their first run:
        nothing was replayed on them (the case or the call options are outside what they accept)."""
        if self.source.structure_error is not None:
            return []
        return [r for r in (self.primary, self.other) if r is not None and r.rejected]

    @property
    def failed_outright(self) -> bool:
        """An implementation that ran (did not refuse the call) failed: whatever another refused,
        that is a failure to report, not bad input."""
        return any(r is not None and not r.rejected and not r.ok for r in (self.primary, self.other))

    @property
    def bad_input(self) -> bool:
        """Not OK only because an implementation refused the call: REFUSED (exit 2), not FAILED."""
        return not self.ok and bool(self.refused) and not self.failed_outright

    def was_refused(self, report) -> bool:
        """Whether ``report`` (the primary's or the other's) is of an implementation that refused the call."""
        return any(report is r for r in self.refused)

    @property
    def ok(self) -> bool:
        if self.source.structure_error is not None:
            return bool(self.rejected_as_spec_requires)
        return self.primary.ok and (self.other is None or self.other.ok)

    def as_dict(self):
        return {
            "source": {"path": str(self.source.path), "kind": self.source.kind, "description": self.source.describe(),
                       "recorded": {k: v for k, v in self.source.recorded.items() if k != "report"}},
            "ok": self.ok,
            "structure_error": self.source.structure_error,
            "rejected_as_spec_requires": self.rejected_as_spec_requires,
            "refused": [f"{r.implementation}: {type(r.run0_error).__name__}: {r.run0_error}" for r in self.refused],
            "oracle_skipped": self.oracle_skipped,
            "implementations": [r.as_dict() for r in (self.primary, self.other) if r is not None],
            "cross": {name: c.as_dict() for name, c in self.cross.items()},
        }


def replay(source: Source, impl: Implementation, runs: int = 100, against: Implementation | None = None,
           oracle: bool = True, on_run=None) -> ReproResult:
    if runs < 1:
        raise ValueError(f"--runs: expected at least 1, got {runs}")
    primary = run_many(impl, source.inputs, runs, on_run=on_run and (lambda r: on_run(impl.label, r)))
    other = None
    if against is not None:
        other = run_many(against, source.inputs, runs, on_run=on_run and (lambda r: on_run(against.label, r)))
    result = ReproResult(source, primary, other)
    if source.structure_error is not None:
        result.oracle_skipped = f"the recorded call breaks SPEC ({source.structure_error}): it must be rejected"
    elif not oracle:
        result.oracle_skipped = "skipped on request (--no-oracle)"
    elif not any(r.run0 for r in (primary, other) if r is not None):
        result.oracle_skipped = "no implementation returned outputs to compare"
    else:
        from properties.case import expected

        want = expected(source.inputs)
        for report in (primary, other):
            if report is not None:
                check_against_oracle(report, want)
    if other is not None:
        result.cross = cross_compare(primary, other)
    return result


# ---------------------------------------------------------------------------
# The same call in fresh processes
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class ProcessReplay:
    """One call of ``implementation`` in each of N fresh processes (properties.processes): the
    SHA-256 of every output, and which processes agree."""

    source: Source
    implementation: str
    device: str
    answers: list  # properties.processes.Answer, in process order

    def groups(self, name: str) -> dict:
        """sha256 -> the processes (0-based) whose ``name`` output has those bytes."""
        found = {}
        for i, answer in enumerate(self.answers):
            if not answer.error:
                found.setdefault(answer.digests[name]["sha256"], []).append(i)
        return found

    @property
    def problems(self) -> list:
        return [f"process {i} (pid {a.pid}): {a.error}" for i, a in enumerate(self.answers) if a.error]

    @property
    def differing(self) -> list:
        return [name for name in OUTPUT_NAMES if len(self.groups(name)) > 1]

    @property
    def ok(self) -> bool:
        return not self.problems and not self.differing and any(not a.error for a in self.answers)

    def as_dict(self):
        return {
            "source": {"path": str(self.source.path), "kind": self.source.kind, "description": self.source.describe()},
            "implementation": self.implementation, "device": self.device, "ok": self.ok,
            "processes": [{"pid": a.pid, "history": a.history, "did": a.did, "error": a.error,
                           "sha256": {n: d["sha256"] for n, d in a.digests.items()}} for a in self.answers],
            "outputs": {name: {"distinct": len(self.groups(name)), "processes_by_sha256": self.groups(name)}
                        for name in OUTPUT_NAMES},
        }


def replay_in_processes(source: Source, impl: Implementation, count: int) -> ProcessReplay:
    """One call in each of ``count`` fresh processes: process 0 does nothing before it, process k
    first allocates and frees tensors of sizes drawn from k and runs k small other calls."""
    import tempfile

    from properties import processes

    if count < 1:
        raise ValueError(f"--processes: expected at least 1, got {count}")
    options = {k: v for k, v in impl.kwargs.items() if k != "backend"}
    with tempfile.TemporaryDirectory(prefix="mqa-bwd-repro-") as tmp:
        inputs = processes.save_inputs(Path(tmp) / "inputs.safetensors", source.inputs)
        requests = processes.requests_for(impl.spec, impl.kwargs.get("backend"), impl.device, count, inputs=inputs,
                                          options=options, framework=impl.framework, first_history=0)
        answers = processes.run_children(requests)
    return ProcessReplay(source, impl.label, impl.device, answers)


#: Recorded properties the replay itself re-checks: determinism is the reruns compared bitwise,
#: agreement is run 0 against the oracle. Any other recorded property is replayed as such.
RERUN_PROPERTIES = ("determinism", "agreement")


def recorded_property(source: Source) -> str | None:
    """The property a failure file records, when the reruns and the oracle cannot tell whether it
    still fails (anything but determinism and agreement); else None. Crash records name a pytest
    node, not a property: their replay is the call itself."""
    from properties.checks import PROPERTIES

    name = source.recorded.get("property")
    if source.kind != "case" or name in RERUN_PROPERTIES or name not in PROPERTIES:
        return None
    return name


def replay_property(source: Source, impl: Implementation, name: str, options=None):
    """Property ``name`` on the recorded case, run on ``impl`` as the suite ran it: with the
    domain the failure file records (none recorded: SPEC's, as the plugin writes it) and the
    call options and framework of the replay. Returns the property's Verdict."""
    from properties import checks
    from properties.target import Target

    from .contract import Domain

    case = source.case.replace(block_h=impl.kwargs.get("block_h"), dkv_buf_bytes=impl.kwargs.get("dkv_buf_bytes"),
                               framework=impl.framework)
    text = source.recorded.get("domain") or "spec"
    if not isinstance(text, str):
        raise ValueError(f"case file {source.path}: 'domain' is not a domain text (got {type(text).__name__})")
    domain = Domain.parse(text, option=f"the domain recorded in {source.path}")
    target = Target(impl.function, impl.spec, impl.kwargs.get("backend"), impl.device, domain)
    return checks.run_property(name, target, case, options or checks.Options())


def recorded_target(source: Source) -> tuple:
    """(impl, backend) that a failure file or capture names; None for what it does not name."""
    impl = source.recorded.get("impl") or None
    if impl == FUZZ_GUARD:  # the fuzzer's recording wrapper stands for ours on the recorded backend
        impl = None
    backend = source.recorded.get("backend") or None
    return impl, backend if isinstance(backend, str) else None
