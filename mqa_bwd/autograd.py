"""Sparse absorbed-MQA attention with a sink as an autograd op, with an opt-in drift check.

    from mqa_bwd.autograd import DriftCheck, sparse_mqa_attention

    out = sparse_mqa_attention(q, kv, attn_sink, token_indices, sm_scale, d_v=512,
                               forward=my_sparse_forward,          # None: reference_forward
                               backward_backend="tilelang",        # None: the best one here
                               drift_check=DriftCheck(every=100))  # None: $MQA_BWD_DRIFT_CHECK

``out`` [B,S,H,d_v] bf16 is differentiable with respect to ``q`` and ``kv``
([B,S,H,Dk] and [B,S_kv,Dk], bf16) and ``attn_sink`` ([H] fp32, or None);
``token_indices`` [B,S,L] is any integer dtype, every value outside
[0, S_kv) an invalid slot (docs/SPEC.md). torch tensors go through
``SparseMQAAttention`` (a ``torch.autograd.Function``), paddle tensors
through its ``paddle.autograd.PyLayer`` twin (``paddle_layer()``, paddle
imported on first use); the numbers are the same bits either way.

The forward is ``forward(q, kv, attn_sink, token_indices, sm_scale, d_v) ->
(out, lse)``, called with the caller's tensors: ``out`` [B,S,H,d_v] bf16 and
``lse`` [B,S,H] fp32, natural-log and sink-EXCLUDED (-inf for a row with no
valid slot), as docs/SPEC.md defines it. ``reference_forward`` is the default.

The backward is this project's (``mqa_bwd.wrapper.backward`` with
``backend=backward_backend``: "tilelang", "tilelang-atomic", "model",
"model-atomic") or cuDNN's ("cudnn", through ``mqa_bwd.cudnn`` where that
module and its peer dependency are installed). ``grad_out`` is handed over
as a contiguous bf16 tensor (a copy only when it is not one already).

Saved for backward (``save_for_backward``, so nothing beyond what autograd
holds): q, kv, attn_sink and token_indices themselves (no copies), the
output ``out`` itself, and ``lse`` [B,S,H] fp32, the one tensor the forward
adds. Modifying q, kv or out in place before the backward is an autograd
error, as for any saved tensor.

The drift check (``DriftCheck``, or ``MQA_BWD_DRIFT_CHECK=N``) runs every
N-th backward twice on the same tensors and compares dq, dkv and
d_attn_sink bit for bit. On a difference it writes the backward's inputs as
a capture (``mqa_bwd.capture``: safetensors, atomic) and warns
(``DriftWarning``) or raises (``DriftError``); the message names the file
and the ``mqa-bwd repro`` command that replays it. The first run's
gradients are the ones returned.
"""

import dataclasses
import functools
import numbers
import os
import secrets
import shlex
import threading
import warnings
from pathlib import Path

import torch

from . import capture, edge
from .contract import BACKENDS, OUTPUT_NAMES, PEERS, backend_device, peer
from .wrapper import backward as project_backward
from .wrapper import problem_of, require_budget, scratch_bytes, validate_forward_inputs

#: What ``backward_backend`` may name: this project's backends and the peers (contract.PEERS:
#: cuDNN's backward).
BACKWARD_BACKENDS = BACKENDS + tuple(PEERS)
#: Environment: check every N-th backward (unset, "" or "0": off), where captures go, warn or raise.
ENV_EVERY = "MQA_BWD_DRIFT_CHECK"
ENV_DIR = "MQA_BWD_DRIFT_DIR"
ENV_ON_DRIFT = "MQA_BWD_DRIFT_ON"
DRIFT_ACTIONS = ("warn", "raise")
DEFAULT_CAPTURE_DIR = "mqa-drift"
#: Working-set target of one block of query rows in reference_forward (the gathered kv rows
#: dominate: L x Dk floats a row).
FORWARD_BLOCK_BYTES = 512 << 20


# ---------------------------------------------------------------------------
# The reference forward
# ---------------------------------------------------------------------------


