"""How an implementation behaves just outside its declared domain: one call per boundary.

The strategies draw inside the domain (``mqa_bwd.contract.Domain``), so no
property fails on the implementation's own refusal of what it does not
support. What it does with such input is still worth knowing once: for every
field the domain restricts, ``boundary_probes`` builds one case just across
that boundary (inside the domain in every other respect), and each is handed
to the implementation once:

  rejected            a ValueError naming the argument: the right answer
  rejected_unnamed    a ValueError that names no argument it concerns
  assert              an AssertionError (``python -O`` strips those: no guard)
  raised              any other exception
  accepted_agrees     the call returned, within tolerance of the oracle
                      (the domain is narrower than what it handles)
  accepted_disagrees  the call returned a wrong result
  crashed             the process died (a signal, an abort, os._exit)
  timeout             the call did not return in time

The calls run in a child process (``python -m properties.outside``), so that
a crash ends the child, not the test run; a new child takes the probes after
the one that crashed.
"""

import dataclasses
import json
import signal
import subprocess
import sys
import traceback

import numpy as np

from mqa_bwd.contract import FRAMEWORKS, SPEC_ARGS

from . import checks, processes
from .case import ALL_INVALID_KINDS, SLOT_BLOCK, Case, to_framework
from .strategies import PRODUCTION_WIDTHS, SMALL_WIDTHS, Space, dimensions
from .target import Target

#: Seconds one probe may take (a JIT-compiling kernel compiles each new shape).
PROBE_TIMEOUT_S = 180.0
#: Seconds a child may take to start (torch's import).
START_TIMEOUT_S = 120.0
_MARK = "mqa-outside: "
_TENSOR_ARGS = tuple(a for a in SPEC_ARGS if a != "sm_scale")
_HEAD_ARGS = ("query", "out", "grad_out", "lse", "attn_sink")
_WIDTH_ARGS = ("query", "kv", "out", "grad_out")
_BATCH_ARGS = ("query", "kv", "out", "grad_out", "lse", "token_indices")

RIGHT = ("rejected",)
#: How each behaviour reads in a report.
BEHAVIOUR_TEXT = {
    "rejected": "rejected with a ValueError naming the argument (the right answer)",
    "rejected_unnamed": "rejected with a ValueError that does not name the argument",
    "assert": "an AssertionError, not a ValueError (python -O strips asserts)",
    "raised": "raised an exception other than ValueError",
    "accepted_agrees": "accepted, and agrees with the oracle (the domain is narrower than what it handles)",
    "accepted_disagrees": "accepted, and DISAGREES with the oracle",
    "crashed": "crashed the process",
    "timeout": "did not return",
    "not_run": "could not be probed",
}


@dataclasses.dataclass(frozen=True)
class Probe:
    boundary: str  # the Domain field crossed
    label: str  # what the case is, e.g. "L=65, outside topk_multiple=64"
    case: Case
    names: tuple  # the arguments a right rejection names (any one of them)

    def as_dict(self) -> dict:
        return {"boundary": self.boundary, "label": self.label, "case": self.case.to_dict(), "names": list(self.names)}

    @classmethod
    def from_dict(cls, d: dict) -> "Probe":
        return cls(d["boundary"], d["label"], Case.from_dict(d["case"]), tuple(d["names"]))


@dataclasses.dataclass(frozen=True)
class Finding:
    boundary: str
    label: str
    behaviour: str  # BEHAVIOUR_TEXT's keys
    detail: str  # the exception and where it was raised, the oracle's verdict, the signal
    case: dict

    @property
    def right(self) -> bool:
        return self.behaviour in RIGHT

    def line(self) -> str:
        return f"{self.label}: {BEHAVIOUR_TEXT[self.behaviour]}" + (f": {self.detail}" if self.detail else "")

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "right": self.right, "text": self.line()}

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        return cls(d["boundary"], d["label"], d["behaviour"], d["detail"], d["case"])


# ---------------------------------------------------------------------------
# The probes
# ---------------------------------------------------------------------------


def base_case(space: Space) -> Case:
    """A small case inside the domain, the probes' starting point."""
    L = space.fit_topk(SLOT_BLOCK)
    pattern = space.pattern_choices()[0]
    d_k, d_v = space.width_choices()[0]
    return Case(B=1, S=4, S_kv=space.fit_kv_rows(4, 16, L, pattern), H=space.fit_heads(16), L=L, d_k=d_k, d_v=d_v,
                pattern=pattern, sink="none" if space.domain.sink == "unsupported" else "random", seed=0,
                framework=space.framework_choices()[0])


