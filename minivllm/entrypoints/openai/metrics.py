"""Prometheus metrics for `GET /metrics`, with vLLM's names, meanings and labels, so that a
dashboard made for vLLM works unchanged. Every series has vLLM's labels `model_name` (the served
name) and `engine` ("0": one engine).

    vllm:num_requests_running, vllm:num_requests_waiting    gauge      requests in the batch / waiting
    vllm:kv_cache_usage_perc                                 gauge      share of KV blocks in use, 0..1
    vllm:prompt_tokens_total                                 counter    prompt tokens of requests that got
                                                                        their first token (counted at commit)
    vllm:generation_tokens_total                             counter    tokens generated (at commit: rejected
                                                                        drafts and recomputed tokens never count)
    vllm:num_preemptions_total                               counter    requests preempted
    vllm:request_success_total{finished_reason}              counter    requests finished: stop, length, abort, error
    vllm:prefix_cache_queries_total, _hits_total             counter    prompt tokens looked up / found cached
    vllm:time_to_first_token_seconds                         histogram  arrival -> first token
    vllm:inter_token_latency_seconds                         histogram  between a request's successive outputs
    vllm:e2e_request_latency_seconds                         histogram  arrival -> finished
  with speculative decoding on:
    vllm:spec_decode_num_drafts_total                        counter    drafts verified (one per request per step)
    vllm:spec_decode_num_draft_tokens_total                  counter    draft tokens verified
    vllm:spec_decode_num_accepted_tokens_total               counter    draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}  counter  accepted at draft position 0, 1, ...

    acceptance rate  = rate(..._num_accepted_tokens_total) / rate(..._num_draft_tokens_total)
    mean accepted length = 1 + rate(..._num_accepted_tokens_total) / rate(..._num_drafts_total)

- Gauges and counters are read from the engine's latest `EngineStats` at scrape time (a custom
  collector). The engine's totals can go down: a failed step is rolled back with its counts. A
  Prometheus counter never does, so each reports the highest total seen (the rolled-back work,
  redone, is counted once).
- The histograms are fed by the async engine as outputs arrive (`latency_observers`); their
  buckets are vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minivllm.engine.async_engine import AsyncLLMEngine, LatencyKind
from minivllm.engine.stats import EngineStats

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = (model_name, "0")
        r.register(EngineCollector(engine, labels))
        self.histograms = {
            "ttft": Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, registry=r, buckets=_TTFT_BUCKETS).labels(*labels),
            "itl": Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LABELS, registry=r, buckets=_ITL_BUCKETS).labels(*labels),
            "e2e": Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, registry=r, buckets=_E2E_BUCKETS).labels(*labels),
        }
        engine.latency_observers.append(self.observe)

    def observe(self, kind: LatencyKind, seconds: float) -> None:
        self.histograms[kind].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """The engine's gauges and counters, read from its latest stats at every scrape."""

    def __init__(self, engine: AsyncLLMEngine, labels: tuple[str, str]) -> None:
        self.engine, self.labels = engine, list(labels)
        spec = engine.engine.spec_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0  # 0: spec decoding off
        self._highest: dict[tuple[str, ...], float] = {}  # (counter, label values...) -> highest total seen

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          1.0 - s.num_free_blocks / s.num_total_blocks)
        for name, doc, total in (
                ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.num_prompt_tokens_total),
                ("vllm:generation_tokens", "Number of generation tokens processed.", s.num_generation_tokens_total),
                ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions),
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 s.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 s.prefix_cache_hits)):
            yield self._counter(name, doc, {(): total})
        yield self._counter("vllm:request_success", "Count of successfully processed requests.",
                            {(reason,): s.finished_requests.get(reason, 0) for reason in FINISH_REASONS},
                            "finished_reason")
        if self.num_spec_tokens:
            yield from self._spec_decode(s)

    def _spec_decode(self, s: EngineStats) -> Iterator[Metric]:
        drafts, accepted = spec_decode_counts(s)
        per_position = [accepted[pos] if pos < len(accepted) else 0 for pos in range(self.num_spec_tokens)]
        yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", {(): drafts})
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", {(): s.num_draft_tokens})
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                            {(): s.num_accepted_tokens})
        yield self._counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                            {(str(pos),): n for pos, n in enumerate(per_position)}, "position")

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, doc, labels=LABELS)
        gauge.add_metric(self.labels, value)
        return gauge

    def _counter(self, name: str, doc: str, totals: dict[tuple[str, ...], float],
                 label: str | None = None) -> CounterMetricFamily:
        """`totals`: the engine's cumulative count per value of `label` (or {(): count})."""
        counter = CounterMetricFamily(name, doc, labels=[*LABELS, *([label] if label else [])])
        for values, total in totals.items():
            key = (name, *values)
            self._highest[key] = max(self._highest.get(key, 0), total)
            counter.add_metric([*self.labels, *values], self._highest[key])
        return counter


def spec_decode_counts(s: EngineStats) -> tuple[int, tuple[int, ...]]:
    """Drafts verified, and draft tokens accepted at each position, as counts (vLLM's counters)."""
    return s.num_drafts, s.num_accepted_tokens_per_pos
