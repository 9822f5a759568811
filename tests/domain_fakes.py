"""Stand-ins for foreign kernels with a narrow domain, on the CPU model (tests/test_domains.py).

Each is our implementation (the model backend) behind the kind of guard a
public kernel has: an ``assert`` on what it supports. With its domain declared
the harness draws inside it; without (``--mqa-domain spec``), every property
trips the assert, as it did before domains existed.
"""

from mqa_bwd import mqa_latent_sparse_bwd
from mqa_bwd.contract import Domain


def topk_multiple_of_64(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **options):
    """Only top-k widths that are a multiple of its 64-slot block (a non-tensor goes on to ours,
    which rejects it as SPEC asks: the guard is about the domain, not about argument types)."""
    if hasattr(token_indices, "shape"):
        assert token_indices.shape[-1] % 64 == 0, "top-k must be a multiple of 64"
    return mqa_latent_sparse_bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **options)


topk_multiple_of_64.domain = Domain(topk_multiple=64)


def more_than_one_head(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **options):
    """Only H > 1: one head trips its assert (H = 0 goes on to ours, which rejects it as SPEC asks)."""
    assert query.shape[2] != 1
    return mqa_latent_sparse_bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **options)


more_than_one_head.domain = Domain(heads=(2, 128))


def rejects_one_head(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **options):
    """Only H > 1, refused as SPEC asks: a ValueError naming the argument."""
    if query.ndim == 4 and query.shape[2] < 2:
        raise ValueError(f"query: needs at least 2 heads, got {query.shape[2]}")
    return mqa_latent_sparse_bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **options)


rejects_one_head.domain = Domain(heads=(2, 128))


def wrong_dq_with_sink(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **options):
    """dq off by one whenever a sink tensor is given; right otherwise (a known failure, for the ledger)."""
    dq, dkv, dsink = mqa_latent_sparse_bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale,
                                           **options)
    return (dq + 1 if attn_sink is not None else dq), dkv, dsink


def ours(*args, **options):
    """Ours, under another name (a ledger entry for it must be an unexpected pass)."""
    return mqa_latent_sparse_bwd(*args, **options)


ours.takes_instruments = lambda: True


def second_peer(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None,
                dkv_buf_bytes=None):
    """A peer as mqa_bwd.cudnn is one (no backend=, a device of its own, its own reason not to run,
    a domain), here ours on the CPU model: registered in contract.PEERS, the tools must serve it
    by what it declares, with no branch of their own (tests/test_bench_errors.py, test_repro.py)."""
    return mqa_latent_sparse_bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, block_h=block_h,
                                 dkv_buf_bytes=dkv_buf_bytes, backend="model")


second_peer.domain = Domain(heads=(2, 64), topk_multiple=16)
second_peer.device = "cpu"
second_peer.backend_unavailable = lambda backend: None
