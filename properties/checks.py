"""The seven properties of the backward, as plain functions.

Each property takes a ``Target`` (any function with the docs/SPEC.md signature),
a ``Case`` and ``Options``, drives the target only through that signature,
and returns a ``Verdict``: pass or fail, with a report that says what broke,
where, and by how much. Nothing here knows about pytest or Hypothesis, so the
same functions serve the test suite, the mutant self-test and the command
line.

  agreement         dq, dkv, d_attn_sink within 2x the bf16 baseline's error
                    (+ a float32 floor) of the float64 oracle
  determinism       N reruns into NaN-poisoned outputs are bitwise identical
  pad_heads_inert   zero heads appended by the caller change no real bit
  output_contract   exact shapes, dtypes, framework and device of each output
  rejection         every bad argument is a ValueError naming it, raised
                    before any launch or allocation
  memory_safety     no access outside any buffer (guard bands; the CPU
                    model's bounds checks), inputs left untouched
  invariance        a batch element's dq/dkv ignore the other elements, a
                    head's dq/d_attn_sink ignore the other heads, nothing
                    depends on the scratch budget; bitwise

Exceptions the target raises are failures of the property (reported with
the exception), except in ``rejection``, where a ValueError is the point.
Exceptions derived from BaseException only (pytest's skip, KeyboardInterrupt)
pass through untouched: a driver may end a test that way.
"""

import dataclasses
import re
import traceback

import numpy as np

from mqa_bwd import edge
from mqa_bwd.contract import BoundsError, Instruments

from . import compare as cmp
from .case import Case, expected, to_framework
from .target import OUTPUT_NAMES, Target

#: docs/SPEC.md: the sink value of a pad head ("no sink").
PAD_SINK = -1e30
#: Budgets are raised by doubling until the target accepts one; past this, give up.
MAX_BUDGET_BYTES = 1 << 36


@dataclasses.dataclass(frozen=True)
class Options:
    repeats: int = 20  # determinism: calls per example


@dataclasses.dataclass
class Verdict:
    property: str
    ok: bool
    report: str
    #: Sub-checks and whether each held (None: not applicable to this case).
    findings: dict = dataclasses.field(default_factory=dict)


class CallFailed(Exception):
    """The target raised (or returned something that is not three outputs)."""

    def __init__(self, what: str, error: BaseException | None, message: str | None = None):
        self.what, self.error = what, error
        if message is None:
            message = f"{what}: the implementation raised {type(error).__name__}: {error}"
            frames = traceback.extract_tb(error.__traceback__)[-3:]
            if frames:
                message += "\n    raised at " + " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames))
        super().__init__(message)


# ---------------------------------------------------------------------------
# Framework-neutral helpers
# ---------------------------------------------------------------------------


def framework_of(x) -> str:
    """The framework of an output, or its type's name when it is none of ours."""
    return edge.framework_of(x) or type(x).__name__


def host_copy(x) -> np.ndarray:
    """A host NumPy copy that later writes to ``x`` cannot change."""
    return np.array(edge.to_numpy(x), copy=True)


def poison(outputs) -> None:
    """Fill floating outputs with NaN in place, so stale memory cannot pass as a fresh result."""
    for x in outputs:
        t = edge.to_torch(x, "output")
        if t.is_floating_point():
            t.fill_(float("nan"))


def unpack(result, what: str) -> tuple:
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise CallFailed(what, None, f"{what}: expected (dq, dkv, d_attn_sink), got {type(result).__name__}"
                         + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else ""))
    return tuple(result)


def spec_default_block_h(H: int) -> int:
    """docs/SPEC.md: the default picks 32 when it divides H, else 16."""
    return 32 if H % 32 == 0 else 16


def bitwise_difference(name: str, got, want) -> str | None:
    """None when got and want are the same bytes of the same shape and dtype; else what differs."""
    a, b = edge.to_numpy(got), edge.to_numpy(want)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{name}: shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    return cmp.first_difference(name, [b, a], labels=("reference call", "other call"))


