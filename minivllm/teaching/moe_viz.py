"""A mixture of experts watched at work, and what its decode step must read (notebook 18; needs matplotlib).

    captures = capture_routing(llm, prompt_ids)      each sparse layer's input rows and router logits, one prefill
    plot_token_route(probs, topk_ids, topk_weights)  one token: the router's softmax, the k experts it picks
    plot_expert_load(loads, top_k)                   routes per expert over a prompt, one group of bars a layer
    plot_sorted_routes(alignment, top_k)             moe_align_block_size's output: blocks of one expert's routes
    decode_bytes(spec, 2)                            what one decode step reads, MoE and dense of the same size
    expected_active_experts(E, k, batch)             experts a batch touches, if routing were uniform
    plot_bytes_per_step(nbytes, batches)             GB a step against the batch: MoE and dense
    time_moe_decode(layer, batch)                    one FusedMoE's decode step, timed, and the bytes it read

The routing itself is never recomputed here: `capture_routing` hooks the engine's own router (the
`gate` Linear of each SparseMoeBlock, models/qwen3_moe.py) while `LLM.generate` runs, and the notebook
calls `select_experts`, `sort_tokens_by_expert` and `moe_align_block_size` on what it caught.

Bytes are counted on the model the engine builds, on the meta device (shapes, no memory): every weight is
read once a step, except the experts (an expert's weights are read only if a token of the step routes
to it) and the embedding table (looked up, one row a token, never read whole; not counted).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from minivllm import LLM
from minivllm.kernels.moe_align import MoeAlignment
from minivllm.layers.fused_moe import FusedMoE, count_experts
from minivllm.models.hf_config import ModelSpec
from minivllm.teaching.viz import WIDTH, _axes, _legend_below, _patch

CHOSEN, OTHER, PAD = "tab:orange", "tab:blue", "0.85"



class RouterCapture(NamedTuple):
    """One sparse layer's view of a prefill: what entered its MoE block and what its router said."""
    hidden: torch.Tensor  # (T, H): the MoE block's input, one row a prompt token
    router_logits: torch.Tensor  # (T, E): gate(hidden)


