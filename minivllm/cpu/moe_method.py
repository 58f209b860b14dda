"""`CpuMoeMethod`: a `FusedMoE`'s experts through minivllm's packed skinny-GEMM kernels on CPU.

A `FusedMoE` (layers/fused_moe.py) computes its routes through `layer.moe_method.apply(layer, x,
topk_weights, topk_ids)`, as a `Linear` multiplies through its `quant_method`. Its default, F.linear per
active expert, already reads only the experts a step routes to; this method reads them as one sequential
stream each, in the layout of kernels/skinny_gemm.py, with the ISA paths of that kernel (AVX-512 with
its bf16 dot products, AVX2 + FMA, plain loops): kernels/moe_cpu.py `cpu_fused_moe`.

Warm-up attaches it to every FusedMoE (cpu/attach.py), which calls `process_weights_after_loading` (vLLM's
name for the step) once per layer:

    w13_weight (E, 2I, H)  ->  (E, 2I/16, H, 16)      fp32    (bf16: (E, 2I/16, H/2, 16, 2), k pairs)
    w2_weight  (E, H, I)   ->  (E, H/16, I, 16)

The packed tensors REPLACE the layer's parameters (vLLM's CPU MoE does the same): the experts are nearly all
of an MoE model's bytes, and keeping the checkpoint's layout beside the packed one, as the dense skinny form
does for its weights (cpu/matmul_forms.py `weight.skinny`), would double the model in memory. Anything
reading `w13_weight` afterwards sees the packed shape (and F.linear refuses it): only this method reads it.
Prefill-sized experts lay their weight back out for F.linear, one expert at a time (kernels/moe_cpu.py).

Eager only: the engine does not compile or graph-capture MoE models yet (Qwen3MoeForCausalLM.supports_compile
is False), and this method's loop follows the routes' sizes, which are data (which experts, how many rows).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.kernels.moe_cpu import PackedExperts, can_pack_moe, cpu_fused_moe, pack_moe_experts
from minivllm.layers.fused_moe import FusedMoE, MoeMethodBase, fused_moe_layers


class CpuMoeMethod(MoeMethodBase):
    """The experts of a layer packed once (`process_weights_after_loading`), then every step `cpu_fused_moe`."""

    @staticmethod
    def can_run(layer: FusedMoE) -> str | None:
        """None if this method can take `layer`; else why not (the engine then keeps TorchMoeMethod)."""
        if not (build := load_cpu_kernels()).available:
            return f"minivllm's CPU kernels are not built here ({build.detail})"
        if not can_pack_moe(layer.w13_weight, layer.w2_weight):
            return (f"the experts are {layer.w13_weight.dtype} on {layer.w13_weight.device} with hidden size "
                    f"{layer.hidden_size}, intermediate size {layer.intermediate_size}: the kernels take CPU fp32, "
                    f"or bf16 with both sizes even")
        return None

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Swap the layer's two expert weights for their packed copies (the checkpoint's layout is freed)."""
        packed = pack_moe_experts(layer.w13_weight.detach(), layer.w2_weight.detach())
        layer.w13_weight = nn.Parameter(packed.w13, requires_grad=False)
        layer.w2_weight = nn.Parameter(packed.w2, requires_grad=False)

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_counts: torch.Tensor | None = None) -> torch.Tensor:  # x (T, H), topk_* (T, k) -> (T, H)
        packed = PackedExperts(layer.w13_weight, layer.w2_weight, layer.hidden_size, layer.intermediate_size)
        return cpu_fused_moe(x, packed, topk_weights, topk_ids, expert_counts)

    def __repr__(self) -> str:
        return "CpuMoeMethod()"


def attach_moe_method(model: nn.Module) -> str | None:
    """Give every FusedMoE of `model` a CpuMoeMethod, packing its experts (once: a layer that has one keeps it);
    one line saying what was done, or None for a model without experts."""
    layers = fused_moe_layers(model)
    if not layers:
        return None
    method = CpuMoeMethod()  # holds nothing: the packed weights live on each layer
    for layer in layers:
        if isinstance(layer.moe_method, CpuMoeMethod):
            continue
        if (why_not := method.can_run(layer)) is not None:
            return f"MoE experts: F.linear per active expert ({why_not})"
        method.process_weights_after_loading(layer)
        layer.moe_method = method
    packed_bytes = sum(t.nbytes for layer in layers for t in (layer.w13_weight, layer.w2_weight))
    return (f"MoE experts: minivllm's packed skinny kernels, active experts only ({len(layers)} layers, "
            f"{packed_bytes / 1e6:.1f} MB packed in place of the checkpoint's layout)")
