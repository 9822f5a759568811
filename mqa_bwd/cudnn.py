"""cuDNN-frontend's DSA backward behind the docs/SPEC.md signature: a peer to gate and to time.

``pip install 'mqa-bwd[cudnn]'`` brings nvidia-cudnn-frontend 1.32.0 and the
CUTLASS Python DSL it is written in. Its sparse-attention backward,
``cudnn.deepseek_sparse_attention.sparse_attention_backward.
sparse_attention_backward_wrapper``, takes (read from its 1.32.0 source):

  q [R, H, Dk], kv [R_kv, Dk], out and dout [R, H, Dv]   one 16-bit dtype (bf16 here)
  lse [R, H] fp32          natural log, sink-exclusive (its "KV-only LSE"), as SPEC's
  attn_sink [H] fp32       always a tensor; -inf is "no sink"
  topk_idxs [R, L] int32   global kv rows; an entry outside [0, R_kv) is skipped
  softmax_scale, deterministic, and outputs / workspace it allocates when not given

with R = B*S and R_kv = B*S_kv (batches concatenated, so a query row of batch
element b names kv row b*S_kv + index), and returns a dict-like
{"dq" [R, H, Dk], "dkv" [R_kv, Dk], "d_sink" [H] fp32}. Dk is 576 (Dv 512) or
512 (Dv 512); H must exceed 1 (it asserts). Any L: the last block of slots is
masked. On SM90 dKV goes through an fp32 accumulator by atomic adds, and so
does d_sink: not reproducible. ``deterministic=True`` (SM100 only, H in
DETERMINISTIC_HEADS) folds bounded per-shard dKV buffers in a fixed order;
check_support refuses it elsewhere.

What this adapter converts: heads and rows flattened; every invalid index
(any kind SPEC names) becomes -1 *before* the batch offset is added, since an
index like S_kv of batch element 0 is b*S_kv + S_kv = a valid row of batch
element 1 in the concatenated layout; attn_sink None becomes -inf; the results
are viewed back as [B,S,H,Dk], [B,S_kv,Dk] and [H], in the caller's framework.
``block_h`` is validated as SPEC says and has no effect (cuDNN tiles heads
itself). cuDNN's scratch on SM90 is an fp32 dKV accumulator (output-sized) and
two fp32 [R, H] statistics, which grow with the query rows: a ``dkv_buf_bytes``
below those (``scratch_bytes``) is a ValueError that states them; cuDNN cannot
be chunked from here. A NaN or +inf lse or sink is made NaN before the call
(``poisoned``), SPEC's rule. Whatever cuDNN cannot take is a ValueError
naming the argument, raised before cuDNN is called.
"""

import dataclasses
import importlib
import math
from typing import Callable

import torch

from . import edge
from .contract import Domain
from . import layout
from .wrapper import require_budget, torch_inputs, validate

