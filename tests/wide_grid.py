"""The wide tile's 64-head tiles as a launch each, for tests that compare it with the one grid the
wrapper asks for (tests/test_wrapper_model.py on the CPU model, tests/test_gpu_kernels.py on the
H200)."""

import dataclasses


class TileALaunch:
    """A launcher mixin: a launch of several wide tiles runs as one launch of a tile each."""

    def main_bwd(self, *args, config, head_base=0, **kw):
        for tile in range(config.tiles):
            super().main_bwd(*args, config=dataclasses.replace(config, tiles=1), head_base=head_base + tile * config.heads,
                             **kw)