class Caller:
    """Calls one target for one case with the case's options.

    A scratch budget the target rejects as too small (a ValueError naming
    dkv_buf_bytes) is doubled until accepted: the smallest accepted budget is
    what "a small budget" means for that implementation. The budget used is
    remembered, so every later call of the example uses the same one.
    """

    def __init__(self, target: Target, case: Case):
        self.target, self.case = target, case
        self.options = case.call_options()
        self._accepted = {}  # requested budget -> accepted budget
        self.notes = []

    def tensors(self, host: dict) -> dict:
        return to_framework(host, self.case.framework, self.target.device)

    def __call__(self, tensors: dict, what: str = "call", **overrides) -> tuple:
        options = {**self.options, **overrides}
        requested = options.get("dkv_buf_bytes")
        if requested is not None and requested in self._accepted:
            options["dkv_buf_bytes"] = self._accepted[requested]
        while True:
            try:
                result = self.target(tensors, **options)
            except ValueError as err:
                budget = options.get("dkv_buf_bytes")
                if budget is not None and "dkv_buf_bytes" in str(err) and budget < MAX_BUDGET_BYTES:
                    options["dkv_buf_bytes"] = budget * 2
                    continue
                raise CallFailed(what, err) from err
            except Exception as err:
                raise CallFailed(what, err) from err
            break
        if requested is not None and options["dkv_buf_bytes"] != requested and requested not in self._accepted:
            self.notes.append(f"dkv_buf_bytes {requested} was rejected as too small; used {options['dkv_buf_bytes']}")
        if requested is not None:
            self._accepted[requested] = options["dkv_buf_bytes"]
        return unpack(result, what)


def _describe_call(case: Case, **overrides) -> str:
    options = {**case.call_options(), **overrides}
    text = ", ".join(f"{k}={v}" for k, v in options.items())
    return f"({text})" if text else "(default options)"


# ---------------------------------------------------------------------------
# 1. Agreement with the oracle
# ---------------------------------------------------------------------------


def agreement(target: Target, case: Case, options: Options = Options()) -> Verdict:
    host = case.inputs()
    call = Caller(target, case)
    got = call(call.tensors(host))
    want64, baseline = expected(host)
    comparisons = [cmp.compare(name, g, w, b) for name, g, w, b in zip(OUTPUT_NAMES, got, want64, baseline)]
    ok = all(c.ok for c in comparisons)
    lines = [f"agreement with the float64 oracle {_describe_call(case)}: {'holds' if ok else 'FAILS'}"]
    lines += [c.report() for c in comparisons] + call.notes
    return Verdict("agreement", ok, "\n".join(lines), {c.name: c.ok for c in comparisons})


# ---------------------------------------------------------------------------
# 2. Bitwise run-to-run stability
# ---------------------------------------------------------------------------


def determinism(target: Target, case: Case, options: Options = Options()) -> Verdict:
    host = case.inputs()
    call = Caller(target, case)
    tensors = call.tensors(host)
    tallies = {name: cmp.RunTally(name) for name in OUTPUT_NAMES}
    fresh_nan, stale = {}, {}  # run 0's NaNs; the first later run with a NaN where run 0 had a number
    previous = None
    for i in range(options.repeats):
        if previous is not None:
            poison(previous)  # the next call must write every output element itself
        result = call(tensors, what=f"run {i}")
        for name, x in zip(OUTPUT_NAMES, result):
            copy = host_copy(x)
            tallies[name].add(copy)
            nan = np.isnan(copy.astype(np.float32))
            if i == 0:
                fresh_nan[name] = nan
            elif name not in stale and nan.shape == fresh_nan[name].shape and (nan & ~fresh_nan[name]).any():
                stale[name] = i
        previous = result
    differences = {name: tallies[name].report() for name in OUTPUT_NAMES}
    for name in OUTPUT_NAMES:
        if name in stale and differences[name]:
            differences[name] += (f"\n    {name}: NaN in run {stale[name]} where run 0 had a number: the poison put there "
                                  "before the call survived it - the implementation did not write those elements itself "
                                  "(reused or stale output memory)")
    drifting = [tallies[n] for n in OUTPUT_NAMES if differences[n]]
    ok = not drifting
    head = (f"determinism over {options.repeats} runs {_describe_call(case)}, outputs NaN-poisoned between runs: "
            + ("bitwise identical" if ok else "DIFFERS in " + ", ".join(_divergence(t) for t in drifting)))
    lines = [head] + [differences[n] or f"{n}: identical in all {options.repeats} runs" for n in OUTPUT_NAMES]
    return Verdict("determinism", ok, "\n".join(lines + call.notes), {n: differences[n] is None for n in OUTPUT_NAMES})


