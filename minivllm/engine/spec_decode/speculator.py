"""`Speculator`: the engine's side of speculative decoding, after each step's commit.

    after_step(plan, out, released)
                              count drafts and acceptances; tell the proposer what the target
                              verified (`on_commit`), then which sequences gave their blocks back
                              since, for whatever reason (finished, aborted, failed, preempted:
                              `on_free`), so that it forgets them
    propose(running, room)    ask the proposer for drafts for every decoding sequence that has none;
                              the engine hands them to the scheduler (`update_draft_token_ids`, the
                              only way a draft reaches a sequence); the next `schedule()` reserves
                              their slots — as many as its token budget and the pool allow — and
                              that step verifies them

Drafts are proposed after the commit, never between planning and the forward: a plan is final when
`schedule()` returns.

The proposer is checked like user input: more drafts than asked, an id outside the vocabulary, or
`Draft.probs` that is no distribution over the drafts (shape, sign, sum) is an error naming the
proposer, never silently trimmed or broadcast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.step_types import DraftTokenIds, ModelRunnerOutput, SchedulerOutput
from minivllm.engine.resolved_config import ResolvedConfig
from minivllm.engine.spec_decode.config import SpeculativeConfig
from minivllm.engine.spec_decode.ngram import NgramProposer
from minivllm.engine.spec_decode.proposer import Draft, DraftRequest, Proposer


def build_proposer(cfg: SpeculativeConfig, config: ResolvedConfig, num_blocks: int) -> Proposer:
    """The proposer a `speculative_config` asks for (`num_blocks`: the target's KV pool)."""
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_max, cfg.prompt_lookup_min)
    if cfg.method == "custom":
        if not isinstance(cfg.proposer, Proposer):
            raise TypeError(f"speculative_config['proposer'] must be a minivllm Proposer, got "
                            f"{type(cfg.proposer).__name__}")
        return cfg.proposer
    from minivllm.engine.spec_decode.draft_model import DraftModelProposer

    c = config.engine
    return DraftModelProposer(cfg.model, config.spec, device=config.device, dtype=config.dtype, num_blocks=num_blocks,
                              block_size=c.block_size, max_model_len=c.max_model_len,
                              attention_backend=c.attention_backend, max_num_seqs=c.max_num_seqs,
                              num_speculative_tokens=cfg.num_speculative_tokens)


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, proposer: Proposer,
                 check_token_ids: Callable[[str, str, list[int]], list[int]], vocab_size: int) -> None:
        self.proposer = proposer
        self.check_token_ids = check_token_ids
        self.vocab_size = vocab_size
        self.num_speculative_tokens = cfg.num_speculative_tokens
        # A caller's proposer is checked like user input; the built-in ones are trusted (the draft model's
        # distributions are the sampler's own: checking (d, V) tensors each step would cost ~1 ms a sequence).
        self.check_probs = cfg.method == "custom"
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.per_position = [[0, 0] for _ in range(cfg.num_speculative_tokens)]  # [drafted, accepted]

    def propose(self, running: list[Sequence], room: Callable[[Sequence], int]) -> DraftTokenIds:
        """Drafts for every decoding sequence in `running` that has none, at most `room(seq)` (the
        scheduler's `draft_room`: what max_tokens and max_model_len allow) and num_speculative_tokens each.
        All are checked before any is returned: a proposer's bad draft hands over nothing. Reads the
        sequences, writes none of them."""
        wanted = [(seq, min(self.num_speculative_tokens, room(seq))) for seq in running if not seq.spec_token_ids]
        wanted = [(seq, k) for seq, k in wanted if k > 0]
        out = DraftTokenIds([], [], [])
        if not wanted:
            return out
        requests = [DraftRequest(seq.request_id, seq.token_ids, k, tuple(seq.block_table), seq.num_computed_tokens,
                                 seq.sampling_params, seq.seed) for seq, k in wanted]
        drafts = self.proposer.propose(requests)
        if len(drafts) != len(requests):
            raise ValueError(f"the proposer returned {len(drafts)} drafts for {len(requests)} requests")
        for (seq, k), draft in zip(wanted, drafts):
            self._check(seq, k, draft)
        for (seq, _), draft in zip(wanted, drafts):
            ids = list(draft.token_ids)
            out.req_ids.append(seq.request_id)
            out.draft_token_ids.append(ids)
            out.draft_probs.append(draft.probs[:len(ids)] if draft.probs is not None and ids else None)
        return out

    def _check(self, seq: Sequence, k: int, draft: Draft) -> None:
        ids = list(draft.token_ids)
        if len(ids) > k:
            raise ValueError(f"the proposer drafted {len(ids)} tokens for {seq.request_id!r}, more than the {k} asked")
        self.check_token_ids(seq.request_id, "draft token_ids", ids)
        if draft.probs is not None and ids and self.check_probs:
            self._check_probs(seq.request_id, ids, draft.probs)

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

    def after_step(self, plan: SchedulerOutput | None, sampled: ModelRunnerOutput | None,
                   released: list[str]) -> None:
        """After a committed step (`plan`, `sampled`), or after requests were finished without one (None):
        count, tell the proposer what was verified, then what was released."""
        if plan is not None:
            self._count_and_commit(plan, sampled)
        for request_id in released:
            self.proposer.on_free(request_id)

    def _count_and_commit(self, plan: SchedulerOutput, sampled: ModelRunnerOutput) -> None:
        ids, computed = [], []
        for sched, out in zip(plan.scheduled, sampled.outputs):
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
