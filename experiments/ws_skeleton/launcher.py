"""The product's launcher with the skeleton in place of the wide tile's main kernel.

Everything else (validation, slot layout and order, Delta, the fixed-point plan,
the other head groups, the conversions) is the product's, so an A/B against
``mqa_bwd.launch.TileLangLauncher`` times and checks the main kernel alone.
"""

import functools

from mqa_bwd import launch

from .kernel import SLOTS, skeleton_program


@functools.lru_cache(maxsize=None)
def compiled_skeleton(d_k: int, d_v: int, accumulate: str, overlap: bool = True, sector_adds: bool = True):
    from mqa_bwd.kernels import toolchain

    return toolchain.compile_program(skeleton_program(d_k, d_v, accumulate, overlap, sector_adds))


class SkeletonLauncher(launch.TileLangLauncher):
    """Runs the skeleton wherever the product would run its wide 64-head tile."""

    def __init__(self, deterministic: bool = True, device=None, overlap: bool = True, sector_adds: bool = True):
        super().__init__(deterministic=deterministic, device=device)
        self.name = "skeleton" if deterministic else "skeleton-atomic"
        self.knobs = (overlap, sector_adds)

    def compile(self, d_k=576, d_v=512):
        return compiled_skeleton(d_k, d_v, "fixed" if self.deterministic else "atomic", *self.knobs)

    def main_bwd(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, *, config, sm_scale, heads=None, head_base=0,
                 row_scale=None, allowance=None, flag=None):
        if not config.wide:
            return super().main_bwd(q, kv, grad_out, indices, lse2, delta, dq, dkv, config=config, sm_scale=sm_scale,
                                    heads=heads, head_base=head_base, row_scale=row_scale, allowance=allowance, flag=flag)
        if indices.shape[1] % SLOTS:
            raise ValueError(f"token_indices: the skeleton needs the padded top-k ({indices.shape[1]}) to be a "
                             f"multiple of {SLOTS}")
        import torch

        kernel = compiled_skeleton(config.d_k, config.d_v, config.accumulate, *self.knobs)
        if row_scale is None:
            row_scale = torch.empty((kv.shape[0],), dtype=torch.float32, device=kv.device)
            allowance = lse2
            flag = torch.empty((q.shape[0],), dtype=torch.int32, device=kv.device)
        self.launched("main_bwd")
        kernel(q, kv, grad_out, indices, lse2, delta, dq, dkv, row_scale, allowance, flag, float(sm_scale),
               int(head_base), 0, 1)
