"""What docs/SPEC.md fixes and every layer shares: names, backends, the instrumentation seam.

Standard library only, so that the oracle's users, the harness and the
implementation can all import it without importing each other (the layers are
listed in docs/design.md; tests/test_layers.py enforces them).

The instrumentation seam is the one way the harness sees inside an
implementation beyond the SPEC signature. An implementation that supports it
takes ``instruments=`` (an ``Instruments``) as a keyword; one that does not is
still tested, with the properties that need the seam reduced to what the
signature shows.
"""

import collections
import dataclasses
import threading
from typing import Callable

#: The SPEC signature's positional arguments, in order.
SPEC_ARGS = ("query", "kv", "out", "grad_out", "lse", "attn_sink", "token_indices", "sm_scale")
#: The SPEC signature's outputs, in order.
OUTPUT_NAMES = ("dq", "dkv", "d_attn_sink")
#: This project's implementation, as ``--impl`` names it.
OURS = "mqa_bwd:mqa_latent_sparse_bwd"
#: The implementations behind ``backend=``: the TileLang kernels (deterministic, and
#: the fp32-atomic control) and their CPU tile models.
BACKENDS = ("tilelang", "tilelang-atomic", "model", "model-atomic")
GPU_BACKENDS = ("tilelang", "tilelang-atomic")
#: The head-group widths SPEC allows for ``block_h``.
BLOCK_H_CHOICES = (16, 32)


def backend_device(backend: str | None, cuda_available: Callable[[], bool] | None = None) -> str:
    """Where a backend's tensors live: the GPU backends on CUDA, the models on the CPU;
    None (the default backend) on CUDA where ``cuda_available()`` says there is one."""
    if backend in GPU_BACKENDS:
        return "cuda"
    if backend is None and cuda_available is not None and cuda_available():
        return "cuda"
    return "cpu"


class BoundsError(IndexError):
    """An implementation's own detection of an access outside a buffer (the CPU tile
    model raises a subclass). The harness reports it as a memory-safety failure."""


@dataclasses.dataclass
class Instruments:
    """Injected by a caller that wants to see a call's allocations and launches.

    ``allocate(shape, dtype, device) -> tensor``: where every scratch, output and
    padded-copy allocation of the call comes from (a guard-banded allocator, say);
    None: the implementation's own. ``counts``: "launches", "allocations" and
    "launch:<kernel>", incremented as they happen (so that a rejected call can be
    shown to have launched and allocated nothing).
    """

    allocate: Callable | None = None
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1