def reference_forward(q, kv, attn_sink, token_indices, sm_scale, d_v):
    """docs/SPEC.md's forward in torch: (out [B,S,H,d_v] in q's dtype, lse [B,S,H]).

    Computed in fp32 (float64 for float64 inputs, where it is differentiable by
    torch for gradcheck), a block of query rows at a time so that the gathered
    kv rows stay under FORWARD_BLOCK_BYTES. Every index outside [0, S_kv) is an
    invalid slot: its kv row is never read (a NaN there cannot reach a result).
    lse is natural-log and sink-exclusive, -inf where no slot is valid (out 0).
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, S, H, d_k = q.shape
    S_kv, L = kv.shape[1], token_indices.shape[2]
    per_row = torch.finfo(compute).bits // 8 * (2 * L * d_k + 4 * H * L + 2 * H * d_k)
    block = max(1, FORWARD_BLOCK_BYTES // per_row)
    sink = None if attn_sink is None else attn_sink.to(compute)
    outs, lses = [], []
    for b in range(B):
        for s0 in range(0, S, block):
            rows = slice(s0, min(S, s0 + block))
            idx = token_indices[b, rows].long()
            valid = (idx >= 0) & (idx < S_kv)
            keys = kv[b][torch.where(valid, idx, 0)].to(compute)
            keys = torch.where(valid[..., None], keys, torch.zeros((), dtype=compute, device=keys.device))
            logits = torch.einsum("nhd,nld->nhl", q[b, rows].to(compute), keys) * sm_scale
            logits = logits.masked_fill(~valid[:, None, :], -torch.inf)
            live = valid.any(-1)[:, None].expand(-1, H)
            # The shifts are constants of the gradient; dead rows get 0, so nothing is -inf - -inf.
            shift = torch.where(live, logits.amax(-1), 0.0).detach()
            total = torch.exp(logits - shift[..., None]).sum(-1)
            lse_live = shift + torch.log(torch.where(live, total, 1.0))
            norm = lse_live if sink is None else torch.logaddexp(lse_live, sink)
            p = torch.exp(logits - norm[..., None])
            outs.append(torch.einsum("nhl,nld->nhd", p, keys[..., :d_v]).to(q.dtype))
            lses.append(torch.where(live, lse_live, -torch.inf))
    out = torch.cat(outs).reshape(B, S, H, d_v)
    lse = torch.cat(lses).reshape(B, S, H)
    return out, lse


# ---------------------------------------------------------------------------
# The drift check
# ---------------------------------------------------------------------------


class DriftWarning(UserWarning):
    """A backward rerun on the same tensors gave other bits (``DriftCheck(on_drift="warn")``).
    ``capture`` is the file written (None if it could not be), ``command`` replays it."""

    def __init__(self, message, capture_path=None, command=None):
        super().__init__(message)
        self.capture, self.command = capture_path, command


class DriftError(RuntimeError):
    """A backward rerun on the same tensors gave other bits (``DriftCheck(on_drift="raise")``)."""

    def __init__(self, message, capture_path=None, command=None):
        super().__init__(message)
        self.capture, self.command = capture_path, command


class DriftCheck:
    """Every ``every``-th backward through the op runs twice on the same tensors and
    the bits of dq, dkv and d_attn_sink are compared; on a difference a capture goes
    to ``capture_dir`` (created if missing) and ``on_drift`` says warn or raise.

    One object counts the backwards it has seen: pass the same one to every call.
    Counts, readable at any time: ``backwards`` (seen), ``checks`` (rerun and
    compared), ``drifts`` (found different), ``captures`` (the files written).
    """

    def __init__(self, every: int = 1, on_drift: str = "warn", capture_dir=DEFAULT_CAPTURE_DIR):
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(f"drift_check.every: expected a positive integer (check every N-th backward), "
                             f"got {every!r}")
        if on_drift not in DRIFT_ACTIONS:
            raise ValueError(f"drift_check.on_drift: one of {DRIFT_ACTIONS}, got {on_drift!r}")
        if not isinstance(capture_dir, (str, os.PathLike)) or not str(capture_dir):
            raise ValueError(f"drift_check.capture_dir: expected a directory path, got {capture_dir!r}")
        self.every, self.on_drift, self.capture_dir = int(every), on_drift, Path(capture_dir)
        self.backwards = self.checks = self.drifts = 0
        self.captures = []
        self._lock = threading.Lock()

    def __repr__(self):
        return (f"DriftCheck(every={self.every}, on_drift={self.on_drift!r}, capture_dir={str(self.capture_dir)!r}; "
                f"backwards={self.backwards}, checks={self.checks}, drifts={self.drifts})")

    def due(self) -> int | None:
        """Count one backward; its number when it is to be checked, else None."""
        with self._lock:
            self.backwards += 1
            if self.backwards % self.every:
                return None
            self.checks += 1
            return self.backwards

    def found(self, path) -> None:
        with self._lock:
            self.drifts += 1
            if path is not None:
                self.captures.append(Path(path))


def _positive_env(name, text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}: expected N >= 0 (check every N-th backward; 0: off), got {text!r}")
    return value


@functools.lru_cache(maxsize=None)
def _environment_check(every_text, directory, on_drift):
    # One DriftCheck per setting, so that its counts run across calls (and read back).
    every = _positive_env(ENV_EVERY, every_text)
    if not every:
        return None
    if on_drift not in DRIFT_ACTIONS:
        raise ValueError(f"{ENV_ON_DRIFT}: one of {DRIFT_ACTIONS}, got {on_drift!r}")
    return DriftCheck(every, on_drift, directory or DEFAULT_CAPTURE_DIR)


def environment_drift_check() -> DriftCheck | None:
    """The DriftCheck that $MQA_BWD_DRIFT_CHECK ($MQA_BWD_DRIFT_DIR, $MQA_BWD_DRIFT_ON) asks
    for, the same object for as long as they do not change; None when it is off."""
    return _environment_check(os.environ.get(ENV_EVERY, "").strip() or "0", os.environ.get(ENV_DIR, ""),
                              os.environ.get(ENV_ON_DRIFT, "warn").strip() or "warn")


def _chosen_check(drift_check):
    if drift_check is None:
        return environment_drift_check()
    if drift_check is False:
        return None
    if not isinstance(drift_check, DriftCheck):
        raise ValueError(f"drift_check: expected a DriftCheck, None (the environment decides) or False (off), "
                         f"got {type(drift_check).__name__}")
    return drift_check


def _differences(first, second) -> dict:
    """{output name: properties.compare.Difference} of the outputs whose bytes differ."""
    from properties.compare import difference

    found = {}
    for name, a, b in zip(OUTPUT_NAMES, first, second):
        if not edge.same_bits(a, b):
            found[name] = difference(edge.to_numpy(a), edge.to_numpy(b))
    return found


# ---------------------------------------------------------------------------
# The backward
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Backward:
    """One backward, ready to call as ``self(q, kv, out, grad_out, lse, attn_sink, token_indices,
    sm_scale)`` on torch tensors; ``replay_options`` are what ``mqa-bwd repro`` needs for it."""

    name: str
    function: object
    options: dict
    capture_meta: dict
    replay_options: tuple

    def __call__(self, *args):
        return self.function(*args, **self.options)


def _peer_backward(word: str):
    """The backward of the peer ``word`` (contract.peer), or a ValueError naming backward_backend
    with why it cannot run here."""
    function, reason = peer(word)
    if reason is not None:
        raise ValueError(f"backward_backend: {word!r} cannot run here: {reason}")
    return function


def resolve_backward(backward_backend, device, d_k, d_v, block_h=None, dkv_buf_bytes=None) -> Backward:
    """The Backward that ``backward_backend`` names, for tensors on ``device``; ValueError naming
    the argument when it is unknown, cannot run here or cannot build the widths. ``block_h``
    and ``dkv_buf_bytes`` are passed on as given (wrapper.problem_of checks them)."""
    from . import backends

    config = {k: v for k, v in (("block_h", block_h), ("dkv_buf_bytes", dkv_buf_bytes)) if v is not None}
    flags = sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in config.items()), [])
    if backward_backend is None:
        backward_backend = backends.default_backend(device)
    if backward_backend in PEERS:
        function, spec = _peer_backward(backward_backend), PEERS[backward_backend]
        return Backward(backward_backend, function, dict(block_h=block_h, dkv_buf_bytes=dkv_buf_bytes),
                        dict(config, impl=spec), ("--impl", spec, "--device", device.type, *flags))
    if backward_backend not in BACKENDS:
        raise ValueError(f"backward_backend: one of {BACKWARD_BACKENDS} or None, got {backward_backend!r}")
    reason = backends.unavailable(backward_backend)
    if reason is not None:
        raise ValueError(f"backward_backend: {reason}")
    wanted = backend_device(backward_backend)
    if device.type != wanted:
        raise ValueError(f"backward_backend: {backward_backend!r} runs on {wanted}, but the tensors are on {device}")
    backends.get_launcher(backward_backend, device).check_widths(d_k, d_v)
    return Backward(backward_backend, project_backward, dict(config, backend=backward_backend),
                    dict(config, backend=backward_backend), ("--backend", backward_backend, *flags))


@dataclasses.dataclass(frozen=True)
class Call:
    """What the forward and the backward of one call share (no tensors)."""

    forward: object
    backward: Backward
    drift_check: DriftCheck | None
    sm_scale: float
    d_v: int


def _capture_drift(call: Call, number: int, inputs: dict, differing: dict):
    """Write the capture of a drifted backward; (path, command), path None if it could not be written."""
    check = call.drift_check
    # The pid and a random tag keep two processes, or two checks of one, from writing one file.
    name = f"drift-pid{os.getpid()}-backward{number}-{secrets.token_hex(3)}.safetensors"
    path = check.capture_dir / name
    meta = dict(call.backward.capture_meta, written_by="mqa_bwd.autograd drift check", backward_call=number,
                differing=sorted(differing))
    try:
        check.capture_dir.mkdir(parents=True, exist_ok=True)
        path = capture.write(path, inputs, meta).resolve()
    except (OSError, ValueError) as err:
        return None, f"(no capture: writing {path} failed: {err})"
    return path, shlex.join(["mqa-bwd", "repro", str(path), *call.backward.replay_options])


def run_backward(call: Call, q, kv, out, grad_out, lse, attn_sink, token_indices):
    """(dq, dkv, d_attn_sink) as torch tensors, with the drift check where it is due."""
    grad_out = grad_out.to(torch.bfloat16).contiguous()
    args = (q, kv, out, grad_out, lse, attn_sink, token_indices, call.sm_scale)
    first = call.backward(*args)
    number = None if call.drift_check is None else call.drift_check.due()
    if number is None:
        return first
    differing = _differences(first, call.backward(*args))
    if not differing:
        return first
    inputs = dict(query=q, kv=kv, out=out, grad_out=grad_out, lse=lse, attn_sink=attn_sink,
                  token_indices=token_indices, sm_scale=call.sm_scale)
    path, command = _capture_drift(call, number, inputs, differing)
    call.drift_check.found(path)
    details = "; ".join(f"{name}: {d.describe(str(first[OUTPUT_NAMES.index(name)].dtype).replace('torch.', ''))}"
                        for name, d in differing.items())
    message = (f"mqa_bwd drift check: backward {number} on {call.backward.name!r} gave other bits when rerun on "
               f"the same tensors ({details}). Capture: {path}. Replay: {command}")
    if call.drift_check.on_drift == "raise":
        raise DriftError(message, path, command)
    warnings.warn(DriftWarning(message, path, command), stacklevel=2)
    return first


# ---------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------


def _torch_view(t, name="tensor", framework="torch"):
    """A torch tensor sharing ``t``'s memory (edge.to_torch detaches a paddle tensor, as DLPack
    requires); None stays None."""
    return None if t is None else edge.to_torch(t, name, accept=(framework,))


def _forward_result(result, q, d_v, framework):
    """The user forward's (out, lse) as torch tensors, checked; ValueError naming forward."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ValueError(f"forward: expected it to return (out, lse), got {type(result).__name__}")
    out, lse = (_torch_view(t, f"forward's {name}", framework) for name, t in zip(("out", "lse"), result))
    B, S, H, _ = q.shape
    for name, t, shape, dtype in (("out", out, (B, S, H, d_v), torch.bfloat16), ("lse", lse, (B, S, H), torch.float32)):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"forward: {name} must be {shape} {dtype}, got {tuple(t.shape)} {t.dtype}")
    return out, lse


