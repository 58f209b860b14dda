"""Decode attention and greedy sampling: whether the PyTorch backend and the sampler run minivllm's C++
kernels here, measured at warm-up and handed to them.

Two parts of a decode step have a C++ CPU kernel beside torch's way of doing the same thing:

    decode attention + K/V write   gather each request's blocks into a padded tensor and run one SDPA,
                                   writing K/V by index_copy_ (the default) -- or the kernel that reads
                                   the blocks in place (kernels/paged_decode_attention.py) with the memcpy
                                   loop that writes them (kernels/kv_cache_write_cpu.py)
    greedy sampling                argmax_rows over a float32 copy (the default) -- or one pass over the
                                   model's own bf16/fp32 logits (kernels/greedy_argmax.py)

The layers hold the switch (`TorchAttentionBackend.decode_kernel`, `Sampler.greedy_kernel`: a
`KernelChoice`, layers/custom_op.py) and read only whether the kernel is used; they import nothing from
here. This module decides, as the tuner decides everything measured (tuner.py): each kernel must beat
the default on every probe (a batch of short contexts and a few long ones; 32 rows and 1) by its margin,
and the answer is cached per machine, dtype and sizes. Where no kernel is built, or the dtype is one the
kernel does not take, nothing is timed: the default.
"""

from __future__ import annotations

import torch

from minivllm.cpu.tuner import Choice, Probe, Tuning, choose, forced, untimed
from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.kernels.greedy_argmax import greedy_argmax
from minivllm.layers.attention_interface import AttentionMetadata
from minivllm.layers.sampler import GREEDY_CANDIDATES, GREEDY_SUBJECT, Sampler, argmax_rows
from minivllm.layers.torch_attention import DECODE_CANDIDATES, DECODE_SUBJECT, TorchAttentionBackend

# Where decode attention is timed both ways: (rows, context) pairs, a batch of short contexts and a few long ones.
DECODE_PROBES = ((16, 128), (2, 1024))
# Where greedy sampling is timed both ways: rows, of the model's vocabulary.
GREEDY_PROBES = (32, 1)


def untimed_reason(dtype: torch.dtype) -> str | None:
    """Why neither kernel can be timed here (no build, a dtype they lack), or None."""
    build = load_cpu_kernels()
    if not build.available:
        return f"CPU kernels {build.detail}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the kernel takes float32 or bfloat16, not {dtype}"
    return None


@torch.inference_mode()
def choose_decode_kernel(backend: TorchAttentionBackend, dtype: torch.dtype, block_size: int,
                         tuning: Tuning = "cached") -> Choice:
    """Whether the kernel beats gather + SDPA for `backend`'s heads here (DECODE_PROBES, random caches); set
    on the backend and returned. CPU only."""
    why = untimed_reason(dtype)
    if why is not None:
        choice = untimed(DECODE_CANDIDATES[0], why)
    else:
        entry = (f"decode_attention {str(dtype).removeprefix('torch.')} heads {backend.num_heads}/"
                 f"{backend.num_kv_heads} dim {backend.head_dim} block {block_size} probes {DECODE_PROBES}")
        chosen = backend.decode_kernel
        try:
            choice = choose(entry, DECODE_CANDIDATES, lambda: [_decode_probe(backend, rows, context, dtype, block_size)
                                                               for rows, context in DECODE_PROBES], tuning)
        finally:
            backend.decode_kernel = chosen  # the probes switch it while they run
    probes = ", ".join(f"{rows} rows x {context} keys" for rows, context in DECODE_PROBES)
    backend.decode_kernel = choice.about(DECODE_SUBJECT, probes)
    return backend.decode_kernel


def _decode_probe(backend: TorchAttentionBackend, rows: int, context: int, dtype: torch.dtype,
                  block_size: int) -> Probe:
    """One all-decode step of `rows` requests of ~`context` keys, through `backend` either way."""
    Hkv, D = backend.num_kv_heads, backend.head_dim
    g = torch.Generator().manual_seed(0)
    lens = [max(1, context - 7 * i) for i in range(rows)]  # unequal, so the SDPA path needs its mask
    nb = -(-context // block_size)
    kv_cache = torch.randn(2, rows * nb, block_size, Hkv, D, generator=g).to(dtype)  # (2, blocks, bs, Hkv, D)
    tables = torch.arange(rows * nb, dtype=torch.int32).view(rows, nb)  # (rows, nb)
    slots = torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(lens)])  # each row's last position
    q = torch.randn(rows, backend.num_heads, D, generator=g).to(dtype)  # (rows, Hq, D)
    k = torch.randn(rows, Hkv, D, generator=g).to(dtype)  # (rows, Hkv, D)
    meta = AttentionMetadata(slots, torch.arange(rows + 1, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), tables, [1] * rows, lens, block_size)

    def run(candidate: str) -> None:
        backend.decode_kernel = forced(DECODE_CANDIDATES, candidate, "timing")
        backend.prepare(meta)
        backend.forward(q, k, k, kv_cache, meta)

    return run


@torch.inference_mode()
def choose_greedy_kernel(sampler: Sampler, vocab_size: int, dtype: torch.dtype, tuning: Tuning = "cached") -> Choice:
    """Whether the kernel beats argmax_rows for an all-greedy step's argmax here (GREEDY_PROBES rows of random
    logits); set on the sampler and returned. CPU only."""
    why = untimed_reason(dtype)
    if why is not None:
        choice = untimed(GREEDY_CANDIDATES[0], why)
    else:
        entry = f"greedy_argmax {str(dtype).removeprefix('torch.')} vocab {vocab_size} rows {GREEDY_PROBES}"
        choice = choose(entry, GREEDY_CANDIDATES,
                        lambda: [_greedy_probe(rows, vocab_size, dtype) for rows in GREEDY_PROBES], tuning)
    probes = ", ".join(f"{rows} rows x {vocab_size}" for rows in GREEDY_PROBES)
    sampler.greedy_kernel = choice.about(GREEDY_SUBJECT, probes)
    return sampler.greedy_kernel


def _greedy_probe(rows: int, vocab_size: int, dtype: torch.dtype) -> Probe:
    logits = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(0)).to(dtype)  # (rows, V)
    return lambda candidate: greedy_argmax(logits) if candidate == "kernel" else argmax_rows(logits.float())
