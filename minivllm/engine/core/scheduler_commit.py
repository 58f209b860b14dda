"""The commit: `Scheduler.update_from_output`, the one place a step's results land (vLLM v1's name).

`StepCommit` is the half of `Scheduler` that runs after the forward (the scheduler inherits it: every
write to a request's state is still the scheduler's own, through its `finish` / `fail` / `preempt`).
The plan's reservations were made final before it runs (the step's transaction committed), so there
is no going back, only forward. For each row group of the plan, in order:

    advance   what the forward computed is the sequence's now: its K/V (and a hybrid's state) up to the
              verified tokens, prompt logprobs recorded, drafts used up (the full blocks the step
              computed were published to the prefix cache when they were allocated)
    tokens    accepted drafts, then the target's token, each advancing the request's grammar (structured
              outputs) and going through the stop rules (`StopChecker`): token by token (EOS, stop ids, a
              complete grammar, lengths), then the new text (stop strings)
    trim      blocks it will not read go back: the slots of rejected drafts, and in a sliding-window
              group the blocks that left the window (`BlockManager.trim`)
then, once, the step's shared tail: the states the step kept join a hybrid's prefix cache.

Invariants:
  * Nothing escapes a committed step. A request finished earlier in the loop would go unreported, so an
    exception ends only the requests it was for, with finish_reason "error" and the message: one in a
    request's part ends that request; one in the tail ends
    every request of the step still running. Each of them is in `CommitResult.changed`: reported.
  * A failure after the token that finished a sequence ("length", "stop") is an error, not an output
    one token short of its text.
"""

from __future__ import annotations

import time

from minivllm.engine.core.kv_cache_groups import KVBlockManager
from minivllm.engine.core.state_pool import StatePool
from minivllm.engine.core.stop_checker import StopChecker, advance_grammar
from minivllm.engine.request.sequence import FinishReason, Sequence
from minivllm.engine.request.step_types import (CommitResult, ModelRunnerOutput, RowGroupOutput, SampledToken,
                                                ScheduledSequence, SchedulerOutput)


class StepCommit:
    """`Scheduler`'s commit. What it reads of the scheduler, declared for the reader and the type checker:"""

    block_manager: KVBlockManager
    state_pool: StatePool | None
    stop_checker: StopChecker
    running: list[Sequence]

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        raise NotImplementedError  # the scheduler's (engine/core/scheduler.py): it gives back what seq holds

    def fail(self, seq: Sequence, error: str) -> None:
        raise NotImplementedError  # the scheduler's: finish with "error" unless finished

    def preempt(self, seq: Sequence) -> None:
        raise NotImplementedError  # the scheduler's: back to WAITING, recomputed

    def update_from_output(self, plan: SchedulerOutput, runner_output: ModelRunnerOutput) -> CommitResult:
        """Commit a step's results, request by request. The step has committed: nothing may escape (a
        request finished earlier in the loop would go unreported), so what raises ends the requests it was
        for with the error, each of them in `result.changed`."""
        result = CommitResult()
        for sched, out in zip(plan.scheduled, runner_output.outputs, strict=True):
            if sched.seq.is_finished:
                continue
            try:
                self._commit_request(sched, out, result)
            except Exception as error:
                self._fail_commit([sched], error, result)
        try:
            self._commit_tail(plan)
        except Exception as error:  # what the step's rows share: every request still running in it fails
            self._fail_commit(plan.scheduled, error, result)
        return result

    def _commit_request(self, sched: ScheduledSequence, out: RowGroupOutput, result: CommitResult) -> None:
        """One request's part: what its rows computed, its tokens and stops, the blocks it no longer needs."""
        seq = sched.seq
        self._advance(sched, out)
        if out.error is not None:  # no token it may draw (e.g. its grammar against its allowed_token_ids)
            result.mark_changed(seq.group_id)
            return self.fail(seq, out.error)
        if out.tokens:
            result.mark_changed(seq.group_id)
            try:
                self._commit_tokens(seq, out.tokens, result)
            except Exception as error:  # even if its last token finished it ("length"): that token's text is lost
                self.finish(seq, FinishReason.ERROR, error=commit_error("token", error))
        if not seq.is_finished:
            self.block_manager.trim(seq, seq.num_tokens)

    def _commit_tail(self, plan: SchedulerOutput) -> None:
        """What the step's rows share, once each has committed: the states it kept join the prefix cache."""
        if self.state_pool is not None:
            self.state_pool.publish_snapshots(plan.scheduled)

    def _fail_commit(self, rows: list[ScheduledSequence], error: Exception, result: CommitResult) -> None:
        """The rows' sequences end with `error` unless finished."""
        for s in [row.seq for row in rows]:
            if not s.is_finished:
                result.mark_changed(s.group_id)  # reported, with the tokens it has
                message = commit_error("step", error)
                try:
                    self.fail(s, message)
                except Exception:  # giving back what it holds failed again: it still ends (what it held is
                    if s in self.running:  # lost), and the other rows still fail: nothing escapes
                        self.running.remove(s)
                    s.finish(FinishReason.ERROR, error=message)

    def _advance(self, sched: ScheduledSequence, out: RowGroupOutput) -> None:
        """What the forward computed is the sequence's now: K/V (and a hybrid model's state) up to the
        verified tokens, prompt logprobs recorded; its drafts are used up."""
        seq = sched.seq
        if self.state_pool is not None:  # the staging slot (after a verification: the accepted drafts' state)
            self.state_pool.publish(seq)
        seq.num_computed_tokens = sched.start + sched.num_new_tokens - sched.num_spec_tokens
        seq.clear_drafts()
        seq.prompt_logprobs.extend(out.prompt_logprobs)

    def _commit_tokens(self, seq: Sequence, tokens: list[SampledToken], result: CommitResult) -> None:
        """Append accepted drafts then the target's token, each through the token rules (tokens past a
        stop are dropped), then the text through the stop strings."""
        first = seq.num_output_tokens == 0
        if first:
            seq.first_token_time = time.perf_counter()
        num_new = 0
        for i, token in enumerate(tokens):
            if i:
                seq.num_computed_tokens += 1  # the previous token was an accepted draft: its K/V are computed
            seq.append_token(token.token_id)
            num_new += 1
            if token.logprob is not None:
                seq.logprobs.append(token)
                seq.cumulative_logprob += token.logprob
            grammar_done = advance_grammar(seq, token.token_id)  # the one place a grammar advances
            stop = self.stop_checker.check_token(seq, token.token_id, grammar_done)
            if stop is not None:
                self.finish(seq, stop.finish_reason, stop.stop_reason)
                break
        kept, match = self.stop_checker.check_strings(seq, num_new)
        if match is not None:
            self.finish(seq, FinishReason.STOP, match.stop)
            seq.truncate_output(seq.num_output_tokens - num_new + kept)
        result.num_generation_tokens += kept
        if first and seq.index == 0:  # an n > 1 request's prompt counts once
            result.num_prompt_tokens += seq.num_prompt_tokens


def commit_error(what: str, error: Exception) -> str:
    return f"committing this request's {what} failed: {type(error).__name__}: {error}"
