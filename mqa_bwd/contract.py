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
import importlib
import threading
from typing import Callable

#: The SPEC signature's positional arguments, in order.
SPEC_ARGS = ("query", "kv", "out", "grad_out", "lse", "attn_sink", "token_indices", "sm_scale")
#: The SPEC signature's outputs, in order.
OUTPUT_NAMES = ("dq", "dkv", "d_attn_sink")
#: This project's implementation, as ``--impl`` names it.
OURS = "mqa_bwd:mqa_latent_sparse_bwd"
#: cuDNN-frontend's DSA backward behind the SPEC signature (a peer: the ``cudnn`` extra), as ``--impl`` names it.
CUDNN = "mqa_bwd.cudnn:cudnn_backward"
#: Peers the tools name by one word (``bench --backends``, ``repro --against``): word ->
#: 'module:function'. A peer takes no ``backend=``; its function describes itself, so a new
#: peer is one entry here: ``device`` (the device type its tensors must be on),
#: ``backend_unavailable(None)`` (why it cannot run here, or None), ``domain``, and
#: ``scratch_bytes(problem)`` (the least dkv_buf_bytes it accepts; without it, a budget is refused).
PEERS = {"cudnn": CUDNN}

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


def peer_function(word: str) -> Callable | None:
    """The SPEC-signature function of the peer PEERS names ``word``, or None for a word it does
    not name (one of our backends). ImportError when its module does not import."""
    spec = PEERS.get(word)
    if spec is None:
        return None
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def peer(word: str) -> tuple:
    """(function, reason) of the peer PEERS names ``word``: its SPEC-signature function (None where
    its module does not import) and why it cannot run here (None where it can): the import's
    error, or the function's own ``backend_unavailable(None)``."""
    try:
        function = peer_function(word)
    except ImportError as err:
        return None, f"{PEERS[word]} does not import: {err!r}"
    ask = getattr(function, "backend_unavailable", None)
    return function, ask(None) if callable(ask) else None


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
    shown to have launched and allocated nothing). ``redone``: for each deterministic
    call with a wide launch, its [1] int32 redo flag on the device, nonzero where a kv
    row's lanes bound failed and the wide launches were redone in int64 (the same bits,
    about twice the time; mqa_bwd.fixed_point, "The lanes"); reading one synchronises.
    """

    allocate: Callable | None = None
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    redone: list = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def note_redone(self, flag) -> None:
        with self._lock:
            self.redone.append(flag)


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

    Its text form (``parse`` / ``to_text``; the command line and REPRO lines)
    is comma-separated ``field=value``, listing only what differs from SPEC::

        heads=2-128,topk_multiple=64,widths=576x512+512x512,sink=required,
        invalid_indices=minus_one+s_kv,causal_indices=yes,frameworks=torch

    ``spec`` is the whole SPEC domain.
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

    # -- text form ---------------------------------------------------------
    @classmethod
    def parse(cls, text: str, base: "Domain | None" = None, option: str = "--domain") -> "Domain":
        """'field=value,...' -> a Domain: the fields named replace ``base``'s (default: SPEC's).
        'spec' (or an empty text) is the whole SPEC domain, whatever ``base`` says.
        Errors are ValueErrors naming ``option`` and the field."""
        text = text.strip()
        if text in ("", "spec"):
            return cls()
        changes = {}
        for item in text.split(","):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or not key:
                raise ValueError(f"{option}: expected field=value, got {item.strip()!r}")
            if key not in _FIELD_ORDER:
                raise ValueError(f"{option}: unknown field {key!r}; one of {', '.join(_FIELD_ORDER)}")
            if key in changes:
                raise ValueError(f"{option}: {key} given twice")
            try:
                changes[key] = _PARSERS[key](value)
            except ValueError as err:
                raise ValueError(f"{option}: {key}={value!r}: {err}") from None
        try:
            return dataclasses.replace(base or cls(), **changes)
        except ValueError as err:
            raise ValueError(f"{option}: {err}") from None

    def to_text(self) -> str:
        """The text ``parse`` reads back to this domain: only the fields that differ from SPEC's."""
        spec = Domain()
        parts = [f"{name}={_FORMATTERS[name](getattr(self, name))}" for name in _FIELD_ORDER
                 if getattr(self, name) != getattr(spec, name)]
        return ",".join(parts) or "spec"

    def __str__(self) -> str:
        return self.to_text()

    @property
    def is_spec(self) -> bool:
        """Is this the whole SPEC domain (nothing declared)?"""
        return self == Domain()

    # -- membership ----------------------------------------------------------
    def admits_heads(self, heads: int) -> bool:
        lo, hi = self.heads or (1, heads)
        return lo <= heads <= hi and heads % self.heads_multiple == 0

    def admits_topk(self, topk: int) -> bool:
        return topk >= self.topk_min and topk % self.topk_multiple == 0

    def violations(self, *, batch=None, heads=None, topk=None, widths=None, sink=None, invalid_indices=None,
                   causal=None, framework=None) -> tuple:
        """Why a case with these dimensions is outside the domain, one text per field it breaks
        (empty: inside). A dimension left None is not checked. ``sink``: is attn_sink given;
        ``invalid_indices``: the invalid-index kinds the indices hold; ``causal``: is every valid
        index <= s + S_kv - S."""
        why = []
        if heads is not None:
            if self.heads is not None and not self.heads[0] <= heads <= self.heads[1]:
                why.append(f"H={heads} is outside heads={_FORMATTERS['heads'](self.heads)}")
            if heads % self.heads_multiple:
                why.append(f"H={heads} is not a multiple of heads_multiple={self.heads_multiple}")
        if topk is not None:
            if topk < self.topk_min:
                why.append(f"L={topk} is below topk_min={self.topk_min}")
            if topk % self.topk_multiple:
                why.append(f"L={topk} is not a multiple of topk_multiple={self.topk_multiple}")
        if widths is not None and self.widths is not None and tuple(widths) not in self.widths:
            why.append(f"(Dk, Dv)=({widths[0]}, {widths[1]}) is not in widths={_FORMATTERS['widths'](self.widths)}")
        if batch is not None and self.batch_max is not None and batch > self.batch_max:
            why.append(f"B={batch} is above batch_max={self.batch_max}")
        if sink is not None:
            if not sink and self.sink == "required":
                why.append("attn_sink is None, but sink=required")
            if sink and self.sink == "unsupported":
                why.append("attn_sink is given, but sink=unsupported")
        if invalid_indices is not None and self.invalid_indices is not None:
            refused = sorted(set(invalid_indices) - set(self.invalid_indices))
            if refused:
                why.append(f"invalid index kinds {'+'.join(refused)} are not in "
                           f"invalid_indices={_FORMATTERS['invalid_indices'](self.invalid_indices)}")
        if causal is not None and self.causal_indices and not causal:
            why.append("the indices are not causal (some valid index > s + S_kv - S), but causal_indices=yes")
        if framework is not None and framework not in self.frameworks:
            why.append(f"framework {framework} is not in frameworks={'+'.join(self.frameworks)}")
        return tuple(why)

    def contains(self, **dimensions) -> bool:
        """Is a case with these dimensions inside the domain? (``violations`` says why not.)"""
        return not self.violations(**dimensions)