def _first_non_causal_seed(case: Case) -> Case:
    """The case with the first seed whose random indices break causality (some valid index > s + S_kv - S)."""
    for seed in range(case.seed, case.seed + 64):
        c = case.replace(seed=seed)
        idx = c.indices().astype(np.int64)
        limit = np.arange(c.S)[None, :, None] + c.S_kv - c.S
        if ((idx >= 0) & (idx < c.S_kv) & (idx > limit)).any():
            return c
    return case


def boundary_probes(space: Space) -> list:
    """One case just across each boundary the domain draws (none for the whole SPEC domain)."""
    d = space.domain
    base = base_case(space)
    probes = []

    def add(boundary, label, names, **changes):
        probes.append(Probe(boundary, label, base.replace(**changes), names))

    if d.heads is not None:
        lo, hi, m = d.heads[0], d.heads[1], d.heads_multiple
        below = lo - m if lo - m >= 1 else lo - 1  # the next count of the multiple, where there is one
        above = hi + m if hi + m <= 128 else hi + 1
        if lo > 1:
            add("heads", f"H={below}, below heads={lo}-{hi}", _HEAD_ARGS, H=below)
        if hi < 128:
            add("heads", f"H={above}, above heads={lo}-{hi}", _HEAD_ARGS, H=above)
    if d.heads_multiple > 1:
        lo, hi = d.heads or (1, 128)
        odd = next((h for h in range(max(lo, space.head_choices()[0]), hi + 1) if h % d.heads_multiple), None)
        if odd is not None:
            add("heads_multiple", f"H={odd}, not a multiple of heads_multiple={d.heads_multiple}", _HEAD_ARGS, H=odd)
    if d.topk_min > 1:
        below = [n for n in range(d.topk_min - 1, 0, -1) if n % d.topk_multiple == 0] or [d.topk_min - 1]
        add("topk_min", f"L={below[0]}, below topk_min={d.topk_min}", ("token_indices",), L=below[0])
    if d.topk_multiple > 1:
        add("topk_multiple", f"L={base.L + 1}, not a multiple of topk_multiple={d.topk_multiple}", ("token_indices",),
            L=base.L + 1)
    if d.widths is not None:
        candidates = (PRODUCTION_WIDTHS + SMALL_WIDTHS) if space.widths == "production" else (SMALL_WIDTHS + PRODUCTION_WIDTHS)
        other = next((w for w in candidates if w not in d.widths), None)
        if other is not None:
            add("widths", f"Dk={other[0]} Dv={other[1]}, not in widths={'+'.join(f'{a}x{b}' for a, b in d.widths)}",
                _WIDTH_ARGS, d_k=other[0], d_v=other[1])
    if d.batch_max is not None:
        add("batch_max", f"B={d.batch_max + 1}, above batch_max={d.batch_max}", _BATCH_ARGS, B=d.batch_max + 1)
    if d.sink == "required":
        add("sink", "attn_sink=None, but sink=required", ("attn_sink",), sink="none")
    elif d.sink == "unsupported":
        add("sink", "an attn_sink tensor, but sink=unsupported", ("attn_sink",), sink="random")
    if d.invalid_indices is not None:
        for kind in ALL_INVALID_KINDS:
            if kind not in d.invalid_indices:
                add("invalid_indices", f"invalid indices of kind {kind}, not in invalid_indices", ("token_indices",),
                    invalid=(kind,), hole_rate=0.3)
    if d.causal_indices:
        probes.append(Probe("causal_indices", "non-causal indices (random top-k), but causal_indices=yes",
                            _first_non_causal_seed(base.replace(pattern="random")), ("token_indices",)))
    for framework in FRAMEWORKS:
        if framework not in d.frameworks and framework in space.frameworks:
            add("frameworks", f"{framework} tensors, not in frameworks={'+'.join(d.frameworks)}", _TENSOR_ARGS,
                framework=framework)
    # Each probe crosses its own boundary (it may cross another too: a smaller L than topk_min
    # is rarely a multiple); none may be inside, or it would probe nothing.
    return [p for p in probes if d.violations(**dimensions(p.case))]


