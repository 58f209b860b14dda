"""`EngineStats`: the counters `LLM.get_stats()` returns (a snapshot, not a live view), and
`EngineCounters`, the engine's running totals it is made from."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.engine.core.kv_cache_groups import KVBlockManager
    from minivllm.engine.core.scheduler import Scheduler
    from minivllm.engine.spec_decode.speculator import Speculator


@dataclass(frozen=True)
class EngineStats:
    num_steps: int
    num_prefill_tokens: int  # tokens computed in prefill chunks (prompts and recomputes)
    num_decode_tokens: int
    num_mixed_steps: int  # steps whose batch held both prefill chunks and decodes
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of which found cached
    num_free_blocks: int
    num_total_blocks: int  # every pool's blocks (a model with sliding-window layers has two)
    num_running: int
    num_waiting: int
    step_time_s: float  # wall time inside step()
    forward_time_s: float  # of which in the model forward (incl. LM head)
    # Counted at commit, so recomputed tokens (after a preemption) never count twice:
    num_prompt_tokens_total: int = 0  # prompt tokens of requests that produced their first token
    num_generation_tokens_total: int = 0  # tokens appended to outputs
    finished_requests: dict[str, int] = field(default_factory=dict)  # finish_reason -> requests
    # Speculative decoding (0 when off): drafts verified, drafts accepted, and per draft position
    # the share accepted (position 0 = the first draft after the last token).
    num_drafts: int = 0  # verifications with at least one draft (vLLM's spec_decode_num_drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Blocks held by requests, per KV-cache group ("full_attention", and "sliding_attention" for a model
    # with sliding-window layers: engine/core/kv_cache_groups.py); num_free_blocks counts every group's free blocks.
    kv_blocks_in_use: dict[str, int] = field(default_factory=dict)
    acceptance_per_position: tuple[float, ...] = ()
    # A hybrid model's prefix caching (engine/core/state_cache.py): bytes reserved for state snapshots, how
    # many are cached now, and how many admissions resumed from one (0 when off).
    state_cache_bytes: int = 0
    state_snapshots_cached: int = 0
    state_snapshot_hits: int = 0
    # A mixture of experts (engine/worker/expert_load.py; () for a dense model): routes per expert index, summed
    # over the sparse layers, in the last step that ran a forward, and since the start (a step's sum is
    # tokens x experts per token x sparse layers; every row the forward computed counts, rejected drafts too).
    expert_load: tuple[int, ...] = ()
    expert_load_total: tuple[int, ...] = ()

    @property
    def committed_tokens(self) -> int:
        """Prompt tokens (at their first token) and generated ones: the difference over one step is what vLLM's
        vllm:iteration_tokens_total observes."""
        return self.num_prompt_tokens_total + self.num_generation_tokens_total

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def overhead_fraction(self) -> float:
        """Share of step time spent outside the model forward (scheduling, packing, sampling...)."""
        return 1.0 - self.forward_time_s / self.step_time_s if self.step_time_s else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
                "acceptance_rate": self.acceptance_rate,
                "overhead_fraction": self.overhead_fraction}


@dataclass
class EngineCounters:
    """The engine's running totals (what `EngineStats` reports of them). Tokens are counted at commit,
    so recomputed or rejected ones never count."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_mixed_steps: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    finished_requests: dict[str, int] = field(default_factory=dict)  # finish_reason -> requests
    expert_load: tuple[int, ...] = ()  # a mixture of experts: the last step's routes per expert
    expert_load_total: tuple[int, ...] = ()

    def count_step(self, num_prefill_tokens: int, num_decode_tokens: int, forward_time_s: float,
                   step_time_s: float, expert_load: tuple[int, ...] = ()) -> None:
        self.num_steps += 1
        if expert_load:  # ModelRunnerOutput.expert_load: () for a dense model
            total = self.expert_load_total or (0,) * len(expert_load)
            self.expert_load, self.expert_load_total = expert_load, tuple(map(sum, zip(total, expert_load)))
        self.num_prefill_tokens += num_prefill_tokens
        self.num_decode_tokens += num_decode_tokens
        self.num_mixed_steps += bool(num_prefill_tokens and num_decode_tokens)
        self.forward_time_s += forward_time_s
        self.step_time_s += step_time_s

    def count_finished(self, reasons: Iterable[str]) -> None:
        for reason in reasons:
            self.finished_requests[reason] = self.finished_requests.get(reason, 0) + 1


def engine_stats(c: EngineCounters, bm: KVBlockManager, scheduler: Scheduler, speculator: Speculator | None
                 ) -> EngineStats:
    spec = {}
    if speculator is not None:
        sp = speculator
        spec = dict(num_drafts=sp.per_position[0][0] if sp.per_position else 0,
                    num_draft_tokens=sp.num_draft_tokens, num_accepted_tokens=sp.num_accepted_tokens,
                    num_accepted_tokens_per_pos=tuple(a for _, a in sp.per_position),
                    acceptance_per_position=sp.acceptance_per_position)
    cache = scheduler.state_pool.cache if scheduler.state_pool is not None else None
    if cache is not None:
        spec.update(state_cache_bytes=cache.cfg.reserved_bytes, state_snapshots_cached=len(cache.entries),
                    state_snapshot_hits=cache.num_hits)
    return EngineStats(
        num_steps=c.num_steps, num_prefill_tokens=c.num_prefill_tokens, num_decode_tokens=c.num_decode_tokens,
        num_mixed_steps=c.num_mixed_steps, num_preemptions=scheduler.num_preemptions,
        prefix_cache_queries=bm.num_queried_tokens, prefix_cache_hits=bm.num_hit_tokens,
        num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks, kv_blocks_in_use=bm.kv_blocks_in_use,
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        step_time_s=c.step_time_s, forward_time_s=c.forward_time_s,
        num_prompt_tokens_total=c.num_prompt_tokens_total, num_generation_tokens_total=c.num_generation_tokens_total,
        finished_requests=dict(c.finished_requests), expert_load=c.expert_load,
        expert_load_total=c.expert_load_total, **spec)
