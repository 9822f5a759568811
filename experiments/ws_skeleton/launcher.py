"""The product's launcher with the skeleton in place of the wide tile's main kernel.

Everything else (validation, slot layout and order, Delta, the fixed-point plan,
the other head groups, the conversions) is the product's, so an A/B against
``mqa_bwd.launch.TileLangLauncher`` times and checks the main kernel alone.
"""

import functools

from mqa_bwd import launch

from .kernel import SLOTS, skeleton_program


@functools.lru_cache(maxsize=None)
def compiled_skeleton(d_k: int, d_v: int, accumulate: str, overlap: bool = True, sector_adds: bool = True,
                      prefetch: bool = False, pair_stores: bool = False, wg0_chunks: int = 0, row_stages: int = 0):
    from mqa_bwd.kernels import toolchain

    return toolchain.compile_program(skeleton_program(d_k, d_v, accumulate, overlap, sector_adds, prefetch, pair_stores,
                                                      wg0_chunks, row_stages))


class SkeletonLauncher(launch.TileLangLauncher):
    """Runs the skeleton wherever the product would run its wide 64-head tile."""

    def __init__(self, deterministic: bool = True, device=None, overlap: bool = True, sector_adds: bool = True,
                 accumulate=None, prefetch: bool = False, pair_stores: bool = False, wg0_chunks: int = 0):
        super().__init__(deterministic=deterministic, device=device)
        self.name = "skeleton" if deterministic else "skeleton-atomic"
        self.knobs = (overlap, sector_adds, prefetch, pair_stores, wg0_chunks)  # skeleton_program's, after accumulate
        self.lanes_knobs = ()  # the lanes kernel's own (row_stages), after those
        self.accumulate = accumulate  # None: the configuration's; "none": no adds (a timing of the rest)

    def main_bwd(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, *, config, sm_scale, heads=None, head_base=0,
                 row_scale=None, allowance=None, flag=None):
        if not config.wide:
            return super().main_bwd(q, kv, grad_out, indices, lse2, delta, dq, dkv, config=config, sm_scale=sm_scale,
                                    heads=heads, head_base=head_base, row_scale=row_scale, allowance=allowance, flag=flag)
        self.run_skeleton(self.accumulate or config.accumulate, q, kv, grad_out, indices, lse2, delta, dq, dkv, config=config,
                          sm_scale=sm_scale, head_base=head_base, row_scale=row_scale, allowance=allowance, flag=flag)

    def run_skeleton(self, accumulate, q, kv, grad_out, indices, lse2, delta, dq, dkv, *, config, sm_scale, head_base,
                     row_scale, allowance, flag, bound=None, gate=None):
        import torch

        if indices.shape[1] % SLOTS:
            raise ValueError(f"token_indices: the skeleton needs the padded top-k ({indices.shape[1]}) to be a "
                             f"multiple of {SLOTS}")
        kernel = compiled_skeleton(config.d_k, config.d_v, accumulate, *self.knobs,
                                   *(self.lanes_knobs if accumulate == "lanes" else ()))
        if row_scale is None:  # the atomic kernel never touches them; the signature is shared
            row_scale = torch.empty((kv.shape[0],), dtype=torch.float32, device=kv.device)
            allowance = lse2
            flag = torch.empty((q.shape[0],), dtype=torch.int32, device=kv.device)
        if bound is None:  # the lanes design's only
            bound = torch.empty((kv.shape[0],), dtype=torch.int64, device=kv.device)
        if gate is None:
            gate = torch.ones((1,), dtype=torch.int32, device=kv.device)
        self.launched("main_bwd")
        kernel(q, kv, grad_out, indices, lse2, delta, dq, dkv, row_scale, allowance, flag, float(sm_scale),
               int(head_base), 0, 1, bound, gate)


#: A column's final sum must fit 32 signed bits for its lanes to decode exactly.
LANE_LIMIT = 2**31


def lanes_scale(row_scale, gain: int):
    """The lanes' row scales: the plan's (which keeps every int64 partial sum below 2^61) times
    2^(gain - 30). gain = 0 keeps every partial sum of a lane below 2^31 by the plan's proof
    alone, far above the real sums; each bit of gain is a bit of resolution, until a row's
    Bound reaches LANE_LIMIT and the call takes the int64 redo."""
    if not 0 <= gain <= 30:
        raise ValueError(f"gain: {gain!r} (0 to 30: a lane integer is 2^(30 - gain) of the plan's)")
    return row_scale * 2.0 ** (gain - 30)


def decode_words(words):
    """[N, C / 2] int64 words lo + 2^32 hi of two signed 32-bit lanes (summed mod 2^64) ->
    [N, C] int64 lane sums; exact whenever each lane's final sum fits 32 signed bits."""
    import torch

    lo = (words << 32) >> 32  # arithmetic shifts: the low lane, sign-extended
    hi = (words - lo) >> 32
    return torch.stack((lo, hi), dim=-1).reshape(words.shape[0], -1)


