"""`Scheduler`: who runs in this step and how many tokens each (`schedule`), and what the step's
results change (`update_from_output`).

One step = one forward pass over a flat batch of up to `max_num_batched_tokens` tokens from at most
`max_num_seqs` sequences (a request with n > 1 is n sequences, plain requests here: the scheduler never
sees them as one). Prefill and decode share the batch ("mixed batches"):

  1. RUNNING requests first, oldest first. Each gets the tokens it has not computed yet, capped by
     the budget: one token for a decode (plus the drafts attached to it, speculative decoding), the
     next chunk for a request still in (chunked) prefill. If the pool has no block for it, drafts
     are dropped first; then the NEWEST running request is preempted by recompute: its blocks are
     freed and it goes back to the front of WAITING (its finished blocks stay in the prefix cache, so
     the recompute is often cheap). The oldest request therefore always progresses.
  2. WAITING requests are then admitted in the policy's order with what is left of the budget,
     skipping any that does not fit now and carrying on (no head-of-line blocking). With chunked
     prefill any admitted request may receive a partial chunk. Nothing is admitted in a step that
     preempted (the pool is under pressure).

Starvation: a request passed over for lack of blocks or seats counts `num_admission_skips`; past
`max_admission_skips`, admission stops at it until enough blocks are free. Requests that can never run
are refused before they get here (`InputProcessor.unservable_reason`), so the loop cannot hang.

Prefix caching at allocation (vLLM v1's rule): the full blocks a step will compute get their hashes when
they are allocated, so a request admitted later in the same step (an n > 1 request's next sequence, say)
already hits them: every layer writes the whole batch's K/V before any of its attention reads the cache.

The commit, `update_from_output`, is the one place a step's results land, request by request (an
exception fails only its request): computed counts advance, tokens go through the stop rules, unused
blocks go back. It is the scheduler's, written in
engine/core/scheduler_commit.py (`StepCommit`, which `Scheduler` inherits) to keep the plan on one screen.

Mapping onto the small teaching API of MinivLLM (github.com/Wenyueh/MinivLLM — a separate study
project built on nano-vllm, whose guide writes a scheduler with these method names; not this project):
  add_sequence(seq), preempt(seq), is_finished()  -> same
  schedule() -> (seqs, is_prefill)   -> schedule() -> SchedulerOutput; `is_prefill` is per row group
                                        (`ScheduledSequence.is_prefill`): one batch mixes both
  postprocess(seqs, token_ids)       -> update_from_output(scheduler_output, model_runner_output)
                                        (vLLM v1's name): one RowGroupOutput per row group
"""

from __future__ import annotations

import time
from collections import deque

from minivllm.engine.core.kv_cache_groups import KVBlockManager
from minivllm.engine.core.overwritten import overwritten, planned_tables
from minivllm.engine.core.scheduler_commit import StepCommit
from minivllm.engine.core.scheduling_policy import FCFSPolicy, SchedulingPolicy
from minivllm.engine.core.state_pool import StatePool
from minivllm.engine.core.stop_checker import StopChecker
from minivllm.engine.request.journal import Journal, Journaled, JournaledDeque, JournaledList
from minivllm.engine.request.sequence import FinishReason, Sequence, SequenceStatus
from minivllm.engine.request.step_types import DraftTokenIds, ScheduledSequence, SchedulerOutput
from minivllm.engine.structured_output.grammar_fill import grammar_bitmask