_FIELD_ORDER = tuple(f.name for f in dataclasses.fields(Domain))


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("expected an integer") from None


def _parse_heads(text: str) -> tuple:
    lo, sep, hi = text.partition("-")
    return (_parse_int(lo), _parse_int(hi)) if sep else (_parse_int(lo),) * 2


def _parse_widths(text: str) -> tuple:
    pairs = []
    for pair in text.split("+"):
        d_k, sep, d_v = pair.partition("x")
        if not sep:
            raise ValueError("expected DKxDV[+DKxDV...], e.g. 576x512")
        pairs.append((_parse_int(d_k), _parse_int(d_v)))
    return tuple(pairs)


def _parse_yes_no(text: str) -> bool:
    answers = {"yes": True, "true": True, "1": True, "no": False, "false": False, "0": False}
    if text.lower() not in answers:
        raise ValueError("expected yes or no")
    return answers[text.lower()]


def _parse_kinds(text: str):
    if text == "all":
        return None
    return () if text == "none" else tuple(k for k in text.split("+") if k)


_PARSERS = {
    "heads": _parse_heads,
    "heads_multiple": _parse_int,
    "topk_min": _parse_int,
    "topk_multiple": _parse_int,
    "widths": _parse_widths,
    "batch_max": lambda text: None if text == "any" else _parse_int(text),
    "sink": str,
    "invalid_indices": _parse_kinds,
    "causal_indices": _parse_yes_no,
    "frameworks": lambda text: tuple(k for k in text.split("+") if k),
}
_FORMATTERS = {
    "heads": lambda h: f"{h[0]}-{h[1]}" if h[0] != h[1] else str(h[0]),
    "heads_multiple": str,
    "topk_min": str,
    "topk_multiple": str,
    "widths": lambda w: "+".join(f"{d_k}x{d_v}" for d_k, d_v in w),
    "batch_max": str,
    "sink": str,
    "invalid_indices": lambda kinds: "+".join(kinds) if kinds else "none",
    "causal_indices": lambda yes: "yes" if yes else "no",
    "frameworks": lambda f: "+".join(f),
}
