"""`MoeSpec`: the mixture-of-experts numbers of a Qwen3-MoE or Qwen2-MoE `config.json`.

A sparse layer replaces the MLP by `num_experts` small MLPs ("experts", each of width
`moe_intermediate_size`) and a router that sends every token to `num_experts_per_tok` of them
(layers/moe_router.py, layers/fused_moe.py). Which layers are sparse is HF's rule, read here once:

    layer i is sparse  <=>  i not in mlp_only_layers  and  (i + 1) % decoder_sparse_step == 0

the other layers keep the dense MLP of `intermediate_size`.

    key (config.json)                   Qwen3-MoE          Qwen2-MoE
    num_experts (t5: num_local_experts) E                  E
    num_experts_per_tok                 k                  k
    moe_intermediate_size               each expert's I    each expert's I
    norm_topk_prob                      renormalize top-k  renormalize top-k   (both default False,
                                                                               as transformers' classes)
    shared_expert_intermediate_size     ignored (no shared) the shared expert's width (must be > 0)
    decoder_sparse_step, mlp_only_layers the sparse layers  the sparse layers

transformers 5 writes Qwen3-MoE's expert count as "num_local_experts" (its attribute map), transformers 4
as "num_experts": both are read (both present and different: refused). The router's auxiliary loss
(`router_aux_loss_coef`, `output_router_logits`) only matters for training and is ignored; what would change
inference and is not implemented is refused by name, and so is a missing num_experts_per_tok or
moe_intermediate_size (HF would fall back to its class's defaults, a guess about someone else's model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int  # E: experts per sparse layer
    num_experts_per_tok: int  # k: experts each token is routed to
    moe_intermediate_size: int  # I: each expert's width (under tensor parallelism, this rank's share)
    norm_topk_prob: bool  # divide the k routing weights by their sum (vLLM: renormalize)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert; 0: none
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts={self.num_experts}: a mixture-of-experts model needs at least one expert "
                             "(a checkpoint without experts is the dense Qwen2/Qwen3 decoder)")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts="
                             f"{self.num_experts}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be positive")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be at least 1")

    def is_sparse(self, layer: int) -> bool:
        """Does layer `layer` route through the experts (HF's rule, above), or keep the dense MLP?"""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def parse_moe_spec(arch: str, cfg: dict[str, Any], num_layers: int) -> MoeSpec:
    """The MoE numbers of a config.json of `arch` (one of MOE_ARCHITECTURES)."""
    experts, local = cfg.get("num_experts"), cfg.get("num_local_experts")
    if experts is None and local is None:
        raise ValueError(f"{arch}: config.json gives neither num_experts nor num_local_experts")
    if experts is not None and local is not None and int(experts) != int(local):
        raise ValueError(f"{arch}: config.json gives num_experts={experts} and num_local_experts={local}; they name "
                         "the same count: keep the one that matches the checkpoint's experts")
    experts = experts if experts is not None else local
    for field in ("num_experts_per_tok", "moe_intermediate_size"):  # HF's class defaults are a guess: refuse
        if cfg.get(field) is None:
            raise ValueError(f"{arch}: config.json lacks {field}; add it (the checkpoint's own config.json has it)")
    only = tuple(int(i) for i in cfg.get("mlp_only_layers") or ())
    outside = [i for i in only if not 0 <= i < num_layers]
    if outside:
        raise ValueError(f"mlp_only_layers {list(only)} names layers {outside} outside the model's {num_layers}")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    if arch == "Qwen2MoeForCausalLM" and shared < 1:
        raise ValueError(f"shared_expert_intermediate_size={shared}: Qwen2MoeForCausalLM always has a shared expert; "
                         "give its width in config.json")
    return MoeSpec(num_experts=int(experts), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   shared_expert_intermediate_size=shared,
                   decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)), mlp_only_layers=only)
