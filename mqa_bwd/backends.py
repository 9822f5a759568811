"""Backend names and how to pick the best one a machine has."""

import functools

import torch

BACKENDS = ("tilelang", "tilelang-atomic", "model", "model-atomic")


@functools.lru_cache(maxsize=None)
def hopper_available() -> bool:
    """A CUDA device of compute capability 9.x and an importable tilelang."""
    if not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        import tilelang  # noqa: F401
    except Exception:
        return False
    return True


def default_backend(device: torch.device | None = None) -> str:
    if (device is None or device.type == "cuda") and hopper_available():
        return "tilelang"
    return "model"


def get_launcher(backend, device: torch.device | None = None):
    from .launch import TileLangLauncher
    from .model import ModelLauncher

    if backend is None:
        backend = default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend.startswith("model"):
        return ModelLauncher(deterministic=backend == "model")
    if not hopper_available():
        raise ValueError(f"backend: {backend!r} needs a Hopper GPU (sm_90) and tilelang; this machine has none")
    return TileLangLauncher(deterministic=backend == "tilelang", device=device)