MODULE = "cudnn.deepseek_sparse_attention.sparse_attention_backward"
FUNCTION = "sparse_attention_backward_wrapper"
INSTALL = "pip install 'mqa-bwd[cudnn]' (nvidia-cudnn-frontend 1.32.0, nvidia-cutlass-dsl 4.8.1)"
#: (Dk, Dv) pairs its kernels are tiled for.
WIDTHS = ((576, 512), (512, 512))
#: Compute capability majors it has kernels for: Hopper (SM90) and datacenter Blackwell (SM100, SM103).
MAJORS = (9, 10)
#: Head counts its SM100 deterministic kernels take.
DETERMINISTIC_HEADS = (16, 32, 64, 96, 128)
MIN_HEADS = 2


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the adapter hands tensors to cuDNN: the device type they must be on, and how to
    read a device's compute capability. The public function uses CUDA_PLACEMENT; a test
    can place a stand-in module's work elsewhere. Shaped like a launcher for
    ``wrapper.validate`` (name, device, check_widths)."""

    device: torch.device
    capability: Callable[[torch.device], tuple]
    name: str = "cudnn"

    def check_widths(self, d_k: int, d_v: int) -> None:
        if (d_k, d_v) not in WIDTHS:
            raise ValueError(f"query: width Dk={d_k} with Dv={d_v} is not one cuDNN's DSA backward is tiled for; "
                             f"supported (Dk, Dv): {list(WIDTHS)}")


def _cuda_capability(device: torch.device) -> tuple:
    return tuple(torch.cuda.get_device_capability(device))


CUDA_PLACEMENT = Placement(torch.device("cuda"), _cuda_capability)


def unavailable() -> str | None:
    """Why cuDNN's DSA backward cannot run here, or None when it can: the module imports,
    there is a CUDA device, and it is SM90 or SM100."""
    try:
        importlib.import_module(MODULE)
    except Exception as err:  # a broken install must say what broke, not only that something did
        return f"cuDNN-frontend's DSA backward ({MODULE}) does not import: {err!r}; {INSTALL}"
    if not torch.cuda.is_available():
        return "cuDNN's DSA backward needs a CUDA GPU; this machine has none"
    major, minor = _cuda_capability(torch.device("cuda"))
    if major not in MAJORS:
        return (f"cuDNN's DSA backward has kernels for SM90 and SM100; the CUDA device "
                f"{torch.cuda.get_device_name()} is SM{major}{minor}")
    return None


def _function():
    try:
        module = importlib.import_module(MODULE)
    except Exception as err:
        raise ImportError(f"cuDNN-frontend's DSA backward ({MODULE}) does not import: {err!r}; {INSTALL}") from err
    return getattr(module, FUNCTION)


# ---------------------------------------------------------------------------
# Layout: SPEC's tensors <-> cuDNN's flat ones
# ---------------------------------------------------------------------------


def global_indices(token_indices: torch.Tensor, problem) -> torch.Tensor:
    """[B,S,L] any integer -> [B*S, L] int32: b*S_kv + index where 0 <= index < S_kv, else -1,
    in the caller's order: our slot layout's two steps (layout.slot_keys, which tests validity
    before the batch offset, and layout.place_slots), without the sort and the padding."""
    nkv = problem.B * problem.S_kv
    keys = layout.slot_keys(token_indices.reshape(problem.rows, problem.L), 0, problem.S, problem.S_kv, nkv)
    indices = torch.empty_like(keys)
    layout.place_slots(keys, indices, nkv)
    return indices


#: cuDNN's kernels load rows by TMA and 16-byte copies: a view at an odd offset is copied.
ALIGNMENT = 16


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()


def poisoned(x: torch.Tensor) -> torch.Tensor:
    """NaN and +inf become NaN, on the device (no host sync), so that a non-finite lse or
    sink reaches cuDNN as SPEC's poison; -inf (no valid slot, no sink) keeps its meaning.
    cuDNN carries a NaN lse into dq and d_attn_sink but not into dkv (the ledger,
    docs/known-failures-cudnn.toml, records it): the adapter reports that, it does not
    patch the outputs."""
    return torch.where(x == math.inf, torch.full_like(x, math.nan), x)


def scratch_bytes(problem) -> int:
    """The scratch of cuDNN's SM90 backward that grows with the query rows: two fp32
    [R rounded up to 64, H] statistics. The least dkv_buf_bytes the adapter accepts."""
    rows = -(-problem.B * problem.S // 64) * 64
    return 2 * rows * problem.H * 4


def flat_inputs(problem, query, kv, out, grad_out, lse, attn_sink, token_indices) -> dict:
    """cuDNN's tensor arguments by name (q, kv, out, dout, lse, attn_sink, topk_idxs): flat,
    contiguous and aligned."""
    p = problem
    R = p.B * p.S
    if attn_sink is None:
        sink = torch.full((p.H,), -math.inf, dtype=torch.float32, device=query.device)
    else:
        sink = poisoned(attn_sink.to(torch.float32))
    return dict(
        q=_aligned(query.reshape(R, p.H, p.d_k)),
        kv=_aligned(kv.reshape(p.B * p.S_kv, p.d_k)),
        out=_aligned(out.reshape(R, p.H, p.d_v)),
        dout=_aligned(grad_out.reshape(R, p.H, p.d_v)),
        lse=_aligned(poisoned(lse.reshape(R, p.H).to(torch.float32))),
        attn_sink=_aligned(sink),
        topk_idxs=global_indices(token_indices, p),
    )


def spec_outputs(problem, result) -> tuple:
    """cuDNN's {"dq", "dkv", "d_sink"} -> (dq [B,S,H,Dk], dkv [B,S_kv,Dk], d_attn_sink [H])."""
    p = problem
    return (result["dq"].reshape(p.B, p.S, p.H, p.d_k), result["dkv"].reshape(p.B, p.S_kv, p.d_k),
            result["d_sink"].reshape(p.H))


@dataclasses.dataclass(frozen=True)
class Layout:
    """The two conversions, replaceable in a test (a mutant): the real ones are LAYOUT.

    to_cudnn(problem, query, kv, out, grad_out, lse, attn_sink, token_indices) -> dict of cuDNN's tensors
    from_cudnn(problem, result) -> (dq, dkv, d_attn_sink) in SPEC's shapes
    """

    to_cudnn: Callable
    from_cudnn: Callable


