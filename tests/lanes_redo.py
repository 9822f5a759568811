"""The int64 design on the wide tile, for tests that compare the lanes with it (tests/test_lanes.py
on the CPU model, tests/test_gpu_kernels.py on the H200)."""

from mqa_bwd import fixed_point


class ForcedRedo:
    """A launcher mixin: every lanes launch fails its bound without adding, so every call's wide
    launches are the int64 redo."""

    def main_bwd(self, *args, config, bound=None, **kw):
        if config.accumulate == "lanes":
            bound.fill_(fixed_point.LANE_LIMIT)
            return
        super().main_bwd(*args, config=config, **kw)
