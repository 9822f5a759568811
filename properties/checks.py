"""The properties of the backward, as plain functions.

Each property takes a ``Target`` (any function with the docs/SPEC.md signature),
a ``Case`` and ``Options``, drives the target only through that signature,
and returns a ``Verdict``: pass or fail, with a report that says what broke,
where, and by how much. Nothing here knows about pytest or Hypothesis, so the
same functions serve the test suite, the mutant self-test and the command
line.

  agreement         dq, dkv, d_attn_sink within 2x the bf16 baseline's error
                    (+ a float32 floor) of the float64 oracle
  determinism       N reruns into NaN-poisoned outputs are bitwise identical
  process_determinism
                    the same call in N fresh processes, each with its own
                    allocator history and kernel order, gives the same
                    bytes (SHA-256) as in this process
  pad_heads_inert   zero heads appended by the caller change no real bit
  output_contract   exact shapes, dtypes, framework and device of each output
  rejection         every bad argument is a ValueError naming it, raised
                    before any launch or allocation; a non-finite lse or
                    sink, or tensors that require grad, get SPEC's answer
  memory_safety     no access outside any buffer, inputs left untouched:
                    writes change a guard band's bytes, reads of a float
                    input's neighbouring rows turn the outputs NaN (read
                    bands), an fp32 atomic add flushes a denormal canary
                    around an allocation (properties/guards.py); the CPU
                    model's bounds checks
  invariance        a batch element's dq/dkv ignore the other elements, a
                    head's dq/d_attn_sink ignore the other heads, nothing
                    depends on the scratch budget; bitwise
  slot_order        each row's slots in another order (the same indices)
                    change no bit of any output

Exceptions the target raises are failures of the property (reported with
the exception), except in ``rejection``, where a ValueError is the point.
Exceptions derived from BaseException only (pytest's skip, KeyboardInterrupt)
pass through untouched: a driver may end a test that way.
"""

import dataclasses
import re
import traceback

import ml_dtypes
import numpy as np

import oracle
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
    processes: int = 2  # process_determinism: fresh processes per example (besides this one)


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

    def options_used(self) -> dict:
        """The case's call options as the calls so far ran them (a rejected budget replaced by the accepted one)."""
        options = dict(self.options)
        if options.get("dkv_buf_bytes") in self._accepted:
            options["dkv_buf_bytes"] = self._accepted[options["dkv_buf_bytes"]]
        return options


def _describe_call(case: Case, **overrides) -> str:
    options = {**case.call_options(), **overrides}
    text = ", ".join(f"{k}={v}" for k, v in options.items())
    return f"({text})" if text else "(default options)"


# ---------------------------------------------------------------------------
# 1. Agreement with the oracle
# ---------------------------------------------------------------------------


def oracle_comparisons(outputs, host) -> list:
    """Each output of a call on ``host`` compared with the float64 oracle (compare.compare)."""
    want64, baseline = expected(host)
    return [cmp.compare(name, g, w, b) for name, g, w, b in zip(OUTPUT_NAMES, outputs, want64, baseline)]


def agreement(target: Target, case: Case, options: Options = Options()) -> Verdict:
    host = case.inputs()
    call = Caller(target, case)
    got = call(call.tensors(host))
    comparisons = oracle_comparisons(got, host)
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
# 2b. The same bits in fresh processes
# ---------------------------------------------------------------------------


