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


def slots_by_hand(idx: np.ndarray, S_kv: int, padded: int) -> np.ndarray:
    """The slot layout written out row by row: [B*S, padded] global kv rows (b * S_kv + index)
    ascending, then -1s."""
    B, S, L = idx.shape
    out = np.full((B * S, padded), -1, dtype=np.int64)
    for b in range(B):
        for s in range(S):
            row = [int(i) + b * S_kv for i in idx[b, s] if 0 <= int(i) < S_kv]
            out[b * S + s, : len(row)] = sorted(row)
    return out
