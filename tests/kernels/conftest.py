"""Where the Triton kernels of these tests run: Triton's interpreter on CPU (the default, TRITON_INTERPRET=1
from tests/conftest.py), or compiled for a GPU with MINIVLLM_KERNEL_TEST_DEVICE=cuda (benchmarks/cuda_check.py).

On a GPU the tests stay as they are: they build their inputs on CPU and compare with the CPU references.
Each Triton launcher they import is wrapped here, before the test modules import it, so that its tensor
arguments are copied to the GPU, the compiled kernel runs there, and its results (returned or written in
place into an argument) are copied back. Run these in a pytest process of their own: the wrapping stays
for the rest of the process."""

from __future__ import annotations

import functools
import importlib
import os

import torch

# module -> its Triton launchers (the functions the tests call that launch a kernel)
LAUNCHERS = {
    "minivllm.kernels.paged_attention": ("paged_attention",),
    "minivllm.kernels.split_kv_decode": ("split_kv_decode",),
    "minivllm.kernels.grouped_decode_attention": ("grouped_decode_attention",),
    "minivllm.kernels.kv_cache_write": ("kv_cache_write",),
    "minivllm.kernels.sampling": ("compute_cutoffs", "gumbel_argmax", "triton_sample"),
    "minivllm.kernels.rejection_sampling": ("triton_rejection_sample",),
    "minivllm.kernels.gated_delta_rule": ("fused_recurrent_gated_delta_rule",),
    "minivllm.kernels.fused_moe": ("fused_moe",),
}


def _on(device: torch.device, launcher):
    @functools.wraps(launcher)
    def run(*args, **kwargs):
        moved = {}  # id of a CPU tensor argument -> its copy on the device

        def to_device(x):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                return moved.setdefault(id(x), (x, x.to(device)))[1]
            if isinstance(x, (tuple, list)):  # e.g. paged_attention's tiles
                return type(x)(map(to_device, x))
            return x

        out = launcher(*[to_device(a) for a in args], **{k: to_device(v) for k, v in kwargs.items()})
        for original, copy in moved.values():  # what the kernel wrote in place (caches, states)
            original.copy_(copy)

        def back(x):
            if isinstance(x, torch.Tensor):
                return x.cpu() if moved else x
            if isinstance(x, tuple):
                return type(x)(*map(back, x)) if hasattr(x, "_fields") else tuple(map(back, x))
            return x

        return back(out)

    return run


_device = os.environ.get("MINIVLLM_KERNEL_TEST_DEVICE", "cpu")
if _device != "cpu":
    for _name, _functions in LAUNCHERS.items():
        _module = importlib.import_module(_name)
        for _function in _functions:
            setattr(_module, _function, _on(torch.device(_device), getattr(_module, _function)))