def process_determinism(target: Target, case: Case, options: Options = Options()) -> Verdict:
    import os
    import tempfile

    from . import processes

    why = processes.names_the_function(target.spec, target.function)
    if why:
        return Verdict("process_determinism", False, "process determinism: cannot run the implementation in a fresh "
                       f"process: {why}", {"call": False})
    host = case.inputs()
    call = Caller(target, case)
    labels = [f"this process (pid {os.getpid()})"]
    runs = {name: [host_copy(x)] for name, x in zip(OUTPUT_NAMES, call(call.tensors(host), what=labels[0]))}
    problems = []
    with tempfile.TemporaryDirectory(prefix="mqa-bwd-processes-") as tmp:
        requests = processes.requests_for(target.spec, target.backend, target.device, options.processes, case=case,
                                          options=call.options_used(), framework=case.framework, outputs_dir=tmp)
        answers = processes.run_children(requests)
        for i, answer in enumerate(answers, start=1):
            if answer.error:
                problems.append(f"{answer.label(i)}: {answer.error}")
                continue
            labels.append(answer.label(i))
            for name, output in answer.outputs().items():
                runs[name].append(output)
    differences = {name: cmp.first_difference(name, runs[name], labels=labels) for name in OUTPUT_NAMES}
    findings = {name: differences[name] is None for name in OUTPUT_NAMES}
    findings["processes"] = not problems
    ok = not problems and not any(differences.values())
    digests = ", ".join(f"{name} {processes.digest(runs[name][0])['sha256'][:12]}" for name in OUTPUT_NAMES)
    lines = [f"process determinism {_describe_call(case)}: this process and {options.processes} fresh ones, each with "
             "its own allocator history and kernel order: "
             + ("bitwise identical (sha256 " + digests + ")" if ok else "DIFFERS" if any(differences.values())
                else "NOT SHOWN (a fresh process gave no result)")]
    lines += labels[1:] + problems + [d for d in differences.values() if d] + call.notes
    return Verdict("process_determinism", ok, "\n".join(lines), findings)


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
    """One class of bad input: what it is, which argument names a correct rejection may
    use, and how to make it.

    ``make(host, case) -> (host, call keyword arguments)`` changes the NumPy inputs;
    ``after(tensors, case, device) -> tensors`` (None: nothing) changes the tensors
    once they are in the case's framework (a tensor that requires grad, one on
    another device, an argument that is no tensor at all); ``unavailable(case,
    device)`` says why the class cannot be built here (None: it can). ``judge``
    (None: only a ValueError is right) accepts a call that returns instead:
    ``judge(outputs, bad_host, case) -> None`` when the outputs are SPEC's
    defined answer, else what is wrong with them.
    """

    label: str
    names: tuple
    make: object
    after: object = None
    unavailable: object = None
    judge: object = None


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


def _emptied(host, axes: dict) -> dict:
    """``host`` with the named arrays cut to length 0 along the given axis."""
    return _replace(host, **{name: np.take(host[name], [], axis=axis) for name, axis in axes.items()
                             if host[name] is not None})


#: Query-row axes (B: 0, S: 1), head axes, of the arrays that have them.
_ROW_ARRAYS = ("query", "out", "grad_out", "lse", "token_indices")
_HEAD_AXES = {"query": 2, "out": 2, "grad_out": 2, "lse": 2, "attn_sink": 0}


def _on_another_device(name):
    def after(tensors, case, device):
        t = tensors[name]
        if case.framework == "torch":
            moved = t.to("meta") if device == "cpu" else t.to("cpu")  # meta: a second device on any machine
        else:
            moved = edge.numpy_to(edge.to_numpy(t), "paddle", "cpu")
        return {**tensors, name: moved}

    def unavailable(case, device):
        if case.framework == "paddle" and device == "cpu":
            return "paddle has no second device on a machine without a GPU"
        return None

    return after, unavailable


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
    # Empty dimensions: SPEC's dimensions are all >= 1.
    d.append(Defect("B = 0 (an empty batch)", ("query", "kv", "out", "grad_out", "lse", "token_indices"),
                    lambda h, c: (_emptied(h, {n: 0 for n in _ROW_ARRAYS + ("kv",)}), {})))
    d.append(Defect("S = 0 (no query rows)", _ROW_ARRAYS, lambda h, c: (_emptied(h, {n: 1 for n in _ROW_ARRAYS}), {})))
    d.append(Defect("H = 0 (no heads)", tuple(_HEAD_AXES), lambda h, c: (_emptied(h, _HEAD_AXES), {})))
    d.append(Defect("S_kv = 0 (no kv rows)", ("kv",), lambda h, c: (_emptied(h, {"kv": 1}), {})))
    d.append(Defect("L = 0 (no slots)", ("token_indices",), lambda h, c: (_emptied(h, {"token_indices": 2}), {})))
    for value in (float("nan"), float("inf"), -0.125, 0.0, None, "0.125", True):
        d.append(Defect(f"sm_scale={value!r}", ("sm_scale",), lambda h, c, v=value: (_replace(h, sm_scale=v), {})))
    for block_h in (0, 8, 48, 64, -16):
        d.append(Defect(f"block_h={block_h}", ("block_h",), lambda h, c, b=block_h: (h, {"block_h": b})))
    for budget in (0, -8, 1.5, "4096"):
        d.append(Defect(f"dkv_buf_bytes={budget!r}", ("dkv_buf_bytes",), lambda h, c, b=budget: (h, {"dkv_buf_bytes": b})))
    for name in ("kv", "token_indices"):
        after, unavailable = _on_another_device(name)
        d.append(Defect(f"{name} on another device than query", (name, "query"), lambda h, c: (h, {}), after, unavailable))
    d.append(Defect("query a NumPy array, not a tensor", ("query",), lambda h, c: (h, {}),
                    lambda t, c, dev: {**t, "query": edge.to_numpy(t["query"])}))
    d.append(Defect("token_indices a list, not a tensor", ("token_indices",), lambda h, c: (h, {}),
                    lambda t, c, dev: {**t, "token_indices": edge.to_numpy(t["token_indices"]).tolist()}))
    return tuple(d)


