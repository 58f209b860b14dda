"""What a step samples: which hidden rows get logits, and what each sampled row asks.

Which hidden rows get logits (the LM head runs on these rows only):
  * the last row of every chunk that reaches the end of its sequence: one sampled row (an n > 1
    request is n sequences, each with its own last row and seed: engine/processing/parallel_sampling.py);
  * every prompt row of a chunk whose request asked for `prompt_logprobs` (row p predicts prompt
    token p+1), recorded once even if the prompt is recomputed after a preemption.

Per sampled row, what the request asks of the logits (`RowProcessing`: masks, biases, penalties
with the output so far, its grammar's bitmask) and of the draw (`SamplingRow`) travel as typed records, never tuples.

Grammar masks come with the plan: the scheduler fills them once a step (engine/structured_output/grammar_fill.py, where
a request whose grammar fails or runs over its mask budget is found, and ends before anything runs); the
packing applies them to their rows (`apply_grammar_bitmask`).

The grammar's end wins over `min_tokens`: a row that holds EOS and stop ids off until min_tokens, whose
grammar allows nothing else (the output is complete, only EOS may follow), has EOS's hold lifted; the
request then ends "stop" with its complete output instead of failing on a row where nothing may be drawn.
The client's stop_token_ids stay held: a grammar that can only go on with one (regex `x;y`, stop `;`) is a
conflict, and the request fails with that message rather than ending before min_tokens.

Prompt logprobs (`prompt_logits`, `record_prompt_logprobs`): the prompt rows' logits are made a chunk of
PROMPT_LOGPROBS_CHUNK rows at a time, each turned into logprobs before the next: a 2,048-token chunk's
float32 log-softmax over a 49k vocabulary would take 400 MB at once (and its logits as much again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.step_types import GrammarBitmask, PromptLogprob, RowGroupOutput, SampledToken
from minivllm.layers.logits_processors import RowProcessing
from minivllm.layers.sampler import SamplingRow
from minivllm.models.interface import CausalLM

PROMPT_LOGPROBS_CHUNK = 256  # prompt rows whose logits and log-softmax exist at once (prompt_logprobs)
OnPromptLogits = Callable[[int, torch.Tensor], None]  # (first prompt row, its chunk's logits (R, V))


class SampledRow(NamedTuple):
    entry: int  # index of the scheduled row group
    num_logprobs: int | None


class SpecGroup(NamedTuple):
    """The 1 + d sampled rows verifying one sequence's d drafts."""

    entry: int
    first: int  # index of its first row among the sampled rows
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None  # (d, V), None = one-hot (a deterministic proposer)


class PromptRow(NamedTuple):
    entry: int
    position: int  # the prompt token this row predicts
    token_id: int
    num_logprobs: int


