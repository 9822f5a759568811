"""Mutants of our implementation, one per known bug class, and the kill matrix.

Each mutant is a function with the SPEC.md signature, built from our own
wrapper by wrapping it or by swapping one of its internals for the duration
of the call (mqa_bwd/ itself is never edited). The suite must fail on every
one, and say which property caught it:

  no_head_padding          #1784: a head count below the group width goes to
                           the kernel unpadded, so its 16-row tile reads and
                           writes past the heads it was given
  atomic_dkv               dKV by fp32 atomics (adds in arrival order)
  pad_rows_uninitialised   the head-padding rows of q, out, dO, lse and the
                           sink are allocated but never written
  lse_natural_as_base2     the natural-log lse and sink go to the base-2
                           kernel unconverted
  lse_sink_exclusive       the sink-exclusive lse goes to the kernel, which
                           expects the sink folded in
  only_minus_one_invalid   only -1 is treated as an invalid index; S_kv and
                           other out-of-range values address other rows
  dtype_unchecked          no dtype validation: float32 / float16 tensors run
  pad_dq_unsliced          the pad heads' dq rows are returned with the rest
  outputs_reused           (a check of the harness) output buffers kept from
                           the last call, rows with no valid slot not
                           rewritten: only the NaN poisoning between reruns
                           can tell it from ours

A kill is a case on which the property fails for the mutant and holds for
ours: a property that also fails on the original proves nothing about the
mutant. Every mutant also has a benign case where its bug cannot show, on
which it must agree with ours bit for bit: a mutant that crashes everywhere
would be "killed" by every property and prove nothing either.
"""

import contextlib
import dataclasses
import threading
import types

from hypothesis import Verbosity, given, settings

from . import checks, profiles, strategies
from .case import Case
from .target import GPU_BACKENDS, Target

_patch_lock = threading.RLock()


class MutantUnbuildable(RuntimeError):
    """The internal a mutant swaps no longer exists in mqa_bwd: update the mutant, do not trust its kills."""


def _wrapper():
    from mqa_bwd import wrapper

    return wrapper


def _ours():
    import mqa_bwd

    return mqa_bwd.mqa_latent_sparse_bwd


@contextlib.contextmanager
def _swapped(module, name: str, make_replacement):
    """Replace ``module.name`` by ``make_replacement(original)`` for the duration of the block."""
    with _patch_lock:
        if not hasattr(module, name):
            raise MutantUnbuildable(f"{module.__name__} has no attribute {name!r} any more")
        original = getattr(module, name)
        setattr(module, name, make_replacement(original))
        try:
            yield
        finally:
            setattr(module, name, original)


class _ModuleProxy(types.SimpleNamespace):
    """A stand-in for a module: the given attributes overridden, everything else the module's."""

    def __init__(self, module, **overrides):
        super().__init__(**overrides)
        object.__setattr__(self, "_module", module)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_module"), name)


# ---------------------------------------------------------------------------
# The mutants
# ---------------------------------------------------------------------------


def no_head_padding(*args, **kwargs):
    """#1784: Problem(pad_heads=False) - a group narrower than the tile goes to the kernel as is."""
    wrapper = _wrapper()

    def unpadded(validate):
        return lambda *a, **k: dataclasses.replace(validate(*a, **k), pad_heads=False)

    with _swapped(wrapper, "validate", unpadded):
        return _ours()(*args, **kwargs)


def atomic_dkv(*args, backend=None, **kwargs):
    """Our wrapper on the atomic control of the same backend."""
    atomic = "tilelang-atomic" if backend in GPU_BACKENDS else "model-atomic"
    return _ours()(*args, backend=atomic, **kwargs)


def pad_rows_uninitialised(*args, **kwargs):
    wrapper = _wrapper()

    def without_fill(_pad_heads):
        def pad_heads(x, padded, value, launcher):
            H = x.shape[1]
            if H == padded:
                return x.contiguous()
            y = launcher.empty((x.shape[0], padded) + tuple(x.shape[2:]), x.dtype)
            y[:, :H] = x  # the pad rows keep whatever the allocation held
            return y

        return pad_heads

    with _swapped(wrapper, "_pad_heads", without_fill):
        return _ours()(*args, **kwargs)


