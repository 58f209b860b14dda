"""A failed step: roll it back, find the request to blame, finish it with the error.

    rollback      the scheduler and the block manager go back to where they were before `schedule()`
                  (the step's journal); a free cached block the failed step may have written loses its
                  hash, so a half-written block is never served from the prefix cache
    bisection     the step is re-run in halves, down to single row groups: a request whose failure
                  reproduces when it runs alone is to blame. O(culprits x log(batch)) extra forwards,
                  paid only by a failed step. The re-runs write only the step's own slots, and each
                  carries its drafts and their distributions (they are on the sequences): it runs as
                  the step ran.
    named         a `RequestsFailedError` names its culprits itself (found before the forward, e.g. a grammar
                  over its mask budget): rolled back, those finish with their messages, nothing re-run
    the verdict   culprits finish with finish_reason "error" and the message; the others continue
                  with exactly the tokens they would have drawn without them (seeded noise). No
                  culprit: the error is raised again, the engine consistent. A fatal error (a device
                  error, a failed collective) is never re-run: `EngineDeadError`.
"""

from __future__ import annotations

from minivllm.engine.core.scheduler import Scheduler
from minivllm.engine.executor.abstract import Executor
from minivllm.engine.request.errors import EngineDeadError, RequestsFailedError, is_fatal
from minivllm.engine.request.sequence import FinishReason
from minivllm.engine.request.step_types import GrammarBitmask, ScheduledSequence, SchedulerOutput


class StepRecovery:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler, self.executor = scheduler, executor

    def recover(self, plan: SchedulerOutput, error: Exception) -> list[str]:
        """Roll the failed step back and finish its culprits; returns their requests' ids. Raises `error`
        again when no single request reproduces it; `EngineDeadError` when it is fatal."""
        if isinstance(error, RequestsFailedError):
            return self._finish_named(plan, error)
        try:
            if is_fatal(error):
                raise dead(error) from error
            culprits = self._blame(plan.scheduled, plan.grammar_bitmask)
        finally:
            self.scheduler.rollback_step(plan)  # the trial runs write only the plan's slots too
        if not culprits:
            raise error
        for sched, err in culprits:
            self.scheduler.finish(sched.seq, FinishReason.ERROR,
                                  error=f"this request made the step fail on its own: {type(err).__name__}: {err}")
        return list(dict.fromkeys(sched.seq.group_id for sched, _ in culprits))

    def _finish_named(self, plan: SchedulerOutput, error: RequestsFailedError) -> list[str]:
        self.scheduler.rollback_step(plan)
        named = [s.seq for s in plan.scheduled if s.seq.request_id in error.culprits and not s.seq.is_finished]
        if not named:  # not this plan's requests: nobody to blame
            raise error
        for seq in named:
            self.scheduler.finish(seq, FinishReason.ERROR, error=error.culprits[seq.request_id])
        return list(dict.fromkeys(seq.group_id for seq in named))

    def _blame(self, group: list[ScheduledSequence], masks: GrammarBitmask | None
               ) -> list[tuple[ScheduledSequence, Exception]]:
        """Re-run `group` (a part of the failed plan); if it fails, re-run each half, down to single requests."""
        if not group:
            return []
        try:
            self.executor.execute_model(SchedulerOutput(list(group), grammar_bitmask=masks))  # masks: by request
            return []
        except Exception as error:
            if is_fatal(error):
                raise dead(error) from error
            if len(group) == 1:
                return [(group[0], error)]
        mid = len(group) // 2
        return self._blame(group[:mid], masks) + self._blame(group[mid:], masks)


def dead(error: Exception) -> EngineDeadError:
    if isinstance(error, EngineDeadError):
        return error  # it says what happened already (e.g. which worker failed, and how)
    return EngineDeadError(f"the engine hit a device error and must be restarted: {error}")
