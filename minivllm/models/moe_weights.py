"""Where a checkpoint's expert tensors go in `FusedMoE`'s two stacked weights (layers/fused_moe.py).

Checkpoints store the experts in one of two layouts; both are read:

    per expert (transformers 4, and what transformers 5's save_pretrained writes for Qwen-MoE):
        model.layers.L.mlp.experts.E.gate_proj.weight  (I, H)  -> w13_weight[E, 0:I]
        model.layers.L.mlp.experts.E.up_proj.weight    (I, H)  -> w13_weight[E, I:2I]
        model.layers.L.mlp.experts.E.down_proj.weight  (H, I)  -> w2_weight[E]
    fused (transformers 5's in-memory form, `model.state_dict()`):
        model.layers.L.mlp.experts.gate_up_proj        (E, 2I, H) -> w13_weight  (gate rows, then up rows)
        model.layers.L.mlp.experts.down_proj           (E, H, I)  -> w2_weight

Under tensor parallelism a rank holds rows [r I/N, (r+1) I/N) of every expert's gate and of its up
(w13's two halves) and the same columns of its down (models/sharding.py), read as slices straight from
the memory-mapped file. `expert_copies` says which slice of the file goes to which slice of which
parameter; the loader checks the shapes, copies, and counts what it filled (models/loader.py).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from safetensors import safe_open

from minivllm.models.sharding import ShardLayout

_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up|down)_proj")


class ExpertCopy(NamedTuple):
    target: str  # the parameter's name: ...mlp.experts.w13_weight or ...mlp.experts.w2_weight
    dest: torch.Tensor  # the slice of that parameter to fill
    source: torch.Tensor  # what the checkpoint holds for it (this rank's slice)


def is_expert_tensor(name: str) -> bool:
    return _PER_EXPERT.fullmatch(name) is not None or _FUSED.fullmatch(name) is not None


def expert_copies(f: safe_open, ckpt_name: str, name: str, params: dict[str, torch.Tensor],
                  layout: ShardLayout | None) -> list[ExpertCopy]:
    """The copies that load checkpoint tensor `ckpt_name` (`name` in the text decoder's naming), an expert
    tensor (`is_expert_tensor`); [] when `params` has no such parameter (the loader then names it)."""
    rank, n = (layout.rank, layout.world_size) if layout is not None else (0, 1)
    if m := _PER_EXPERT.fullmatch(name):
        prefix, expert, proj = m[1], int(m[2]), m[3]
        target = f"{prefix}.{'w2_weight' if proj == 'down' else 'w13_weight'}"
        if target not in params:
            return []
        param = params[target].data[expert]  # (2I, H) or (H, I): this rank's sizes
        sliced = f.get_slice(ckpt_name)
        if proj == "down":
            I = param.shape[1]
            _check_shape(name, sliced.get_shape(), (param.shape[0], I * n))
            return [ExpertCopy(target, param, sliced[:, rank * I:(rank + 1) * I])]
        I = param.shape[0] // 2
        _check_shape(name, sliced.get_shape(), (I * n, param.shape[1]))
        half = param[:I] if proj == "gate" else param[I:]
        return [ExpertCopy(target, half, sliced[rank * I:(rank + 1) * I])]
    m = _FUSED.fullmatch(name)
    target = f"{m[1]}.{'w13_weight' if m[2] == 'gate_up' else 'w2_weight'}"
    if target not in params:
        return []
    param = params[target].data  # (E, 2I, H) or (E, H, I)
    sliced = f.get_slice(ckpt_name)
    if m[2] == "down":
        I = param.shape[2]
        _check_shape(name, sliced.get_shape(), (param.shape[0], param.shape[1], I * n))
        return [ExpertCopy(target, param, sliced[:, :, rank * I:(rank + 1) * I])]
    I = param.shape[1] // 2  # this rank's width of each half
    full = I * n  # the checkpoint's
    _check_shape(name, sliced.get_shape(), (param.shape[0], 2 * full, param.shape[2]))
    return [ExpertCopy(target, param[:, :I], sliced[:, rank * I:(rank + 1) * I]),  # gate rows
            ExpertCopy(target, param[:, I:], sliced[:, full + rank * I:full + (rank + 1) * I])]  # up rows


def _check_shape(name: str, shape: list[int], expected: tuple[int, ...]) -> None:
    """Slicing a tensor of the wrong size would read a wrong part of it silently: refuse first."""
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(shape)}, expected {tuple(expected)}; config.json's num_experts / "
                         "moe_intermediate_size and the weights disagree")