def lse_natural_as_base2(*args, **kwargs):
    """The wrapper forgets the log2(e) factor: natural-log values reach the base-2 kernel."""
    wrapper = _wrapper()
    with _swapped(wrapper, "K", lambda kernels: _ModuleProxy(kernels, LOG2E=1.0)):
        return _ours()(*args, **kwargs)


def lse_sink_exclusive(*args, **kwargs):
    """The wrapper does not fold the sink into lse: Lse2 = lse * log2(e)."""
    wrapper = _wrapper()

    def without_sink(torch_module):
        def logaddexp(lse, sink):
            return torch_module.broadcast_tensors(lse, sink)[0].clone()  # lse alone, shaped like the original

        return _ModuleProxy(torch_module, logaddexp=logaddexp)

    with _swapped(wrapper, "torch", without_sink):
        return _ours()(*args, **kwargs)


def only_minus_one_invalid(*args, **kwargs):
    wrapper = _wrapper()

    def minus_one_only(_global_slots):
        def global_slots(token_indices, p):
            import torch

            idx = token_indices.to(torch.int64)
            base = (torch.arange(p.B, device=idx.device, dtype=torch.int64) * p.S_kv).view(p.B, 1, 1)
            g = torch.where(idx != -1, idx + base, torch.full_like(idx, -1)).reshape(p.rows, p.L)
            if p.padded_slots != p.L:
                g = torch.nn.functional.pad(g, (0, p.padded_slots - p.L), value=-1)
            return g.to(torch.int32).contiguous()

        return global_slots

    with _swapped(wrapper, "global_slots", minus_one_only):
        return _ours()(*args, **kwargs)


def dtype_unchecked(*args, **kwargs):
    wrapper = _wrapper()
    with _swapped(wrapper, "_require_dtype", lambda _check: (lambda name, t, dtype: None)):
        return _ours()(*args, **kwargs)


def pad_dq_unsliced(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *,
                    block_h=None, dkv_buf_bytes=None, backend=None):
    """Pads the heads to the group width itself (as the wrapper does) and returns dq unsliced."""
    import torch

    from mqa_bwd.backends import get_launcher

    wrapper = _wrapper()
    framework = wrapper._framework(query)
    if framework is None:
        raise ValueError(f"query: expected a torch or paddle tensor, got {type(query).__name__}")
    names = ("query", "kv", "out", "grad_out", "lse", "token_indices")
    t = {n: wrapper._to_torch(n, x) for n, x in zip(names, (query, kv, out, grad_out, lse, token_indices))}
    sink = None if attn_sink is None else wrapper._to_torch("attn_sink", attn_sink)
    p = wrapper.validate(t["query"], t["kv"], t["out"], t["grad_out"], t["lse"], sink, t["token_indices"], sm_scale,
                         block_h, dkv_buf_bytes, get_launcher(backend, t["query"].device))
    extra = p.padded_heads - p.H

    def pad(x, value=0.0):
        shape = list(x.shape)
        shape[2] = extra
        return torch.cat([x, torch.full(shape, value, dtype=x.dtype, device=x.device)], dim=2)

    if extra:
        t = {**t, "query": pad(t["query"]), "out": pad(t["out"]), "grad_out": pad(t["grad_out"]), "lse": pad(t["lse"])}
        if sink is not None:
            sink = torch.cat([sink, torch.full((extra,), wrapper.PAD_SINK, dtype=sink.dtype, device=sink.device)])
    dq, dkv, dsink = _ours()(t["query"], t["kv"], t["out"], t["grad_out"], t["lse"], sink, t["token_indices"], sm_scale,
                             block_h=p.block_h, dkv_buf_bytes=dkv_buf_bytes, backend=backend)
    return tuple(wrapper._from_torch(x, framework) for x in (dq, dkv, dsink[: p.H]))


_persistent_outputs = {}


