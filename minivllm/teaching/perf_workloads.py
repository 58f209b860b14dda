"""The performance track's workloads: what is timed for each hands-on part, and how many bytes it must read.

Each part is timed on the work the engine gives it in a decode step, built the same way for the student's
implementation and for the engine's own, so the two times divide into a fair ratio:

    part        one unit of work                                   the limit (bytes a unit must read)
    attention   one layer's decode attention, a batch of requests  every cached key and value once
    kernel      the same through the Triton kernel (CUDA only)     the same
    filter      top-k, top-p, min-p over a step's sampled logits   none: sorting, not reading, costs
    allocator   one call of a prefix-cache-heavy call trace        none: Python bookkeeping
    speed       y = x W^T for a few rows (hands-on 5)              every weight byte once

Where a limit applies the work rotates through a working set bigger than the caches (`set_mib`, 64 MiB
by default, twice an L3): a model's forward reads each layer's KV cache or weight from memory, and a
single tensor timed in a loop would sit in cache and beat the machine's read bandwidth. A round runs the
whole set once; `TimedCase.units` says how many units a round holds, so time per unit = round / units.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class PerfSettings:
    """How much is timed. `quick`: tiny shapes and a small set, for the tests (it only has to run)."""

    quick: bool = False
    set_mib: int = 64  # the rotating working set (>= 2x L3)
    rounds: int = 7  # rounds timed in each process; the process reports the fastest

    def __post_init__(self) -> None:
        if self.set_mib < 1 or self.rounds < 1:
            raise ValueError(f"set_mib ({self.set_mib}) and rounds ({self.rounds}) must be >= 1")

    @property
    def set_bytes(self) -> int:
        return self.set_mib << 20


class TimedCase(NamedTuple):
    """One shape of one part: `run_round()` does `units` units of work; a unit must read `bytes_per_unit`
    bytes (None: no bandwidth limit applies). `sync` waits for queued GPU work (None on CPU). Untimed, around
    each round: `refresh()` gives the round new input values, `check()` says what was wrong with the round's
    results (None: all right), so speed is measured on fresh inputs and credited only to right answers."""

    label: str
    run_round: Callable[[], None]
    units: int
    bytes_per_unit: int | None
    sync: Callable[[], None] | None = None
    refresh: Callable[[], None] | None = None
    check: Callable[[], str | None] | None = None


def copies_for(one_bytes: int, settings: PerfSettings) -> int:
    """How many copies of a `one_bytes` tensor make the working set (at least 2: never one tensor in cache)."""
    return max(2, -(-settings.set_bytes // max(1, one_bytes)))


# --- attention: decode rows over a paged KV cache ---------------------------------------------------------

class AttentionShape(NamedTuple):
    label: str
    context_lens: tuple[int, ...]  # one decode row per request
    num_heads: int = 9  # SmolLM2-135M: 9 query heads, 3 KV heads of 64
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16


ATTENTION_SHAPES = (AttentionShape("8 requests x 512 keys", (512,) * 8),
                    AttentionShape("1 request x 2048 keys", (2048,)))
ATTENTION_QUICK = (AttentionShape("2 requests x 20 keys", (20, 6), 4, 2, 16),)  # block 16: what Triton's tl.dot takes


def attention_cases(make_backend: Callable, settings: PerfSettings,
                    device: torch.device = torch.device("cpu")) -> list[TimedCase]:
    """Decode steps of `make_backend(num_heads, num_kv_heads, head_dim)`: per round, `prepare` once (the
    step's shared work) and `forward` on each layer's KV cache, each a different tensor (the working set)."""
    from minivllm.layers.attention_interface import AttentionMetadata

    cases = []
    for shape in ATTENTION_QUICK if settings.quick else ATTENTION_SHAPES:
        g = torch.Generator().manual_seed(0)
        Hq, Hkv, D, bs = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size
        per_req = [-(-ctx // bs) for ctx in shape.context_lens]
        num_blocks = sum(per_req) + 1
        order = torch.randperm(num_blocks, generator=g).tolist()  # a request's blocks lie anywhere in the pool
        tables, at = [], 0
        for nb in per_req:
            tables.append(order[at:at + nb])
            at += nb
        slots = [t[(ctx - 1) // bs] * bs + (ctx - 1) % bs for t, ctx in zip(tables, shape.context_lens)]
        B, width = len(shape.context_lens), max(per_req)
        meta = AttentionMetadata(
            torch.tensor(slots, dtype=torch.int64, device=device),
            torch.arange(B + 1, dtype=torch.int32, device=device),
            torch.tensor(shape.context_lens, dtype=torch.int32, device=device),
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            [1] * B, list(shape.context_lens), bs)
        one_layer = 2 * num_blocks * bs * Hkv * D * 4
        layers = [torch.randn(2, num_blocks, bs, Hkv, D, generator=g).to(device)
                  for _ in range(copies_for(one_layer, settings))]  # (2, num_blocks, block_size, Hkv, D) each
        qkv = torch.randn(B, Hq + 2 * Hkv, D, generator=g).to(device)  # (B, Hq + 2 Hkv, D), as the model splits it
        q, k, v = qkv.split([Hq, Hkv, Hkv], dim=1)
        backend = make_backend(Hq, Hkv, D)

        def run_round(backend=backend, meta=meta, layers=layers, q=q, k=k, v=v) -> None:
            backend.prepare(meta)
            for kv_cache in layers:
                backend.forward(q, k, v, kv_cache, meta)

        keys_read = 2 * sum(shape.context_lens) * Hkv * D * 4  # every cached key and value once, fp32
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        cases.append(TimedCase(shape.label, run_round, len(layers), keys_read, sync))
    return cases


def engine_attention(device: torch.device = torch.device("cpu")) -> tuple[Callable, str]:
    """The engine's own backend and its name: on CPU the torch backend, its decode rows through the C++
    kernel where built (its fastest decode path); on CUDA the Triton backend."""
    if device.type == "cuda":
        from minivllm.layers.triton_attention import TritonAttentionBackend

        bs = ATTENTION_SHAPES[0].block_size
        return (lambda Hq, Hkv, D: TritonAttentionBackend(Hq, Hkv, D, device, bs)), "TritonAttentionBackend"
    from minivllm.cpu.tuner import forced
    from minivllm.kernels.cpu_build import isa_level, load_cpu_kernels
    from minivllm.layers.torch_attention import DECODE_CANDIDATES, DECODE_SUBJECT, TorchAttentionBackend

    build = load_cpu_kernels()
    chosen = "kernel" if build.available else DECODE_CANDIDATES[0]

    def make(Hq: int, Hkv: int, D: int) -> TorchAttentionBackend:
        backend = TorchAttentionBackend(Hq, Hkv, D)
        backend.decode_kernel = forced(DECODE_CANDIDATES, chosen, "the performance track").about(DECODE_SUBJECT)
        return backend

    how = f"C++ decode kernel, {isa_level()} build" if build.available else f"gather + SDPA: {build.detail}"
    return make, f"TorchAttentionBackend ({how})"


# --- filter: a step's sampled rows -------------------------------------------------------------------------

def filter_cases(sampling_filter: object, settings: PerfSettings) -> list[TimedCase]:
    """8 rows of SmolLM2's 49,152 logits, top_k 50, top_p 0.9, min_p 0.05 (quick: 2 rows of 64)."""
    from minivllm.layers.sampler import SamplingRow, SamplingTensors

    rows, vocab = (2, 64) if settings.quick else (8, 49152)
    g = torch.Generator().manual_seed(0)
    params = [SamplingRow(1.0, 50 if not settings.quick else 8, 0.9, 0.05, seed, 0) for seed in range(rows)]
    sampling = SamplingTensors.from_params(params, vocab, torch.device("cpu"))
    logits = [torch.randn(rows, vocab, generator=g) * 3 for _ in range(4)]  # (rows, vocab) each

    def run_round() -> None:
        for x in logits:
            sampling_filter(x, sampling)

    return [TimedCase(f"{rows} rows x {vocab} logits", run_round, len(logits), None)]


# --- allocator: a prefix-cache-heavy call trace -----------------------------------------------------------

class AllocatorCall(NamedTuple):
    method: str  # "take", "give_back", "revive"
    block: int
    stamp: int


def allocator_trace(num_blocks: int, calls: int, seed: int = 0) -> list[AllocatorCall]:
    """A valid trace for an LRU allocator: takes, frees (rising stamps) and prefix-cache revivals, mixed."""
    from minivllm.engine.core.block_allocator import LRUAllocator

    rng, lru, owned, stamp, trace = random.Random(seed), LRUAllocator(), [], num_blocks, []
    lru.reset(num_blocks)
    for _ in range(calls):
        pick = rng.random()
        if owned and (pick < 0.4 or not len(lru)):
            block = owned.pop(rng.randrange(len(owned)))
            stamp += 1
            lru.give_back(block, stamp)
            trace.append(AllocatorCall("give_back", block, stamp))
        elif pick < 0.55:  # a prefix-cache hit on a free block, anywhere in the order
            block = rng.choice(list(lru))
            lru.revive(block)
            owned.append(block)
            trace.append(AllocatorCall("revive", block, 0))
        else:
            block = lru.take()
            owned.append(block)
            trace.append(AllocatorCall("take", block, 0))
    return trace


def allocator_cases(allocator_cls: type, settings: PerfSettings) -> list[TimedCase]:
    """`reset` then one trace, a round; a unit is one call (the reset is in the round for both sides)."""
    num_blocks, calls = (32, 200) if settings.quick else (4096, 20000)
    trace = allocator_trace(num_blocks, calls)
    allocator = allocator_cls()

    def run_round() -> None:
        allocator.reset(num_blocks)
        for call in trace:
            if call.method == "take":
                allocator.take()
            elif call.method == "give_back":
                allocator.give_back(call.block, call.stamp)
            else:
                allocator.revive(call.block)

    return [TimedCase(f"{calls} calls, {num_blocks} blocks", run_round, len(trace), None)]


# --- speed: the few-row matmul (hands-on 5) -----------------------------------------------------------------

SPEED_WEIGHT = (3072, 576)  # SmolLM2-135M's gate/up projection (out, in)
SPEED_ROWS = (1, 4, 8)


def speed_cases(solution: object, settings: PerfSettings) -> list[TimedCase]:
    """`solution.matmul(x, packed, out)` over a rotating set of weights packed by `solution.pack`, fp32 and
    bf16, at 1, 4 and 8 rows (quick: a 64 x 64 weight, 1 and 8 rows).

    Each weight has its own x buffer, refilled with new values before every round, and every result of a
    round is kept and checked against `naive_skinny_gemm` after it (untimed), as the engine refills its
    activations every step and still holds each result: a cache of results (by pointer or by value) or an
    output buffer reused across calls cannot make a round faster without making it wrong."""
    from minivllm.kernels.skinny_gemm import naive_skinny_gemm
    from minivllm.teaching.perf_speed import mismatch

    out_f, in_f = (64, 64) if settings.quick else SPEED_WEIGHT
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        one = out_f * in_f * torch.finfo(dtype).bits // 8
        weights = [(torch.randn(out_f, in_f, generator=g) * in_f ** -0.5).to(dtype)
                   for _ in range(copies_for(one, settings))]  # (out, in) each, kept for the check
        packed = [solution.pack(w) for w in weights]
        for rows in (1, 8) if settings.quick else SPEED_ROWS:
            xs = [torch.empty(rows, in_f, dtype=dtype) for _ in weights]  # (rows, in) each, one per weight
            results: list = [None] * len(weights)

            def refresh(xs=xs, g=g) -> None:
                for x in xs:
                    x.copy_(torch.randn(x.shape, generator=g))  # the same buffers, new values

            def run_round(xs=xs, packed=packed, results=results) -> None:
                for i, (x, p) in enumerate(zip(xs, packed)):
                    results[i] = solution.matmul(x, p, out_f)

            def check(xs=xs, weights=weights, results=results) -> str | None:
                for i, (x, w, y) in enumerate(zip(xs, weights, results)):
                    want = naive_skinny_gemm(x, w)  # (rows, out)
                    ok = isinstance(y, torch.Tensor) and y.shape == want.shape and y.dtype == want.dtype
                    wrong = mismatch(y, want) if ok else f"returned {getattr(y, 'shape', type(y).__name__)}"
                    if wrong:
                        return f"call {i + 1} of {len(xs)} in a timed round: {wrong}"
                return None

            name = str(dtype).removeprefix("torch.")
            cases.append(TimedCase(f"{name} {rows} row{'s' * (rows > 1)} x {out_f}x{in_f}", run_round, len(packed),
                                   one, refresh=refresh, check=check))
    return cases