# ---------------------------------------------------------------------------
# One probe, in this process
# ---------------------------------------------------------------------------


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    text = f" ({f.line.strip()})" if f.line else ""
    return f" at {f.filename.rsplit('/', 1)[-1]}:{f.lineno}{text}"


def _names(message: str, names) -> list:
    return [n for n in names if checks._names(message, n)]


def run_probe(target: Target, probe: Probe) -> Finding:
    """Call the target once on the probe's case and say how it behaved."""
    case = probe.case

    def finding(behaviour, detail=""):
        return Finding(probe.boundary, probe.label, behaviour, detail, case.to_dict())

    host = case.inputs()
    try:
        result = target(to_framework(host, case.framework, target.device), **case.call_options())
    except ValueError as err:
        named = _names(str(err), probe.names)
        if named:
            return finding("rejected", f"names {', '.join(named)}: {err}")
        return finding("rejected_unnamed", f"want one of {', '.join(probe.names)}: {err}")
    except AssertionError as err:
        return finding("assert", f"AssertionError{_where(err)}" + (f": {err}" if str(err) else ""))
    except Exception as err:  # noqa: BLE001 - which exception it is, is the finding
        return finding("raised", f"{type(err).__name__}{_where(err)}: {err}")
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        return finding("accepted_disagrees", f"returned {type(result).__name__}, not (dq, dkv, d_attn_sink)")
    bad = [c for c in checks.oracle_comparisons(result, host) if not c.ok]
    if bad:
        return finding("accepted_disagrees", "; ".join(c.report().splitlines()[0] for c in bad))
    return finding("accepted_agrees")


# ---------------------------------------------------------------------------
# Every probe, in child processes
# ---------------------------------------------------------------------------


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def probe_outside(target: Target, space: Space, probe_timeout_s: float = PROBE_TIMEOUT_S) -> list:
    """A Finding for every boundary probe of ``space``'s domain, each call made in a child process."""
    probes = boundary_probes(space)
    results = {}
    remaining = list(range(len(probes)))
    while remaining:
        request = {"impl": target.name, "backend": target.backend,
                   "probes": [probes[i].as_dict() for i in remaining]}
        timeout = START_TIMEOUT_S + probe_timeout_s * len(remaining)
        timed_out = False
        try:
            proc = subprocess.run([sys.executable, "-m", "properties.outside"], input=json.dumps(request),
                                  capture_output=True, text=True, timeout=timeout,
                                  env=processes.child_environment())
            out, err, code = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, err, code, timed_out = e.stdout or "", e.stderr or "", None, True
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            err = err.decode(errors="replace") if isinstance(err, bytes) else err
        started = None
        for line in out.splitlines():
            if not line.startswith(_MARK):
                continue
            message = json.loads(line[len(_MARK):])
            if "start" in message:
                started = remaining[message["start"]]
            elif "finding" in message:
                results[remaining[message["result"]]] = Finding.from_dict(message["finding"])
                started = None
        if started is None:  # the child ended between probes, or before the first one
            if code == 0 and not timed_out:
                break
            tail = (err.strip().splitlines() or ["no output"])[-1]
            for i in remaining:
                if i not in results:
                    results[i] = Finding(probes[i].boundary, probes[i].label, "not_run",
                                         f"the probing process ended before this probe: {tail}",
                                         probes[i].case.to_dict())
            break
        p = probes[started]
        if timed_out:
            results[started] = Finding(p.boundary, p.label, "timeout", f"within {probe_timeout_s:g} s (the process "
                                       "was stopped)", p.case.to_dict())
        else:
            how = _signal_name(code) if code is not None and code < 0 else f"exit code {code}"
            tail = (err.strip().splitlines() or [""])[-1]
            results[started] = Finding(p.boundary, p.label, "crashed", how + (f"; last words: {tail}" if tail else ""),
                                       p.case.to_dict())
        remaining = [i for i in remaining if i not in results]
    return [results[i] for i in range(len(probes)) if i in results]


def main() -> int:
    request = json.load(sys.stdin)
    target = Target.load(request["impl"], request["backend"], domain="spec")
    for i, data in enumerate(request["probes"]):
        print(_MARK + json.dumps({"start": i}), flush=True)
        finding = run_probe(target, Probe.from_dict(data))
        print(_MARK + json.dumps({"result": i, "finding": finding.as_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