def _divergence(tally: cmp.RunTally) -> str:
    """'dkv (first divergence: run 1 at (0, 3, 17); 20 distinct results in 20 runs)'."""
    where = f" at {tally.first_element}" if tally.first_element is not None else " (shape or dtype)"
    return (f"{tally.name} (first divergence: run {tally.first_diverging_run}{where}; "
            f"{tally.distinct} distinct results in {tally.runs} runs)")


# ---------------------------------------------------------------------------
# 3. Pad heads stay inert
# ---------------------------------------------------------------------------


def append_inert_heads(host: dict, count: int) -> dict:
    """docs/SPEC.md's zero padding done by the caller: q = out = dO = 0, lse = 0, sink = -1e30."""
    padded = dict(host)
    for name in ("query", "out", "grad_out", "lse"):
        a = host[name]
        zeros = np.zeros(a.shape[:2] + (count,) + a.shape[3:], a.dtype)
        padded[name] = np.concatenate([a, zeros], axis=2)
    if host["attn_sink"] is not None:
        padded["attn_sink"] = np.concatenate([host["attn_sink"], np.full(count, PAD_SINK, np.float32)])
    return padded


def pad_heads_inert(target: Target, case: Case, options: Options = Options()) -> Verdict:
    H = case.H
    block_h = case.block_h or spec_default_block_h(H)
    # Up to the group multiple the wrapper itself pads to (the caller's zeros
    # must equal its padding), or past it by up to one whole extra group.
    to_group = -H % block_h
    count = 1 + int(case.derived_rng("pad_heads_inert").integers(0, to_group + block_h))
    if not target.domain.admits_heads(H + count):  # a declared domain: pad only to head counts inside it
        inside = [c for c in range(1, to_group + block_h + 1) if target.domain.admits_heads(H + c)]
        if not inside:
            return Verdict("pad_heads_inert", True, f"pad heads inert: not applicable: no H={H}+k (k <= "
                           f"{to_group + block_h}) is inside the domain {target.domain}", {})
        count = inside[(count - 1) % len(inside)]
    host = case.inputs()
    call = Caller(target, case)
    plain = call(call.tensors(host), what=f"call with H={H}", block_h=block_h)
    padded = call(call.tensors(append_inert_heads(host, count)), what=f"call with H={H}+{count} pad heads", block_h=block_h)
    dq_p, dkv_p, dsink_p = (host_copy(x) for x in padded)
    problems = []
    findings = {}
    for name, got, want in (("dq", dq_p[:, :, :H], plain[0]), ("dkv", dkv_p, plain[1]), ("d_attn_sink", dsink_p[:H], plain[2])):
        diff = bitwise_difference(f"{name} of the real heads" if name != "dkv" else name, got, want)
        findings[name] = diff is None
        if diff:
            problems.append(diff)
    pad_sink = dsink_p[H:]
    nonzero = np.flatnonzero(~(pad_sink == 0))
    findings["pad d_attn_sink"] = nonzero.size == 0
    if nonzero.size:
        k = int(nonzero[0])
        problems.append(f"d_attn_sink of the pad heads: {nonzero.size} of {pad_sink.size} not exactly 0; "
                        f"first: pad head {k} (head {H + k}) = {pad_sink[k]!r}")
    ok = not problems
    lines = [f"pad heads inert: H={H} vs H={H}+{count} zero heads appended by the caller, "
             f"block_h={block_h} {_describe_call(case, block_h=block_h)}: " + ("bitwise identical" if ok else "DIFFERS")]
    lines += problems + call.notes
    return Verdict("pad_heads_inert", ok, "\n".join(lines), findings)


# ---------------------------------------------------------------------------
# 4. Exact shapes, dtypes, framework and device
# ---------------------------------------------------------------------------


