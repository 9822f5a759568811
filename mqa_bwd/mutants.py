"""Mutants of this project's implementation, one per known bug class, for the kill matrix.

Each mutant is a function with the SPEC signature. It calls the wrapper's
``backward`` with one of its named steps (``wrapper.Steps``) replaced, or
wraps the public function; nothing in mqa_bwd is patched or edited. The
suite must fail on every one, and say which property caught it
(``properties.kills``; tests/test_mutants.py runs it):

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
  non_finite_unpoisoned    the Lse2 of a +inf lse or sink is not poisoned:
                           zero gradients, or a NaN d_attn_sink alone
  grad_recorded            tensors that require grad reach the launches in
                           grad mode (a RuntimeError from inside on the model)
  pad_dq_unsliced          the pad heads' dq rows are returned with the rest
  budget_rounds_chunks     a budget given, dKV is computed in two chunks of
                           query rows whose bf16 results are summed and
                           rounded again: its bits follow the budget
  slots_in_caller_order    each row's slots laid out in the order the caller
                           gave them, not the canonical one: dQ's fp32 sum
                           over slot blocks follows the top-k selector's order
  outputs_reused           (a check of the harness) output buffers kept from
                           the last call, rows with no valid slot not
                           rewritten: only the NaN poisoning between reruns
                           can tell it from ours

A tool, above the implementation and the harness: it uses the wrapper's
seams and the harness's Mutant record.
"""

import dataclasses
import functools
import math

import torch

from properties.case import Case
from properties.kills import Mutant

from . import edge, layout, wrapper
from .contract import GPU_BACKENDS, SPEC_ARGS
from .kernels import LOG2E
from .layout import per_head


def _with_steps(**replaced):
    def call(*args, **kwargs):
        return wrapper.backward(*args, steps=dataclasses.replace(wrapper.STEPS, **replaced), **kwargs)

    return call


def _no_head_padding_validate(*args, **kwargs):
    return dataclasses.replace(wrapper.STEPS.validate(*args, **kwargs), pad_heads=False)


def _pad_heads_unfilled(x, padded, value, launcher):
    H = x.shape[1]
    if H == padded:
        return x.contiguous()
    y = launcher.empty((x.shape[0], padded) + tuple(x.shape[2:]), x.dtype)
    y[:, :H] = x  # the pad rows keep whatever the allocation held
    return y


def _with_lse2(terms, lse2, sink2):
    # The row terms with another Lse2, and the sink rows the Delta launch would have formed from
    # it and sink2 (the sink in base 2, or what the mutant takes for it), as when the launch
    # itself had them wrong.
    return terms._replace(lse2=lse2.contiguous(), dsink_rows=layout.sink_rows(lse2, sink2, terms.delta))


def _lse_natural(out, grad_out, lse, sink, launcher):
    # The log2(e) factor forgotten: the natural-log values reach the base-2 kernel.
    terms = wrapper.STEPS.row_terms(out, grad_out, lse, sink, launcher)
    return _with_lse2(terms, terms.lse2 / LOG2E, sink)


def _lse_without_sink(out, grad_out, lse, sink, launcher):
    # lse handed over sink-exclusive (logaddexp with -inf is lse exactly); the sink itself as usual.
    terms = wrapper.STEPS.row_terms(out, grad_out, lse, sink, launcher)
    exclusive = wrapper.STEPS.row_terms(out, grad_out, lse, torch.full_like(sink, float("-inf")), launcher).lse2
    return _with_lse2(terms, exclusive, sink * LOG2E)


def _lse_unpoisoned(out, grad_out, lse, sink, launcher):
    # The rule before SPEC's "Bad input": -inf lse mapped to +inf, nothing poisoned,
    # so a +inf lse gives zero gradients and a +inf sink a NaN d_attn_sink only.
    lse2 = per_head(lambda lse_h, sink_h: torch.logaddexp(lse_h, sink_h) * LOG2E, lse, sink)
    lse2 = torch.where(lse == -math.inf, math.inf, lse2)
    return _with_lse2(wrapper.STEPS.row_terms(out, grad_out, lse, sink, launcher), lse2, sink * LOG2E)


