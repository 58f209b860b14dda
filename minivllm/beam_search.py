"""Beam search, vLLM's way: each step's beams are ordinary one-token requests, and the prefix cache
shares what they have in common.

    prompt P, beam_width k = 2                     what the engine runs at each step
    step 0   beams: [P]                            1 request: "P",      max_tokens=1, logprobs=2k
    step 1   beams: [P a] [P b]                    2 requests: "P a", "P b"  (P's full blocks: cache hits)
    step 2   beams: [P a c] [P a d]                2 requests: "P a c", "P a d"  ("P b" was pruned)

At every step each beam proposes its 2k most likely next tokens (the request's top logprobs: the
model's raw log-softmax). Every candidate's score is its beam's cumulative logprob plus the token's;
the k best candidates are the next step's beams. 2k candidates per beam are enough (HF's rule too):
even if k of them were EOS ids (a model has one or a few), k others continue. A candidate ending in
EOS is *complete* (set aside, unless `ignore_eos`); after `max_tokens` steps the k best of the
complete and the live beams, by `beam_score`, are the answer.

Why requests and not forks inside the scheduler (docs/concepts/sampling-outputs.md has the numbers):
- The blocks are the same. A block's prefix-cache key is the hash of its whole prefix, so two beams
  with a common ancestor hit the same blocks for every full block they share, exactly the blocks a
  copy-on-write fork would share; each beam computes its partial last block itself.
- Nothing in the scheduler changes: a beam is a request, so preemption, chunking, failures, aborts
  and the step's transaction already hold for it, and a pruned beam is simply never sent again (its
  blocks went back when its one-token request finished; the full ones stay findable by hash).
- The price is compute: each step recomputes each beam's tail past its last full block (1 to
  block_size tokens, not 1) and rebuilds its request.

Invariants: a search never holds blocks between its steps; `BeamSearch.history` keeps the beams
kept at each step (the search tree); every beam's `tokens` start with the prompt (as in vLLM, its
`text` is the decoded prompt and output together).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minivllm.outputs import Logprob, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine, PromptType


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`. `temperature` is accepted only as 0: beams are ranked by the model's
    own log-probabilities, which a temperature would not change (it is there for vLLM's signature)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"BeamSearchParams.{name}={getattr(self, name)!r} is invalid: {why}")

        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise bad(name, "must be an integer >= 1")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be true or false")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        if self.temperature != 0:
            raise bad("temperature", "beam search ranks beams by the model's own log-probabilities; use 0")

    def check_length_penalty(self, max_model_len: int) -> None:
        """Raises ValueError unless every beam's score (`beam_score`) is finite for beams up to
        max_model_len tokens: a finite length_penalty is not enough (2 ** 1e308 overflows, 2 ** -1e308 is 0)."""
        bound = max_length_penalty(max_model_len)
        if abs(self.length_penalty) > bound:
            raise ValueError(f"BeamSearchParams.length_penalty={self.length_penalty!r} is invalid: beams rank by "
                             f"cum_logprob / length ** length_penalty, which stays finite for lengths up to "
                             f"max_model_len={max_model_len} only within ±{bound:.3g} (usual values: 0 to 2)")

    @property
    def num_candidates(self) -> int:
        """Candidates asked of each beam per step: 2k, so that k survive even if k of them are EOS."""
        return 2 * self.beam_width


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's name): the prompt and the tokens chosen so far, with their logprobs."""

    tokens: list[int]  # prompt + generated
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token: the candidates seen
    cum_logprob: float = 0.0  # the generated tokens' logprobs, summed
    text: str | None = None  # set on the final beams: the decoded prompt + output, as vLLM's
    finish_reason: str | None = None  # "stop" (ended in EOS) or "length" (max_tokens), on the final beams
    stop_reason: int | str | None = None  # vLLM's field; None for EOS, the only stop beam search has


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]


# length ** length_penalty is kept within 10 ** ±_MAX_FACTOR_DIGITS for every length up to max_model_len, so a
# score is finite for any |cum_logprob| < 1e200 (a sum of fp32 logprobs, each > -1e39, over < 1e9 tokens).
_MAX_FACTOR_DIGITS = 100


def max_length_penalty(max_model_len: int) -> float:
    """The largest |length_penalty| whose length factor stays finite and nonzero up to max_model_len tokens."""
    return _MAX_FACTOR_DIGITS / math.log10(max(max_model_len, 2))


