"""Reference (oracle) for the sparse absorbed-MQA backward with an attention sink."""

from .reference import backward, backward_bf16_baseline, forward

__all__ = ["forward", "backward", "backward_bf16_baseline"]
