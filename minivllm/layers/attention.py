"""Choosing the attention backend: `get_attention_backend(name or instance, device, ...)`.

    "torch"   layers/torch_attention.py   plain tensor ops + SDPA (and a C++ decode kernel on CPU)
    "triton"  layers/triton_attention.py  the paged-attention kernels of kernels/
    "auto"    Triton on CUDA, PyTorch elsewhere (on CPU, Triton runs only in its slow interpreter)
    yours     an `AttentionBackend` instance, used as it is once its heads are checked against the model's

The interface both implement, `AttentionBackend`, and the per-step `AttentionMetadata` live in
`attention_interface.py`; they are re-exported here so that `from minivllm.layers.attention import
AttentionBackend, AttentionMetadata, get_attention_backend` gives a caller everything at once.
The backends are imported inside the factory, so loading this module does not load Triton.
"""

from __future__ import annotations

import torch

from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def get_attention_backend(choice: str | AttentionBackend, device: torch.device, num_heads: int, num_kv_heads: int,
                          head_dim: int, block_size: int) -> AttentionBackend:
    """"auto" is Triton on CUDA and PyTorch on CPU (where Triton runs only in its slow interpreter); an
    instance (the engine's `attention_backend` of your own) is returned once its shapes match these."""
    if isinstance(choice, AttentionBackend):
        theirs = tuple(getattr(choice, a, None) for a in ("num_heads", "num_kv_heads", "head_dim"))  # its __init__'s
        if theirs != (num_heads, num_kv_heads, head_dim):
            raise ValueError(f"attention_backend={type(choice).__name__}(num_heads={theirs[0]}, num_kv_heads="
                             f"{theirs[1]}, head_dim={theirs[2]}) does not fit the model, which has num_heads="
                             f"{num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}: build the backend with those")
        return choice
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "triton":
        from minivllm.layers.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, device, block_size)
    from minivllm.layers.torch_attention import TorchAttentionBackend

    return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