DEFECTS = _defects()


# Classes SPEC answers with a defined result, where a ValueError naming the
# argument (before any launch) is right too. docs/SPEC.md, "Bad input".


def _judge_poisoned(outputs, host, case) -> str | None:
    """SPEC's rule for a NaN or +inf lse[b, s, h], or a NaN or +inf sink[h] (every row of
    head h): d_attn_sink[h] is NaN; dq[b, s, h] is NaN in every column where row (b, s)
    has a valid slot; every kv row a valid slot of that row names is NaN in every
    column of dkv. Nothing is asked of the other outputs (a fixed-point design may
    poison more of dkv)."""
    dq, dkv, dsink = (host_copy(x).astype(np.float32) for x in outputs)
    want = {"dq": (case.B, case.S, case.H, case.d_k), "dkv": (case.B, case.S_kv, case.d_k), "d_attn_sink": (case.H,)}
    for name, x in zip(OUTPUT_NAMES, (dq, dkv, dsink)):
        if x.shape != want[name]:
            return f"{name} has shape {x.shape}, want {want[name]}"
    poisoned = ~(host["lse"] < np.inf)  # NaN or +inf
    if host["attn_sink"] is not None:
        poisoned |= ~(host["attn_sink"] < np.inf)[None, None, :]
    idx = host["token_indices"].astype(np.int64)
    valid = (idx >= 0) & (idx < case.S_kv)
    problems = []
    heads = np.flatnonzero(poisoned.any(axis=(0, 1)) & ~np.isnan(dsink))
    if heads.size:
        problems.append(f"d_attn_sink[{heads[0]}] = {dsink[heads[0]]!r}, not NaN")
    hit = poisoned & valid.any(axis=2)[:, :, None]
    numbers = np.argwhere(hit & ~np.isnan(dq).all(axis=3))
    if numbers.size:
        b, s, h = numbers[0]
        problems.append(f"dq[{b}, {s}, {h}] holds numbers ({int((~np.isnan(dq[b, s, h])).sum())} of {case.d_k} "
                        f"columns), not NaN ({len(numbers)} such (row, head) pairs)")
    for b, s in np.argwhere(hit.any(axis=2)):
        rows = np.unique(idx[b, s][valid[b, s]])
        clean = rows[~np.isnan(dkv[b, rows]).all(axis=1)]
        if clean.size:
            problems.append(f"dkv[{b}, {clean[0]}] holds numbers, not NaN, though row ({b}, {s})'s valid slots name it")
            break
    return "; ".join(problems) or None


def _judge_untouched(outputs, host, case) -> str | None:
    """Tensors that require grad are read as they are: the outputs agree with the oracle."""
    bad = [c for c in oracle_comparisons(outputs, host) if not c.ok]
    return "; ".join(c.report() for c in bad) or None


def _live_row_head(host, case, purpose):
    """(b, s, h): a query row with a valid slot where there is one, and a head; from the case's seed."""
    rng = case.derived_rng(purpose)
    idx = host["token_indices"].astype(np.int64)
    live = np.argwhere(((idx >= 0) & (idx < case.S_kv)).any(axis=2))
    b, s = live[rng.integers(len(live))] if len(live) else (rng.integers(case.B), rng.integers(case.S))
    return int(b), int(s), int(rng.integers(case.H))


