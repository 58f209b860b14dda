"""`quantization="int8"`: the decoder's linear layers in int8, for CPU decode (vLLM's option name).

Bytes per token are the budget of decode. Each new token multiplies one row by every weight of the
model, so a decode step streams all the weights from memory once and does 2 FLOPs per weight byte
(fp32: 0.5 FLOP per byte): the memory bus, not arithmetic, sets its time. SmolLM2-135M streams

    fp32  540 MB a token    bf16  270 MB    int8 (decoder) + bf16 LM head  107 + 57 MB

so at a given bandwidth fewer bytes are more tokens per second. Int8 keeps a quarter of fp32's bytes.

What "int8" computes here (W8A8: int8 weights, int8 activations, int32 sums):

    weights      q_w[o, :] = round(W[o, :] / s_w[o]),   s_w[o] = max|W[o, :]| / 127   once, at load
                 (symmetric, one scale per output row: "per channel")
    activations  q_x[t, :] = round(127 * x[t, :] / m[t]),  m[t] = max|x[t, :]|         every call
                 (symmetric, one scale per row, i.e. per token: "absmax")
    product      y[t, o] = m[t] * s_w[o] / 127 * sum_i q_x[t, i] q_w[o, i] + b[o]

fbgemm's VNNI kernels do the int8 GEMM (`vpdpbusd`: unsigned 8-bit activations times signed 8-bit
weights, summed in 32 bits). fbgemm quantizes a whole input with one (scale, zero point), so the
per-token scale is applied around it: each row is divided by its own maximum first, which puts every
row in [-1, 1], and the output row is multiplied back (the product is linear in x). Then one fixed grid
serves every row of every batch: scale 1/127, zero point 128 (q_x + 128 in 1..255), handed to fbgemm as
is (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`). Two consequences:

  * an outlier token does not blur its neighbours. One scale for a whole batch (what
    `quantize_dynamic` does) let a single large row (the first token of a prompt often is one) decide
    everyone's resolution: +62 % perplexity on SmolLM2, against +3.5-5 % per token;
  * a row's result does not depend on the other rows: int8 is batch-invariant like the float paths
    (tested), so a request gets the same tokens alone, in a batch, or beside a compiled step's padding.
    An earlier version let fbgemm pick the grid from each batch's minimum and maximum
    (`quantized::linear_dynamic`); a row's rounding then moved with its neighbours.

How it plugs in (vLLM's shape): every decoder `Linear` keeps its class, its names and its forward; its
`quant_method` becomes the model's one `Int8LinearMethod`, which, once the float weight is loaded,
quantizes it into fbgemm's packed int8 weight and keeps that on the layer (`weight_packed`, in place of
the float `weight`: vLLM's `process_weights_after_loading`), then computes each product from it
(`apply`). A forward hook on an int8 layer is a hook on the same `Linear` as in the float model.

Compiling (`enforce_eager=False`): Dynamo cannot trace fbgemm's packed weight (a TorchScript object),
so inside the graph the product is an opaque op, `minivllm::int8_linear`, that finds its layer by
number; the per-token scaling around it stays in the graph, where Inductor fuses it with its
neighbours. For one stream that matters more than for bf16: int8 makes the matmuls cheap, so the
small ops between them are a larger share of the step.

What stays in float: the embedding (a lookup, nothing streamed), norms, attention and its KV cache,
and the LM head (quantizing it too measured +5.9 % perplexity on SmolLM2 instead of +4.3 %, an
earlier version's figures). In a mixture of experts int8 covers attention and the dense MLPs only: the
experts stay in the model's dtype (a `FusedMoE`, not a `Linear`), and so do the routers (`mlp.gate`,
Qwen2-MoE's `shared_expert_gate`), which vLLM builds with quant_config=None: an int8 router changed the
top-2 experts of 1 % of token-layers on a tiny model. `QuantizedModel.summary` says so at start-up.
Activations are full 8-bit where the CPU has VNNI; without it AVX2's 16-bit pair sums could saturate,
so 7-bit activations are used there (`reduce_range`: scale 1/63, zero point 64, q_x + 64 in 1..127).
Which one is the caller's to say (the loader asks minivllm/cpu/'s `CpuInfo`): this module reads no CPU.

Why fbgemm and not torchao (the successor of `torch.ao.quantization`, which torch 2.13 deprecates):
torchao 0.18's `Int8DynamicActivationInt8WeightConfig` gave the same error (1.04 % against 1.04 %) but
ran 3-8x slower in eager on 2 AMD EPYC cores (1.3-1.9 ms against 0.17-0.45 ms for 4-64 rows of a
3072 x 576 weight), so it is not a dependency.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import NamedTuple

import torch
from torch import nn

from minivllm.layers.custom_op import direct_register_custom_op
from minivllm.layers.fused_moe import FusedMoE, fused_moe_layers
from minivllm.layers.linear import Linear, LinearMethodBase, UnquantizedLinearMethod

QUANTIZATIONS = ("int8",)
ROUTERS = ("gate", "shared_expert_gate")  # beside a FusedMoE: which experts run, and the shared expert's share


# Inside a compiled forward (models/compiled_forward.py) the int8 product is an opaque op: Dynamo cannot
# trace fbgemm's packed weight (a TorchScript object), so the graph passes the layer's number and the op
# finds the layer here. Weak: a layer lives as long as its model. The per-token scaling around the
# product stays in the graph, where Inductor fuses it.
_LAYERS: weakref.WeakValueDictionary[int, Linear] = weakref.WeakValueDictionary()
_layer_ids = itertools.count()


def _int8_linear_op(x: torch.Tensor, layer: int) -> torch.Tensor:  # x (T, in) fp32 -> (T, out) fp32
    return _LAYERS[layer].quant_method.int8_product(_LAYERS[layer], x)


def _int8_linear_fake(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _LAYERS[layer].out_features)  # shapes only, for tracing


direct_register_custom_op("int8_linear", _int8_linear_op, _int8_linear_fake)


class Int8LinearMethod(LinearMethodBase):
    """int8 weights (one scale per output row) times int8 activations (one scale per token), for a `Linear`.

    One method serves every quantized layer of a model; each layer keeps its own int8 weight
    (`weight_packed`) and its number for the compiled op (`int8_id`)."""

    def __init__(self, reduce_range: bool) -> None:
        self.reduce_range = reduce_range  # 7-bit activations: a CPU without VNNI (see the module docstring)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Quantize `layer`'s loaded float weight (out, in) per output row into fbgemm's packed int8 weight,
        kept on the layer in its place (the float weight is dropped: a quarter of fp32's bytes stay)."""
        w = layer.weight.detach().float()  # (out, in)
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)
        zero_points = torch.zeros(layer.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; fbgemm's prepack takes one
            warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
            q = torch.quantize_per_channel(w, scale.double(), zero_points, 0, torch.qint8)
        # The bias is added after the per-token scale is undone, so fbgemm gets none.
        layer.weight_packed = torch.ops.quantized.linear_prepack(q, None)
        del layer.weight
        if layer.bias is not None:  # added to the fp32 product, before the cast back to x's dtype
            layer.bias = nn.Parameter(layer.bias.detach().float(), requires_grad=False)
        layer.int8_id = next(_layer_ids)  # how the compiled forward's opaque op finds this layer
        _LAYERS[layer.int8_id] = layer

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """(T, in) -> (T, out), in x's dtype."""
        m = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-12)  # (T, 1): each token's own scale
        if torch.compiler.is_compiling():
            y = torch.ops.minivllm.int8_linear(x / m, layer.int8_id)  # (T, out) fp32
        else:
            y = self.int8_product(layer, x / m)
        y = y.mul_(m) if bias is None else torch.addcmul(bias, y, m)
        return y.to(x.dtype)

    def int8_product(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) fp32, rows in [-1, 1] -> (T, out) fp32, through the layer's packed int8 weight."""
        # One fixed grid for [-1, 1]: q = round(x * 127) + 128 in 1..255 (7-bit: round(x * 63) + 64).
        scale, zero_point = (1 / 63, 64) if self.reduce_range else (1 / 127, 128)
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, scale, zero_point,
                                                                                 layer.weight_packed)

    @staticmethod
    def weight_bytes(layer: nn.Module) -> int:
        """The bytes a product streams from `layer`: int8 weights and fp32 scales (one per output row)."""
        return layer.in_features * layer.out_features + 4 * layer.out_features

    def __repr__(self) -> str:
        return f"Int8LinearMethod(per-channel int8 weights, {7 if self.reduce_range else 8}-bit activations)"


