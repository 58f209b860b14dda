"""`Scheduler`: who runs in this step and how many tokens each (`schedule`), and what the step's
results change (`update_from_output`).

One step = one forward pass over a flat batch of up to `max_num_batched_tokens` tokens from at most
`max_num_seqs` sequences (a request with n > 1 counts its n: its children, forked when the prompt is
done, are reserved a seat at admission). Prefill and decode share the batch ("mixed batches"):

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

The commit, `update_from_output`, is the one place a step's results land, request by request (an
exception fails only its request; one in the step's shared tail, its requests still running): computed
counts advance, full blocks (and a hybrid's state snapshots) reach the prefix cache, a done prompt forks
its n - 1 children, tokens (accepted drafts, then the target's) go through the stop rules
(`StopChecker`), unused draft slots and finished blocks go back.

Mapping onto the small teaching API of MinivLLM (github.com/Wenyueh/MinivLLM — a separate study
project built on nano-vllm, whose guide writes a scheduler with these method names; not this project):
  add_sequence(seq), preempt(seq), is_finished()  -> same
  schedule() -> (seqs, is_prefill)   -> schedule() -> SchedulerOutput; `is_prefill` is per row group
                                        (`ScheduledSequence.is_prefill`): one batch mixes both
  postprocess(seqs, token_ids)       -> update_from_output(scheduler_output, model_runner_output)
                                        (vLLM v1's name): one RowGroupOutput per row group
"""

from __future__ import annotations

from collections import deque

from minivllm.engine.kv_cache_groups import KVBlockManager
from minivllm.engine.scheduling_policy import FCFSPolicy, SchedulingPolicy
from minivllm.engine.sequence import FinishReason, Sequence, SequenceStatus
from minivllm.engine.state_pool import StatePool
from minivllm.engine.step_types import (CommitResult, ModelRunnerOutput, RowGroupOutput, SampledToken,
                                        ScheduledSequence, SchedulerOutput)
from minivllm.engine.stop_checker import StopChecker
from minivllm.engine.undo_log import StepTransaction