def _lse_at(value):
    def make(h, c):
        lse = h["lse"].copy()
        lse[_live_row_head(h, c, "rejection.lse")] = value
        return _replace(h, lse=lse), {}

    return make


def _sink_at(value):
    def make(h, c):
        sink = _sink(h, c).copy()
        sink[_live_row_head(h, c, "rejection.sink")[2]] = value
        return _replace(h, attn_sink=sink), {}

    return make


def _requiring_grad(tensors, case, device):
    changed = dict(tensors)
    for name in ("query", "kv", "out", "grad_out", "lse", "attn_sink"):
        t = tensors[name]
        if t is None:
            continue
        if case.framework == "torch":
            changed[name] = t.detach().clone().requires_grad_(True)
        else:
            t = t.clone()
            t.stop_gradient = False
            changed[name] = t
    return changed


ANSWERED = (
    Defect("lse NaN at one (row, head)", ("lse",), _lse_at(np.nan), judge=_judge_poisoned),
    Defect("lse +inf at one (row, head)", ("lse",), _lse_at(np.inf), judge=_judge_poisoned),
    Defect("attn_sink NaN at one head", ("attn_sink",), _sink_at(np.nan), judge=_judge_poisoned),
    Defect("attn_sink +inf at one head", ("attn_sink",), _sink_at(np.inf), judge=_judge_poisoned),
    Defect("float inputs that require grad", ("query", "kv", "out", "grad_out", "lse", "attn_sink"), lambda h, c: (h, {}),
           _requiring_grad, judge=_judge_untouched),
)


def answered_class(case: Case) -> Defect:
    """The one class with a defined answer that ``rejection`` tries on ``case`` (from its seed):
    each needs a full call, so an example tries one of them, all the bad arguments."""
    return ANSWERED[int(case.derived_rng("rejection.answered").integers(len(ANSWERED)))]


