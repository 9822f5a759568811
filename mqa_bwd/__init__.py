"""Deterministic backward of sparse absorbed MQA with an attention sink (docs/SPEC.md).

The public API is imported on first use, so that the layers below it
(``mqa_bwd.contract``, ``mqa_bwd.edge``) can be imported without torch's
start-up or the implementation.
"""

from .contract import BACKENDS

__all__ = ["mqa_latent_sparse_bwd", "BACKENDS", "default_backend", "Instruments", "scratch_bytes"]


def __getattr__(name):
    if name == "mqa_latent_sparse_bwd":
        from .wrapper import mqa_latent_sparse_bwd

        return mqa_latent_sparse_bwd
    if name == "scratch_bytes":
        from .wrapper import scratch_bytes

        return scratch_bytes
    if name == "default_backend":
        from .backends import default_backend

        return default_backend
    if name == "Instruments":
        from .contract import Instruments

        return Instruments
    raise AttributeError(f"module 'mqa_bwd' has no attribute {name!r}")