class Scheduler(StepCommit, Journaled):
    def __init__(self, block_manager: KVBlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: frozenset[int] = frozenset(), enable_chunked_prefill: bool = True,
                 max_admission_skips: int = 8, state_pool: StatePool | None = None,
                 policy: SchedulingPolicy | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_admission_skips = max_admission_skips
        self.state_pool = state_pool  # hybrid models: a state slot per running request, too
        self.policy = policy or FCFSPolicy()  # which waiting request to try first, whom to preempt
        self.stop_checker = StopChecker(eos_token_ids, max_model_len)
        # Ids of the sequences that gave their blocks back (finished, aborted, failed, preempted) since the
        # engine last took them (`take_released`): a proposer with a cache of its own forgets them. Journaled
        # like the queues, so a preemption that a failed step undoes is never reported.
        self.released: list[str] = JournaledList()
        self.waiting: deque[Sequence] = JournaledDeque()
        self.running: list[Sequence] = JournaledList()  # in admission order: running[-1] is the newest
        self.num_preemptions = 0
        # The step's transaction (engine/request/journal.py): the queues, the block manager, the state pool and every
        # sequence given to the scheduler note their writes in it while a step is open.
        self.journal = Journal()
        self.journal.watch(self)

    # --- queues --------------------------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        self.journal.watch(seq)
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    @property
    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    # --- the step's transaction (engine/request/journal.py) ------------------------------------------------------
    def begin_step(self) -> None:
        """From here on, what planning (and a failed run) changes can be undone: blocks, queues, sequences."""
        self.journal.begin()

    def commit_step(self) -> None:
        """The forward succeeded: the plan's reservations are final (`update_from_output` then applies it)."""
        self.journal.commit()

    def rollback_step(self, plan: SchedulerOutput | None = None) -> list[Sequence]:
        """Back to where `begin_step` found everything, except what the failed run of `plan` (None: nothing
        ran) may have overwritten (engine/core/overwritten.py): a preemption whose blocks another sequence took
        stands (the victim is preempted again), and blocks it may have written, free again, lose their
        hashes. Returns the victims."""
        planned = planned_tables(self.live_sequences) if plan is not None else None
        self.journal.rollback()
        if planned is None:
            return []
        lost = overwritten(plan, planned, self.block_manager.block_size)
        for seq in lost.victims:  # outside the transaction now: this stands
            self.preempt(seq)
        self.block_manager.forget_overwritten(lost.blocks, lost.sliding_blocks)
        return lost.victims

    # --- the plan --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The step's plan: running requests first, then admissions (module docstring). A hybrid model's rows
        also get their state slots (`StatePool.plan_rows`): integers, which the runner's tensors follow;
        structured requests that sample get their grammar masks (engine/structured_output/grammar_fill.py)."""
        loads: dict[str, int] = {}  # hybrid: admitted with a prefix hit -> the snapshot slot to start from
        out = self._plan(loads)
        if self.state_pool is not None:
            out.scheduled = self.state_pool.plan_rows(out.scheduled, loads)
        out.grammar_bitmask = grammar_bitmask(out.scheduled)  # structured rows' masks (vLLM: get_grammar_bitmask)
        return out

    def _plan(self, loads: dict[str, int]) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running requests, oldest first; preempt (the policy's victim: fcfs = last admitted) when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            spec = min(len(seq.spec_token_ids), self.draft_room(seq), budget - n) if n == 1 else 0
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
        still_waiting: deque[Sequence] = JournaledDeque()
        hold = False  # set once a starving request must be served before anyone behind it
        seats = self.max_num_seqs - len(self.running)
        for seq in self.policy.admission_order(self.waiting):
            if hold or budget == 0 or seats == 0:
                still_waiting.append(seq)
                continue
            prefix = bm.get_computed_blocks(seq)
            n = seq.num_tokens - prefix.num_tokens
            fits_budget = n <= budget or self.enable_chunked_prefill
            n = min(n, budget)
            no_state = self.state_pool is not None and not self.state_pool.can_allocate(seq)
            if not fits_budget or no_state or not bm.can_allocate(seq, n, prefix):
                seq.num_admission_skips += 1
                hold = seq.num_admission_skips > self.max_admission_skips
                still_waiting.append(seq)
                continue
            bm.allocate(seq, n, prefix)
            load = self.state_pool.allocate(seq) if self.state_pool is not None else None
            if load is not None:
                loads[seq.request_id] = load
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = prefix.num_tokens
            if seq.first_scheduled_time is None:  # the end of its queue time (a preemption's re-admission is not)
                seq.first_scheduled_time = time.perf_counter()
            seq.status = SequenceStatus.RUNNING
            seq.num_admission_skips = 0
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, prefix.num_tokens, n))
            budget -= n
            seats -= 1
        self.waiting = still_waiting
        return out

    def draft_room(self, seq: Sequence) -> int:
        """How many drafts `seq` may have verified now: d drafts commit at most d + 1 tokens, never past
        max_tokens or max_model_len. None for a sequence that is not decoding."""
        if seq.num_uncomputed_tokens != 1 or seq.is_finished:
            return 0
        return max(0, self.stop_checker.tokens_left(seq) - 1)

    def update_draft_token_ids(self, drafts: DraftTokenIds) -> None:
        """Attach the proposer's drafts to the running sequences they name (vLLM's name; the only way a
        draft reaches a sequence). The next `schedule()` reserves their slots; the step verifies them.
        A name no longer running (finished, preempted since) is skipped: its drafts are for nobody."""
        by_id = {seq.request_id: seq for seq in self.running}
        for request_id, ids, probs in zip(drafts.req_ids, drafts.draft_token_ids, drafts.draft_probs, strict=True):
            seq = by_id.get(request_id)
            if seq is not None and ids:
                seq.spec_token_ids, seq.draft_probs = list(ids), probs

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, forget the K/V and drafts, back to the front of WAITING."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.clear_drafts()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        """Finish a sequence (any state) and give back what it holds."""
        if seq.is_finished:  # e.g. a stop string completed by the token that hit max_tokens: the reason changes
            seq.finish(reason, stop_reason, error)
            return
        # By membership, not status: if `_release` raised, the retry (the commit's `fail`) finds the sequence
        # out of both queues but not finished, and gives back what it still holds.
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finish(reason, stop_reason, error)

    def _release(self, seq: Sequence) -> None:
        """Give back everything `seq` holds: blocks and its state pair; note it for the proposer."""
        self.block_manager.free(seq)
        if self.state_pool is not None:  # the state is recomputed from scratch with the prompt
            self.state_pool.release(seq)
        self.released.append(seq.request_id)

    def take_released(self) -> list[str]:
        released = list(self.released)  # the ids released since the last call
        self.released.clear()
        return released

    def fail(self, seq: Sequence, error: str) -> None:  # a commit that raised: unless finished, it ends so
        if not seq.is_finished:
            self.finish(seq, FinishReason.ERROR, error=error)

