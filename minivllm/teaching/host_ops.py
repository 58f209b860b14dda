"""The kernel assignment's rule that the attention is computed IN the kernel: what the host code may do.

A kernel submission must launch a @triton.jit function of its own (submission_watch.Watch sees the
launch), but a launch alone proves little: the attention could be computed in torch and a trivial
kernel launched to copy the answer out. So while the grader runs `paged_attention`, a
`TorchDispatchMode` sees every torch op at the dispatcher (below Python: an alias or a helper cannot hide
one), and the ops run on a float tensor OUTSIDE a launch must be the host's honest work: allocating the
output, views and strides, `.contiguous()`, gathers and dtype casts. `Watch` closes the mode during a
launch (Triton's interpreter computes with torch and numpy in there: that is the kernel).

    with Watch(RULES["kernel"]) as watch, TorchOps() as ops:   # the grader, around the student's call
        out = paged_attention(...)
    ops.check(who)  # AssignmentError naming the first compute op seen ("aten.bmm": torch.matmul, einsum)
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from minivllm.teaching.submission_rules import AssignmentError

HOST_RULE = ("the attention is computed in your kernel: outside its launch, paged_attention may only allocate, "
             "view, copy, gather and cast float tensors (torch.empty, .view, .contiguous(), .to(dtype)), never "
             "compute with them (matmul, einsum, softmax, exp, sum, max, mul, ...)")

# What a kernel's host code may do to a float tensor outside its launches (aten op names, as the dispatcher
# sees them: torch.matmul and einsum arrive as mm/bmm, softmax as _softmax): make it, view it, copy, gather
# and cast it. Anything else computes, and the kernel assignment's attention is computed in the kernel.
HOST_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "fill_", "zero_", "lift_fresh",  # allocation
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "permute", "transpose", "t", "expand",
    "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "narrow", "alias", "detach",
    "unflatten", "flatten", "view_as", "contiguous", "clone", "copy_", "_to_copy", "to", "_local_scalar_dense",
    "index", "index_select", "index_copy_", "index_put_", "cat", "stack"})  # views, copies, gathers and casts


class TorchOps(TorchDispatchMode):
    """While open, records every torch op run on a float tensor that `HOST_OPS` does not allow (`Watch`
    closes it during a Triton launch: inside, the interpreter may use torch as it likes)."""

    def __init__(self) -> None:
        super().__init__()
        self.computed: list[str] = []  # "aten.bmm", ... in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in HOST_OPS and any(isinstance(a, torch.Tensor) and a.is_floating_point()
                                        for a in tree_flatten((args, kwargs))[0]):
            self.computed.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))

    def check(self, who: str) -> None:
        """Raise `AssignmentError` naming the first compute op seen, if any."""
        if self.computed:
            ops = list(dict.fromkeys(self.computed))
            raise AssignmentError(f"{who} broke a RULE: {HOST_RULE}.\n  while the grader ran your code, torch ran "
                                  f"{ops[0]} on a float tensor outside the kernel's launch (all: {ops[:6]})")
