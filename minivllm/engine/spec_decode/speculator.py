"""`Speculator`: the engine's side of speculative decoding, between planning and the forward.

    propose(plan)             ask the proposer for drafts to fill the draft slots the scheduler
                              reserved; drafts go to `seq.spec_token_ids` (recorded in the step's
                              undo log) and each row group shrinks to the drafts actually proposed
    after_step(plan, out, released)
                              count drafts and acceptances; tell the proposer what the target
                              verified (`on_commit`), then which sequences gave their blocks back
                              since, for whatever reason (finished, aborted, failed, preempted:
                              `on_free`), so that it forgets them

The proposer is checked like user input: more drafts than asked, an id outside the vocabulary, or
`Draft.probs` that is no distribution over the drafts (shape, sign, sum) is an error naming the
proposer, never silently trimmed or broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minivllm.engine.sampling_metadata import RowGroupOutput
from minivllm.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from minivllm.engine.spec_decode.config import SpeculativeConfig
from minivllm.engine.spec_decode.ngram import NgramProposer
from minivllm.engine.spec_decode.proposer import DraftRequest, Proposer


def build_proposer(cfg: SpeculativeConfig, engine: Any, num_blocks: int) -> Proposer:
    """The proposer a `speculative_config` asks for (`engine`: the LLMEngine being built)."""
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_max, cfg.prompt_lookup_min)
    if cfg.method == "custom":
        if not isinstance(cfg.proposer, Proposer):
            raise TypeError(f"speculative_config['proposer'] must be a minivllm Proposer, got "
                            f"{type(cfg.proposer).__name__}")
        return cfg.proposer
    from minivllm.engine.spec_decode.draft_model import DraftModelProposer

    c = engine.config
    return DraftModelProposer(cfg.model, engine.spec, device=engine.device, dtype=engine.dtype, num_blocks=num_blocks,
                              block_size=c.block_size, max_model_len=c.max_model_len,
                              attention_backend=c.attention_backend)


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, proposer: Proposer,
                 check_token_ids: Callable[[str, str, list[int]], list[int]], vocab_size: int) -> None:
        self.proposer = proposer
        self.check_token_ids = check_token_ids
        self.vocab_size = vocab_size
        # A caller's proposer is checked like user input; the built-in ones are trusted (the draft model's
        # distributions are the sampler's own: checking (d, V) tensors each step would cost ~1 ms a sequence).
        self.check_probs = cfg.method == "custom"
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.per_position = [[0, 0] for _ in range(cfg.num_speculative_tokens)]  # [drafted, accepted]

    def propose(self, plan: SchedulerOutput, scheduler: Scheduler) -> None:
        entries = [(i, s) for i, s in enumerate(plan.scheduled) if s.num_spec_tokens]
        if not entries:
            return
        requests = [DraftRequest(s.seq.request_id, s.seq.token_ids, s.num_spec_tokens, tuple(s.seq.block_table),
                                 s.seq.num_computed_tokens, s.seq.sampling_params, s.seq.seed) for _, s in entries]
        drafts = self.proposer.propose(requests)
        if len(drafts) != len(requests):
            raise ValueError(f"the proposer returned {len(drafts)} drafts for {len(requests)} requests")
        for (i, sched), draft in zip(entries, drafts):
            seq, ids = sched.seq, list(draft.token_ids)
            if len(ids) > sched.num_spec_tokens:
                raise ValueError(f"the proposer drafted {len(ids)} tokens for {seq.request_id!r}, "
                                 f"more than the {sched.num_spec_tokens} asked")
            self.check_token_ids(seq.request_id, "draft token_ids", ids)
            if draft.probs is not None and ids and self.check_probs:
                self._check_probs(seq.request_id, ids, draft.probs)
            scheduler.undo.record_seq(seq)
            seq.spec_token_ids = ids
            unused = sched.num_spec_tokens - len(ids)
            plan.scheduled[i] = ScheduledSequence(seq, sched.start, sched.num_new_tokens - unused, len(ids))
            if draft.probs is not None and ids:
                plan.draft_probs[seq.request_id] = draft.probs[:len(ids)]

    def _check_probs(self, request_id: str, ids: list[int], probs: torch.Tensor) -> None:
        """A proposal distribution must be one: a (drafts, V) row per draft, finite, non-negative, summing to 1,
        and giving its own draft a chance. Anything else would be broadcast or misread by rejection sampling,
        silently changing the distribution the target samples from."""
        name, d, V = type(self.proposer).__name__, len(ids), self.vocab_size
        where = f"{name} returned Draft.probs for {request_id!r}"
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
            raise ValueError(f"{where} that is not a floating-point tensor ({type(probs).__name__})")
        if probs.dim() != 2 or probs.shape[0] < d or probs.shape[1] != V:
            raise ValueError(f"{where} of shape {tuple(probs.shape)}; give one row per draft token: ({d}, {V}) "
                             "(or more rows, of which the first len(token_ids) are used)")
        rows = probs[:d].float()
        if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()):
            raise ValueError(f"{where} with negative, NaN or infinite entries; give probabilities")
        sums = rows.sum(-1)
        if not bool(((sums - 1).abs() <= 1e-3).all()):
            raise ValueError(f"{where} whose rows sum to {sums.tolist()}, not 1; give normalised distributions")
        if bool((rows[torch.arange(d), torch.tensor(ids)] <= 0).any()):
            raise ValueError(f"{where} that gives probability 0 to its own draft token; a draft must be drawn "
                             "from its distribution")

    def after_step(self, plan: SchedulerOutput | None, sampled: list[RowGroupOutput] | None,
                   released: list[str]) -> None:
        """After a committed step (`plan`, `sampled`), or after requests were finished without one (None):
        count, tell the proposer what was verified, then what was released."""
        if plan is not None:
            self._count_and_commit(plan, sampled)
        for request_id in released:
            self.proposer.on_free(request_id)

    def _count_and_commit(self, plan: SchedulerOutput, sampled: list[RowGroupOutput]) -> None:
        ids, computed = [], []
        for sched, out in zip(plan.scheduled, sampled):
            seq = sched.seq
            if sched.num_spec_tokens:
                accepted = max(0, len(out.tokens) - 1)
                self.num_draft_tokens += sched.num_spec_tokens
                self.num_accepted_tokens += accepted
                for j in range(sched.num_spec_tokens):
                    self.per_position[j][0] += 1
                    self.per_position[j][1] += j < accepted
            if not seq.is_finished:  # finished ones are in `released`
                ids.append(seq.request_id)
                computed.append(seq.num_computed_tokens)
        self.proposer.on_commit(ids, computed)

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        return tuple(a / d if d else 0.0 for d, a in self.per_position)
