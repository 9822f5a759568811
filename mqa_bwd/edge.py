"""The framework edge: torch, paddle and NumPy tensors converted one way, everywhere.

bf16 bits are never changed: NumPy holds them as ``ml_dtypes.bfloat16``, torch
as ``torch.bfloat16``, paddle as ``paddle.bfloat16`` (whose ``.numpy()`` gives
uint16 bits). torch moves to and from paddle through DLPack, zero-copy. Every
error is a ValueError that names the argument.
"""

import ml_dtypes
import numpy as np

FRAMEWORKS = ("torch", "paddle", "numpy")


def framework_of(x) -> str | None:
    """'torch', 'paddle' or 'numpy' for a tensor or array of that framework, else None."""
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__ or ""
    for name in ("torch", "paddle"):
        if module.startswith(name):
            return name
    return None


def to_numpy(x, name: str = "tensor") -> np.ndarray:
    """torch / paddle / NumPy -> a NumPy array on the host (bf16 as ml_dtypes.bfloat16)."""
    framework = framework_of(x)
    if framework == "numpy":
        return x
    if framework == "torch":
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if framework == "paddle":
        import paddle

        if x.dtype == paddle.bfloat16:
            return x.cpu().numpy().view(np.uint16).view(ml_dtypes.bfloat16)
        return x.cpu().numpy()
    if np.isscalar(x):
        return np.asarray(x)
    raise ValueError(f"{name}: expected a torch tensor, a paddle tensor or a NumPy array, got {type(x).__name__}")


def numpy_to_torch(a: np.ndarray, device="cpu"):
    """A NumPy array -> a torch tensor on ``device`` (a copy; bf16 bits kept)."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a.copy())
    return t.to(device)


def _paddle_place(device):
    import paddle

    text = str(device)
    if not text.startswith("cuda"):
        return paddle.CPUPlace()
    return paddle.CUDAPlace(int(text.partition(":")[2] or 0))


def numpy_to(a: np.ndarray, framework: str, device="cpu"):
    """A NumPy array -> a tensor of ``framework`` on ``device`` (bf16 bits kept)."""
    if framework == "numpy":
        return a
    if framework == "torch":
        return numpy_to_torch(a, device)
    if framework == "paddle":
        import paddle

        place = _paddle_place(device)
        if a.dtype == ml_dtypes.bfloat16:
            return paddle.to_tensor(np.ascontiguousarray(a).view(np.uint16), place=place).view(paddle.bfloat16)
        return paddle.to_tensor(np.ascontiguousarray(a), place=place)
    raise ValueError(f"framework: expected one of {FRAMEWORKS}, got {framework!r}")


def to_torch(x, name: str = "tensor", accept=("torch", "paddle", "numpy")):
    """A tensor of one of the ``accept``ed frameworks -> a torch tensor, on its own device
    (paddle through DLPack, zero-copy; NumPy copied to the CPU)."""
    framework = framework_of(x)
    if framework not in accept:
        tensors = [f for f in accept if f != "numpy"]
        kinds = " or ".join((["a " + " or ".join(tensors) + " tensor"] if tensors else [])
                            + (["a NumPy array"] if "numpy" in accept else []))
        raise ValueError(f"{name}: expected {kinds}, got {type(x).__name__}")
    if framework == "torch":
        return x
    if framework == "paddle":
        import torch

        # paddle exports no tensor that requires grad (stop_gradient=False); its
        # detached view shares the memory.
        return torch.from_dlpack(x.detach() if not x.stop_gradient else x)
    return numpy_to_torch(x)


def as_cpu_torch(x, name: str = "tensor"):
    """Any framework's tensor -> a contiguous CPU torch tensor, bits unchanged."""
    return to_torch(x, name).detach().to("cpu").contiguous()


def from_torch(t, framework: str):
    """A torch tensor -> the same tensor in ``framework`` (paddle through DLPack; NumPy on the host)."""
    if framework == "torch":
        return t
    if framework == "paddle":
        import paddle

        return paddle.utils.dlpack.from_dlpack(t.contiguous())
    if framework == "numpy":
        return to_numpy(t)
    raise ValueError(f"framework: expected one of {FRAMEWORKS}, got {framework!r}")


def bits(t):
    """A torch tensor's raw bits as a same-shaped integer tensor: torch.equal of two such views
    is bitwise equality, NaN payloads and signed zeros included."""
    import torch

    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a, b) -> bool:
    """Whether two torch tensors hold the same dtype, shape and raw bits (so -0 differs from +0,
    and a NaN equals only its own payload)."""
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def dtype_name(dtype, framework: str = "torch") -> str:
    """A torch dtype as ``framework`` spells it: torch.bfloat16, or paddle.bfloat16 for a paddle
    caller (paddle names its dtypes as torch does), so that a message speaks the caller's framework."""
    text = str(dtype)
    if framework == "paddle":
        return "paddle." + text.removeprefix("torch.")
    return text


def device_name(device, framework: str = "torch") -> str:
    """A torch device as ``framework`` spells it: cpu / cuda:0, or Place(cpu) / Place(gpu:0) for paddle."""
    text = str(device)
    if framework == "paddle":
        return "Place(" + text.replace("cuda", "gpu") + ")"
    return text
