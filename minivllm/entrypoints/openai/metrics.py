"""Prometheus metrics for `GET /metrics`, in a registry of the app's own (no process-wide state).

Gauges are read from the engine's latest stats at scrape time; counters advance by what changed since
the previous scrape; the two latency histograms are fed by the async engine as tokens arrive.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minivllm.engine.async_engine import AsyncLLMEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self.running = Gauge("minivllm:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("minivllm:num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("minivllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use", registry=r)
        self.hit_rate = Gauge("minivllm:prefix_cache_hit_rate", "Prefix-cache hits / queried prompt tokens",
                              registry=r)
        self.preemptions = Counter("minivllm:num_preemptions", "Requests preempted (recompute)", registry=r)
        self.prompt_tokens = Counter("minivllm:prompt_tokens", "Prefill tokens computed", registry=r)
        self.generation_tokens = Counter("minivllm:generation_tokens", "Decode tokens computed", registry=r)
        self.ttft = Histogram("minivllm:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("minivllm:inter_token_latency_seconds", "Time between output tokens", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self._last = engine.stats
        engine.latency_observers.append(self.observe)

    def observe(self, kind: str, seconds: float) -> None:
        (self.ttft if kind == "ttft" else self.itl).observe(seconds)

    def render(self) -> bytes:
        s, last = self.engine.stats, self._last
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(1.0 - s.num_free_blocks / s.num_total_blocks)
        self.hit_rate.set(s.prefix_cache_hit_rate)
        self.preemptions.inc(s.num_preemptions - last.num_preemptions)
        self.prompt_tokens.inc(s.num_prefill_tokens - last.num_prefill_tokens)
        self.generation_tokens.inc(s.num_decode_tokens - last.num_decode_tokens)
        self._last = s
        return generate_latest(self.registry)
