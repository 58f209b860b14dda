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
(w13's two halves) and the same columns of its down, read as slices straight from the memory-mapped file
(a per-expert tensor's slice is models/sharding.py's `checkpoint_slice`, as any matrix's; a fused one holds
every expert and is sliced here). `expert_copies` says which slice of the file goes to which slice of which
parameter; the loader checks the shapes, copies, and marks what it filled (models/loader.py): a place written
twice (a fused and a per-expert tensor for one layer, a key in two shards) is refused, and a place left
unwritten is named by `describe_unfilled` as expert e's gate_proj / up_proj / down_proj.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from safetensors import safe_open

from minivllm.models.sharding import ShardLayout

_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up|down)_proj")


Index = tuple[int | slice, ...]


class ExpertCopy(NamedTuple):
    target: str  # the parameter's name: ...mlp.experts.w13_weight or ...mlp.experts.w2_weight
    index: Index  # the part of that parameter to fill: param[index]; never the last dimension
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
        num_experts = params[target].shape[0]
        if expert >= num_experts:
            raise ValueError(f"{name}: expert {expert} is past config.json's num_experts={num_experts} (experts "
                             f"0..{num_experts - 1}); is config.json from the same checkpoint?")
        param = params[target].data[expert]  # (2I, H) or (H, I): this rank's sizes
        sliced = f.get_slice(ckpt_name)
        I = param.shape[1] if proj == "down" else param.shape[0] // 2
        # this rank's rows of gate / up, columns of down: the layout's answer, as for every other matrix
        piece = layout.checkpoint_slice(name) if layout is not None else None
        start, stop = (piece.start, piece.stop) if piece is not None else (0, I)
        if proj == "down":
            _check_shape(name, sliced.get_shape(), (param.shape[0], I * n))
            return [ExpertCopy(target, (expert,), sliced[:, start:stop])]
        _check_shape(name, sliced.get_shape(), (I * n, param.shape[1]))
        half = slice(0, I) if proj == "gate" else slice(I, 2 * I)
        return [ExpertCopy(target, (expert, half), sliced[start:stop])]
    m = _FUSED.fullmatch(name)
    target = f"{m[1]}.{'w13_weight' if m[2] == 'gate_up' else 'w2_weight'}"
    if target not in params:
        return []
    param = params[target].data  # (E, 2I, H) or (E, H, I)
    sliced = f.get_slice(ckpt_name)
    if m[2] == "down":
        I = param.shape[2]
        _check_shape(name, sliced.get_shape(), (param.shape[0], param.shape[1], I * n))
        return [ExpertCopy(target, (), sliced[:, :, rank * I:(rank + 1) * I])]
    I = param.shape[1] // 2  # this rank's width of each half
    full = I * n  # the checkpoint's
    _check_shape(name, sliced.get_shape(), (param.shape[0], 2 * full, param.shape[2]))
    return [ExpertCopy(target, (slice(None), slice(0, I)), sliced[:, rank * I:(rank + 1) * I]),  # gate rows
            ExpertCopy(target, (slice(None), slice(I, 2 * I)), sliced[:, full + rank * I:full + (rank + 1) * I])]


def describe_unfilled(target: str, unfilled: torch.Tensor) -> str:
    """`target` (a parameter), with the experts and projections `unfilled` (its loader mask, True where no
    tensor wrote: (E, 2I) for w13, (E, H) for w2) says are missing; `target` alone for any other parameter."""
    if target.endswith("w13_weight"):
        I = unfilled.shape[1] // 2
        missing = [f"expert {e}'s {proj}_proj" for e in range(unfilled.shape[0])
                   for proj, rows in (("gate", slice(0, I)), ("up", slice(I, 2 * I))) if unfilled[e, rows].any()]
    elif target.endswith("w2_weight"):
        missing = [f"expert {e}'s down_proj" for e in range(unfilled.shape[0]) if unfilled[e].any()]
    else:
        return target
    return f"{target} ({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})"


def _check_shape(name: str, shape: list[int], expected: tuple[int, ...]) -> None:
    """Slicing a tensor of the wrong size would read a wrong part of it silently: refuse first."""
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(shape)}, expected {tuple(expected)}; config.json's num_experts / "
                         "moe_intermediate_size and the weights disagree")
