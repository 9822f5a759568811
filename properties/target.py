"""The implementation under test: any function with the SPEC.md signature.

    fn(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale,
       *, block_h=None, dkv_buf_bytes=None, backend=None) -> (dq, dkv, d_attn_sink)

A ``Target`` names it as ``module:function`` (imported from the Python path
exactly as given, so a user's wrapper of ours works), with the backend it is
asked for and the device its tensors live on. Properties drive it only
through that signature.
"""

import dataclasses
import importlib
from typing import Callable

SPEC_ARGS = ("query", "kv", "out", "grad_out", "lse", "attn_sink", "token_indices", "sm_scale")
OUTPUT_NAMES = ("dq", "dkv", "d_attn_sink")
OURS = "mqa_bwd:mqa_latent_sparse_bwd"
GPU_BACKENDS = ("tilelang", "tilelang-atomic")


def load_function(spec: str, option: str = "--impl") -> Callable:
    """'package.module:function' (or 'module:Class.method') -> the callable.

    Errors are ValueErrors naming ``option``, the flag or variable the spec came from.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{option}: expected module:function, got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{option}: cannot import module {module_name!r}: {err}") from err
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{option}: {module_name!r} has no attribute {attribute!r}") from None
    if not callable(obj):
        raise ValueError(f"{option}: {spec!r} is not callable")
    return obj


def backend_device(backend: str | None) -> str:
    """Where a backend's tensors live: the GPU backends on CUDA, everything else on the CPU."""
    if backend in GPU_BACKENDS:
        return "cuda"
    if backend is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


def default_backend() -> str:
    import mqa_bwd

    return mqa_bwd.default_backend()


@dataclasses.dataclass(frozen=True)
class Target:
    function: Callable
    spec: str = OURS  # "module:function", as given on the command line
    backend: str | None = None
    device: str = "cpu"

    @classmethod
    def load(cls, spec: str | None = None, backend: str | None = None) -> "Target":
        spec = spec or OURS
        backend = backend or default_backend()
        return cls(load_function(spec), spec, backend, backend_device(backend))

    @property
    def ours(self) -> bool:
        """Is this our own wrapper (so launch counters and the model's bounds checks speak for it)?"""
        import mqa_bwd

        return self.function is mqa_bwd.mqa_latent_sparse_bwd

    @property
    def needs_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def unavailable(self) -> str | None:
        """Why this target cannot run on this machine, or None."""
        if self.needs_gpu:
            import torch

            if not torch.cuda.is_available():
                return f"backend {self.backend!r} needs a CUDA GPU; this machine has none"
            if self.backend in GPU_BACKENDS:
                from mqa_bwd import backends

                if not backends.hopper_available():
                    return f"backend {self.backend!r} needs a Hopper (sm_90) GPU and tilelang"
        return None

    def __call__(self, tensors: dict, **options):
        """Call with framework tensors (SPEC_ARGS keys) and keyword options."""
        if self.backend is not None:
            options.setdefault("backend", self.backend)
        return self.function(*[tensors[name] for name in SPEC_ARGS], **options)

    def with_function(self, function: Callable, spec: str) -> "Target":
        return dataclasses.replace(self, function=function, spec=spec)
