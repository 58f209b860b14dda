"""`attach_cpu_kernels`: at warm-up, this machine's choices for a built model, handed to its layers.

A model is built from plain layers (minivllm/layers/) that know nothing of timing: each `Linear`
multiplies through its `quant_method` (F.linear by default), each RMSNorm, MLP and the rotary step
holds a `kernels` switch (None: torch's ops). Warm-up (engine/worker/warmup.py) calls this function once the
weights are loaded, and it

  1. collects the weights of every plain `Linear` in forward order (`model.modules()` lists them as the
     forward runs them; an int8 layer keeps its own method, layers/quantization.py), then the LM head's,
     which multiplies only sampled rows (decode-only);
  2. measures the matmul plan over them, or reads it from the tuning cache (matmul_plan.py), and sets
     one `PlannedLinearMethod` (planned_linear.py) sharing that plan on every one of those layers;
  3. where the model's element-wise work can run minivllm's C++ kernels (`sizes` given: the Llama
     family), asks whether they beat torch's ops here (norm_rope_kernels.py) and hands the answer to
     every layer holding a `kernels` switch and to the rotary step;
  4. gives every mixture-of-experts layer (`FusedMoE`) a `CpuMoeMethod` (moe_method.py), packing its
     experts for the skinny kernel in place of the checkpoint's layout: not timed, since it reads only
     the active experts' bytes on every ISA level, as the dense skinny form does for a few rows.

It returns one line per choice, which the engine logs and `minivllm bench` prints (`describe` says the
same later). Attaching twice measures the matmuls once: the second call reuses the plan it finds.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from minivllm.cpu.matmul_plan import MatmulPlan
from minivllm.cpu.moe_method import attach_moe_method
from minivllm.cpu.norm_rope_kernels import NormRopeKernels
from minivllm.cpu.planned_linear import PlannedLinearMethod
from minivllm.cpu.tuner import Tuning
from minivllm.layers.fused_moe import fused_moe_layers
from minivllm.layers.linear import Linear, UnquantizedLinearMethod


class NormRopeSizes(NamedTuple):
    """The sizes one rank's element-wise work runs at (its heads, its share of the MLP)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # 0: no gated MLP


def attach_cpu_kernels(model: nn.Module, lm_head: nn.Module, tuning: Tuning = "cached",
                       sizes: NormRopeSizes | None = None) -> list[str]:
    """Measure (or read) the CPU choices for `model`, whose logits `lm_head` computes (a `Linear`, or the
    embedding when tied), and attach them to its layers; one line per choice."""
    # Only the plain products are timed: an int8 layer (layers/quantization.py) keeps its own method.
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not lm_head
               and isinstance(m.quant_method, UnquantizedLinearMethod)]
    plan = attached_plan(lm_head)
    if plan is None:
        plan = MatmulPlan()
        plan.measure([m.weight for m in linears] + [lm_head.weight], decode_only=(lm_head.weight,), tuning=tuning)
        method = PlannedLinearMethod(plan)
        for layer in (*linears, lm_head):
            layer.quant_method = method
    said = [plan.summary()]
    if sizes is not None:
        kernels = NormRopeKernels().choose(sizes.hidden_size, sizes.num_heads, sizes.num_kv_heads, sizes.head_dim,
                                           lm_head.weight.dtype, tuning, sizes.intermediate_size)
        set_norm_rope_kernels(model, kernels)
        said.append(str(kernels))
    if (moe := attach_moe_method(model)) is not None:
        said.append(moe)
    return said


def set_norm_rope_kernels(model: nn.Module, kernels: NormRopeKernels) -> None:
    """Hand `kernels` to every layer of `model` holding a `kernels` switch, and to its rotary step."""
    for layer in (*model.modules(), getattr(model, "rotary", None)):
        if hasattr(layer, "kernels"):
            layer.kernels = kernels


def attached_plan(layer: nn.Module) -> MatmulPlan | None:
    """The plan a layer multiplies by, if `attach_cpu_kernels` gave it one."""
    method = getattr(layer, "quant_method", None)
    return method.plan if isinstance(method, PlannedLinearMethod) else None


def describe(model: nn.Module, lm_head: nn.Module) -> list[str]:
    """What was attached to `model`, in the words `attach_cpu_kernels` returned."""
    plan = attached_plan(lm_head)
    said = [plan.summary() if plan is not None else MatmulPlan().summary()]
    kernels = next((m.kernels for m in model.modules() if isinstance(getattr(m, "kernels", None), NormRopeKernels)),
                   None)
    said += [str(kernels)] if kernels is not None else []
    moe = [m.moe_method for m in fused_moe_layers(model)]
    return said + ([f"MoE experts: {moe[0]!r} on {len(moe)} layers"] if moe else [])