def _minus_one_only_slots(token_indices, p, launcher, marks=None, row_blocks=None):
    idx = token_indices.to(torch.int64)
    base = (torch.arange(p.B, device=idx.device, dtype=torch.int64) * p.S_kv).view(p.B, 1, 1)
    nkv = p.B * p.S_kv  # sorts last, as the wrapper's invalid slots do
    g = torch.where(idx != -1, idx + base, torch.full_like(idx, nkv)).reshape(p.rows, p.L)
    g = wrapper.canonical_order(g)
    g = torch.where(g == nkv, -1, g)
    if p.padded_slots != p.L:
        g = torch.nn.functional.pad(g, (0, p.padded_slots - p.L), value=-1)
    g = g.to(torch.int32).contiguous()
    if marks is not None:
        launcher.mark_slots(g, *marks)
    if row_blocks is not None:
        launcher.row_blocks(g, nkv, row_blocks)
    return g


no_head_padding = _with_steps(validate=_no_head_padding_validate)
pad_rows_uninitialised = _with_steps(pad_heads=_pad_heads_unfilled)
lse_natural_as_base2 = _with_steps(row_terms=_lse_natural)
lse_sink_exclusive = _with_steps(row_terms=_lse_without_sink)
only_minus_one_invalid = _with_steps(global_slots=_minus_one_only_slots)
dtype_unchecked = _with_steps(require_dtype=lambda name, t, dtype, framework: None)
non_finite_unpoisoned = _with_steps(row_terms=_lse_unpoisoned)
#: Not in MUTANTS: its bug shows only to a paddle caller (tests/test_mutants.py runs it).
messages_in_torch = _with_steps(
    validate=lambda *args, **kwargs: wrapper.STEPS.validate(*args, **{**kwargs, "framework": "torch"}))


def grad_recorded(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None,
                  dkv_buf_bytes=None, backend=None, instruments=None):
    """Our wrapper without its detach at the edge: the caller's tensors, requiring grad or not,
    go to the launches in grad mode."""
    from .backends import get_launcher

    framework = edge.framework_of(query)
    args = [None if x is None else edge.to_torch(x, name, accept=("torch", "paddle"))
            for name, x in zip(SPEC_ARGS, (query, kv, out, grad_out, lse, attn_sink, token_indices))]
    launcher = get_launcher(backend, args[0].device, instruments)
    with torch.enable_grad():
        result = wrapper.backward_with(launcher, *args, sm_scale, block_h=block_h, dkv_buf_bytes=dkv_buf_bytes,
                                       framework=framework)
    return tuple(edge.from_torch(t, framework) for t in result)


slots_in_caller_order = _with_steps(global_slots=functools.partial(wrapper.global_slots, order=wrapper.caller_order))


def atomic_dkv(*args, backend=None, **kwargs):
    """Our wrapper on the atomic control of the same backend."""
    atomic = "tilelang-atomic" if backend in GPU_BACKENDS else "model-atomic"
    return wrapper.mqa_latent_sparse_bwd(*args, backend=atomic, **kwargs)


def pad_dq_unsliced(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None, **kwargs):
    """Pads the heads to the group width itself (as the wrapper does) and returns dq unsliced."""
    ours = wrapper.mqa_latent_sparse_bwd
    framework = edge.framework_of(query)
    if framework not in ("torch", "paddle") or len(query.shape) != 4:
        return ours(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, block_h=block_h, **kwargs)
    H = query.shape[2]
    width = block_h or (32 if H % 32 == 0 else 16)
    extra = -H % width
    t = {n: edge.to_torch(x, n) for n, x in (("query", query), ("out", out), ("grad_out", grad_out), ("lse", lse))}

    def pad(x, value=0.0):
        shape = list(x.shape)
        shape[2] = extra
        return torch.cat([x, torch.full(shape, value, dtype=x.dtype, device=x.device)], dim=2)

    sink = None if attn_sink is None else edge.to_torch(attn_sink, "attn_sink")
    if extra:
        t = {n: pad(x) for n, x in t.items()}
        if sink is not None:
            sink = torch.cat([sink, torch.full((extra,), wrapper.PAD_SINK, dtype=sink.dtype, device=sink.device)])
    dq, dkv, dsink = ours(t["query"], edge.to_torch(kv, "kv"), t["out"], t["grad_out"], t["lse"], sink,
                          edge.to_torch(token_indices, "token_indices"), sm_scale, block_h=width, **kwargs)
    return tuple(edge.from_torch(x, framework) for x in (dq, dkv, dsink[:H]))