LAYOUT = Layout(flat_inputs, spec_outputs)


# ---------------------------------------------------------------------------
# The call
# ---------------------------------------------------------------------------


def check_cudnn_domain(problem, device: torch.device, placement: Placement, deterministic) -> bool:
    """What cuDNN takes beyond SPEC; the ``deterministic`` flag to pass. ValueError naming the argument."""
    if problem.H < MIN_HEADS:
        raise ValueError(f"query: cuDNN's DSA backward needs H >= {MIN_HEADS} heads (it asserts H > 1), got H={problem.H}")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise ValueError(f"deterministic: expected None, True or False, got {deterministic!r}")
    major, minor = placement.capability(device)
    if major not in MAJORS:
        raise ValueError(f"query: on a device of compute capability {major}.{minor}; cuDNN's DSA backward has "
                         f"kernels for SM90 and SM100 only")
    if deterministic and (major != 10 or problem.H not in DETERMINISTIC_HEADS):
        raise ValueError(f"deterministic: cuDNN's deterministic DSA backward needs SM100 and H in "
                         f"{DETERMINISTIC_HEADS}; this is SM{major}{minor} with H={problem.H}")
    return bool(deterministic)


def backward_with(placement: Placement, query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *,
                  block_h=None, dkv_buf_bytes=None, deterministic=None, layout: Layout = LAYOUT, framework="torch"):
    """cudnn_backward with the tensors' placement (and the layout steps) given; torch tensors in and
    out. ``framework``: whose names the error messages use (the caller's, before the edge converted it)."""
    # design=None: cuDNN keeps scratch of its own, so the budget is checked against it below.
    problem = validate(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, block_h, dkv_buf_bytes,
                       placement, framework=framework, design=None)
    flag = check_cudnn_domain(problem, query.device, placement, deterministic)
    require_budget(problem.dkv_buf_bytes, scratch_bytes(problem), problem.rows, "mqa_bwd.cudnn.scratch_bytes")
    function = _function()
    flat = layout.to_cudnn(problem, query, kv, out, grad_out, lse, attn_sink, token_indices)
    result = function(**flat, softmax_scale=float(sm_scale), deterministic=flag)
    return layout.from_cudnn(problem, result)


def cudnn_backward(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None,
                   dkv_buf_bytes=None, deterministic=None):
    """cuDNN-frontend's DSA backward with the signature and semantics of docs/SPEC.md.

    Returns (dq [B,S,H,Dk] bf16, dkv [B,S_kv,Dk] bf16, d_attn_sink [H] fp32) in the
    caller's framework, on its CUDA device. ``deterministic``: None or False, cuDNN's
    default (atomic dKV); True, its SM100 deterministic kernels (a ValueError elsewhere).
    ``block_h`` is validated and has no effect; ``dkv_buf_bytes`` below cuDNN's own per-row
    scratch is refused (see the module).
    """
    # Tensors that require grad are accepted, as SPEC says: the backward is not differentiated.
    framework, tensors = torch_inputs(query, kv, out, grad_out, lse, attn_sink, token_indices)
    with torch.no_grad():
        dq, dkv, dsink = backward_with(CUDA_PLACEMENT, *tensors, sm_scale, block_h=block_h, dkv_buf_bytes=dkv_buf_bytes,
                                       deterministic=deterministic, framework=framework)
    return tuple(edge.from_torch(t, framework) for t in (dq, dkv, dsink))


def _backend_unavailable(backend) -> str | None:
    if backend is not None:
        return f"cudnn_backward takes no backend= (cuDNN picks its kernel by the GPU), got {backend!r}"
    return unavailable()


#: What cuDNN's DSA backward takes, inside SPEC: H >= 2, its two widths, any top-k width and
#: batch, a sink or none (None becomes -inf here), every invalid-index kind (each becomes -1
#: here), no causality requirement on the indices.
cudnn_backward.domain = Domain(heads=(MIN_HEADS, 128), widths=WIDTHS, sink="optional", invalid_indices=None,
                               causal_indices=False)
# The harness's seam (mqa_bwd.contract): there is no backend= to choose; why it cannot run here.
cudnn_backward.backend_unavailable = _backend_unavailable
#: The least dkv_buf_bytes it accepts (a peer's account of its scratch, contract.PEERS).
cudnn_backward.scratch_bytes = scratch_bytes
#: Where its tensors must be (a peer, contract.PEERS): cuDNN's kernels run on a CUDA GPU only.
cudnn_backward.device = CUDA_PLACEMENT.device.type
