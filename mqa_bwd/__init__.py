"""Deterministic backward of sparse absorbed MQA with an attention sink (see SPEC.md)."""

from .backends import BACKENDS, default_backend
from .wrapper import mqa_latent_sparse_bwd

__all__ = ["mqa_latent_sparse_bwd", "BACKENDS", "default_backend"]