def _names(message: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


#: A framework's qualified names (torch.bfloat16, paddle.float32, torch.device).
_QUALIFIED = {"torch": re.compile(r"\btorch\.\w"), "paddle": re.compile(r"\bpaddle\.\w")}


def _foreign_names(message: str, framework: str) -> str | None:
    """The other framework, where the message speaks it to this framework's caller."""
    for other, pattern in _QUALIFIED.items():
        if other != framework and pattern.search(message):
            return other
    return None


def rejection(target: Target, case: Case, options: Options = Options()) -> Verdict:
    """Every bad argument SPEC names is a ValueError that names it (in the caller's
    framework: a paddle caller is not told about torch.float32), raised before any
    launch or allocation (counted through instruments= where the implementation
    takes it). The classes SPEC gives a defined answer (a NaN or +inf lse or sink,
    tensors that require grad) may be a ValueError of the same kind, or a returned
    call whose outputs are that answer (``Defect.judge``); one of them per example
    (``answered_class``), as each needs a full call."""
    import torch

    host = case.inputs()
    problems = []
    findings = {}
    skipped = []
    answered = answered_class(case)
    for defect in DEFECTS + (answered,):
        reason = defect.unavailable(case, target.device) if defect.unavailable else None
        if reason:
            findings[defect.label] = None
            skipped.append(f"{defect.label}: not tried ({reason})")
            continue
        bad_host, kwargs = defect.make(host, case)
        tensors = to_framework(bad_host, case.framework, target.device)
        if defect.after is not None:
            tensors = defect.after(tensors, case, target.device)
        if defect.judge is not None and case.block_h is not None:
            kwargs = {"block_h": case.block_h, **kwargs}
        instruments = Instruments() if target.instrumented else None
        error = result = None
        try:
            with torch.enable_grad():  # a tensor that requires grad is met in grad mode, as in training
                result = target(tensors, **kwargs, **({"instruments": instruments} if instruments else {}))
        except Exception as err:  # noqa: BLE001 - which exception it is, is the verdict
            error = err
        wrong = None
        if error is None:
            if defect.judge is None:
                wrong = "accepted: no exception"
            else:
                try:
                    wrong = defect.judge(unpack(result, defect.label), bad_host, case)
                except CallFailed as failed:
                    wrong = str(failed)
                if wrong:
                    wrong = "returned, but not SPEC's answer: " + wrong
        elif not isinstance(error, ValueError):
            wrong = f"raised {type(error).__name__} instead of ValueError: {error}"
        elif not any(_names(str(error), n) for n in defect.names):
            wrong = f"ValueError does not name {' or '.join(defect.names)}: {str(error)!r}"
        elif _foreign_names(str(error), case.framework):
            wrong = (f"ValueError speaks {_foreign_names(str(error), case.framework)} to a {case.framework} caller: "
                     f"{str(error)!r}")
        if error is not None:
            launched = {k: v for k, v in (instruments.counts if instruments else {}).items()
                        if k in ("launches", "allocations") and v}
            if launched:
                counts = ", ".join(f"{v} {k}" for k, v in launched.items())
                wrong = (wrong + "; and " if wrong else "rejected, but only ") + f"after {counts} (counted through instruments=)"
        findings[defect.label] = wrong is None
        if wrong:
            problems.append(f"{defect.label}: {wrong}")
    ok = not problems
    proof = ("no launch or allocation counted before a rejection (instruments=)" if target.instrumented
             else "launches not counted: the implementation takes no instruments=")
    tried = sum(v is not None for v in findings.values())
    lines = [f"rejection of {tried} bad-argument classes ({case.framework}), {answered.label!r} among them: "
             + (f"every one a ValueError naming the argument or SPEC's answer; {proof}" if ok else f"{len(problems)} FAIL")]
    return Verdict("rejection", ok, "\n".join(lines + problems + skipped), findings)


# ---------------------------------------------------------------------------
# 6. Memory safety
# ---------------------------------------------------------------------------


#: The float inputs, placed inside read bands (NaN) by memory_safety.
FLOAT_INPUTS = ("query", "kv", "out", "grad_out", "lse", "attn_sink")


def _call_in_bands(call: Caller, case: Case, device_tensors: dict, instrumented: bool, read_band=None):
    """One call with every input inside guard bands (float ones in read bands on the sides
    ``read_band(name)`` names: "both" by default) and, through the seam, every allocation inside
    denormal canaries: (bands, placed torch inputs, outputs or None, CallFailed or None)."""
    import torch

    from .guards import GuardBands

    read_band = read_band or (lambda name: "both")
    bands = GuardBands()
    seam = {"instruments": bands.instruments()} if instrumented else {}
    placed = {k: (bands.place_input(v, k, read_band(k)) if isinstance(v, torch.Tensor) else v)
              for k, v in device_tensors.items()}
    handed = placed
    if case.framework == "paddle":
        handed = {k: (edge.from_torch(v, "paddle") if isinstance(v, torch.Tensor) else v) for k, v in placed.items()}
    result, error = None, None
    try:
        result = call(handed, **seam)
    except CallFailed as failed:
        error = failed
    if call.target.needs_gpu:
        torch.cuda.synchronize()
    return bands, placed, result, error


def _nan_masks(outputs) -> dict:
    masks = {}
    for name, x in zip(OUTPUT_NAMES, outputs):
        a = host_copy(x)
        floating = a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16
        masks[name] = np.isnan(a.astype(np.float32)) if floating else np.zeros(a.shape, bool)
    return masks


def _new_nan(masks: dict, base: dict) -> dict:
    """Per output, the elements NaN in ``masks`` but not in ``base`` (where the shapes agree)."""
    return {n: (masks[n] & ~base[n]) if masks[n].shape == base[n].shape else masks[n] for n in masks}


def _describe_nan(extra: dict) -> str:
    parts = []
    for name, mask in extra.items():
        if mask.any():
            first = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(mask)[0]), mask.shape))
            parts.append(f"{name} in {int(mask.sum())} elements (first at {first})")
    return ", ".join(parts)