def outputs_reused(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs):
    """Writes into output buffers kept from the previous call of the same shapes, skipping the dq
    rows of query rows with no valid slot (it assumes those rows are still zero from last time)."""
    import torch

    from mqa_bwd import wrapper

    dq, dkv, dsink = _ours()(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs)
    framework = wrapper._framework(dq)
    dq_t, dkv_t, dsink_t = (wrapper._to_torch(n, x) for n, x in zip(("dq", "dkv", "d_attn_sink"), (dq, dkv, dsink)))
    idx = wrapper._to_torch("token_indices", token_indices).to(torch.int64)
    S_kv = wrapper._to_torch("kv", kv).shape[1]
    has_valid = ((idx >= 0) & (idx < S_kv)).any(dim=2)  # [B, S]
    key = (framework, tuple(dq_t.shape), tuple(dkv_t.shape), tuple(dsink_t.shape), str(dq_t.device))
    if key not in _persistent_outputs:
        _persistent_outputs[key] = tuple(torch.zeros_like(t) for t in (dq_t, dkv_t, dsink_t))
    keep_dq, keep_dkv, keep_dsink = _persistent_outputs[key]
    keep_dq[has_valid] = dq_t[has_valid]
    keep_dkv.copy_(dkv_t)
    keep_dsink.copy_(dsink_t)
    return tuple(wrapper._from_torch(t, framework) for t in (keep_dq, keep_dkv, keep_dsink))


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    function: object
    bug: str
    #: The property designed to catch this bug class (others may catch it too).
    designated: str
    #: A case on which the bug cannot show: the mutant must equal ours bitwise there.
    benign: Case


#: H a multiple of both group widths: no head padding happens.
_BENIGN = Case(B=1, S=3, S_kv=9, H=32, L=5, d_k=32, d_v=16, sink="random", seed=5)

MUTANTS = {
    m.name: m
    for m in (
        Mutant("no_head_padding", no_head_padding, "#1784: no head padding below the tile", "memory_safety", _BENIGN),
        Mutant("atomic_dkv", atomic_dkv, "dKV by fp32 atomics", "determinism",
               # one query row, one slot: every kv row gets at most one addition, in any order
               _BENIGN.replace(S=1, L=1)),
        Mutant("pad_rows_uninitialised", pad_rows_uninitialised, "pad rows left uninitialised instead of zeroed",
               "pad_heads_inert", _BENIGN),
        Mutant("lse_natural_as_base2", lse_natural_as_base2, "lse convention: natural log taken as base 2",
               "agreement", _BENIGN.replace(invalid=("minus_one",), hole_rate=1.0)),  # no valid slot: lse = -inf
        Mutant("lse_sink_exclusive", lse_sink_exclusive, "lse convention: sink-exclusive taken as sink-inclusive",
               "agreement", _BENIGN.replace(sink="none")),
        Mutant("only_minus_one_invalid", only_minus_one_invalid, "only -1 treated as invalid", "agreement",
               _BENIGN.replace(B=2, invalid=("minus_one",), hole_rate=0.3)),
        Mutant("dtype_unchecked", dtype_unchecked, "dtype not checked", "rejection", _BENIGN),
        Mutant("pad_dq_unsliced", pad_dq_unsliced, "pad heads' dq not sliced", "output_contract", _BENIGN),
        # Not in the list: it checks the harness itself. Only the NaN poisoning between
        # reruns can tell this mutant from ours: unpoisoned, its stale rows are the right zeros.
        Mutant("outputs_reused", outputs_reused, "outputs kept between calls, rows without a valid slot not rewritten",
               "determinism", _BENIGN),
    )
}


def mutant_target(name: str, ours: Target) -> Target:
    return ours.with_function(MUTANTS[name].function, f"properties.mutants:{name}")


def check_buildable(name: str, ours: Target) -> None:
    """Run the mutant on its benign case: it must run and equal ours bitwise (else MutantUnbuildable)."""
    from .case import to_framework

    mutant = MUTANTS[name]
    tensors = to_framework(mutant.benign.inputs(), "torch", ours.device)
    want = ours(tensors)
    got = mutant_target(name, ours)(tensors)
    for output, a, b in zip(("dq", "dkv", "d_attn_sink"), got, want):
        diff = checks.bitwise_difference(output, a, b)
        if diff:
            raise MutantUnbuildable(f"mutant {name} differs from ours on its benign case {mutant.benign.to_json()}: {diff}")


# ---------------------------------------------------------------------------
# Kill search and the matrix
# ---------------------------------------------------------------------------