class LanesSums:
    """The lanes design's host side, for a launcher that can add into lanes and into int64
    (``add_lanes``, ``add_int64``): dKV summed in two signed 32-bit lanes a 64-bit word, exact
    by a bound summed per kv row as the adds go out.

    Where every kv row's Bound stays below LANE_LIMIT, the decoded lanes are added into the
    int64 accumulator (exactly: a power-of-two shift) and converted as the fixed design's sums;
    otherwise the whole call is redone with int64 adds (the fixed design, at the plan's scale).
    Both decisions follow from integer sums, so the bits are the same on every run. The redo is
    launched on every call with a device flag (``add_int64(gate=...)``) that ends its CTAs at
    once where no bound failed: no host synchronisation.
    """

    def _lanes_init(self, gain: int):
        self.gain = gain
        self._redo_count = None  # a device counter of the calls whose int64 redo ran
        self._pending = {}  # dkv accumulator address -> the call's lanes, bounds and launches

    def _lanes_state(self, dkv, config, kv):
        import torch

        state = self._pending.get(dkv.data_ptr())
        if state is None:  # the call's first launch (H = 128 has two, into the same sums)
            state = self._pending[dkv.data_ptr()] = dict(
                words=torch.zeros((kv.shape[0], config.d_k // 2), dtype=torch.int64, device=kv.device),
                bound=torch.zeros((kv.shape[0],), dtype=torch.int64, device=kv.device), launches=[])
        return state

    def main_bwd(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, *, config, sm_scale, heads=None, head_base=0,
                 row_scale=None, allowance=None, flag=None):
        launch = dict(q=q, kv=kv, grad_out=grad_out, indices=indices, lse2=lse2, delta=delta, dq=dq, dkv=dkv,
                      config=config, sm_scale=sm_scale, heads=heads, head_base=head_base, row_scale=row_scale,
                      allowance=allowance, flag=flag)
        if config.accumulate != "fixed":
            return self.add_int64(gate=None, **launch)
        state = self._lanes_state(dkv, config, kv)
        state["launches"].append(launch)
        try:
            self.add_lanes(state["words"], state["bound"], lanes_scale(row_scale, self.gain), **launch)
        except BaseException:
            self._pending.pop(dkv.data_ptr(), None)  # a refused launch keeps none of the call's tensors
            raise

    def fixed_to_bf16(self, acc, row_scale, dst):
        state = self._pending.pop(acc.data_ptr(), None)
        if state is None:
            return super().fixed_to_bf16(acc, row_scale, dst)
        import torch

        # No host synchronisation: the int64 redo is launched on every call and its CTAs end at
        # once unless some kv row's bound failed. Then acc holds the int64 design's sums and the
        # lanes are dropped; else the lanes join acc exactly (their scale is the plan's times
        # 2^(gain - 30), so a lane integer is 2^(30 - gain) of acc's). Either way one int64
        # conversion, and a call is the lanes design or the int64 design bit for bit.
        need = (state["bound"] >= LANE_LIMIT).any().to(torch.int32).reshape(1)
        self._redo_count = need if self._redo_count is None else self._redo_count + need
        for recorded in state["launches"]:
            self.add_int64(gate=need, **recorded)
        acc += (decode_words(state["words"]) << (30 - self.gain)) * (1 - need).to(torch.int64)
        super().fixed_to_bf16(acc, row_scale, dst)

    @property
    def redos(self) -> int:
        """Calls so far whose int64 redo ran (reading it synchronises with the device)."""
        return 0 if self._redo_count is None else int(self._redo_count.item())


class LanesLauncher(LanesSums, SkeletonLauncher):
    """The skeleton's lanes kernel (accumulate "lanes") on the wide tile; the redo is the
    skeleton's fixed kernel with sector adds."""

    def __init__(self, gain: int = 18, device=None, overlap: bool = True, prefetch: bool = False,
                 pair_stores: bool = False, wg0_chunks: int = 0, row_stages: int = 0):
        super().__init__(True, device=device, overlap=overlap, sector_adds=True, prefetch=prefetch,
                         pair_stores=pair_stores, wg0_chunks=wg0_chunks)
        self.lanes_knobs = (row_stages,)
        self._lanes_init(gain)
        self.name = f"lanes-gain{gain}"

    def add_lanes(self, words, bound, scale, *, dkv, config, heads, **launch):
        if not config.wide:
            raise ValueError(f"config: the lanes kernel covers wide tiles only, got {config}")
        args = [launch.pop(k) for k in ("q", "kv", "grad_out", "indices", "lse2", "delta", "dq")]
        launch["row_scale"] = scale
        self.run_skeleton("lanes", *args, words, config=config, bound=bound, **launch)

    def add_int64(self, gate, config, **launch):
        args = [launch.pop(k) for k in ("q", "kv", "grad_out", "indices", "lse2", "delta", "dq", "dkv")]
        launch.pop("heads")
        self.run_skeleton(config.accumulate, *args, config=config, gate=gate, **launch)
