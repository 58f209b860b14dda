"""Compiling the forward: one `torch.compile` graph per token count, attention as an opaque op.

A decoder layer is mostly small element-wise operations around a few matmuls:

    h ─ RMSNorm ─ qkv_proj ─ split ─ (q/k norm) ─ RoPE ─ attention ─ o_proj ─ + ─ RMSNorm ─ gate_up ─ silu·up ─ down ─ +

Run eagerly, every one of those operations is a separate dispatch from Python with its own trip
through memory; for one decode row of SmolLM2 that is about a third of a token's time. Inductor
(`torch.compile`'s default backend) traces the whole forward into one graph, fuses the element-wise
operations into a few generated loops, and runs the graph without returning to Python between ops.

What stays opaque. Attention's work changes shape every step (how many requests, how long each
context, which blocks), so the graph calls it as one custom op, `minivllm::attention`, that runs the
attention backend eagerly (as vLLM does). A custom op takes only tensors and numbers, so the step's
metadata, the backend and the KV caches travel beside the graph in a `StepContext` the op looks up
by number (vLLM calls its version the "forward context"). The matmuls, too, stay the kernels the CPU
matmul plan measured (its linear method, cpu/planned_linear.py, hands them to the graph as another
opaque op), and int8 layers keep fbgemm's product the same way (`minivllm::int8_linear`,
layers/quantization.py).

Shapes. A graph is specialised to its input shapes, and the only one that varies is T, the number of
token rows in the step. So graphs are made for a few sizes (`sizes`, e.g. 1, 2, 4, ..., 128; all at
warm-up), and the model runner pads each step's rows up to the next size: 3 rows run the graph for 4.
A padding row is token 0 at position 0; its K/V is stored in a scratch block that no request owns
(engine/worker/model_runner.py) and attention gives it no output, so it changes no real row. Steps with
more rows than the largest size (long prefills, where the matmuls dominate anyway) run eagerly.

`enforce_eager=True` (vLLM's name) turns it off; see `EngineConfig.enforce_eager` for the default.
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata
from minivllm.layers.custom_op import direct_register_custom_op

# (layer index, q (T, Hq, D), k, v (T, Hkv, D)) -> attention output (T, Hq * D)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def padded_num_tokens(sizes: tuple[int, ...], num_tokens: int) -> int:
    """The smallest compiled size >= `num_tokens`, or `num_tokens` itself when it is larger than all of
    them (that step runs eagerly). `sizes` is sorted."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else num_tokens


@dataclass(eq=False)
class StepContext:
    """What the opaque attention op needs during one compiled forward; empty between steps."""

    meta: AttentionMetadata | None = None
    backend: AttentionBackend | None = None
    kv_caches: list[torch.Tensor] | None = None  # per layer (2, num_blocks, block_size, Hkv, D)


# The op finds its model's context by number. Weak: a context lives as long as its `CompiledForward`.
_CONTEXTS: weakref.WeakValueDictionary[int, StepContext] = weakref.WeakValueDictionary()
_context_numbers = itertools.count()


def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, layer: int) -> torch.Tensor:
    # It writes this step's K/V into the layer's cache, which the graph never sees: nothing in the graph
    # reads the cache but this op, and each layer's call depends on the previous layer's output, so the
    # order of the writes is fixed by the data flow.
    ctx = _CONTEXTS[context]
    return ctx.backend.forward(q, k, v, ctx.kv_caches[layer], ctx.meta)


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # shapes only, for tracing


direct_register_custom_op("attention", _attention_op, _attention_fake)  # see layers/custom_op.py


class CompiledForward:
    """`forward(model, input_ids, positions, attend)` compiled for the token counts in `sizes`."""

    def __init__(self, forward: Callable[..., torch.Tensor], sizes: tuple[int, ...]) -> None:
        self.sizes = tuple(sorted(set(sizes)))
        # Dynamo keeps its graphs per code object, one per size here; past `recompile_limit` (default 8)
        # it gives up. Raised to the sizes, and each model gets its own copy of the code below, so two
        # engines in one process do not share (and exhaust) one budget.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(self.sizes) + 2)
        self.context = StepContext()
        self._compiled: set[int] = set()  # sizes already traced
        # The number is a constant inside the graph, so it is part of the key of Inductor's on-disk cache:
        # a counter (the first model of a process is 0 in every process) lets a restart reuse the compiled
        # graphs; a memory address (`id`) changed the key each time and cost a full compile (~25 s).
        context = next(_context_numbers)
        _CONTEXTS[context] = self.context

        def graph(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return forward(model, input_ids, positions,
                           lambda i, q, k, v: torch.ops.minivllm.attention(q, k, v, context, i))

        graph.__code__ = graph.__code__.replace()  # this model's own code object (see above)
        self.graph = torch.compile(graph, dynamic=False, fullgraph=True)

    def runs(self, num_tokens: int) -> bool:
        return num_tokens in self.sizes

    def __call__(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, kv_caches: list[torch.Tensor], backend: AttentionBackend) -> torch.Tensor:
        ctx = self.context
        ctx.meta, ctx.backend, ctx.kv_caches = meta, backend, kv_caches
        try:
            num_tokens = input_ids.shape[0]
            if num_tokens not in self._compiled:  # the first run of a size: Dynamo traces and compiles
                hidden = self.graph(model, input_ids, positions)  # (T, hidden)
                self._compiled.add(num_tokens)  # only once it ran: a failed first run is retried in full
                return hidden
            # Later runs: before each call Dynamo re-checks every assumption its graphs were built on
            # (shapes, dtypes and devices of ~200 weights: ~1 ms, 4 % of a SmolLM2 token). None can change
            # here (the weights are fixed and this code object is this model's alone), so only the checks
            # that tell its graphs apart, the sizes, are kept; measured +2.5 % a token.
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self.graph(model, input_ids, positions)
        finally:
            ctx.meta = ctx.backend = ctx.kv_caches = None  # nothing of a step outlives it

    def __repr__(self) -> str:
        return f"CompiledForward(sizes={self.sizes})"