class _Killed(Exception):
    pass


def find_kill(prop: str, mutant: Target, ours: Target, options: checks.Options, space: strategies.Space,
              search_settings: settings) -> dict | None:
    """The first generated case on which ``prop`` fails for the mutant and holds for ours, or None."""
    found = {}

    @settings(search_settings, verbosity=Verbosity.quiet)
    @given(case=strategies.cases(space))
    def search(case):
        if found:
            raise _Killed()  # Hypothesis replays the failing example: it is the one already found
        verdict = checks.run_property(prop, mutant, case, options)
        if verdict.ok:
            return
        if not checks.run_property(prop, ours, case, options).ok:
            return  # the original fails here too: not evidence against the mutant
        found.update(case=case.to_json(), report=verdict.report)
        raise _Killed()

    try:
        search()
    except Exception:  # noqa: BLE001 - _Killed, or Hypothesis' wrapping of it
        if not found:
            raise
    return found or None


#: Examples and determinism reruns per cell of the matrix. The designated
#: property gets the dev profile's examples and the full reruns; the other
#: cells, which only show what else notices the bug, get a cheaper search.
OTHER_CELL_EXAMPLES = 20
OTHER_CELL_REPEATS = 5


def kill_row(name: str, ours: Target, options: checks.Options = checks.Options(),
             space: strategies.Space = strategies.Space(), search_settings: settings | None = None) -> dict:
    """One row of the kill matrix: for every property, the killing case (or None)."""
    search_settings = search_settings or profiles.examples_for_mutant_kills()
    m = MUTANTS[name]
    check_buildable(name, ours)  # an unbuildable mutant would raise everywhere: "killed" by every property
    mutant = mutant_target(name, ours)
    kills = {}
    for prop in checks.PROPERTY_NAMES:
        if prop == m.designated:
            cell_settings, cell_options = search_settings, options
        else:
            cell_settings = settings(search_settings, max_examples=min(OTHER_CELL_EXAMPLES, search_settings.max_examples))
            cell_options = dataclasses.replace(options, repeats=min(OTHER_CELL_REPEATS, options.repeats))
        kills[prop] = find_kill(prop, mutant, ours, cell_options, space, cell_settings)
    return {"mutant": name, "bug": m.bug, "designated": m.designated, "backend": ours.backend,
            "examples": search_settings.max_examples, "other_examples": min(OTHER_CELL_EXAMPLES, search_settings.max_examples),
            "kills": kills}


def format_kill_matrix(rows: list) -> str:
    """Mutants down, properties across: KILL where the property caught the mutant (* = the designated property)."""
    props = list(checks.PROPERTY_NAMES)
    order = list(MUTANTS)
    rows = sorted(rows, key=lambda r: order.index(r["mutant"]) if r["mutant"] in order else len(order))
    width = max([len(r["mutant"]) for r in rows] + [6])
    header = "mutant".ljust(width) + "  " + "  ".join(p.ljust(max(len(p), 5)) for p in props) + "  verdict"
    lines = [header, "-" * len(header)]
    for r in rows:
        cells = []
        for p in props:
            mark = "KILL" if r["kills"].get(p) else "-"
            if p == r["designated"]:
                mark += "*"
            cells.append(mark.ljust(max(len(p), 5)))
        killed = any(r["kills"].values())
        lines.append(r["mutant"].ljust(width) + "  " + "  ".join(cells) + "  " + ("killed" if killed else "SURVIVED"))
    designated = max(r.get("examples", 0) for r in rows)
    other = max(r.get("other_examples", 0) for r in rows)
    lines.append(f"(* = the property designed for that bug class, searched with up to {designated} generated examples; "
                 f"other cells up to {other} (determinism with {OTHER_CELL_REPEATS} reruns); derandomized; "
                 f"a kill needs the original to pass the same case)")
    return "\n".join(lines)


def kill_details(row: dict) -> str:
    lines = [f"{row['mutant']} ({row['bug']}):"]
    for prop, kill in row["kills"].items():
        if kill:
            lines.append(f"  {prop}: killed by {kill['case']}\n    " + kill["report"].replace("\n", "\n    "))
        else:
            lines.append(f"  {prop}: survived")
    return "\n".join(lines)
