"""`EngineStats`: the counters `LLM.get_stats()` returns (a snapshot, not a live view)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    num_total_blocks: int
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
    acceptance_per_position: tuple[float, ...] = ()

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