def _gradients(needs, grads, attn_sink):
    dq, dkv, dsink = grads
    return (dq if needs[0] else None, dkv if needs[1] else None,
            dsink if attn_sink is not None and needs[2] else None)


class SparseMQAAttention(torch.autograd.Function):
    """The op on torch tensors: ``apply(q, kv, attn_sink, token_indices, call)`` with ``call`` a
    ``Call``. Use ``sparse_mqa_attention``, which validates and builds the Call."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, token_indices, call):
        if call.forward is None:
            out, lse = reference_forward(q, kv, attn_sink, token_indices, call.sm_scale, call.d_v)
        else:
            out, lse = _forward_result(call.forward(q, kv, attn_sink, token_indices, call.sm_scale, call.d_v),
                                       q, call.d_v, "torch")
        ctx.save_for_backward(q, kv, attn_sink, token_indices, out, lse)
        ctx.call = call
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, kv, attn_sink, token_indices, out, lse = ctx.saved_tensors
        grads = run_backward(ctx.call, q, kv, out, grad_out, lse, attn_sink, token_indices)
        return (*_gradients(ctx.needs_input_grad, grads, attn_sink), None, None)


@functools.lru_cache(maxsize=None)
def paddle_layer():
    """The op on paddle tensors (a ``paddle.autograd.PyLayer``), defined on first use.

    ``apply(q, kv, attn_sink, token_indices, call)``; the tensors cross to torch by
    DLPack (zero-copy) and the gradients come back the same way."""
    import paddle

    class SparseMQAAttentionPaddle(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx, q, kv, attn_sink, token_indices, call):
            if call.forward is None:
                views = [_torch_view(t, framework="paddle") for t in (q, kv, attn_sink, token_indices)]
                out, lse = (edge.from_torch(t, "paddle")
                            for t in reference_forward(*views, call.sm_scale, call.d_v))
            else:
                out, lse = call.forward(q, kv, attn_sink, token_indices, call.sm_scale, call.d_v)
                _forward_result((out, lse), _torch_view(q, framework="paddle"), call.d_v, "paddle")
            ctx.save_for_backward(q, kv, attn_sink, token_indices, out, lse)
            ctx.call = call
            ctx.needs = (not q.stop_gradient, not kv.stop_gradient,
                         attn_sink is not None and not attn_sink.stop_gradient)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            saved = ctx.saved_tensor()
            q, kv, attn_sink, token_indices, out, lse = (_torch_view(t, framework="paddle") for t in saved)
            grads = run_backward(ctx.call, q, kv, out, _torch_view(grad_out, framework="paddle"), lse, attn_sink,
                                 token_indices)
            dq, dkv, dsink = (None if g is None else edge.from_torch(g, "paddle")
                              for g in _gradients(ctx.needs, grads, attn_sink))
            # One gradient per tensor input of forward: token_indices gets None.
            return (dq, dkv, None) if attn_sink is None else (dq, dkv, dsink, None)

    return SparseMQAAttentionPaddle


def _validate(q, kv, attn_sink, token_indices, sm_scale, d_v, framework):
    """The op's own arguments, before anything runs; ValueError naming the argument. The ones
    the backward shares go through the wrapper's checks; d_v, which the backward reads off
    the forward's out, is the op's own."""
    for name, t in (("q", q), ("kv", kv), ("token_indices", token_indices)):
        if t is None:
            raise ValueError(f"{name}: is None; only attn_sink may be None")
    *_, d_k = validate_forward_inputs(q, kv, attn_sink, token_indices, sm_scale, framework=framework, query_name="q")
    if isinstance(d_v, bool) or not isinstance(d_v, numbers.Integral) or not 1 <= d_v <= d_k or d_v % 16:
        raise ValueError(f"d_v: expected a multiple of 16 in [16, Dk={d_k}], got {d_v!r}")


def sparse_mqa_attention(q, kv, attn_sink, token_indices, sm_scale, *, d_v=512, forward=None, backward_backend=None,
                         drift_check=None, block_h=None, dkv_buf_bytes=None):
    """Sparse absorbed-MQA attention with a sink (docs/SPEC.md), differentiable by this
    project's deterministic backward (or the one ``backward_backend`` names).

    q [B,S,H,Dk] and kv [B,S_kv,Dk] bf16, attn_sink [H] fp32 or None, token_indices
    [B,S,L] integer, torch or paddle tensors of one device. Returns out [B,S,H,d_v]
    bf16 (the first d_v columns of kv are the value). ``forward``: a callable
    ``forward(q, kv, attn_sink, token_indices, sm_scale, d_v) -> (out, lse)``
    (None: ``reference_forward``). ``backward_backend``: one of BACKWARD_BACKENDS
    (None: the best backend for the tensors' device). ``drift_check``: a DriftCheck,
    None (``$MQA_BWD_DRIFT_CHECK`` decides) or False (off). ``block_h`` and
    ``dkv_buf_bytes`` go to the backward as docs/SPEC.md defines them.

    Every bad argument is a ValueError naming it, raised before the forward runs.
    """
    framework = edge.framework_of(q)
    if framework not in ("torch", "paddle"):
        raise ValueError(f"q: expected a torch or paddle tensor, got {type(q).__name__}")
    views = {name: _torch_view(t, name, framework)
             for name, t in (("q", q), ("kv", kv), ("attn_sink", attn_sink), ("token_indices", token_indices))}
    _validate(*views.values(), sm_scale, d_v, framework)
    if forward is not None and not callable(forward):
        raise ValueError(f"forward: expected a callable returning (out, lse) or None, got {type(forward).__name__}")
    check = _chosen_check(drift_check)
    B, S, H, d_k = views["q"].shape
    S_kv, L = views["kv"].shape[1], views["token_indices"].shape[2]
    # block_h, dkv_buf_bytes and the kernels' limits on L, as the backward will check them.
    problem = problem_of(B, S, S_kv, H, L, d_k, int(d_v), block_h, dkv_buf_bytes)
    backward = resolve_backward(backward_backend, views["q"].device, d_k, int(d_v), block_h, dkv_buf_bytes)
    if problem.dkv_buf_bytes is not None:  # the backward's budget, refused before the forward
        if backward.name in BACKENDS:
            least = scratch_bytes(B, S, S_kv, H, L, d_k, int(d_v), block_h=block_h, backend=backward.name)
            source = "mqa_bwd.scratch_bytes"
        else:  # a peer's own account (contract.PEERS), which it must give to take a budget
            scratch = getattr(backward.function, "scratch_bytes", None)
            if not callable(scratch):
                raise ValueError(f"dkv_buf_bytes: backward_backend {backward.name!r} does not say what scratch it "
                                 "needs (no scratch_bytes); pass dkv_buf_bytes=None")
            least, source = scratch(problem), f"{PEERS[backward.name]}.scratch_bytes"
        require_budget(problem.dkv_buf_bytes, least, problem.rows, source)
    call = Call(forward, backward, check, float(sm_scale), int(d_v))
    layer = SparseMQAAttention if framework == "torch" else paddle_layer()
    return layer.apply(q, kv, attn_sink, token_indices, call)
