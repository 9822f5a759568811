"""The wrapper on the CPU tile model, and the slot layout it hands the kernels written out by hand:
shared by tests/test_wrapper_model.py and tests/test_fixed_point.py."""

import numpy as np

from mqa_bwd import wrapper
from mqa_bwd.contract import SPEC_ARGS
from mqa_bwd.model import ModelLauncher


def call_model(inputs, dkv_buf_bytes=None, launcher=None):
    """The wrapper on a given launcher (default: the deterministic model); ``inputs`` are framework
    tensors by SPEC name (properties.case.to_framework)."""
    return wrapper.backward_with(launcher or ModelLauncher(), *[inputs[k] for k in SPEC_ARGS],
                                 dkv_buf_bytes=dkv_buf_bytes)


def slots_by_hand(idx: np.ndarray, S_kv: int, padded: int, walk_block: int | None = 32) -> np.ndarray:
    """The slot layout written out row by row: [B*S, padded] global kv rows (b * S_kv + index)
    ascending, then -1s, and the row's first ceil(valid / walk_block) blocks of walk_block
    slots rotated to start at block s mod blocks (s the row's position in its sequence);
    walk_block None: not rotated (for what does not see the order)."""
    B, S, L = idx.shape
    out = np.full((B * S, padded), -1, dtype=np.int64)
    for b in range(B):
        for s in range(S):
            row = sorted(int(i) + b * S_kv for i in idx[b, s] if 0 <= int(i) < S_kv)
            blocks = -(-len(row) // walk_block) if walk_block else 0
            laid = row + [-1] * (blocks * walk_block - len(row)) if blocks else row
            if blocks:
                start = (s % blocks) * walk_block
                laid = laid[start:] + laid[:start]
            out[b * S + s, : len(laid)] = laid
    return out
