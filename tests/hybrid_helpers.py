"""A stand-in for the engine side of a hybrid (Qwen3.5) model, for tests: weights copied from the HF
model, a paged KV cache for the full-attention layers, a state pool for the linear-attention layers,
the per-step metadata `ModelRunner.prepare_inputs` would build, and commit = storing the new states."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from minivllm.layers.attention_interface import AttentionMetadata
from minivllm.layers.linear_attn_metadata import LinearAttnMetadata, LinearAttnState
from minivllm.layers.torch_attention import TorchAttentionBackend
from minivllm.models.hf_config import ModelSpec
from minivllm.models.loader import PACKED_MODULES


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Import into a test module to run it on one intra-op thread. These tensors are tiny: a second
    thread only adds synchronisation, and on a busy 2-core machine every one of the hundreds of small ops
    then waits for a core (measured: a 100-token chunked rule took 1.8 s instead of 6 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@torch.no_grad()
def load_from_hf(model: torch.nn.Module, spec: ModelSpec, state_dict: dict[str, torch.Tensor]) -> None:
    """The loader's packing (q/k/v -> qkv_proj, gate/up -> gate_up_proj) with q_proj's gate rows counted."""
    params = dict(model.named_parameters())
    sizes = {"qkv_proj": [spec.q_proj_size, spec.kv_size, spec.kv_size],
             "gate_up_proj": [spec.intermediate_size, spec.intermediate_size]}
    filled = set()
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        *module, proj, leaf = name.split(".")
        if proj in PACKED_MODULES:
            packed, index = PACKED_MODULES[proj]
            target = ".".join(module + [packed, leaf])
            start = sum(sizes[packed][:index])
            params[target].data[start:start + sizes[packed][index]].copy_(tensor)
        else:
            target = name
            params[target].data.copy_(tensor)
        filled.add(target)
    assert filled == set(params), f"not loaded: {set(params) - filled}"


@dataclass
class CapturingStates(LinearAttnMetadata):
    """Slots with no staging slots to write: the new states are kept here instead (the harness commits them)."""

    captured: list[LinearAttnState] = field(default_factory=list)

    def store(self, layer: int, new: LinearAttnState) -> None:
        assert layer == len(self.captured), "the layers' states come in layer order"
        self.captured.append(new)


@dataclass
class Chunk:
    """`num_new` tokens of one request, starting at position `start`, in state slot `slot`."""

    token_ids: list[int]  # all the request's tokens so far
    start: int
    num_new: int
    slot: int


class HybridHarness:
    def __init__(self, model: torch.nn.Module, spec: ModelSpec, num_slots: int = 4, blocks_per_request: int = 32,
                 block_size: int = 4) -> None:
        self.model, self.spec, self.block_size = model, spec, block_size
        self.blocks_per_request = blocks_per_request
        num_blocks = num_slots * blocks_per_request  # request in slot i owns blocks [i * M, (i + 1) * M)
        self.kv_caches = [torch.zeros(2, num_blocks, block_size, spec.num_key_value_heads, spec.head_dim)
                          for _ in spec.full_attention_layers]
        la = spec.linear_attn
        self.conv_pools = [torch.zeros(num_slots, *la.conv_state_shape) for _ in spec.linear_attention_layers]
        self.recurrent_pools = [torch.zeros(num_slots, *la.recurrent_state_shape)
                                for _ in spec.linear_attention_layers]
        self.backend = TorchAttentionBackend(spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim)

    def metadata(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                      LinearAttnMetadata]:
        """What `ModelRunner.prepare_inputs` builds, plus the linear-attention layers' slots."""
        bs, M = self.block_size, self.blocks_per_request
        ids, positions, slot_mapping = [], [], []
        for c in chunks:
            ids += c.token_ids[c.start:c.start + c.num_new]
            positions += list(range(c.start, c.start + c.num_new))
            slot_mapping += [(c.slot * M + p // bs) * bs + p % bs for p in range(c.start, c.start + c.num_new)]
        query_lens = [c.num_new for c in chunks]
        context_lens = [c.start + c.num_new for c in chunks]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping),
            cu_seqlens_q=torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            block_tables=torch.tensor([list(range(c.slot * M, (c.slot + 1) * M)) for c in chunks], dtype=torch.int32),
            query_lens=query_lens, context_lens_host=context_lens, block_size=bs)
        self.backend.prepare(meta)
        state = CapturingStates(
            state_slots=torch.tensor([c.slot for c in chunks]),
            has_initial_state=torch.tensor([c.start > 0 for c in chunks]),
            conv_pools=self.conv_pools, recurrent_pools=self.recurrent_pools)
        return torch.tensor(ids), torch.tensor(positions), meta, state

    @torch.no_grad()
    def forward(self, chunks: list[Chunk]) -> tuple[torch.Tensor, list[LinearAttnState]]:
        """Logits (T, V) of every new row and the new states, WITHOUT committing them."""
        ids, positions, meta, state = self.metadata(chunks)
        hidden = self.model(ids, positions, meta, self.kv_caches, self.backend, state)
        return self.model.compute_logits(hidden), state.captured

    def commit(self, chunks: list[Chunk], new_states: list[LinearAttnState]) -> None:
        slots = torch.tensor([c.slot for c in chunks])
        for pool_c, pool_r, new in zip(self.conv_pools, self.recurrent_pools, new_states):
            pool_c[slots] = new.conv
            pool_r[slots] = new.recurrent

    def step(self, chunks: list[Chunk]) -> torch.Tensor:
        logits, new_states = self.forward(chunks)
        self.commit(chunks, new_states)
        return logits

    def run(self, token_ids: list[int], pieces: list[int], slot: int = 0) -> torch.Tensor:
        """One request, prefilled/decoded in pieces of the given sizes; the logits of every row."""
        out, start = [], 0
        for n in pieces:
            out.append(self.step([Chunk(token_ids, start, n, slot)]))
            start += n
        return torch.cat(out)