def _read_band_hits(call: Caller, case: Case, device_tensors: dict, instrumented: bool, masks: dict) -> list:
    """Reports of reads outside the float inputs, from the NaN masks of the call inside read bands.

    NaN in the outputs is a read only where it goes away with the read bands
    replaced by write bands (finite values); the buffer and the side are found
    by re-running with one band at a time in NaN. Only calls whose outputs
    hold NaN pay for the re-runs."""
    if not any(m.any() for m in masks.values()):
        return []
    plain = _call_in_bands(call, case, device_tensors, instrumented, lambda name: "none")[2]
    if plain is None:
        return []  # the call raised without the read bands: the call's failure, reported as such
    base = _nan_masks(plain)
    extra = _new_nan(masks, base)
    if not any(m.any() for m in extra.values()):
        return []  # the implementation's own NaN, there with or without the bands
    hits = []
    for name in FLOAT_INPUTS:
        if device_tensors.get(name) is None:
            continue
        t = device_tensors[name]
        rows = int(t.shape[1] if t.dim() >= 2 else t.shape[0])
        for side, where in (("before", "before its first row (row -1)"), ("after", f"past its last row (row {rows})")):
            outputs = _call_in_bands(call, case, device_tensors, instrumented,
                                     lambda n, name=name, side=side: side if n == name else "none")[2]
            if outputs is None:
                continue
            alone = _new_nan(_nan_masks(outputs), base)
            if any(m.any() for m in alone.values()):
                hits.append(f"out-of-bounds read of {name}, {where}: with only that NaN guard band, "
                            f"the outputs turn NaN: {_describe_nan(alone)}")
    if not hits:
        hits.append(f"out-of-bounds read: inside the NaN read bands the outputs turn NaN ({_describe_nan(extra)}), "
                    "with finite bands they do not, and no single band reproduces it (a read past several buffers)")
    return hits