@dataclass
class SamplingBatch:
    logits_indices: list[int] = field(default_factory=list)  # hidden rows sampled
    sampled: list[SampledRow] = field(default_factory=list)
    rows: list[SamplingRow] = field(default_factory=list)
    processing: list[RowProcessing] = field(default_factory=list)
    prompt_indices: list[int] = field(default_factory=list)  # hidden rows for prompt logprobs
    prompt_rows: list[PromptRow] = field(default_factory=list)
    spec_groups: list[SpecGroup] = field(default_factory=list)
    # structured requests: for each of a request's 1 + d masks, the sampled rows that take it
    grammar_targets: dict[str, list[list[int]]] = field(default_factory=dict)

    def add_sampled(self, entry: int, seq: Sequence, hidden_row: int, eos_token_ids: frozenset[int]) -> None:
        """The sampled row of a chunk that reaches the end of `seq`."""
        sp = seq.sampling_params
        if seq.grammar is not None:
            self.grammar_targets[seq.request_id] = [[len(self.sampled)]]
        self.logits_indices.append(hidden_row)
        self.sampled.append(SampledRow(entry, sp.logprobs))
        self.rows.append(SamplingRow(0.0 if sp.greedy else sp.temperature, sp.top_k, sp.top_p, sp.min_p, seq.seed,
                                     seq.num_tokens))
        self.processing.append(row_processing(seq, eos_token_ids))

    def add_verification(self, entry: int, seq: Sequence, hidden_row: int, num_drafts: int,
                         eos_token_ids: frozenset[int]) -> None:
        """Rows hidden_row .. hidden_row + d: the target's distribution after the last token and after
        each of the first d drafts attached to `seq`. Row j sees the history with drafts[:j], for
        penalties, bad words and min_tokens."""
        sp, drafts = seq.sampling_params, seq.spec_token_ids[:num_drafts]
        probs = seq.draft_probs[:num_drafts] if seq.draft_probs is not None else None
        self.spec_groups.append(SpecGroup(entry, len(self.sampled), drafts, probs))
        if seq.grammar is not None:
            self.grammar_targets[seq.request_id] = [[len(self.sampled) + j] for j in range(len(drafts) + 1)]
        for j in range(len(drafts) + 1):
            self.logits_indices.append(hidden_row + j)
            self.sampled.append(SampledRow(entry, sp.logprobs))
            self.rows.append(SamplingRow(0.0 if sp.greedy else sp.temperature, sp.top_k, sp.top_p, sp.min_p, seq.seed,
                                         seq.num_tokens + j))
            self.processing.append(row_processing(seq, eos_token_ids, drafts[:j]))

    def apply_grammar_bitmask(self, bitmask: GrammarBitmask | None, eos_token_ids: frozenset[int]) -> None:
        """The plan's masks into their rows' processing (the model's `eos_token_ids`: the only hold a
        grammar's end may lift). Every structured row must have its masks in the plan."""
        for request_id, targets in self.grammar_targets.items():
            masks = bitmask.masks.get(request_id) if bitmask is not None else None
            if masks is None:
                raise ValueError(f"{request_id!r} is a structured request, but the plan has no grammar mask for it "
                                 "(SchedulerOutput.grammar_bitmask, filled by Scheduler.schedule)")
            for mask, sampled_rows in zip(masks, targets, strict=True):  # mask: (W,)
                if mask is None:  # inside reasoning: unconstrained
                    continue
                for i in sampled_rows:
                    held = self.processing[i].held_token_ids
                    if held and only_allows(mask, held):  # the grammar can only end: min_tokens yields EOS,
                        held = [t for t in held if t not in eos_token_ids]  # never the client's stop ids
                    self.processing[i] = dataclasses.replace(self.processing[i], grammar_bitmask=mask,
                                                             held_token_ids=held)

    def add_prompt_rows(self, entry: int, seq: Sequence, start: int, num_new_tokens: int, first_row: int) -> None:
        """Rows of a prompt chunk whose logprobs were asked and not yet recorded."""
        n = seq.sampling_params.prompt_logprobs
        if n is None:
            return
        done = len(seq.prompt_logprobs) + 1  # next prompt position to record (position 0 has none)
        last = min(start + num_new_tokens, seq.num_prompt_tokens - 1)  # row p predicts token p+1
        for p in range(max(start, done - 1), last):
            self.prompt_indices.append(first_row + p - start)
            self.prompt_rows.append(PromptRow(entry, p + 1, seq.token_ids[p + 1], n))


NO_PROCESSING = RowProcessing()  # what a row that asks for nothing gets (shared: nothing may change it)


