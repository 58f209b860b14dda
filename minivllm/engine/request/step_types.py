"""The hand-offs of one step: what the scheduler plans, and what comes back from the model.

    Scheduler.schedule() ──SchedulerOutput──> Executor.execute_model() ──ModelRunnerOutput──>
    Scheduler.update_from_output()

These types sit in a module of their own (vLLM keeps them in `v1/core/sched/output.py` and
`v1/outputs.py`) so that the scheduler imports nothing of the model runner and the model runner
nothing of the scheduler: each side knows only the plan and the result.

A plan is final when `schedule()` returns: nothing edits it afterwards. A sequence's drafts
(speculative decoding) were attached to it before the plan was made (`Sequence.spec_token_ids`), and
the plan says how many of them this step verifies (`num_spec_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

# PromptLogprob and SampledToken live with the Sequence that keeps them; the runner's
# output names them from here, with the step's other hand-offs.
from minivllm.engine.request.sequence import PromptLogprob, SampledToken, Sequence

if TYPE_CHECKING:
    import torch


class StateRow(NamedTuple):
    """A hybrid model's row group: which state slots it reads, writes and keeps (engine/request/state_layout.py). The
    scheduler decides them (integers); the runner's tensors follow (engine/worker/state_tensors.py)."""

    read_slot: int  # the published state it starts from (not read when the sequence starts now)
    write_slot: int  # the staging slot its state after all its rows goes to; the commit publishes it
    load_from: int | None = None  # a snapshot slot copied into read_slot before the forward (a prefix hit)
    kept_offsets: tuple[int, ...] = ()  # the row counts after which a state is kept ...
    kept_slots: tuple[int, ...] = ()  # ... and where: snapshot slots (a prompt chunk) or candidate slots
    kept_are_snapshots: bool = True  # snapshots for prefix caching (else a verification's candidates)


@dataclass(frozen=True)
class ScheduledSequence:
    """One row group of the step: `seq` computes positions [start, start + num_new_tokens). The last
    `num_spec_tokens` of them are draft slots (speculative decoding): the rows after the sequence's
    last token, fed with the first `num_spec_tokens` of its `spec_token_ids`, every one of them
    sampled to verify the drafts. `num_tokens` is the sequence's length when the plan was made: the
    plan's own facts (`samples`, `is_prefill`) read values, not the sequence, which the commit changes."""

    seq: Sequence
    start: int
    num_new_tokens: int
    num_spec_tokens: int = 0
    state: StateRow | None = None  # a hybrid model's state slots for this row group
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_tokens", self.seq.num_tokens)  # frozen: set once, at planning

    @property
    def samples(self) -> bool:
        """Does this chunk reach the end of the sequence (so its last row's logits are sampled)?"""
        return self.start + self.num_new_tokens - self.num_spec_tokens == self.num_tokens

    @property
    def is_prefill(self) -> bool:
        return not (self.num_new_tokens - self.num_spec_tokens == 1 and self.start >= self.seq.num_prompt_tokens)


class GrammarBitmask(NamedTuple):
    """A step's structured-output masks, computed by the scheduler for its plan (vLLM's grammar bitmask,
    engine/structured_output/grammar_fill.py): per request id, one (W,) int32 mask per sampled row, 1 + its drafts
    (None: unconstrained, inside reasoning); and the requests whose grammar cannot go on, each with its message."""

    masks: dict[str, list[torch.Tensor | None]]
    failures: dict[str, str]


@dataclass
class SchedulerOutput:
    """The plan of one step: the row groups to run, in batch order, who was preempted for them, and the
    masks of its structured requests' sampled rows."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_prefill)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RowGroupOutput:
    """What one scheduled row group produced in a step."""

    tokens: list[SampledToken] = field(default_factory=list)  # appended to the sequence, in order
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    error: str | None = None  # the request cannot go on (no token it may draw): it finishes with this error


@dataclass
class ModelRunnerOutput:
    """What a step produced: one `RowGroupOutput` per scheduled row group, in the plan's order."""

    outputs: list[RowGroupOutput]
    forward_time_s: float = 0.0  # the model forward and LM head (for the engine's overhead figures)
    # A mixture of experts: routes per expert index this step, summed over the sparse layers (plain ints: the
    # scheduler side holds no tensors; engine/worker/expert_load.py). () for a dense model.
    expert_load: tuple[int, ...] = ()

    @classmethod
    def from_token_ids(cls, token_ids: Iterable[int | None]) -> "ModelRunnerOutput":
        """One plain token (or None: nothing sampled) per row group: what a test or a notebook that
        drives the scheduler without a model hands to `update_from_output`."""
        return cls([RowGroupOutput([] if t is None else [SampledToken(t)]) for t in token_ids])


class DraftTokenIds(NamedTuple):
    """Drafts for the next step (vLLM's name), from the proposer to `Scheduler.update_draft_token_ids`:
    per sequence named, its draft tokens and their proposal distribution ((d, V); None = one-hot)."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]
    draft_probs: list[torch.Tensor | None]


@dataclass
class CommitResult:
    """What `Scheduler.update_from_output` changed, for the engine to report and finish."""

    # the requests (group ids) whose sequences got a token or finished, in the plan's order, each once
    changed: list[str] = field(default_factory=list)
    num_generation_tokens: int = 0  # tokens appended for good (a stop string's cut excluded)
    num_prompt_tokens: int = 0  # prompt tokens of requests that got their first token

    def mark_changed(self, group_id: str) -> None:
        if group_id not in self.changed:
            self.changed.append(group_id)