def memory_safety(target: Target, case: Case, options: Options = Options()) -> Verdict:
    host = case.inputs()
    call = Caller(target, case)
    device_tensors = to_framework(host, "torch", target.device)
    problems = []
    findings = {}
    bands, placed, result, error = _call_in_bands(call, case, device_tensors, target.instrumented)
    before = {k: v for k, v in host.items() if isinstance(v, np.ndarray)}
    if error is not None:
        if isinstance(error.error, BoundsError):
            problems.append(f"out-of-bounds access caught by the implementation's own bounds checks: {error.error}")
            findings["bounds"] = False
        else:
            problems.append(str(error))
            findings["call"] = False
    damaged = bands.violations()
    findings["guard bands"] = not any(v.unexplained for v in damaged)
    if any(r.kind == "canary" for r in bands.regions):
        findings["denormal canary"] = not any(v.flushed for v in damaged)
    problems += [v.describe() for v in damaged]
    if result is not None:
        reads = _read_band_hits(call, case, device_tensors, target.instrumented, _nan_masks(result))
        findings["read bands"] = not reads
        problems += reads
    for name, old in before.items():
        diff = bitwise_difference(f"input {name}", placed[name], old)
        findings[f"input {name} untouched"] = diff is None
        if diff:
            problems.append(f"the call wrote to its input: {diff}")
    ok = not problems
    floats = [n for n in FLOAT_INPUTS if device_tensors.get(n) is not None]
    lines = [f"memory safety {_describe_call(case)} on {target.device}: {len(bands.regions)} guard-banded buffers, "
             f"{', '.join(floats)} inside NaN read bands, "
             + ("every allocation of the call inside denormal canaries (through instruments=)" if target.instrumented else
                "the implementation takes no instruments=, so its own allocations are not banded")
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
# 8. The order of each row's slots changes no bit
# ---------------------------------------------------------------------------


def permute_slots(indices: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Each row's slots ([B, S, L]) taken in ``order`` ([B, S, L] permutations of range(L))."""
    return np.take_along_axis(indices, order, axis=-1)


def order_revealing_inputs(case: Case, host: dict) -> dict | None:
    """The case's inputs reshaped so that a dQ summed in slot order shows the order in bf16
    (None where Dk == Dv or L < 3: nothing to reshape, or every order of two slots is one sum).

    Sums of a few bf16 products rarely round differently enough in fp32 to change a bf16
    dQ. Here kv rows come in pairs (2m, 2m+1) equal in the value dims and opposite, and
    large, in the rope dims (d >= Dv), where q is zero: both rows of a pair get the same
    scores and the same dS, so their dQ contributions in a rope dim cancel exactly when
    they are added to each other, and lose the small terms' low bits when a small term
    comes between them. Every second slot of a row is made its neighbour's partner."""
    dv = case.d_v
    if case.d_k == dv or case.L < 3 or case.S_kv < 2:
        return None
    revealing = dict(host)
    q = host["query"].copy()
    q[..., dv:] = 0
    kv = host["kv"].astype(np.float32)
    pairs = case.S_kv - case.S_kv % 2
    kv[:, 1:pairs:2, :dv] = kv[:, 0:pairs:2, :dv]
    kv[:, 0:pairs:2, dv:] *= ROPE_SCALE  # a power of two: still bf16-exact
    kv[:, 1:pairs:2, dv:] = -kv[:, 0:pairs:2, dv:]
    idx = host["token_indices"].astype(np.int64)
    firsts = idx[..., 0 : case.L - case.L % 2 : 2]
    has_partner = (firsts >= 0) & ((firsts ^ 1) < pairs)
    idx[..., 1 : case.L - case.L % 2 : 2] = np.where(has_partner, firsts ^ 1, idx[..., 1 : case.L - case.L % 2 : 2])
    revealing.update(query=q, kv=kv.astype(host["kv"].dtype), token_indices=idx.astype(host["token_indices"].dtype))
    out, lse = oracle.forward(revealing["query"], revealing["kv"], revealing["token_indices"], host["attn_sink"],
                              case.sm_scale, dv)
    revealing.update(out=out.astype(host["out"].dtype), lse=lse.astype(np.float32))
    return revealing


#: How much larger the paired kv rows' rope dims are than the other terms (order_revealing_inputs).
ROPE_SCALE = 2.0**12


def slot_order(target: Target, case: Case, options: Options = Options()) -> Verdict:
    """Every output is the same bits whatever order each row's slots come in (the same
    multiset of indices, invalid ones and duplicates included), on the case's inputs and on
    inputs shaped so that an order-dependent dQ sum shows (order_revealing_inputs)."""
    host = case.inputs()
    call = Caller(target, case)
    rng = case.derived_rng("slot_order")
    B, S, L = case.B, case.S, case.L
    orders = {
        "reversed": np.broadcast_to(np.arange(L)[::-1], (B, S, L)),
        "shuffled": np.argsort(rng.random((B, S, L)), axis=-1),
    }
    findings, lines = {}, []
    for inputs_name, inputs in (("case inputs", host), ("order-revealing inputs", order_revealing_inputs(case, host))):
        if inputs is None:
            findings[inputs_name] = None
            lines.append(f"{inputs_name}: not applicable (Dk == Dv, L < 3 or S_kv < 2)")
            continue
        reference = [host_copy(x) for x in call(call.tensors(inputs), what=f"{inputs_name}, the case's order")]
        diffs = []
        for order_name, order in orders.items():
            permuted = dict(inputs, token_indices=permute_slots(inputs["token_indices"], order))
            result = call(call.tensors(permuted), what=f"{inputs_name}, slots {order_name}")
            for name, want, got in zip(OUTPUT_NAMES, reference, result):
                diff = cmp.first_difference(name, [want, host_copy(got)], labels=("the case's order", f"slots {order_name}"))
                if diff:
                    diffs.append(diff)
        findings[inputs_name] = not diffs
        lines.append(f"{inputs_name}: " + ("bitwise identical in every order" if not diffs else "DIFFERS"))
        lines += ["    " + d for d in diffs]
    ok = all(v is not False for v in findings.values())
    head = (f"slot_order {_describe_call(case)}: each row's slots reversed and shuffled: "
            + ("the same bits" if ok else "OUTPUTS FOLLOW THE SLOT ORDER"))
    return Verdict("slot_order", ok, "\n".join([head] + lines + call.notes), findings)


# ---------------------------------------------------------------------------


PROPERTIES = {
    "agreement": agreement,
    "determinism": determinism,
    "process_determinism": process_determinism,
    "pad_heads_inert": pad_heads_inert,
    "output_contract": output_contract,
    "rejection": rejection,
    "memory_safety": memory_safety,
    "invariance": invariance,
    "slot_order": slot_order,
}
PROPERTY_NAMES = tuple(PROPERTIES)
#: Properties that start processes for every example: run on a few examples only (properties.profiles).
SPAWNING = ("process_determinism",)


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
