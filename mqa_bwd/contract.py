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


#: Invalid-index kinds SPEC names (anything outside [0, S_kv)); a Domain may accept fewer.
INVALID_INDEX_KINDS = ("minus_one", "int32_min", "negative", "s_kv", "above_s_kv", "int32_max",
                       "near_negative", "near_above_s_kv")
SINK_SUPPORT = ("optional", "required", "unsupported")
FRAMEWORKS = ("torch", "paddle")


@dataclasses.dataclass(frozen=True)
class Domain:
    """What an implementation supports, inside what docs/SPEC.md allows.

    Declared by an implementation (a ``domain`` attribute of its function) or
    given on the command line (``--domain``), so that the harness draws cases
    inside it and reports once how the implementation behaves just outside it.
    A field left at its default means "whatever SPEC allows".
    """

    heads: tuple | None = None  # (lo, hi) inclusive
    heads_multiple: int = 1
    topk_min: int = 1
    topk_multiple: int = 1
    widths: tuple | None = None  # ((d_k, d_v), ...)
    batch_max: int | None = None
    sink: str = "optional"  # SINK_SUPPORT
    invalid_indices: tuple | None = None  # INVALID_INDEX_KINDS accepted; None: all of them
    causal_indices: bool = False  # every valid index <= s + S_kv - S
    frameworks: tuple = FRAMEWORKS

    def __post_init__(self):
        def positive(name, value):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"domain.{name}: expected a positive integer, got {value!r}")

        if self.heads is not None:
            heads = tuple(self.heads)
            if len(heads) != 2 or heads[0] > heads[1]:
                raise ValueError(f"domain.heads: expected (lo, hi) with lo <= hi, got {self.heads!r}")
            for h in heads:
                positive("heads", h)
            object.__setattr__(self, "heads", heads)
        for name in ("heads_multiple", "topk_min", "topk_multiple"):
            positive(name, getattr(self, name))
        if self.batch_max is not None:
            positive("batch_max", self.batch_max)
        if self.widths is not None:
            widths = tuple(tuple(w) for w in self.widths)
            if not widths or any(len(w) != 2 for w in widths):
                raise ValueError(f"domain.widths: expected ((d_k, d_v), ...), got {self.widths!r}")
            for w in widths:
                for d in w:
                    positive("widths", d)
            object.__setattr__(self, "widths", widths)
        if self.sink not in SINK_SUPPORT:
            raise ValueError(f"domain.sink: one of {SINK_SUPPORT}, got {self.sink!r}")
        if self.invalid_indices is not None:
            kinds = tuple(self.invalid_indices)
            unknown = [k for k in kinds if k not in INVALID_INDEX_KINDS]
            if unknown:
                raise ValueError(f"domain.invalid_indices: {unknown} not in {INVALID_INDEX_KINDS}")
            object.__setattr__(self, "invalid_indices", kinds)
        frameworks = tuple(self.frameworks)
        if not frameworks or any(f not in FRAMEWORKS for f in frameworks):
            raise ValueError(f"domain.frameworks: a non-empty subset of {FRAMEWORKS}, got {self.frameworks!r}")
        object.__setattr__(self, "frameworks", frameworks)