def beam_score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    """vLLM's ranking: cum_logprob / length ** length_penalty, the length counting the prompt and
    not a final EOS. (HF counts only the generated tokens; the two agree whenever the beams compared
    are equally long, e.g. with ignore_eos.) length_penalty > 1 favours longer beams, < 1 shorter."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids and beam.finish_reason == "stop")
    return beam.cum_logprob / (max(length, 1) ** length_penalty)


def step_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """One beam's request at one step: one greedy token, the 2k most likely ones with it; no text (the
    beams are decoded once, at the end), only the finished output."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=params.num_candidates, ignore_eos=True,
                          detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


class BeamSearchFailed(RuntimeError):
    """One of a search's beam requests ended with an error or was aborted: the search ends with it."""


class BeamSearch:
    """One prompt's search (vLLM's `BeamSearchInstance`, with its step in `advance`). Whoever drives it
    sends `step_prompts()` as requests with `step_sampling_params`, and hands their finished outputs,
    in the same order, to `advance`, until `done`."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int],
                 prompt: str | None = None) -> None:
        self.prompt, self.prompt_token_ids = prompt, list(prompt_token_ids)
        self.params, self.eos_token_ids = params, eos_token_ids
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]  # live: extended at the next step
        self.completed: list[BeamSearchSequence] = []  # ended in EOS (never with ignore_eos)
        self.history: list[list[BeamSearchSequence]] = [self.beams]  # the beams kept after each step

    @property
    def num_steps(self) -> int:
        return len(self.history) - 1

    @property
    def done(self) -> bool:
        return self.num_steps >= self.params.max_tokens or not self.beams

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos_token_ids, self.params.length_penalty)

    def step_prompts(self) -> list[dict[str, Any]]:
        """This step's requests: one prompt per live beam (its whole token list)."""
        assert not self.done, "the search is over"
        return [{"prompt_token_ids": beam.tokens} for beam in self.beams]

    def advance(self, outputs: list[RequestOutput]) -> None:
        """One step: the finished outputs of `step_prompts()`'s requests, in order -> the next beams."""
        assert len(outputs) == len(self.beams), f"{len(outputs)} outputs for {len(self.beams)} beams"
        candidates = []
        for beam, out in zip(self.beams, outputs):
            c = out.outputs[0]
            if c.finish_reason not in ("stop", "length") or not c.logprobs:
                raise BeamSearchFailed(f"a beam's request ended with {c.finish_reason!r}: "
                                       f"{out.error or 'it was aborted'}")
            top = c.logprobs[0]
            for token, lp in top.items():  # the 2k most likely tokens (with the one drawn, among them)
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + lp.logprob)
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    new.finish_reason = "stop"  # stop_reason stays None: EOS (vLLM's rule)
                    self.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=self.score, reverse=True)  # stable: ties keep the beams' order, then the ranks'
        self.beams = candidates[:self.params.beam_width]
        self.history.append(self.beams)

    def output(self, tokenizer: Any) -> BeamSearchOutput:
        """The k best beams, complete or not, best first, with their text."""
        for beam in self.beams:
            beam.finish_reason = "length"
        best = sorted(self.completed + self.beams, key=self.score, reverse=True)[:self.params.beam_width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=True)
        return BeamSearchOutput(best)


def new_search(engine: LLMEngine, prompt: PromptType, params: BeamSearchParams) -> BeamSearch:
    """A search for `prompt`, checked now: the prompt as any request's, and the longest request the
    search will send (prompt + max_tokens - 1 tokens, one more computed) against max_model_len and the
    KV pool, and length_penalty against max_model_len (`check_length_penalty`). Raises ValueError saying
    what to change; the engine is not touched."""
    params.check_length_penalty(engine.config.max_model_len)
    sp = step_sampling_params(params)
    text, ids = engine.input_processor.tokenize(prompt)
    last_step = ids + ids[:1] * (params.max_tokens - 1)  # as long as the last step's beams (any tokens)
    longest = engine.make_sequence("beam-search-check", {"prompt_token_ids": last_step}, sp)  # ids, logprobs
    limit = engine.config.max_model_len
    if len(ids) + params.max_tokens > limit:
        raise ValueError(f"beam search over a {len(ids)}-token prompt with max_tokens={params.max_tokens} needs "
                         f"{len(ids) + params.max_tokens} positions, more than max_model_len={limit}; lower "
                         "max_tokens or shorten the prompt")
    reason = engine.unservable_reason(longest)
    if reason is not None:
        raise ValueError(f"beam search's longest step ({longest.num_tokens} tokens): {reason.message}")
    return BeamSearch(ids, params, engine.eos_token_ids, text)
