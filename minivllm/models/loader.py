"""Load a Hugging Face safetensors checkpoint (single file or sharded) into a minivllm model.

The checkpoint stores q/k/v and gate/up separately; our model packs them. `PACKED_MODULES` says
which checkpoint tensor goes to which slice of which packed parameter:

    q_proj  -> qkv_proj rows [0, q_size)                 gate_proj -> gate_up_proj rows [0, I)
    k_proj  -> qkv_proj rows [q_size, q_size + kv_size)  up_proj   -> gate_up_proj rows [I, 2I)
    v_proj  -> qkv_proj rows [q_size + kv_size, end)

Mixture-of-experts checkpoints store each expert's gate/up/down (or, fused, all experts in one tensor):
they go into `FusedMoE`'s stacked `w13_weight` / `w2_weight` (models/moe_weights.py says where).

Every parameter must be filled completely and every place in it written once: the loader keeps, per parameter,
which checkpoint tensor wrote each row (`WrittenBy`; a row is the last dimension, which every copy writes
whole, or one element of a 1-D parameter). A second write to a row (a key in two shards, a layer stored both
fused and per expert) is refused naming both tensors, since whichever came last would win silently and could
hide a missing one; a row no tensor wrote is named (an expert's, by expert and projection).

Tensor parallelism (`layout`, models/sharding.py): each rank reads only its slice of every sharded
tensor, `safe_open(...).get_slice(name)[rows]` (or `[:, columns]`), straight from the memory-mapped
file, so no rank ever holds the whole checkpoint; the packed bounds above are then this rank's sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from minivllm.models.hf_config import ModelSpec
from minivllm.models.moe_weights import Index, describe_unfilled, expert_copies, is_expert_tensor
from minivllm.models.qwen3_5 import text_weight_name
from minivllm.models.sharding import ShardLayout, WeightSlice

PACKED_MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _shard_bounds(spec: ModelSpec, packed: str, index: int, out_rows: int) -> tuple[int, int]:
    if packed == "qkv_proj":
        sizes = [spec.q_proj_size, spec.kv_size, spec.kv_size]  # q_proj: [q_h | gate_h] per head if gated
    else:
        sizes = [out_rows // 2, out_rows // 2]
    start = sum(sizes[:index])
    return start, start + sizes[index]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shards listed in the index are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    return files


class WrittenBy:
    """Which checkpoint tensor wrote each row of each parameter: 0 for none, i for `names[i - 1]`."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.names: list[str] = []
        self.writer = {name: torch.zeros(p.shape[:-1] if p.dim() > 1 else p.shape, dtype=torch.int32)
                       for name, p in params.items()}  # (rows of the parameter,), on the CPU

    def mark(self, path: Path, name: str, target: str, index: Index) -> None:
        rows = self.writer[target][index]  # the same part of the mask as of the parameter
        if (earlier := int(rows.max()) if rows.numel() else 0) > 0:
            raise ValueError(f"{path.name}: {name} writes {target} where {self.names[earlier - 1]} already did; a "
                             "checkpoint holds each weight once (a key in two shards, or a layer stored both fused "
                             "and per expert?)")
        self.names.append(name)
        rows.fill_(len(self.names))

    def unfilled(self) -> list[str]:
        """The parameters some row of which no tensor wrote, with the experts and projections it lacks."""
        return [describe_unfilled(n, w == 0) for n, w in self.writer.items() if bool((w == 0).any())]


def read_tensor(f: safe_open, name: str, piece: WeightSlice | None) -> torch.Tensor:
    """The whole tensor, or only its `piece` (rows or columns) when the rank holds a slice."""
    if piece is None:
        return f.get_tensor(name)
    sliced = f.get_slice(name)
    return sliced[piece.start:piece.stop] if piece.dim == 0 else sliced[:, piece.start:piece.stop]


@torch.no_grad()
def load_weights(model: nn.Module, spec: ModelSpec, model_dir: str | Path, layout: ShardLayout | None = None) -> None:
    model_dir = Path(model_dir)
    local_spec = layout.rank_spec(spec) if layout is not None else spec  # sizes of this rank's packed tensors
    params = dict(model.named_parameters())
    written = WrittenBy(params)
    for path in safetensors_files(model_dir):
        try:
            f = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"cannot read {path}: {e} (the checkpoint is corrupt or incomplete)") from e
        for ckpt_name in f.keys():
            name = text_weight_name(ckpt_name)  # multimodal checkpoints: the text decoder's name, or None
            tied_head = name == "lm_head.weight" and spec.tie_word_embeddings
            if name is None or name.endswith(IGNORED_SUFFIXES) or tied_head:
                continue
            if is_expert_tensor(name):  # one expert's projection, or all experts' (fused)
                copies = expert_copies(f, ckpt_name, name, params, layout)
                if not copies:
                    raise ValueError(f"{path.name}: unexpected tensor {name!r} for {spec.architecture}; "
                                     "is config.json from the same checkpoint?")
                for target, where, tensor in copies:
                    written.mark(path, name, target, where)
                    _copy(path, name, params[target].data[where], tensor)
                continue
            target, rows = name, None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in PACKED_MODULES:
                packed, index = PACKED_MODULES[parts[-2]]
                target = ".".join(parts[:-2] + [packed, parts[-1]])
            if target not in params:
                raise ValueError(f"{path.name}: unexpected tensor {name!r} for {spec.architecture}; "
                                 "is config.json from the same checkpoint?")
            param = params[target]
            tensor = read_tensor(f, ckpt_name, layout.checkpoint_slice(name) if layout is not None else None)
            if rows is None and target != name:
                rows = _shard_bounds(local_spec, packed, index, param.shape[0])
            where = () if rows is None else (slice(rows[0], rows[1]),)
            written.mark(path, name, target, where)
            _copy(path, name, param.data[where], tensor)
    missing = written.unfilled()
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks weights for {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''} (corrupt or truncated checkpoint)")


def _copy(path: Path, name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"{path.name}: {name} has shape {tuple(tensor.shape)}, expected "
                         f"{tuple(dest.shape)}; config.json and the weights disagree")
    dest.copy_(tensor)
