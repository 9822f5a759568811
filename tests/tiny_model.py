"""A tiny language model around one sparse-attention layer (mqa_bwd.autograd), for the
end-to-end tests on the CPU model backend (tests/test_autograd.py) and the H200
(tests/test_autograd_gpu.py): an embedding, q and kv projections, the op with a
learned sink, a linear head and a cross-entropy loss.
"""

import torch

from mqa_bwd.autograd import DriftWarning, sparse_mqa_attention
from properties.checks import bitwise_difference


class TinyModel(torch.nn.Module):
    def __init__(self, vocab=32, width=24, heads=4, d_k=32, d_v=16, **op_options):
        super().__init__()
        self.heads, self.d_k, self.d_v, self.op_options = heads, d_k, d_v, op_options
        self.embed = torch.nn.Embedding(vocab, width)
        self.q_proj = torch.nn.Linear(width, heads * d_k, bias=False)
        self.kv_proj = torch.nn.Linear(width, d_k, bias=False)
        self.sink = torch.nn.Parameter(torch.randn(heads))
        self.head = torch.nn.Linear(heads * d_v, vocab)

    def forward(self, tokens, token_indices, targets):
        B, S = tokens.shape
        x = self.embed(tokens)
        q = self.q_proj(x).view(B, S, self.heads, self.d_k).to(torch.bfloat16)
        kv = self.kv_proj(x).to(torch.bfloat16)
        out = sparse_mqa_attention(q, kv, self.sink, token_indices, self.d_k**-0.5, d_v=self.d_v, **self.op_options)
        logits = self.head(out.float().reshape(B, S, self.heads * self.d_v))
        return torch.nn.functional.cross_entropy(logits.reshape(B * S, -1), targets.reshape(-1))


def batch(seed, B=1, S=16, L=8, vocab=32, device="cpu"):
    """(tokens, causal top-L indices with -1 past what a row sees, targets), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    targets = torch.randint(0, vocab, (B, S), generator=g)
    visible = torch.arange(S).view(1, S, 1) + 1
    picks = (torch.rand((B, S, L), generator=g) * visible).long()
    indices = torch.where(torch.arange(L).view(1, 1, L) < visible, picks, -1).to(torch.int32)
    return tokens.to(device), indices.to(device), targets.to(device)


def train(seed, steps=2, device="cpu", model_options=None, batch_options=None, **op_options):
    """Gradients of every parameter at each of ``steps`` SGD steps of a model built from ``seed``:
    a list of {name: gradient}, one dict a step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyModel(**(model_options or {}), **op_options).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(*batch(seed * 1000 + step, device=device, **(batch_options or {})))
        loss.backward()
        history.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
    return history


def differing_gradients(first, second) -> list:
    """'step N name' for every gradient whose bits differ between two train() histories."""
    differ = []
    for step, (a, b) in enumerate(zip(first, second)):
        for name in a:
            if bitwise_difference(name, a[name], b[name]) is not None:
                differ.append(f"step {step} {name}")
    return differ


def the_drift_warning(caught):
    """The one DriftWarning among the warnings ``pytest.warns`` caught (on a GPU TileLang's own
    warnings may come first)."""
    drifts = [w.message for w in caught if isinstance(w.message, DriftWarning)]
    assert len(drifts) == 1, [str(w.message) for w in caught]
    return drifts[0]