class Scheduler:
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
        # engine last took them (`take_released`): a proposer with a cache of its own forgets them. A list
        # the step's transaction restores, so a preemption that a failed step undoes is never reported.
        self.released: list[str] = []
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: running[-1] is the newest
        self.num_preemptions = 0
        # The step's transaction over the queues, the blocks and the state pool: begin / commit / rollback
        self.transaction = StepTransaction(self, block_manager, state_pool)

    # --- queues --------------------------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    @property
    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    @property
    def num_seats_taken(self) -> int:
        """Sequences running, counting the children each still has to fork (n > 1): a step never holds
        more than max_num_seqs of them, forks included."""
        return len(self.running) + sum(s.num_forks_pending for s in self.running)

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
            self.transaction.record_seq(seq)
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

    def draft_room(self, seq: Sequence) -> int:
        """How many drafts `seq` may have verified now: d drafts commit at most d + 1 tokens, never past
        max_tokens or max_model_len. None for a sequence that is not decoding, or a prompt about to fork
        (n > 1): its last row is sampled once per child, which verification does not do."""
        if seq.num_uncomputed_tokens != 1 or seq.num_forks_pending or seq.is_finished:
            return 0
        return max(0, self.stop_checker.tokens_left(seq) - 1)

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, forget the K/V and drafts, back to the front of WAITING."""
        self.transaction.record_seq(seq)
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
        self.transaction.record_seq(seq)
        if seq.status is SequenceStatus.RUNNING:
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
        self.transaction.record_attr(self, "released")
        self.released.append(seq.request_id)

    def take_released(self) -> list[str]:
        released, self.released = self.released, []  # the ids released since the last call
        return released

    # --- the commit ------------------------------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, runner_output: ModelRunnerOutput) -> CommitResult:
        """Commit a step's results, request by request; the caller then copies `blocks_to_copy` (forks). The
        step has committed: nothing may escape (a request finished earlier in the loop would go unreported),
        so what raises ends the requests it was for with the error, each of them in `result.changed`."""
        result = CommitResult()
        for sched, out in zip(plan.scheduled, runner_output.outputs, strict=True):
            if sched.seq.is_finished:
                continue
            try:
                self._commit_request(sched, out, result)
            except Exception as error:  # its children made so far ran for nobody: they fail with their parent
                self._fail_commit([sched], error, result)
        try:
            self._commit_tail(plan)
        except Exception as error:  # what the step's rows share: every request still running in it fails
            self._fail_commit(plan.scheduled, error, result)
        return result

    def _commit_request(self, sched: ScheduledSequence, out: RowGroupOutput, result: CommitResult) -> None:
        """One request's part: what its row computed, its fork (n > 1), each sequence's tokens and stops."""
        seq = sched.seq
        self._advance(sched, out)
        if not out.tokens and out.error is None:
            return
        result.changed.setdefault(seq.group_id, [])
        if out.error is not None:  # no token it may draw (e.g. its grammar against its allowed_token_ids)
            return self.fail(seq, out.error)
        children = self._fork(seq, out.fork_tokens, result)
        for s, tokens in [*((c, [t]) for c, t in zip(children, out.fork_tokens)), (seq, out.tokens)]:
            try:
                self._commit_tokens(s, tokens, result)
            except Exception as error:  # even if its last token finished it ("length"): that token's text is lost
                self.finish(s, FinishReason.ERROR, error=commit_error("token", error))
        if not seq.is_finished:  # slots of rejected (or never proposed) drafts go back
            self.block_manager.trim(seq, seq.num_tokens)

    def _commit_tail(self, plan: SchedulerOutput) -> None:
        """What the step's rows share, once each has committed: the states it kept join the prefix cache."""
        if self.state_pool is not None:
            self.state_pool.publish_snapshots(plan.scheduled)

    def _fail_commit(self, rows: list[ScheduledSequence], error: Exception, result: CommitResult) -> None:
        """The rows' sequences, and the children they forked in this step, end with `error` unless finished."""
        for s in [s for row in rows for s in (row.seq, *result.changed.get(row.seq.group_id, []))]:
            if not s.is_finished:
                result.changed.setdefault(s.group_id, [])  # reported, with the tokens it has
                self.fail(s, commit_error("step", error))

    def _advance(self, sched: ScheduledSequence, out: RowGroupOutput) -> None:
        """What the forward computed is the sequence's now: K/V (and a hybrid model's state) up to the
        verified tokens, full blocks published, prompt logprobs recorded; its drafts are used up."""
        seq = sched.seq
        if self.state_pool is not None:  # after a verification: the state after the accepted drafts
            self.state_pool.publish(seq, sched.num_spec_tokens, max(0, len(out.tokens) - 1))
        seq.num_computed_tokens = sched.start + sched.num_new_tokens - sched.num_spec_tokens
        seq.clear_drafts()
        seq.prompt_logprobs.extend(out.prompt_logprobs)
        self.block_manager.cache_full_blocks(seq)

    def _fork(self, seq: Sequence, first_tokens: list[SampledToken], result: CommitResult) -> list[Sequence]:
        """n > 1, the prompt is done: its children share its blocks (the partial last one is copied) and
        go to the end of RUNNING, the newest, so preempted first. Forked before the parent appends its
        token: it may finish at once, and its blocks must be shared first."""
        children = []
        for index in range(1, len(first_tokens) + 1):
            child = seq.fork(index, seq.seed + index)
            copy = self.block_manager.fork(seq, child)
            if copy is not None:
                result.blocks_to_copy.append(copy)
                result.copy_owners.append(child.group_id)
            if self.state_pool is not None:
                self.state_pool.fork(seq, child)
            self.running.append(child)
            result.changed[seq.group_id].append(child)
            children.append(child)
        seq.num_forks_pending = 0
        return children

    def _commit_tokens(self, seq: Sequence, tokens: list[SampledToken], result: CommitResult) -> None:
        """Append accepted drafts then the target's token, each through the token rules (tokens past a
        stop are dropped), then the text through the stop strings."""
        first = seq.num_output_tokens == 0
        num_new = 0
        for i, token in enumerate(tokens):
            if i:
                seq.num_computed_tokens += 1  # the previous token was an accepted draft: its K/V are computed
            seq.append_token(token.token_id)
            num_new += 1
            if token.logprob is not None:
                seq.logprobs.append(token)
                seq.cumulative_logprob += token.logprob
            stop = self.stop_checker.check_token(seq, token.token_id)
            if stop is not None:
                self.finish(seq, stop.finish_reason, stop.stop_reason)
                break
        if not seq.is_finished and len(tokens) > 1:
            self.block_manager.cache_full_blocks(seq)  # accepted drafts: only verified blocks
        kept, match = self.stop_checker.check_strings(seq, num_new)
        if match is not None:
            self.finish(seq, FinishReason.STOP, match.stop)
            seq.truncate_output(seq.num_output_tokens - num_new + kept)
        if (self.state_pool is not None and seq.index > 0 and first and not seq.is_finished
                and seq.num_computed_tokens < seq.num_tokens - 1):
            # No free block for the copy of the partial last block: the child would recompute those
            # tokens, but a hybrid model's recurrent state (copied from the parent) already holds
            # them. It recomputes its whole prompt instead, as a preempted sequence does.
            self.preempt(seq)
        result.num_generation_tokens += kept
        if first and seq.index == 0:
            result.num_prompt_tokens += seq.num_prompt_tokens

    def fail(self, seq: Sequence, error: str) -> None:  # a commit that raised: unless finished, it ends so
        if not seq.is_finished:
            self.finish(seq, FinishReason.ERROR, error=error)


def commit_error(what: str, error: Exception) -> str:
    return f"committing this request's {what} failed: {type(error).__name__}: {error}"
