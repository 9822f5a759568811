"""Per-head arithmetic shared by the wrapper and the CPU tile model (below both)."""

import torch


def per_head(fn, rows: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """fn(rows[:, h], heads[h]) for every head h, as an [R, H] tensor.

    On a CPU, torch's vectorised transcendental functions round an element
    differently in the vector body and in the scalar tail (AVX-512), so a
    head's value would depend on how many heads share the call. One call per
    head makes every head's arithmetic the same whatever H is. GPU kernels
    compute per element already.
    """
    if rows.device.type != "cpu":
        return fn(rows, heads.view(1, -1))
    return torch.stack([fn(rows[:, h].contiguous(), heads[h]) for h in range(rows.shape[1])], dim=1)
