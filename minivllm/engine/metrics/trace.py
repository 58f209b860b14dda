"""A per-step record of what the engine did, for pictures and teaching (`EngineConfig.record_trace`).

Each `StepTrace` says which requests ran in the step and how (prefill chunk or decode, which token
range), who was preempted or finished, and the KV pool afterwards: every live request's block table
and which blocks are free or cached. The notebooks draw scheduler timelines and block maps from it
(see `minivllm/teaching/viz.py`). Recording copies the block tables every step, so it is off by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from minivllm.engine.core.kv_cache_groups import KVCacheCoordinator
from minivllm.engine.core.scheduler import Scheduler
from minivllm.engine.request.step_types import ModelRunnerOutput, SchedulerOutput


class ScheduledTrace(NamedTuple):
    request_id: str
    start: int  # first position computed this step
    num_new_tokens: int
    is_prefill: bool
    sampled: bool
    num_draft_tokens: int = 0  # speculative decoding: drafts verified in this row group
    num_accepted_tokens: int = 0  # of which accepted


@dataclass(frozen=True)
class StepTrace:
    step: int
    scheduled: tuple[ScheduledTrace, ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    block_tables: dict[str, tuple[int, ...]]  # live requests after the step
    free_blocks: tuple[int, ...]  # in LRU order (the next to be reused first)
    cached_blocks: frozenset[int]  # blocks findable in the prefix cache (owned or free)
    num_total_blocks: int

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def record_step(step: int, plan: SchedulerOutput, scheduler: Scheduler, finished: list[str],
                runner_output: ModelRunnerOutput | None = None) -> StepTrace:
    """`runner_output`: what the step sampled, for the drafts accepted per row group (none without it)."""
    bm = scheduler.block_manager
    if isinstance(bm, KVCacheCoordinator):  # the full-attention group's pool (the sliding one: notebook 17)
        bm = bm.full
    accepted = ([max(0, len(o.tokens) - 1) if s.num_spec_tokens else 0
                 for s, o in zip(plan.scheduled, runner_output.outputs)] if runner_output is not None
                else [0] * len(plan.scheduled))
    return StepTrace(
        step=step,
        scheduled=tuple(ScheduledTrace(s.seq.request_id, s.start, s.num_new_tokens, s.is_prefill, s.samples,
                                       s.num_spec_tokens, a) for s, a in zip(plan.scheduled, accepted)),
        preempted=tuple(s.request_id for s in plan.preempted),
        finished=tuple(finished),
        block_tables={s.request_id: tuple(s.block_table) for s in scheduler.live_sequences if s.block_table},
        free_blocks=tuple(bm.free_blocks),
        cached_blocks=frozenset(bm.hash_to_block.values()),
        num_total_blocks=bm.num_blocks,
    )
