"""`DirectCall`: the inner layers a decode step calls hundreds of times skip `nn.Module.__call__`.

Calling an `nn.Module` runs `__call__`, which first asks whether anything else should run around
`forward`: forward and backward hooks on the module, global hooks, a JIT trace in progress, a
`module.compile()`d version. The engine uses none of them, yet pays for the asking on every call, and a
decode step of SmolLM2 (30 layers) makes ~210 such calls: four products, two norms and the MLP a layer.
Timed alone, one check is about a microsecond. Inside a step it runs right after a kernel has streamed a
weight through the caches, with the interpreter's own data evicted, and costs two to three times that: on
2 Xeon vCPUs the ~210 calls took ~1.2 ms of a 17 ms single-stream token (docs/guides/benchmarks.md,
"fourth round").

So a layer class that derives from `DirectCall` is called straight through the `forward` its class
defines or inherits: `layer(x)` runs `type(layer).forward(layer, x)`, for the class and every subclass.
What `__call__` would have added is refused where it can be, with an error that says why: hooks on the
layer, and `layer.compile()`. Three things cannot be refused and are bypassed: global module hooks
(`torch.nn.modules.module.register_module_forward_hook`, which torch's FlopCounterMode uses), a
`forward` assigned on one instance, and a `forward` patched onto the class after it was defined (patch
`__call__` too). The layers stay ordinary modules in every other way: parameters, `state_dict`,
`.to()`, `named_modules()`; torch.compile traces a call to one as a call to its `forward`.
"""

from __future__ import annotations

from typing import NoReturn

from torch import nn


class DirectCall(nn.Module):
    """Mix in first (`class Linear(DirectCall, nn.Linear)`): calling the layer calls its `forward`."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward  # each subclass's own forward, so an override is what a call runs

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is called straight through its forward (layers/direct_call.py: "
                        "nn.Module.__call__'s checks cost ~7 % of a decode step), so hooks or a compiled call "
                        "on it would never run; hook or compile the whole model instead")

    register_forward_hook = register_forward_pre_hook = _refuse
    register_full_backward_hook = register_full_backward_pre_hook = register_backward_hook = _refuse
    compile = _refuse  # nn.Module.compile() takes effect only through __call__
