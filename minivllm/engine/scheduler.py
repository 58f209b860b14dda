"""`Scheduler`: who runs in this step, and how many tokens each.

One step = one forward pass over a flat batch of up to `max_num_batched_tokens` tokens from at most
`max_num_seqs` sequences (a request with n > 1 counts its n: its children, forked when the prompt is
done, are reserved a seat at admission). Prefill and decode share the batch ("mixed batches"):

  1. RUNNING requests first, oldest first. Each gets the tokens it has not computed yet, capped by
     the budget: one token for a decode, the next chunk for a request still in (chunked) prefill.
     If the pool has no block for it, the NEWEST running request is preempted by recompute: its
     blocks are freed and it goes back to the front of WAITING (its finished blocks stay in the
     prefix cache, so the recompute is often cheap). The oldest request therefore always progresses.
  2. WAITING requests are then admitted in order with what is left of the budget, skipping any that
     does not fit now and carrying on (no head-of-line blocking). With chunked prefill any admitted
     request may receive a partial chunk, not only the first. Nothing is admitted in a step that
     preempted (the pool is under pressure).

Starvation: skipping lets small requests overtake a large one. Each time a request is passed over for
lack of blocks its `num_admission_skips` grows; past `max_admission_skips`, admission stops at that
request until the running requests free enough blocks for it. The token budget never starves anyone:
with chunked prefill every request can start with a chunk of whatever budget is left.

Requests that can never run are refused at `add_sequence` by the engine (see `LLMEngine`), so every
request admitted here fits in the pool on its own and the loop cannot hang.

Mapping onto the small teaching API of MinivLLM (github.com/Wenyueh/MinivLLM — a separate study
project built on nano-vllm, whose guide writes a scheduler with these method names; not this project):
  add_sequence(seq)             -> same
  schedule() -> (seqs, is_prefill)
                                -> schedule() -> SchedulerOutput; `is_prefill` is per request
                                   (`ScheduledSequence.is_prefill`), because one batch mixes both
  postprocess(seqs, token_ids)  -> postprocess(scheduler_output, outputs): one RowGroupOutput per
                                   scheduled entry (no token for a prefill chunk that has not
                                   reached the end; forked children's first tokens for n > 1)
  preempt(seq), is_finished()   -> same
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sampling_metadata import RowGroupOutput, SampledToken
from minivllm.engine.scheduling_policy import FCFSPolicy, SchedulingPolicy
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.state_pool import StatePool
from minivllm.engine.undo_log import UndoLog


class ScheduledSequence(NamedTuple):
    """One row group of the step: `seq` computes positions [start, start + num_new_tokens). The last
    `num_spec_tokens` of them are draft slots (speculative decoding): the rows after the sequence's
    last token, fed with its `spec_token_ids`, every one of them sampled to verify the drafts."""

    seq: Sequence
    start: int
    num_new_tokens: int
    num_spec_tokens: int = 0

    @property
    def samples(self) -> bool:
        """Does this chunk reach the end of the sequence (so its last row's logits are sampled)?"""
        return self.start + self.num_new_tokens - self.num_spec_tokens == self.seq.num_tokens

    @property
    def is_prefill(self) -> bool:
        return not (self.num_new_tokens - self.num_spec_tokens == 1 and self.start >= self.seq.num_prompt_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Speculative decoding: a draft model's distribution over its drafts, by sequence request_id
    # ((num_spec_tokens, V) tensors; absent = a deterministic proposal, i.e. one-hot).
    draft_probs: dict[str, Any] = field(default_factory=dict)

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


class CommitResult(NamedTuple):
    updated: list[Sequence]  # sequences that received a token (forked children included)
    blocks_to_copy: list[tuple[int, int]]  # (src, dst) K/V blocks to copy: copy-on-write of forks


class StopReason(NamedTuple):
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        enable_chunked_prefill: bool = True,
        max_admission_skips: int = 8,
        num_speculative_tokens: int = 0,
        state_pool: StatePool | None = None,
        policy: SchedulingPolicy | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_admission_skips = max_admission_skips
        self.num_speculative_tokens = num_speculative_tokens  # draft slots per decoding sequence
        self.state_pool = state_pool  # hybrid models: a state slot per running request, too
        self.policy = policy or FCFSPolicy()  # which waiting request to try first, whom to preempt
        # Ids of the sequences that gave their blocks back (finished, aborted, failed, preempted) since the
        # engine last took them (`take_released`): a proposer with a cache of its own forgets them. A list
        # the step's transaction restores, so a preemption that a failed step undoes is never reported.
        self.released: list[str] = []
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: running[-1] is the newest
        self.num_preemptions = 0
        self.undo: UndoLog | None = None  # the open step's log (see begin / rollback)

    # --- queues --------------------------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    @property
    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    # --- the plan --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running requests, oldest first; preempt (the policy's victim: fcfs = last admitted) when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            spec = self._draft_slots(seq, budget - n)
            while not bm.can_append(seq, n + spec):
                if spec:  # short of blocks: drop drafts first, never preempt anyone for them
                    spec -= 1
                    continue
                # Never a request already scheduled in this step: candidates are seq and those after it.
                victim = self.policy.choose_victim(self.running[i:])
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                start = seq.num_computed_tokens
                bm.append_slots(seq, n + spec)
                out.scheduled.append(ScheduledSequence(seq, start, n + spec, spec))
                budget -= n + spec
                i += 1

        # 2. admit waiting requests with what is left (not under memory pressure).
        if out.preempted:
            return out
        still_waiting: deque[Sequence] = deque()
        hold = False  # set once a starving request must be served before anyone behind it
        seats = self.max_num_seqs - self.num_seats_taken
        for seq in self.policy.admission_order(self.waiting):
            if hold or budget == 0 or seats == 0:
                still_waiting.append(seq)
                continue
            prefix = bm.get_computed_blocks(seq)
            n = seq.num_tokens - prefix.num_tokens
            fits_budget = n <= budget or self.enable_chunked_prefill
            n = min(n, budget)
            self._record_seq(seq)
            no_seat = 1 + seq.num_forks_pending > seats  # n > 1: its children will run beside it
            no_state = self.state_pool is not None and not self.state_pool.can_allocate(seq)
            if not fits_budget or no_seat or no_state or not bm.can_allocate(seq, n, prefix):
                seq.num_admission_skips += 1
                hold = seq.num_admission_skips > self.max_admission_skips
                still_waiting.append(seq)
                continue
            bm.allocate(seq, n, prefix)
            if self.state_pool is not None:
                self.state_pool.allocate(seq)
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = prefix.num_tokens
            seq.status = SequenceStatus.RUNNING
            seq.num_admission_skips = 0
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, prefix.num_tokens, n))
            budget -= n
            seats -= 1 + seq.num_forks_pending
        self.waiting = still_waiting
        return out

    @property
    def num_seats_taken(self) -> int:
        """Sequences running, counting the children each still has to fork (n > 1): a step never holds
        more than max_num_seqs of them, forks included."""
        return len(self.running) + sum(s.num_forks_pending for s in self.running)

    def _draft_slots(self, seq: Sequence, budget: int) -> int:
        """How many draft slots a decoding sequence may reserve: within the token budget, and never
        past max_tokens or max_model_len (d drafts commit at most d + 1 tokens). None for a prompt that
        is about to fork (n > 1): its last row is sampled once per child, which verification does not do."""
        if not self.num_speculative_tokens or seq.num_uncomputed_tokens != 1 or seq.num_forks_pending:
            return 0
        room = self.max_model_len - seq.num_tokens - 1
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.num_speculative_tokens, budget, room))

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, forget the K/V, back to the front of WAITING."""
        self._record_seq(seq)
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        """Give back everything `seq` holds: blocks and its state pair; note it for the proposer."""
        self.block_manager.free(seq)
        if self.state_pool is not None:  # the state is recomputed from scratch with the prompt
            self.state_pool.release(seq)
        if self.undo is not None:
            self.undo.record_attr(self, "released")
        self.released.append(seq.request_id)

    def take_released(self) -> list[str]:
        """The ids released since the last call (see `released`)."""
        released, self.released = self.released, []
        return released

    # --- the commit ------------------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, outputs: list[RowGroupOutput | int | None]) -> CommitResult:
        """Commit a successful step: advance computed counts, publish full blocks to the prefix
        cache, fork n > 1 requests whose prompt is done, append sampled tokens and apply the
        token-level stop rules. A plain token id (or None) may stand for a row group's output."""
        assert len(outputs) == len(out.scheduled)
        result = CommitResult([], [])
        for sched, row_out in zip(out.scheduled, outputs):
            if not isinstance(row_out, RowGroupOutput):
                row_out = RowGroupOutput([] if row_out is None else [SampledToken(row_out)])
            one = self.postprocess_one(sched, row_out)
            result.updated.extend(one.updated)
            result.blocks_to_copy.extend(one.blocks_to_copy)
        return result

    def postprocess_one(self, sched: ScheduledSequence, out: RowGroupOutput) -> CommitResult:
        """`postprocess` for one row group. The caller copies `blocks_to_copy` (copy-on-write of
        forked sequences' last blocks) before the next forward."""
        seq = sched.seq
        if self.state_pool is not None:
            self.state_pool.publish(seq)  # the state this step computed is now the request's
        seq.num_computed_tokens = sched.start + sched.num_new_tokens - sched.num_spec_tokens
        seq.spec_token_ids = []
        self.block_manager.cache_full_blocks(seq)
        result = CommitResult([], [])
        if not out.tokens:
            return result
        # Fork before the parent appends its token: it may finish at once, and its blocks must be
        # shared first. Children go to the end of RUNNING: the newest, so preempted first.
        for index, first in enumerate(out.fork_tokens, start=1):
            child = seq.fork(index, seq.seed + index)
            copy = self.block_manager.fork(seq, child)
            if copy is not None:
                result.blocks_to_copy.append(copy)
            if self.state_pool is not None:
                self.state_pool.fork(seq, child)
            self.running.append(child)
            self._append(child, first)
            result.updated.append(child)
            if (self.state_pool is not None and not child.is_finished
                    and child.num_computed_tokens < seq.num_computed_tokens):
                # No free block for the copy of the partial last block: the child would recompute those
                # tokens, but a hybrid model's recurrent state (copied from the parent) already holds
                # them. It recomputes its whole prompt instead, as a preempted sequence does.
                self.preempt(child)
        seq.num_forks_pending = 0
        # Verified drafts then the target's token. Each accepted draft's K/V was computed by this
        # step; tokens past a stop are dropped.
        for i, token in enumerate(out.tokens):
            if i:
                seq.num_computed_tokens += 1  # the previous token was an accepted draft
            self._append(seq, token)
            if seq.is_finished:
                break
        if not seq.is_finished:
            if len(out.tokens) > 1:
                self.block_manager.cache_full_blocks(seq)  # accepted drafts: only verified blocks
            self.block_manager.trim(seq, seq.num_tokens)  # slots of rejected (or never proposed) drafts
        result.updated.insert(0, seq)
        return result

    def _append(self, seq: Sequence, token: SampledToken) -> None:
        seq.append_token(token.token_id)
        if token.logprob is not None:
            seq.logprobs.append(token)
            seq.cumulative_logprob += token.logprob
        stop = self.check_stop(seq, token.token_id)
        if stop is not None:
            self.finish(seq, stop.finish_reason, stop.stop_reason)

    def check_stop(self, seq: Sequence, token_id: int) -> StopReason | None:
        """The token-level stop rules (stop strings need text, so the engine checks those)."""
        sp = seq.sampling_params
        if seq.num_output_tokens > sp.min_tokens:  # the sampler masked these ids before that
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                return StopReason("stop", None)
            if token_id in sp.all_stop_token_ids:
                return StopReason("stop", token_id)
        if sp.max_tokens is not None and seq.num_output_tokens >= sp.max_tokens:
            return StopReason("length", None)
        if seq.num_tokens >= self.max_model_len:
            return StopReason("length", None)
        return None

    def finish(self, seq: Sequence, reason: str, stop_reason: Any = None, error: str | None = None) -> None:
        """Finish a request (any state) and give its blocks back."""
        self._record_seq(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finish(reason, stop_reason, error)

    # --- transactions ----------------------------------------------------------------------------
    def begin(self) -> None:
        """Open the step's transaction: what `schedule()` changes from here on can be rolled back.
        The queues are copied (their size is the number of requests, never the size of the pool);
        blocks and sequences are recorded as they are touched."""
        assert self.undo is None, "a transaction is already open"
        self.undo = UndoLog()
        for name in ("running", "waiting", "num_preemptions"):
            self.undo.record_attr(self, name)
        self.block_manager.begin(self.undo)
        if self.state_pool is not None:
            self.state_pool.undo = self.undo

    def commit(self) -> None:
        """The step succeeded: forget its undo log."""
        self.undo = None
        self.block_manager.commit()
        if self.state_pool is not None:
            self.state_pool.undo = None

    def rollback(self, written_blocks: set[int] = frozenset()) -> None:
        """Undo everything since `begin()` (see `BlockManager.rollback` for `written_blocks`)."""
        assert self.undo is not None, "no transaction is open"
        self.undo = None
        self.block_manager.rollback(written_blocks)  # also restores the state pool's free list
        if self.state_pool is not None:
            self.state_pool.undo = None

    def _record_seq(self, seq: Sequence) -> None:
        if self.undo is not None:
            self.undo.record_seq(seq)