class QuantizedModel(NamedTuple):
    """What `quantize_model` did, for the start-up line."""
    layers: int  # Linears now int8: attention and dense MLPs (the shared expert's too)
    routers: int  # MoE routers kept in float (ROUTERS)
    expert_layers: int  # FusedMoE layers, whose experts stay in the model's dtype

    def summary(self, dtype: torch.dtype) -> str:
        name = str(dtype).removeprefix("torch.")
        said = f"quantization int8: {self.layers} linear layers (attention, dense MLPs); the LM head stays {name}"
        if self.expert_layers:
            said += (f"; the experts of {self.expert_layers} sparse layers and {self.routers} routers stay {name} "
                     "(int8 covers attention and dense MLPs only)")
        return said


def quantize_model(model: nn.Module, method: str, device: torch.device, reduce_range: bool) -> QuantizedModel:
    """Give every plain `Linear` of `model` but the LM head and the MoE routers an `Int8LinearMethod` and
    quantize its weight, in place; returns what it did. `reduce_range`: 7-bit activations (a CPU without VNNI: ask
    `minivllm.cpu.cpu_info.CpuInfo`). CPU only: fbgemm's kernels have no CUDA version (use
    dtype="bfloat16" there)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization={method!r} is invalid: choose one of {QUANTIZATIONS}")
    if device.type != "cpu":
        raise ValueError(f"quantization={method!r} runs on CPU only (fbgemm's int8 kernels), not on {device.type}; "
                         "drop quantization (dtype='bfloat16' halves the weights' bytes there)")
    if torch.backends.quantized.engine == "none":
        raise ValueError("this torch build has no int8 CPU kernels (torch.backends.quantized.engine is 'none')")
    int8 = Int8LinearMethod(reduce_range)
    targets, routers = [], 0
    for parent in model.modules():
        beside_experts = any(isinstance(c, FusedMoE) for c in parent.children())
        for name, child in parent.named_children():
            if not isinstance(child, Linear) or name == "lm_head":
                continue
            if beside_experts and name in ROUTERS:  # vLLM: quant_config=None for the router
                routers += 1
            elif isinstance(child.quant_method, UnquantizedLinearMethod):
                targets.append(child)
    for layer in targets:
        layer.quant_method = int8
        int8.process_weights_after_loading(layer)
    experts = len(fused_moe_layers(model))
    return QuantizedModel(len(targets), routers, experts)
