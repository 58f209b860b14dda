"""`DirectCall`: the inner layers a decode step calls hundreds of times skip `nn.Module.__call__`.

Calling an `nn.Module` runs `__call__`, which first asks whether anything else should run around
`forward`: forward and backward hooks on the module, global hooks, a JIT trace in progress, a
`module.compile()`d version. The engine uses none of them, yet pays for the asking on every call, and a
decode step of SmolLM2 (30 layers) makes ~210 such calls: four products, two norms and the MLP a layer.
Timed alone, one check is about a microsecond. Inside a step it runs right after a kernel has streamed a
weight through the caches, with the interpreter's own data evicted, and costs several times that: on 2
Xeon vCPUs the ~210 calls took ~1.2 ms of a 17 ms single-stream token (docs/guides/benchmarks.md, "fourth
round").

So a layer class that derives from `DirectCall` is called straight through its `forward`: `layer(x)` is
`layer.forward(x)`, with no hook checks, for the class and every subclass. Hooks that could never run are
refused when they are registered, with an error that says so, rather than silently skipped. The layers
stay ordinary modules in every other way: parameters, `state_dict`, `.to()`, `named_modules()`.
torch.compile traces a call to one as a call to its `forward`.
"""

from __future__ import annotations

from typing import NoReturn

from torch import nn


class DirectCall(nn.Module):
    """Mix in first (`class Linear(DirectCall, nn.Linear)`): calling the layer calls its `forward`."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward  # each subclass's own forward, so an override is what a call runs

    def _refuse_hooks(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is called straight through its forward (layers/direct_call.py: "
                        "nn.Module.__call__'s hook checks cost ~7 % of a decode step), so a hook on it would "
                        "never run; hook the whole model instead")

    register_forward_hook = register_forward_pre_hook = _refuse_hooks
    register_full_backward_hook = register_full_backward_pre_hook = register_backward_hook = _refuse_hooks
