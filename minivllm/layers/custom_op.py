"""`direct_register_custom_op`: an opaque op for a compiled graph, registered at the dispatcher directly;
`KernelSwitch` and `KernelChoice`: what a layer with a C++ CPU kernel is told from outside about when to run it.

A compiled forward (models/compiled_forward.py) calls a few things Inductor must not look inside: the
attention over the paged cache, a matmul through a prepacked weight, the int8 product. Each becomes an
op in the `minivllm` namespace that the graph calls by name, with a "fake" twin that only says the
output's shape, for tracing.

`torch.library.custom_op` is the friendly way to make one, but every call then goes through its Python
wrapper (argument binding, autograd checks) before reaching the function: measured 6.3 µs of overhead
a call against 3.7-3.8 µs for an op defined with `torch.library.Library` and given one kernel for every
backend (2 AMD EPYC cores, in a compiled graph). A compiled SmolLM2 decode step makes ~150 such calls.
vLLM registers its ops this way for the same reason, under the same name.

The ops are for inference only: no autograd formula is registered, so they run under
`torch.inference_mode()` / `no_grad`, as the model runner calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

_LIBRARY = torch.library.Library("minivllm", "FRAGMENT")  # the namespace may gain ops from several modules
# The functions behind each op, by name. The dispatcher holds a small forwarder that looks here, so a
# module that is imported again (a notebook's `%autoreload`) swaps in its new functions instead of
# failing to define the op twice.
_OPS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {}


def direct_register_custom_op(name: str, op: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]) -> None:
    """Define `torch.ops.minivllm.<name>` from `op`'s type annotations, run `op` on every backend and
    `fake` while tracing. The op must not modify its inputs: the schema says it does not (the attention
    op's cache writes are invisible to the graph, see models/compiled_forward.py)."""
    if name not in _OPS:
        _LIBRARY.define(name + torch.library.infer_schema(op, mutates_args=()))
        _LIBRARY.impl(name, lambda *args: _OPS[name][0](*args), "CompositeExplicitAutograd")
        torch.library.register_fake(f"minivllm::{name}", lambda *args: _OPS[name][1](*args), lib=_LIBRARY)
    _OPS[name] = (op, fake)


class KernelSwitch(Protocol):
    """Whether minivllm's C++ CPU kernels run for a tensor now, in place of torch's ops. A layer with such
    kernels (RMSNorm, RoPE, silu·mul) holds one as `kernels`, None by default (torch's ops); the engine's
    warm-up sets it from outside once it has measured which is faster here (minivllm/cpu/norm_rope_kernels.py)."""

    def active(self, x: torch.Tensor) -> bool: ...


class KernelChoice(Protocol):
    """Whether a layer's C++ CPU kernel replaces its default path: the attention backend's decode kernel, the
    sampler's greedy argmax. The layer holds one and reads only `used`; warm-up sets it from outside with
    what it measured (minivllm/cpu/decode_kernels.py, a `Choice` of cpu/tuner.py, which also says why)."""

    @property
    def used(self) -> bool: ...


@dataclass(frozen=True)
class NotMeasured:
    """The `KernelChoice` before warm-up (and wherever there is none: a GPU, a test): the default path."""

    subject: str  # what is chosen, in words: "greedy sampling"
    default: str  # the default path's name: "argmax_rows"
    used: bool = False

    def __str__(self) -> str:  # the tuner's `Choice` says the same of an untimed choice
        return f"{self.subject}: {self.default} (not measured: no CPU warm-up)"
