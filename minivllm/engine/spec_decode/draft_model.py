"""A draft model: a small model with the target's vocabulary guesses the next k tokens.

    catch up   run the draft on the sequence's tokens it has not seen yet (after a prefix-cache hit,
               a preemption or accepted drafts: usually one or two tokens, the whole prompt at first)
    k rounds   one forward per draft token, all sequences batched; each round samples a draft from
               the draft's distribution q (kept: rejection sampling needs q(x))

Its KV cache has the target's layout and is indexed by the TARGET's block tables (same block ids,
its own tensors), so no second block manager is needed. A block that the target got from the prefix
cache holds the target's K/V but not necessarily the draft's: the draft never trusts a block it did
not write for this sequence. `computed[request_id]` (how far the draft's K/V are valid) only moves at
commit, to min(what the draft computed, what the target verified): a failed step or rejected drafts
leave nothing stale behind.

Drafts are proposed after a commit, when a sequence's blocks cover its tokens but not yet the slots
of the drafts (the next `schedule()` reserves those). The rounds past the last block write their K/V
into scratch blocks of the draft's own, after the target's: `max_num_seqs` groups of
ceil(k / block_size) + 1, one group per sequence of a proposal. Scratch K/V are never trusted later
(`computed` stops at the sequence's own blocks): an accepted draft there is fed again at the next
catch-up, a row more in a batched forward. With the last block usually part-empty, that is rare.
"""

from __future__ import annotations

from array import array
from pathlib import Path

import torch

from minivllm.config import EngineConfig
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.step_types import ScheduledSequence, SchedulerOutput
from minivllm.engine.spec_decode.proposer import Draft, DraftRequest, Proposer
from minivllm.engine.worker.runner_builder import build_model_runner
from minivllm.layers.sampler import filtered_probs
from minivllm.models.hf_config import ModelSpec, load_model_spec
from minivllm.sampling_params import SamplingParams

_DRAFT_STREAM = 0x6A09E667F3BCC909  # the draft's noise must be independent of the target's


class DraftModelProposer(Proposer):
    def __init__(self, model_dir: str, target: ModelSpec, *, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, max_model_len: int, attention_backend: str, max_num_seqs: int,
                 num_speculative_tokens: int) -> None:
        spec = load_model_spec(Path(model_dir))
        if spec.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({spec.vocab_size} tokens) differs from the target's "
                             f"({target.vocab_size}); a draft must share the target's tokenizer")
        if spec.sliding_window is not None:  # its runner would need the sliding group's tables too
            raise ValueError(f"the draft model ({spec.architecture}) has sliding-window layers, which minivllm does "
                             "not run as a draft; use a Llama, Qwen2 or Qwen3 draft")
        if spec.linear_attn is not None:  # its runner would need a state pool of its own
            raise ValueError(f"the draft model ({spec.architecture}) has linear-attention layers, which minivllm "
                             "does not run as a draft; use a Llama, Qwen2 or Qwen3 draft (the target may be hybrid)")
        if spec.max_position_embeddings < max_model_len:
            raise ValueError(f"the draft model handles {spec.max_position_embeddings} positions but "
                             f"max_model_len={max_model_len}; lower max_model_len")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_per_seq = -(-num_speculative_tokens // block_size) + 1
        scratch = max_num_seqs * self.scratch_per_seq
        # The draft's own engine options: its checkpoint, the target's pool plus the scratch blocks, never compiled
        # (nor quantized, nor batch-invariant: the defaults).
        draft = EngineConfig(model=model_dir, dtype=str(dtype).removeprefix("torch."), block_size=block_size,
                             max_model_len=max_model_len, attention_backend=attention_backend,
                             num_kv_blocks=num_blocks + scratch, enforce_eager=True)
        self.runner = build_model_runner(draft, spec, device, dtype)
        self.computed: dict[str, int] = {}  # published at commit
        self._reached: dict[str, int] = {}  # what this step's proposal computed

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        self._reached = {}
        bs = self.block_size
        for round_ in range(max((r.max_tokens for r in requests), default=0)):
            active = [i for i, r in enumerate(requests) if len(drafts[i]) < r.max_tokens]
            views = [self._view(requests[i], drafts[i], round_, i) for i in active]
            out = SchedulerOutput([ScheduledSequence(v, v.num_computed_tokens, v.num_uncomputed_tokens)
                                   for v in views])
            batch = self.runner.prepare_inputs(out)
            logits = self.runner.forward(batch.inputs).float()  # (A, V)
            q = filtered_probs(logits, batch.sampling)  # (A, V): the distribution the drafts come from
            tokens = self.runner.sampler(logits, batch.sampling).tolist()
            for a, i in enumerate(active):
                drafts[i].append(tokens[a])
                probs[i].append(q[a])
                own_blocks = len(requests[i].block_table) * bs  # K/V past these went to scratch: not kept
                self._reached[requests[i].request_id] = min(views[a].num_tokens, own_blocks)
        return [Draft(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _view(self, r: DraftRequest, drafts: list[int], round_: int, index: int) -> Sequence:
        """A throw-away Sequence over the committed tokens + drafts so far: the target's blocks, then
        the scratch blocks of the proposal's `index`-th sequence."""
        sp = r.sampling_params
        view = Sequence(r.request_id, r.token_ids + array("i", drafts),
                        SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
                                       max_tokens=None), seed=r.seed ^ _DRAFT_STREAM)
        first_scratch = self.num_blocks + index * self.scratch_per_seq
        view.block_table = list(r.block_table) + list(range(first_scratch, first_scratch + self.scratch_per_seq))
        computed = min(self.computed.get(r.request_id, 0), len(r.token_ids) - 1)
        view.num_computed_tokens = computed if round_ == 0 else view.num_tokens - 1
        return view

    def on_commit(self, seq_ids: list[str], num_computed: list[int]) -> None:
        for rid, verified in zip(seq_ids, num_computed):
            if rid in self._reached:
                self.computed[rid] = min(self._reached[rid], verified)
        self._reached = {}

    def on_free(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
