"""The commit: `Scheduler.update_from_output`, the one place a step's results land (vLLM v1's name).

`StepCommit` is the half of `Scheduler` that runs after the forward (the scheduler inherits it: every
write to a request's state is still the scheduler's own, through its `finish` / `fail` / `preempt`).
The plan's reservations were made final before it runs (the step's transaction committed), so there
is no going back, only forward. For each row group of the plan, in order:

    advance   what the forward computed is the sequence's now: its K/V (and a hybrid's state) up to the
              verified tokens, full blocks to the prefix cache, prompt logprobs recorded, drafts used up
    fork      n > 1 and the prompt is done: n - 1 children share its blocks (the partial last one copied)
    tokens    accepted drafts, then the target's token, through the stop rules (`StopChecker`): token by
              token (EOS, stop ids, lengths), then the new text (stop strings); unused draft slots go back
then, once, the step's shared tail: the states the step kept join a hybrid's prefix cache.

Invariants:
  * Nothing escapes a committed step. A request finished earlier in the loop would go unreported, so an
    exception ends only the requests it was for, with finish_reason "error" and the message: one in a
    request's part ends that request (and the children it forked in this step); one in the tail ends
    every request of the step still running. Each of them is in `CommitResult.changed`: reported.
  * A failure after the token that finished a sequence ("length", "stop") is an error, not an output
    one token short of its text.
"""

from __future__ import annotations

from minivllm.engine.kv_cache_groups import KVBlockManager
from minivllm.engine.sequence import FinishReason, Sequence
from minivllm.engine.state_pool import StatePool
from minivllm.engine.step_types import (CommitResult, ModelRunnerOutput, RowGroupOutput, SampledToken,
                                        ScheduledSequence, SchedulerOutput)
from minivllm.engine.stop_checker import StopChecker


class StepCommit:
    """`Scheduler`'s commit. What it reads of the scheduler, declared for the reader and the type checker:"""

    block_manager: KVBlockManager
    state_pool: StatePool | None
    stop_checker: StopChecker
    running: list[Sequence]

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        raise NotImplementedError  # the scheduler's (engine/scheduler.py): it gives back what seq holds

    def fail(self, seq: Sequence, error: str) -> None:
        raise NotImplementedError  # the scheduler's: finish with "error" unless finished

    def preempt(self, seq: Sequence) -> None:
        raise NotImplementedError  # the scheduler's: back to WAITING, recomputed

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
                message = commit_error("step", error)
                try:
                    self.fail(s, message)
                except Exception:  # giving back what it holds failed again: it still ends (what it held is
                    if s in self.running:  # lost), and the other rows still fail: nothing escapes
                        self.running.remove(s)
                    s.finish(FinishReason.ERROR, error=message)

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
            # Registered before it holds anything: if what follows raises, the commit fails it with its parent
            # (`_fail_commit`), which gives back the blocks and state it was given so far.
            self.running.append(child)
            result.changed[seq.group_id].append(child)
            copy = self.block_manager.fork(seq, child)
            if copy is not None:
                result.blocks_to_copy.append(copy)
                result.copy_owners.append(child.group_id)
            if self.state_pool is not None:
                self.state_pool.fork(seq, child)
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


def commit_error(what: str, error: Exception) -> str:
    return f"committing this request's {what} failed: {type(error).__name__}: {error}"