def row_processing(seq: Sequence, eos_token_ids: frozenset[int], drafts: list[int] = ()) -> RowProcessing:
    """What `seq` asks the logits processors to do at its next token (after `drafts`, if any); its grammar's
    mask comes with the plan (`SamplingBatch.apply_grammar_bitmask`)."""
    sp = seq.sampling_params
    before_min_tokens = seq.num_output_tokens + len(drafts) < sp.min_tokens
    if not before_min_tokens and not sp.needs_logits_processing:
        return NO_PROCESSING  # most rows: one shared, never-changed "nothing to do"
    held: list[int] = []
    if before_min_tokens:  # no EOS / stop token before min_tokens
        held = list(sp.all_stop_token_ids) + ([] if sp.ignore_eos else list(eos_token_ids))
    if not sp.needs_logits_processing:
        return RowProcessing(held_token_ids=held)
    banned: list[int] = []
    rules = seq.logit_rules
    output = None
    if rules is not None and rules.bad_words is not None:  # the tail the longest bad word can reach
        reach = rules.bad_words.lengths[-1] if rules.bad_words.lengths else 0
        tail = seq.token_ids[max(seq.num_prompt_tokens, seq.num_tokens - reach):].tolist() + list(drafts)
        banned += rules.bad_words.banned(tail)
    if sp.has_penalties:
        output = seq.output_token_ids + list(drafts)
    return RowProcessing(
        banned_token_ids=banned, held_token_ids=held, rules=rules,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens] if sp.repetition_penalty != 1 else None,
        output_token_ids=output)


def only_allows(mask: torch.Tensor, token_ids: list[int]) -> bool:
    """Does the (W,) int32 grammar mask allow no token outside `token_ids` (bit t % 32 of word t // 32)?"""
    rest = mask.clone()
    for t in token_ids:
        bit = t % 32
        rest[t // 32] &= ~((1 << bit) if bit < 31 else -(1 << 31))  # bit 31 is the int32's sign bit
    return not bool(rest.any())


def gather_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: list[int | None]) -> list[SampledToken]:
    """logprobs: (R, V) log_softmax of raw logits. For each row: the token's logprob and rank, and
    the top-N (N per row; None = not asked)."""
    out = [SampledToken(t) for t in token_ids]
    asked = [i for i, n in enumerate(num_top) if n is not None]
    if not asked:
        return out
    idx = torch.tensor(asked, device=logprobs.device)
    lp = logprobs[idx]  # (A, V)
    tok = torch.tensor([token_ids[i] for i in asked], device=logprobs.device)
    chosen = lp.gather(1, tok[:, None])  # (A, 1)
    ranks = (lp > chosen).sum(-1) + 1  # (A,)
    k = max(num_top[i] for i in asked)
    top = lp.topk(k, dim=-1) if k > 0 else None
    chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
    top_v, top_i = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
    for j, i in enumerate(asked):
        n = num_top[i]
        pairs = tuple(zip(top_i[j][:n], top_v[j][:n])) if n else ()
        out[i] = SampledToken(token_ids[i], chosen_l[j], ranks_l[j], pairs)
    return out


def prompt_logits(model: CausalLM, hidden: torch.Tensor, rows: torch.Tensor,
                  on_prompt_logits: OnPromptLogits | None) -> None:
    """The logits of the prompt rows `rows` of `hidden`, a chunk at a time, each handed to `on_prompt_logits`
    with the index of its first row. Every rank runs the same chunks (the LM head is a collective under
    tensor parallelism); only rank 0 gets logits back."""
    for lo in range(0, len(rows), PROMPT_LOGPROBS_CHUNK):
        chunk = model.compute_logits(hidden[rows[lo:lo + PROMPT_LOGPROBS_CHUNK]])  # (R, V)
        if on_prompt_logits is not None and chunk is not None:
            on_prompt_logits(lo, chunk)


def record_prompt_logprobs(sb: SamplingBatch, result: list[RowGroupOutput], first: int,
                           logits: torch.Tensor) -> None:
    """Prompt rows first .. first + len(logits): their logprobs, rank and top-N into `result`."""
    part = sb.prompt_rows[first:first + len(logits)]
    lp = logits.float().log_softmax(-1)  # (R, V)
    toks = gather_logprobs(lp, [r.token_id for r in part], [r.num_logprobs for r in part])
    for r, tok in zip(part, toks):
        result[r.entry].prompt_logprobs.append(PromptLogprob(r.position, tok))
