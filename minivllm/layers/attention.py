"""Choosing the attention backend: `get_attention_backend(name, device, ...)`.

    "torch"   layers/torch_attention.py   plain tensor ops + SDPA (and a C++ decode kernel on CPU)
    "triton"  layers/triton_attention.py  the paged-attention kernels of kernels/
    "auto"    Triton on CUDA, PyTorch elsewhere (on CPU, Triton runs only in its slow interpreter)

The interface both implement, `AttentionBackend`, and the per-step `AttentionMetadata` live in
`attention_interface.py`; they are re-exported here so that `from minivllm.layers.attention import
AttentionBackend, AttentionMetadata, get_attention_backend` gives a caller everything at once.
The backends are imported inside the factory, so loading this module does not load Triton.
"""

from __future__ import annotations

import torch

from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def get_attention_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int,
                          head_dim: int, block_size: int) -> AttentionBackend:
    """"auto" is Triton on CUDA and PyTorch on CPU (where Triton runs only in its slow interpreter)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from minivllm.layers.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, device, block_size)
    from minivllm.layers.torch_attention import TorchAttentionBackend

    return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
