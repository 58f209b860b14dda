"""`Sequence`: one request's tokens and scheduling state.

A request's life:  WAITING --admit--> RUNNING --finish--> FINISHED
                      ^                  |
                      +----preempt-------+   (blocks freed; recomputed from scratch later)

The token list is `prompt + generated output`, kept in one `array("i")` (4 bytes a token instead of
a 28-byte Python int and an 8-byte pointer). `num_computed_tokens` counts the tokens whose K/V are in
the paged cache; the tokens in `[num_computed_tokens, num_tokens)` are what the next step must run.
A decode step is just the case where that gap is one token. `block_table[i]` is the physical KV block
holding tokens `[i*block_size, (i+1)*block_size)`.

A request with `n > 1` is n sequences from its arrival (engine/processing/parallel_sampling.py): plain requests to
the scheduler, sharing the request's `group_id` (the user's request id), each with its own `request_id`
(`"{index}_{group_id}"` for index >= 1, as vLLM names them), tokens, blocks and seed. They share the
prompt's K/V through the prefix cache, not through anything of their own.

A `Sequence` is `Journaled` (engine/request/journal.py): once the scheduler is given it, each field a step changes
(status, computed tokens, the block tables, drafts, state slots) notes its old value while the step is
open, so a failed step is undone without the code that changes it recording anything.
"""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING, NamedTuple

from minivllm.engine.request.journal import Journaled, JournaledList
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from minivllm.engine.processing.detokenizer import IncrementalDetokenizer
    from minivllm.engine.structured_output.grammar import GrammarMatcher
    from minivllm.layers.logits_processors import RequestLogitRules


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a sequence finished, with vLLM's strings as values (a `FinishReason` compares equal to its
    string, and JSON writes it as one)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the caller aborted the request
    ERROR = "error"  # the request could not run, or made its step fail on its own


def as_token_array(token_ids: SequenceABC[int]) -> array:
    """The boundary where token ids enter the engine: an `array("i")` or a list of Python ints."""
    if isinstance(token_ids, array):
        assert token_ids.typecode == "i", f"token ids must be array('i'), got array({token_ids.typecode!r})"
        return array("i", token_ids)
    return array("i", token_ids)


# A sampled token, and a prompt position's logprob: what a Sequence keeps and the runner returns
# (engine/request/step_types.py re-exports them with the step's other hand-offs).
class SampledToken(NamedTuple):
    token_id: int
    logprob: float | None = None  # the model's raw logprob of this token (None: not asked)
    rank: int | None = None  # 1 + how many tokens the model found strictly more likely
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the N most likely (id, logprob), best first


class PromptLogprob(NamedTuple):
    position: int  # which prompt token this is (>= 1)
    token: SampledToken  # the prompt token, with its logprob, rank and the top-N at that position


class Sequence(Journaled):
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: SequenceABC[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_index: int = 0,
        seed: int = 0,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: array = as_token_array(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self._prompt_list = self.token_ids.tolist()  # the prompt never changes: convert once
        self.sampling_params = sampling_params
        self.arrival_index = arrival_index  # order of arrival (the "newest" RUNNING one is the last admitted)
        self.seed = seed  # keys the sampling noise with the token position (see layers/sampler.py)
        self.priority = priority  # lower = more urgent, for the "priority" scheduling policy (vLLM's rule)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at (first) admission
        self.block_table: list[int] = JournaledList()
        # A model with sliding-window layers: that group's table (engine/core/sliding_window.py); else empty.
        self.sliding_block_table: list[int] = JournaledList()
        self.block_hashes: list[bytes] = []  # prefix-cache hashes of full blocks (BlockManager.block_hashes)
        self.num_admission_skips = 0  # times admission passed over this request (anti-starvation)
        # When (time.perf_counter) it arrived, was first scheduled (at admission), got its first token (at commit)
        # and finished: RequestOutput.metrics. A preemption keeps the first two; a failed step undoes its writes.
        self.arrival_time: float | None = None  # the caller's (AsyncLLMEngine), else LLMEngine.enqueue's
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Sampling outputs and n > 1 (see the module docstring).
        self.group_id = request_id  # the request this sequence belongs to
        self.index = 0  # which of the request's n completions this is
        # allowed ids, biases and bad words, prepared once by the engine (layers/logits_processors.py)
        self.logit_rules: RequestLogitRules | None = None
        # structured outputs: where the committed output stands in the request's grammar
        # (engine/structured_output/grammar.py)
        self.grammar: GrammarMatcher | None = None
        self.logprobs: list[SampledToken] = []  # one per output token, when logprobs are asked
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[PromptLogprob] = []  # one per prompt position done so far
        # The output's text so far, decoded token by token at commit (stop strings are searched in it);
        # None for a sequence built without a tokenizer (the scheduler's own tests).
        self.detokenizer: IncrementalDetokenizer | None = None
        # Speculative decoding: tokens proposed after the last commit, verified by the next step that
        # schedules this sequence. NOT tokens yet: block hashes, the detokenizer and the stop rules only
        # ever see `token_ids`, which only grows. `draft_probs`: the proposer's distribution over them,
        # (len(spec_token_ids), V); None = a deterministic proposal (one-hot).
        self.spec_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        # Hybrid models: the state-pool pair this sequence holds, None while it holds none
        # (see engine/core/state_pool.py).
        self.state_slots: list[int] | None = None

    # --- sizes -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:].tolist()

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_list

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # --- state changes -----------------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        assert isinstance(token_id, int), "append_token takes a Python int (convert tensors first)"
        self.token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop generated tokens past the first `num_output_tokens` — only for a FINISHED sequence
        (a stop string completed by an accepted draft: the drafts after it never happened)."""
        assert self.is_finished, "tokens are append-only while a sequence runs"
        del self.token_ids[self.num_prompt_tokens + num_output_tokens:]
        if self.logprobs:
            del self.logprobs[num_output_tokens:]
            self.cumulative_logprob = sum(t.logprob for t in self.logprobs)

    def clear_drafts(self) -> None:
        if self.spec_token_ids or self.draft_probs is not None:  # (each write is journaled: skip a no-op)
            self.spec_token_ids, self.draft_probs = [], None

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finished_time = time.perf_counter()
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