def _dtype_name(x) -> str:
    return str(x.dtype).replace("torch.", "").replace("paddle.", "")


def _device_name(x) -> str:
    if framework_of(x) == "paddle":
        place = x.place
        return f"cuda:{place.gpu_device_id()}" if place.is_gpu_place() else "cpu"
    device = getattr(x, "device", None)
    return str(device) if device is not None else "?"


def output_contract(target: Target, case: Case, options: Options = Options()) -> Verdict:
    host = case.inputs()
    call = Caller(target, case)
    tensors = call.tensors(host)
    result = call(tensors)
    B, S, S_kv, H = case.B, case.S, case.S_kv, case.H
    expected_outputs = (
        ("dq", (B, S, H, case.d_k), "bfloat16"),
        ("dkv", (B, S_kv, case.d_k), "bfloat16"),
        ("d_attn_sink", (H,), "float32"),
    )
    device = _device_name(tensors["query"])
    problems = []
    findings = {}
    for x, (name, shape, dtype) in zip(result, expected_outputs):
        wrong = []
        if framework_of(x) != case.framework:
            wrong.append(f"framework {framework_of(x)}, want {case.framework}")
        else:
            if tuple(x.shape) != shape:
                wrong.append(f"shape {tuple(x.shape)}, want {shape}")
            if _dtype_name(x) != dtype:
                wrong.append(f"dtype {_dtype_name(x)}, want {dtype}")
            if _device_name(x) != device:
                wrong.append(f"device {_device_name(x)}, want {device} (the inputs' device)")
        findings[name] = not wrong
        if wrong:
            problems.append(f"{name}: " + "; ".join(wrong))
    ok = not problems
    lines = [f"output contract ({case.framework} inputs on {device}): " + ("exact" if ok else "VIOLATED")]
    lines += problems + call.notes
    return Verdict("output_contract", ok, "\n".join(lines), findings)


# ---------------------------------------------------------------------------
# 5. Rejection of bad arguments, before any launch
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Defect:
    """One bad argument: what it is, which argument names a correct rejection may use, how to make it."""

    label: str
    names: tuple
    make: object  # (host inputs, case) -> (host inputs, call keyword arguments)


def _replace(host, **changes):
    out = dict(host)
    out.update(changes)
    return out


def _grow(a: np.ndarray, axis: int, by: int = 1) -> np.ndarray:
    """``a`` with ``by`` more entries along ``axis`` (copies of its first ones)."""
    return np.concatenate([a, np.take(a, range(by), axis=axis, mode="wrap")], axis=axis)


def _widen(a: np.ndarray, by: int) -> np.ndarray:
    return np.concatenate([a, np.zeros(a.shape[:-1] + (by,), a.dtype)], axis=-1)


def _cast(a: np.ndarray, dtype) -> np.ndarray:
    with np.errstate(over="ignore"):  # a cancelling pair's 2**16-scaled values overflow float16: still a bad dtype
        return a.astype(np.float32).astype(dtype)


def _sink(host, case):
    return host["attn_sink"] if host["attn_sink"] is not None else np.zeros(case.H, np.float32)