def budget_rounds_chunks(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, dkv_buf_bytes=None,
                         **kwargs):
    """A budgeted design done wrong: given a budget, dKV comes from two chunks of query rows (each
    a call of ours with the other chunk's slots set to -1, so its rows add nothing), their bf16
    results summed in fp32 and rounded to bf16 again. The double rounding makes dKV's bits depend
    on whether a budget was given. dq and d_attn_sink come from the whole call; without a budget
    it is ours."""
    ours = wrapper.mqa_latent_sparse_bwd
    args = (query, kv, out, grad_out, lse, attn_sink)
    dq, dkv, dsink = ours(*args, token_indices, sm_scale, dkv_buf_bytes=dkv_buf_bytes, **kwargs)
    S = token_indices.shape[1]
    if dkv_buf_bytes is None or S < 2:
        return dq, dkv, dsink
    framework = edge.framework_of(dkv)
    idx = edge.to_torch(token_indices, "token_indices")
    chunks = []
    for rows in (slice(0, S // 2), slice(S // 2, S)):
        only = torch.full_like(idx, -1)
        only[:, rows] = idx[:, rows]
        part = ours(*args, edge.from_torch(only, framework), sm_scale, dkv_buf_bytes=dkv_buf_bytes, **kwargs)[1]
        chunks.append(edge.to_torch(part, "dkv").float())
    summed = (chunks[0] + chunks[1]).to(torch.bfloat16)
    return dq, edge.from_torch(summed, framework), dsink


_persistent_outputs = {}


def outputs_reused(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs):
    """Writes into output buffers kept from the previous call of the same shapes, skipping the dq
    rows of query rows with no valid slot (it assumes those rows are still zero from last time)."""
    dq, dkv, dsink = wrapper.mqa_latent_sparse_bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale,
                                                   **kwargs)
    framework = edge.framework_of(dq)
    dq_t, dkv_t, dsink_t = (edge.to_torch(x, n) for n, x in zip(("dq", "dkv", "d_attn_sink"), (dq, dkv, dsink)))
    idx = edge.to_torch(token_indices, "token_indices").to(torch.int64)
    S_kv = edge.to_torch(kv, "kv").shape[1]
    has_valid = ((idx >= 0) & (idx < S_kv)).any(dim=2)  # [B, S]
    key = (framework, tuple(dq_t.shape), tuple(dkv_t.shape), tuple(dsink_t.shape), str(dq_t.device))
    if key not in _persistent_outputs:
        _persistent_outputs[key] = tuple(torch.zeros_like(t) for t in (dq_t, dkv_t, dsink_t))
    keep_dq, keep_dkv, keep_dsink = _persistent_outputs[key]
    keep_dq[has_valid] = dq_t[has_valid]
    keep_dkv.copy_(dkv_t)
    keep_dsink.copy_(dsink_t)
    return tuple(edge.from_torch(t, framework) for t in (keep_dq, keep_dkv, keep_dsink))


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
        Mutant("non_finite_unpoisoned", non_finite_unpoisoned,
               "a +inf lse or sink not poisoned: zero gradients, or a NaN d_attn_sink only", "rejection", _BENIGN),
        Mutant("grad_recorded", grad_recorded, "inputs that require grad reach the launches: a RuntimeError from inside",
               "rejection", _BENIGN),
        Mutant("pad_dq_unsliced", pad_dq_unsliced, "pad heads' dq not sliced", "output_contract", _BENIGN),
        Mutant("slots_in_caller_order", slots_in_caller_order, "dQ summed in the caller's slot order",
               "slot_order", _BENIGN.replace(L=1)),  # one slot a row: every order is the same
        Mutant("budget_rounds_chunks", budget_rounds_chunks, "dKV rounded per chunk of rows when a budget is given",
               "invariance", _BENIGN),  # no budget: one call of ours
        # Not in the list: it checks the harness itself. Only the NaN poisoning between
        # reruns can tell this mutant from ours: unpoisoned, its stale rows are the right zeros.
        Mutant("outputs_reused", outputs_reused, "outputs kept between calls, rows without a valid slot not rewritten",
               "determinism", _BENIGN),
    )
}
MUTANTS = {name: dataclasses.replace(m, spec=f"mqa_bwd.mutants:{name}") for name, m in MUTANTS.items()}
