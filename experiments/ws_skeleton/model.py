"""The lanes design on the CPU: the product's tile model with its int64 adds replaced by the
lanes kernel's arithmetic, so that the property suite can judge the design without a GPU.

    mqa-bwd check --impl experiments.ws_skeleton.model:lanes_backward --profile dev

What is modelled is the lanes kernel's own arithmetic (kernel.LANES_ADD_SOURCE), on every fixed
launch (the GPU's lanes kernel covers the wide tile only, and the tiling changes no integer):

- each contribution x = c * scale (fp32, a power of two: exact) becomes cvt.rni.s32.f32 of x
  (round half to even, saturating, NaN -> 0), two consecutive columns one word lo + 2^32 hi added
  mod 2^64;
- its kv row's Bound grows by min(ceil(max |x| over the contribution's columns), 2^40), 2^40
  for a NaN.

The decode, the bound test and the int64 redo are launcher.LanesSums', the same code as on the GPU.
"""

import numpy as np

from mqa_bwd import wrapper
from mqa_bwd.model import ModelLauncher

from .launcher import LanesSums

#: What a Bound grows by at most for one contribution (the kernel's fminf): anything larger fails.
BOUND_CAP = 2.0**40


def float_to_int32_rn(x: np.ndarray) -> np.ndarray:
    """PTX cvt.rni.s32.f32 (CUDA __float2int_rn): half to even, NaN -> 0, saturating."""
    r = np.rint(np.asarray(x, dtype=np.float64))
    info = np.iinfo(np.int32)
    return np.clip(np.nan_to_num(r), info.min, info.max).astype(np.int64)  # nan_to_num: NaN -> 0


def lane_words(ints: np.ndarray) -> np.ndarray:
    """[n, C] lane integers -> [n, C / 2] words lo + 2^32 hi, as int64 bits (mod 2^64)."""
    lo = ints[:, 0::2].astype(np.int64).view(np.uint64)
    hi = ints[:, 1::2].astype(np.int64).view(np.uint64)
    return (lo + (hi << np.uint64(32))).view(np.int64)


def contribution_bounds(scaled: np.ndarray) -> np.ndarray:
    """What each contribution adds to its kv row's Bound (int64)."""
    with np.errstate(invalid="ignore"):
        peak = np.abs(scaled).max(axis=1)
    peak = np.where(np.isnan(peak), np.inf, peak).astype(np.float32)
    return np.minimum(np.ceil(peak), np.float32(BOUND_CAP)).astype(np.int64)


class LanesModelLauncher(LanesSums, ModelLauncher):
    """ModelLauncher whose fixed launches add into lanes (LanesSums decides, decodes and redoes)."""

    def __init__(self, gain: int = 18, instruments=None):
        ModelLauncher.__init__(self, True, instruments)
        self._lanes_init(gain)
        self.name = f"model-lanes-gain{gain}"
        self._target = None

    def add_lanes(self, words, bound, scale, **launch):
        self._target = (words, bound, scale)
        try:
            ModelLauncher.main_bwd(self, **launch)
        finally:
            self._target = None

    def add_int64(self, gate, **launch):
        if gate is None or bool(gate):  # the GPU kernel's early exit where the gate is 0
            ModelLauncher.main_bwd(self, **launch)

    def _fixed_add(self, acc, rows, contrib, row_scale):
        if self._target is None:
            return ModelLauncher._fixed_add(acc, rows, contrib, row_scale)
        if rows.numel() == 0:
            return
        words, bound, scale = self._target
        scaled = (contrib * scale[rows].view(-1, 1)).numpy()  # fp32, exact: a power of two
        np.add.at(words.numpy().view(np.uint64), rows.numpy(), lane_words(float_to_int32_rn(scaled)).view(np.uint64))
        np.add.at(bound.numpy(), rows.numpy(), contribution_bounds(scaled))


class RecordingLanesLauncher(LanesModelLauncher):
    """LanesModelLauncher that keeps the last call's per-kv-row Bound (``bound``)."""

    def fixed_to_bf16(self, acc, row_scale, dst):
        self.bound = self._pending[acc.data_ptr()]["bound"].clone()
        return super().fixed_to_bf16(acc, row_scale, dst)


def lanes_backward(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None,
                   dkv_buf_bytes=None, gain: int = 12):
    """SPEC's backward on the CPU, dKV summed in the lanes design (torch tensors). At gain 12
    the suite's small cases take the lanes (their plans' headroom is about 14 to 16 bits)."""
    return wrapper.backward_with(LanesModelLauncher(gain), query, kv, out, grad_out, lse, attn_sink, token_indices,
                                 sm_scale, block_h=block_h, dkv_buf_bytes=dkv_buf_bytes)


def lanes_backward_redo(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None,
                        dkv_buf_bytes=None):
    """lanes_backward at gain 16: on the suite's small cases some kv rows' bounds fail, so a
    call mixes rows decoded from the lanes with rows redone in int64."""
    return lanes_backward(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, block_h=block_h,
                          dkv_buf_bytes=dkv_buf_bytes, gain=16)


def _only_torch():
    from mqa_bwd.contract import Domain

    return Domain(frameworks=("torch",))


lanes_backward.domain = lanes_backward_redo.domain = _only_torch()