def _defects():
    d = []
    for name in ("query", "kv", "out", "grad_out"):
        for dtype in (np.float32, np.float16):
            d.append(Defect(f"{name} {np.dtype(dtype).name} instead of bfloat16", (name,),
                            lambda h, c, n=name, t=dtype: (_replace(h, **{n: _cast(h[n], t)}), {})))
    ranks = {
        "query": lambda a: a.reshape((-1,) + a.shape[2:]),
        "kv": lambda a: a.reshape((-1, a.shape[-1])),
        "out": lambda a: a[None],
        "grad_out": lambda a: a.reshape((-1,) + a.shape[2:]),
        "lse": lambda a: a.reshape((-1, a.shape[-1])),
        "token_indices": lambda a: a.reshape((-1, a.shape[-1])),
    }
    for name, reshape in ranks.items():
        d.append(Defect(f"{name} of the wrong rank", (name,), lambda h, c, n=name, r=reshape: (_replace(h, **{n: r(h[n])}), {})))
    d.append(Defect("attn_sink of rank 2 ([1, H])", ("attn_sink",), lambda h, c: (_replace(h, attn_sink=_sink(h, c)[None]), {})))
    d.append(Defect("attn_sink of shape [H+1]", ("attn_sink",), lambda h, c: (_replace(h, attn_sink=_grow(_sink(h, c), 0)), {})))
    d.append(Defect("kv batch != query batch", ("kv",), lambda h, c: (_replace(h, kv=_grow(h["kv"], 0)), {})))
    d.append(Defect("out with one head too many", ("out",), lambda h, c: (_replace(h, out=_grow(h["out"], 2)), {})))
    d.append(Defect("grad_out with one query row too many", ("grad_out",), lambda h, c: (_replace(h, grad_out=_grow(h["grad_out"], 1)), {})))
    d.append(Defect("lse with one head too many", ("lse",), lambda h, c: (_replace(h, lse=_grow(h["lse"], 2)), {})))
    d.append(Defect("token_indices with one query row too many", ("token_indices",),
                    lambda h, c: (_replace(h, token_indices=_grow(h["token_indices"], 1)), {})))
    d.append(Defect("kv width != Dk", ("kv", "query"), lambda h, c: (_replace(h, kv=_widen(h["kv"], 16)), {})))
    d.append(Defect("Dv > Dk", ("out", "grad_out", "query", "kv"),
                    lambda h, c: (_replace(h, out=_widen(h["out"], c.d_k + 16 - c.d_v), grad_out=_widen(h["grad_out"], c.d_k + 16 - c.d_v)), {})))
    d.append(Defect("Dk the kernel cannot build (Dk + 8)", ("query", "kv"),
                    lambda h, c: (_replace(h, query=_widen(h["query"], 8), kv=_widen(h["kv"], 8)), {})))
    d.append(Defect("token_indices of a floating dtype", ("token_indices",),
                    lambda h, c: (_replace(h, token_indices=h["token_indices"].astype(np.float32)), {})))
    for block_h in (0, 8, 48, 64, -16):
        d.append(Defect(f"block_h={block_h}", ("block_h",), lambda h, c, b=block_h: (h, {"block_h": b})))
    return tuple(d)


DEFECTS = _defects()