def capture_routing(llm: LLM, prompt_token_ids: Sequence[int]) -> list[RouterCapture]:
    """Prefill `prompt_token_ids` through `llm` (one token generated) with a forward hook on every sparse
    layer's router; each sparse layer's inputs and router logits for the prompt, in layer order.
    The prompt must not be in the prefix cache: its cached tokens would skip the forward."""
    from minivllm import SamplingParams

    routers = [layer.mlp.gate for layer in llm.llm_engine.model.model.layers if hasattr(layer.mlp, "experts")]
    if not routers:
        raise ValueError("capture_routing: this model has no mixture-of-experts layer (no SparseMoeBlock)")
    caught: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in routers]
    hooks = [router.register_forward_hook(lambda m, args, out, i=i: caught[i].append((args[0].detach().clone(),
                                                                                       out.detach().clone())))
             for i, router in enumerate(routers)]
    try:  # chunked prefill may run the prompt in several forwards: their rows are concatenated
        llm.generate([{"prompt_token_ids": list(prompt_token_ids)}], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    captures = [RouterCapture(torch.cat([x for x, _ in calls]), torch.cat([y for _, y in calls])) for calls in caught]
    if captures[0].hidden.shape[0] != len(prompt_token_ids):
        raise ValueError(f"capture_routing saw {captures[0].hidden.shape[0]} of the prompt's {len(prompt_token_ids)} "
                         "tokens: part of it came from the prefix cache; pass a new prompt, or build the LLM "
                         "with enable_prefix_caching=False")
    return captures


def plot_token_route(probs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, ax: Any = None,
                     title: str = "") -> Any:
    """One token's router: softmax probability of every expert (E,), the chosen k (k,) highlighted and
    labelled with their weight after renormalising."""
    ax = _axes(ax, (WIDTH, 3.0))
    chosen = {int(e): float(w) for e, w in zip(topk_ids, topk_weights)}
    experts = range(probs.numel())
    ax.bar(experts, probs.tolist(), color=[CHOSEN if e in chosen else OTHER for e in experts])
    for e, w in chosen.items():
        ax.text(e, float(probs[e]), f"{w:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(experts), [str(e) for e in experts], fontsize=9)
    ax.tick_params(labelsize=9)
    ax.set_xlabel("expert", fontsize=10)
    ax.set_ylabel("router probability", fontsize=10)
    ax.set_ylim(0, 1.15 * float(probs.max()))
    ax.set_title(title or "one token's route: softmax over the experts, the top k chosen", fontsize=11)
    _legend_below(ax, [_patch(CHOSEN), _patch(OTHER)],
                  [f"chosen (top {len(chosen)}; number: its weight, renormalised)", "not chosen"])
    return ax


def plot_expert_load(loads: Sequence[torch.Tensor], top_k: int, ax: Any = None, title: str = "") -> Any:
    """Routes per expert, one (E,) count tensor a layer (FusedMoE.last_load), grouped bars; the dashed line
    is a perfectly even load, T*k/E."""
    ax = _axes(ax, (WIDTH, 3.0))
    num_experts, n = loads[0].numel(), len(loads)
    width = 0.8 / n
    for i, load in enumerate(loads):
        ax.bar([e + (i - (n - 1) / 2) * width for e in range(num_experts)], load.tolist(), width,
               label=f"layer {i}")
    even = float(loads[0].sum()) / num_experts
    ax.axhline(even, color="black", ls="--", lw=1, label=f"even load ({even:.1f})")
    ax.set_xticks(range(num_experts), [str(e) for e in range(num_experts)], fontsize=9)
    ax.tick_params(labelsize=9)
    ax.set_xlabel("expert", fontsize=10)
    ax.set_ylabel("routes (tokens sent to it)", fontsize=10)
    tokens = int(loads[0].sum()) // top_k
    ax.set_title(title or f"the load across experts: {tokens} tokens x top-{top_k}, per sparse layer", fontsize=11)
    _legend_below(ax, *ax.get_legend_handles_labels())
    return ax


def plot_sorted_routes(alignment: MoeAlignment, top_k: int, ax: Any = None) -> Any:
    """moe_align_block_size's MoeAlignment drawn as the kernel reads it: one row of cells a block of
    BLOCK_M sorted routes, all of one expert (left label); a cell is its route's token, t = r // k;
    grey cells are the sentinel (padding: masked rows, never loaded or stored)."""
    import matplotlib

    used = int(alignment.num_tokens_post_padded)
    block_m = alignment.sorted_token_ids.numel() // alignment.expert_ids.numel()
    blocks = used // block_m
    sentinel = int(alignment.sorted_token_ids.max())  # T*k: no route has it
    ax = _axes(ax, (WIDTH, 0.9 + 0.32 * blocks))
    # experts told apart by colour: "tab20" without its two greys (grey is padding); more than 18 repeat
    colours = [c for i, c in enumerate(matplotlib.colormaps["tab20"].colors) if i not in (14, 15)]
    for b in range(blocks):
        expert = int(alignment.expert_ids[b])
        for j in range(block_m):
            route = int(alignment.sorted_token_ids[b * block_m + j])
            pad = route == sentinel
            ax.add_patch(_patch(PAD if pad else colours[expert % len(colours)], (j, b), 1, 1))
            ax.text(j + 0.5, b + 0.5, "pad" if pad else f"t{route // top_k}", ha="center", va="center", fontsize=9)
    ax.set_xlim(0, block_m)
    ax.set_ylim(blocks, 0)
    ax.set_yticks([b + 0.5 for b in range(blocks)],
                  [f"block {b}: expert {int(alignment.expert_ids[b])}" for b in range(blocks)], fontsize=9)
    ax.set_xticks([j + 0.5 for j in range(block_m)], [str(j) for j in range(block_m)], fontsize=9)
    ax.set_xlabel(f"row of the block (BLOCK_M = {block_m}); cell: the token whose route it is", fontsize=10)
    ax.set_title(f"sorted_token_ids: {used} rows, {blocks} blocks, one expert each", fontsize=11)
    return ax


class DecodeBytes(NamedTuple):
    """What a decode step reads from memory, by kind (bytes at `bytes_per_weight` a weight)."""
    always: int  # read whatever the tokens route to: attention, norms, routers, dense MLPs, the LM head
    expert: int  # one expert of one sparse layer: its w13 (2I x H) and w2 (H x I)
    sparse_layers: int
    num_experts: int  # E a sparse layer
    top_k: int

    def moe_step(self, active_experts: float) -> float:
        """Bytes of a step whose tokens route to `active_experts` distinct experts in each sparse layer."""
        return self.always + self.sparse_layers * active_experts * self.expert

    @property
    def moe_token(self) -> int:
        """One token alone: its k experts a layer."""
        return int(self.moe_step(self.top_k))

    @property
    def dense(self) -> int:
        """A dense model of the same total size (the experts' bytes as one wide MLP): every byte, every step."""
        return int(self.moe_step(self.num_experts))


def decode_bytes(spec: ModelSpec, bytes_per_weight: float) -> DecodeBytes:
    """`spec`'s model, built by the engine's own class on the meta device (no memory), its weights counted."""
    from minivllm.models.qwen3_moe import Qwen3MoeForCausalLM

    if spec.moe is None:
        raise ValueError(f"decode_bytes: {spec.architecture} has no experts (ModelSpec.moe is None)")
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(spec)
    experts = count_experts(model)  # the engine's own counting (the bench's roofline reads it too)
    embedding = model.model.embed_tokens.weight.numel()  # looked up, not read whole (a tied LM head is it too)
    always = sum(p.numel() for p in model.parameters()) - embedding - experts.total_params
    return DecodeBytes(int(always * bytes_per_weight), int(experts.expert_params * bytes_per_weight),
                       experts.sparse_layers, experts.num_experts, experts.top_k)


def expected_active_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of independent tokens touches in one layer, if each picked its k uniformly:
    an expert is missed by one token with probability 1 - k/E, by all of them with (1 - k/E)^batch."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def plot_bytes_per_step(nbytes: DecodeBytes, batches: Sequence[int], ax: Any = None, title: str = "") -> Any:
    """GB read by one decode step of `batch` tokens: the MoE (its experts touched under uniform routing)
    and a dense model of the same total size, against the batch (log scale)."""
    ax = _axes(ax, (WIDTH, 3.2))
    moe = [nbytes.moe_step(expected_active_experts(nbytes.num_experts, nbytes.top_k, b)) / 1e9 for b in batches]
    ax.plot(batches, [nbytes.dense / 1e9] * len(batches), color=OTHER, lw=2, label="dense, same total size")
    ax.plot(batches, moe, "o-", color=CHOSEN, lw=2, label="MoE, uniform routing")
    ax.axhline(nbytes.always / 1e9, color="0.5", ls=":", lw=1.5, label="outside the experts")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(batches), [str(b) for b in batches])
    ax.tick_params(labelsize=10)
    ax.set_xlabel("tokens in the decode step (batch)", fontsize=10)
    ax.set_ylabel("GB read a step", fontsize=10)
    ax.set_ylim(0, 1.1 * nbytes.dense / 1e9)
    ax.set_title(title or "bytes a decode step reads: a mixture of experts against a dense model", fontsize=11)
    _legend_below(ax, *ax.get_legend_handles_labels())
    return ax


class DecodeTiming(NamedTuple):
    seconds: float  # one forward of the layer, the median of the repeats
    bytes_read: float  # the experts' weights each forward's routes touched, averaged over the repeats


def time_moe_decode(layer: FusedMoE, batch: int, repeats: int = 20, seed: int = 0,
                    evict_bytes: int | None = None) -> DecodeTiming:
    """Time `layer` on `batch` random tokens with random router logits, new ones every repeat (so the
    experts read change, as from one decode step to the next). Before each timed forward a buffer of
    `evict_bytes` (default: twice the last-level cache) is read, so the experts come from memory, as in a
    model whose layers are far larger than the cache; without it a small layer's experts partly sit in
    cache and "beat" the read bandwidth. Bytes: the distinct experts each forward routed to (`last_load`),
    times one expert's bytes as the layer stores them."""
    from minivllm.cpu.cpu_info import CpuInfo

    gen = torch.Generator().manual_seed(seed)
    dtype = layer.w2_weight.dtype
    inputs = [(torch.randn(batch, layer.hidden_size, generator=gen).to(dtype),
               torch.randn(batch, layer.num_experts, generator=gen)) for _ in range(repeats + 1)]
    evict_bytes = 2 * CpuInfo.read().last_level_cache_bytes if evict_bytes is None else evict_bytes
    other = torch.ones(max(evict_bytes // 4, 1))  # (evict_bytes / 4,) float32
    expert_bytes = layer.w13_weight[0].nbytes + layer.w2_weight[0].nbytes
    times, read = [], 0.0
    with torch.no_grad():
        layer(*inputs[0])  # first touch: page faults, kernel selection
        for x, logits in inputs[1:]:
            other.sum()  # the cache now holds this buffer, not the layer's experts
            start = time.perf_counter()
            layer(x, logits)
            times.append(time.perf_counter() - start)
            read += int((layer.last_load > 0).sum()) * expert_bytes
    return DecodeTiming(statistics.median(times), read / repeats)
