"""Backend names and how to pick the best one a machine has."""

import functools
import warnings

import torch

from .contract import BACKENDS, GPU_BACKENDS


@functools.lru_cache(maxsize=None)
def _hopper_missing() -> str | None:
    """Why the TileLang backends cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability()[0] != 9:
        return f"the CUDA device is {torch.cuda.get_device_name()}, not Hopper (sm_90)"
    try:
        import tilelang  # noqa: F401
    except Exception as err:  # a broken install must say so, not quietly leave only the model
        warnings.warn(f"a Hopper GPU is present but tilelang does not import ({err!r}); "
                      "only the CPU model backends are available", stacklevel=2)
        return f"tilelang does not import: {err!r}"
    return None


def hopper_available() -> bool:
    """A CUDA device of compute capability 9.x and an importable tilelang."""
    return _hopper_missing() is None


def unavailable(backend: str | None) -> str | None:
    """Why ``backend`` cannot run on this machine, or None (the seam's backend_unavailable)."""
    if backend in GPU_BACKENDS:
        missing = _hopper_missing()
        return None if missing is None else f"backend {backend!r} needs a Hopper (sm_90) GPU and tilelang: {missing}"
    return None


def default_backend(device: torch.device | None = None) -> str:
    if (device is None or device.type == "cuda") and hopper_available():
        return "tilelang"
    return "model"


def get_launcher(backend, device: torch.device | None = None, instruments=None):
    """The launcher of ``backend`` (None: default_backend(device)), with ``instruments``
    (mqa_bwd.contract.Instruments or None) injected."""
    from .launch import TileLangLauncher
    from .model import ModelLauncher

    if backend is None:
        backend = default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend.startswith("model"):
        return ModelLauncher(deterministic=backend == "model", instruments=instruments)
    if not hopper_available():
        raise ValueError(f"backend: {backend!r} needs a Hopper GPU (sm_90) and tilelang: {_hopper_missing()}")
    # CPU tensors are not the kernels' device: validation then names them.
    cuda = device if device is not None and device.type == "cuda" else None
    return TileLangLauncher(deterministic=backend == "tilelang", device=cuda, instruments=instruments)