def _names(message: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def rejection(target: Target, case: Case, options: Options = Options()) -> Verdict:
    host = case.inputs()
    problems = []
    findings = {}
    for defect in DEFECTS:
        bad_host, kwargs = defect.make(host, case)
        tensors = to_framework(bad_host, case.framework, target.device)
        instruments = Instruments() if target.instrumented else None
        error = None
        try:
            target(tensors, **kwargs, **({"instruments": instruments} if instruments else {}))
        except Exception as err:  # noqa: BLE001 - which exception it is, is the verdict
            error = err
        launched = {k: v for k, v in (instruments.counts if instruments else {}).items()
                    if k in ("launches", "allocations") and v}
        wrong = None
        if error is None:
            wrong = "accepted: no exception"
        elif not isinstance(error, ValueError):
            wrong = f"raised {type(error).__name__} instead of ValueError: {error}"
        elif not any(_names(str(error), n) for n in defect.names):
            wrong = f"ValueError does not name {' or '.join(defect.names)}: {str(error)!r}"
        if launched:
            counts = ", ".join(f"{v} {k}" for k, v in launched.items())
            wrong = (wrong + "; and " if wrong else "rejected, but only ") + f"after {counts} (counted through instruments=)"
        findings[defect.label] = wrong is None
        if wrong:
            problems.append(f"{defect.label}: {wrong}")
    ok = not problems
    proof = ("no launch or allocation counted (instruments=)" if target.instrumented
             else "launches not counted: the implementation takes no instruments=")
    lines = [f"rejection of {len(DEFECTS)} bad-argument classes ({case.framework}): "
             + (f"every one a ValueError naming the argument; {proof}" if ok else f"{len(problems)} FAIL")]
    return Verdict("rejection", ok, "\n".join(lines + problems), findings)


# ---------------------------------------------------------------------------
# 6. Memory safety
# ---------------------------------------------------------------------------


def memory_safety(target: Target, case: Case, options: Options = Options()) -> Verdict:
    import torch

    from .guards import GuardBands

    host = case.inputs()
    call = Caller(target, case)
    device_tensors = to_framework(host, "torch", target.device)
    problems = []
    findings = {}
    bands = GuardBands()
    seam = {"instruments": bands.instruments()} if target.instrumented else {}
    placed = {k: (bands.place(v, k) if isinstance(v, torch.Tensor) else v) for k, v in device_tensors.items()}
    before = {k: host_copy(v) for k, v in placed.items() if isinstance(v, torch.Tensor)}
    handed = placed
    if case.framework == "paddle":
        handed = {k: (edge.from_torch(v, "paddle") if isinstance(v, torch.Tensor) else v) for k, v in placed.items()}
    try:
        call(handed, **seam)
    except CallFailed as failed:
        if isinstance(failed.error, BoundsError):
            problems.append(f"out-of-bounds access caught by the implementation's own bounds checks: {failed.error}")
            findings["bounds"] = False
        else:
            problems.append(str(failed))
            findings["call"] = False
    if target.needs_gpu:
        torch.cuda.synchronize()
    damaged = bands.violations()
    findings["guard bands"] = not damaged
    for label, side, offset, count in damaged:
        problems.append(f"guard band {side} {label} damaged: {count} bytes, first at offset {offset} from the band's start")
    for name, old in before.items():
        diff = bitwise_difference(f"input {name}", placed[name], old)
        findings[f"input {name} untouched"] = diff is None
        if diff:
            problems.append(f"the call wrote to its input: {diff}")
    ok = not problems
    lines = [f"memory safety {_describe_call(case)} on {target.device}: {len(bands.regions)} guard-banded buffers "
             + ("(inputs and every allocation of the call, through instruments=)" if seam else
                "(the inputs; the implementation takes no instruments=, so its own allocations are not banded)")
             + (", bounds-checked model" if target.backend and target.backend.startswith("model") else "")
             + (": safe" if ok else ": VIOLATED")]
    return Verdict("memory_safety", ok, "\n".join(lines + problems + call.notes), findings)


# ---------------------------------------------------------------------------
# 7. Invariances (bitwise)
# ---------------------------------------------------------------------------


def _batch_element(host: dict, b: int) -> dict:
    sliced = dict(host)
    for name in ("query", "kv", "out", "grad_out", "lse", "token_indices"):
        sliced[name] = host[name][b : b + 1]
    return sliced


def _head_range(host: dict, lo: int, hi: int) -> dict:
    sliced = dict(host)
    for name in ("query", "out", "grad_out", "lse"):
        sliced[name] = host[name][:, :, lo:hi]
    if host["attn_sink"] is not None:
        sliced["attn_sink"] = host["attn_sink"][lo:hi]
    return sliced


def _head_subset(case: Case, domain) -> tuple | None:
    """A proper subset [lo, hi) of the case's heads, chosen by the case; within the domain's head
    counts (None: H = 1, or no proper subset is inside the domain)."""
    if case.H < 2:
        return None
    rng = case.derived_rng("invariance.heads")
    lo = int(rng.integers(0, case.H))
    hi = int(rng.integers(lo + 1, case.H + 1))
    if hi - lo == case.H:  # a proper subset: drop the first or the last head
        lo, hi = (1, case.H) if rng.integers(0, 2) else (0, case.H - 1)
    if not domain.admits_heads(hi - lo):  # a declared domain: a subset it admits, if any
        sizes = [k for k in range(1, case.H) if domain.admits_heads(k)]
        if not sizes:
            return None
        k = sizes[int(rng.integers(0, len(sizes)))]
        lo = int(rng.integers(0, case.H - k + 1))
        hi = lo + k
    return lo, hi


def invariance(target: Target, case: Case, options: Options = Options()) -> Verdict:
    host = case.inputs()
    call = Caller(target, case)
    full = [host_copy(x) for x in call(call.tensors(host), what="full call")]
    findings = {}
    lines = []

    # A batch element's dq and dkv do not depend on the rest of the batch.
    if case.B >= 2:
        diffs = []
        for b in range(case.B):
            alone = call(call.tensors(_batch_element(host, b)), what=f"batch element {b} alone")
            for i, name in ((0, "dq"), (1, "dkv")):
                diff = bitwise_difference(f"{name} of batch element {b}", alone[i], full[i][b : b + 1])
                if diff:
                    diffs.append(diff)
        findings["batch"] = not diffs
        lines.append(f"batch: each of {case.B} elements alone gives the same dq, dkv: " + ("holds" if not diffs else "DOES NOT HOLD"))
        lines += ["    " + d for d in diffs]
    else:
        findings["batch"] = None
        lines.append("batch: not applicable (B=1)")

    # A head's dq and d_attn_sink do not depend on the other heads in the call.
    subset = _head_subset(case, target.domain)
    if subset is not None:
        lo, hi = subset
        part = call(call.tensors(_head_range(host, lo, hi)), what=f"heads [{lo}, {hi}) alone")
        diffs = [d for d in (
            bitwise_difference(f"dq of heads [{lo}, {hi})", part[0], full[0][:, :, lo:hi]),
            bitwise_difference(f"d_attn_sink of heads [{lo}, {hi})", part[2], full[2][lo:hi]),
        ) if d]
        findings["heads"] = not diffs
        lines.append(f"heads: heads [{lo}, {hi}) of {case.H} alone give the same dq, d_attn_sink: "
                     + ("holds" if not diffs else "DOES NOT HOLD"))
        lines += ["    " + d for d in diffs]
    else:
        findings["heads"] = None
        lines.append("heads: not applicable (H=1)" if case.H < 2 else
                     f"heads: not applicable (no proper subset of the {case.H} heads is inside the domain {target.domain})")

    # Nothing depends on the scratch budget: the case's budget vs another one.
    if case.dkv_buf_bytes is None:
        other_budget = min(case.slot_row_bytes, case.kv_bytes)  # raised by the Caller until accepted
    else:
        other_budget = None  # the implementation's default
    other = call(call.tensors(host), what=f"call with dkv_buf_bytes={other_budget}", dkv_buf_bytes=other_budget)
    diffs = [d for d in (bitwise_difference(f"{n} with dkv_buf_bytes={other_budget}", other[i], full[i])
                         for i, n in enumerate(OUTPUT_NAMES)) if d]
    findings["budget"] = not diffs
    lines.append(f"budget: dkv_buf_bytes={case.dkv_buf_bytes} vs {other_budget}: " + ("holds" if not diffs else "DOES NOT HOLD"))
    lines += ["    " + d for d in diffs]

    ok = all(v is not False for v in findings.values())
    held = [k for k, v in findings.items() if v]
    broken = [k for k, v in findings.items() if v is False]
    head = f"invariance {_describe_call(case)}: holds: {', '.join(held) or 'none'}" + (f"; BROKEN: {', '.join(broken)}" if broken else "")
    return Verdict("invariance", ok, "\n".join([head] + lines + call.notes), findings)


# ---------------------------------------------------------------------------


PROPERTIES = {
    "agreement": agreement,
    "determinism": determinism,
    "pad_heads_inert": pad_heads_inert,
    "output_contract": output_contract,
    "rejection": rejection,
    "memory_safety": memory_safety,
    "invariance": invariance,
}
PROPERTY_NAMES = tuple(PROPERTIES)


def run_property(name: str, target: Target, case: Case, options: Options = Options()) -> Verdict:
    """Run one property on one case; a target that raises (where it must not) fails the property."""
    try:
        check = PROPERTIES[name]
    except KeyError:
        raise ValueError(f"property: unknown {name!r}; one of {PROPERTY_NAMES}") from None
    try:
        return check(target, case, options)
    except CallFailed as failed:
        return Verdict(name, False, f"{name}: {failed}", {"call": False})


def describe_case(case: Case) -> str:
    return (f"B={case.B} S={case.S} S_kv={case.S_kv} H={case.H} L={case.L} Dk={case.d_k} Dv={case.d_v} "
            f"{case.pattern} invalid={list(case.invalid)}@{case.hole_rate:g} dup={case.duplicates} "
            f"empty_rows={case.empty_rows} sink={case.sink} block_h={case.block_h} "
            f"dkv_buf_bytes={case.dkv_buf_bytes} {case.framework}")
