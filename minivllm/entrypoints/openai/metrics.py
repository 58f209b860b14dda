"""Prometheus metrics for `GET /metrics`, with vLLM's names, meanings and labels, so that a
dashboard made for vLLM works unchanged. Every series has vLLM's labels `model_name` (the served
name) and `engine` ("0": one engine).

    vllm:num_requests_running, vllm:num_requests_waiting    gauge      requests in the batch / waiting
    vllm:num_requests_waiting_by_reason{reason}              gauge      "capacity" (all of them here), "deferred" (0)
    vllm:kv_cache_usage_perc                                 gauge      share of KV blocks in use, 0..1
    vllm:cache_config_info{block_size, num_gpu_blocks, ...}  gauge      1, the KV cache's settings as labels
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
  per request, as the server sees its outputs (`track`):
    vllm:prompt_tokens_by_source_total{source}               counter    prompt tokens at the first token:
                                                                        "local_cache_hit" / "local_compute"
    vllm:prompt_tokens_cached_total                          counter    of which served by the prefix cache
    vllm:request_prefill_kv_computed_tokens                  histogram  prompt tokens computed (not cached)
    vllm:request_prompt_tokens, _generation_tokens           histogram  a finished request's prompt / all its
                                                                        completions' tokens
    vllm:request_max_num_generation_tokens                   histogram  its longest completion's tokens
    vllm:request_params_n, vllm:request_params_max_tokens    histogram  its n and max_tokens (None: what fits)
    vllm:request_decode_time_seconds                         histogram  first token -> finished
    vllm:request_queue_time_seconds                          histogram  arrival -> first scheduled    (the engine's
    vllm:request_prefill_time_seconds                        histogram  first scheduled -> first token   times,
    vllm:request_inference_time_seconds                      histogram  first scheduled -> finished  .metrics)
    vllm:request_time_per_output_token_seconds               histogram  decode time / (tokens - 1)
  per engine step (the async engine's `step_observers`):
    vllm:iteration_tokens_total                              histogram  the tokens a step committed: prompts that
                                                                        got their first token + tokens generated
  with speculative decoding on:
    vllm:spec_decode_num_drafts_total                        counter    drafts verified (one per request per step)
    vllm:spec_decode_num_draft_tokens_total                  counter    draft tokens verified
    vllm:spec_decode_num_accepted_tokens_total               counter    draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}  counter  accepted at draft position 0, 1, ...

    acceptance rate  = rate(..._num_accepted_tokens_total) / rate(..._num_draft_tokens_total)
    mean accepted length = 1 + rate(..._num_accepted_tokens_total) / rate(..._num_drafts_total)
  with a mixture-of-experts model, from its first step (minivllm's own: vLLM has no such series outside its
  expert-parallel load balancer, EPLB, which minivllm does not have):
    minivllm:moe_expert_routes_total{expert}                 counter    routes to expert index 0, 1, ... summed
                                                                        over the sparse layers (engine/worker/
                                                                        expert_load.py): its rate is the load

vLLM's metrics left out, and why:
    vllm:prompt_tokens_recomputed                            always 0: the prefix cache never serves a
                                                             prompt's last token, so none is recomputed
    vllm:engine_sleep_state                                  there is no sleep mode
    vllm:external_prefix_cache_queries/_hits, nixl_* ...     there is no KV connector (KV transfer)
    vllm:mm_cache_queries/_hits                              text only
    vllm:lora_requests_info                                  no LoRA
    vllm:corrupted_requests, vllm:kv_block_*_seconds,        opt-in in vLLM (a NaN check, sampled block
      vllm:estimated_*_per_gpu_total                         residency, FLOP estimates): not implemented
    vllm:gpu_cache_usage_perc, vllm:gpu_prefix_cache_*,      deprecated, hidden in vLLM; renamed to the
      vllm:time_per_output_token_seconds                     ones above

- Gauges and counters are read from the engine's latest `EngineStats` at scrape time (a custom
  collector). The engine's totals can go down: a failed step is rolled back with its counts. A
  Prometheus counter never does, so each reports the highest total seen (the rolled-back work,
  redone, is counted once).
- The latency histograms are fed by the async engine as outputs arrive (`latency_observers`); the
  per-request ones by `track`, which the endpoints wrap around each request's outputs: the prompt's
  at its first token, the rest when it finishes (a request its client abandoned is not observed).
  Buckets are vLLM's.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minivllm.engine.async_commands import LatencyKind
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.metrics.stats import EngineStats
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = (model_name, "0")
        config = engine.engine.config
        self.max_model_len = config.max_model_len
        r.register(EngineCollector(engine, labels))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=r, buckets=buckets).labels(*labels)

        self.histograms = {
            "ttft": histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS),
            "itl": histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS),
            "e2e": histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _E2E_BUCKETS),
        }
        engine.latency_observers.append(self.observe)
        tokens = buckets_1_2_5(self.max_model_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", _E2E_BUCKETS)
        self.time_per_output_token = histogram("vllm:request_time_per_output_token_seconds",
                                               "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _E2E_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", _E2E_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", _E2E_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", _ITERATION_TOKEN_BUCKETS)
        engine.step_observers.append(self.iteration_tokens.observe)
        self.prefill_computed = histogram("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens "
                                          "computed during prefill (excluding cached tokens).", tokens)
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            [*LABELS, "source"], registry=r)
        self.prompt_computed = by_source.labels(*labels, "local_compute")
        self.prompt_cache_hit = by_source.labels(*labels, "local_cache_hit")
        self.prompt_cached = Counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                                     LABELS, registry=r).labels(*labels)
        info = {"block_size": config.block_size, "num_gpu_blocks": engine.stats.num_total_blocks,
                "enable_prefix_caching": config.enable_prefix_caching, "engine": "0"}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info), registry=r
              ).labels(*(str(v) for v in info.values())).set(1)  # vLLM's labels: the settings, no model_name

    def observe(self, kind: LatencyKind, seconds: float) -> None:
        self.histograms[kind].observe(seconds)

    async def track(self, outputs: AsyncIterator[RequestOutput], sp: SamplingParams) -> AsyncIterator[RequestOutput]:
        """`outputs`, unchanged, observed on the way: closing this closes (aborts) them, as before."""
        first_token_at = None
        async with aclosing(outputs):
            async for out in outputs:
                if first_token_at is None and any(c.token_ids for c in out.outputs):
                    first_token_at = time.monotonic()
                    self._prefilled(out)
                if out.finished:
                    self._finished(out, sp, first_token_at)
                yield out

    def _prefilled(self, out: RequestOutput) -> None:
        cached = out.num_cached_tokens
        computed = len(out.prompt_token_ids) - cached
        self.prompt_cache_hit.inc(cached)
        self.prompt_cached.inc(cached)
        self.prompt_computed.inc(computed)
        self.prefill_computed.observe(computed)

    def _finished(self, out: RequestOutput, sp: SamplingParams, first_token_at: float | None) -> None:
        num_prompt = len(out.prompt_token_ids)
        lengths = [len(c.token_ids) for c in out.outputs]
        self.prompt_tokens.observe(num_prompt)
        self.generation_tokens.observe(sum(lengths))
        self.max_generation_tokens.observe(max(lengths, default=0))
        self.params_n.observe(sp.n)
        # max_tokens=None runs until the context is full: vLLM records that length.
        self.params_max_tokens.observe(sp.max_tokens if sp.max_tokens is not None else self.max_model_len - num_prompt)
        times = out.metrics  # the engine's: None for beam search's assembled output
        if times is not None and times.first_scheduled_time is not None and times.finished_time is not None:
            self.queue_time.observe(times.time_in_queue)
            self.inference_time.observe(times.finished_time - times.first_scheduled_time)
            if times.first_token_time is not None:
                self.prefill_time.observe(times.first_token_time - times.first_scheduled_time)
        if first_token_at is not None:
            decode = time.monotonic() - first_token_at
            self.decode_time.observe(decode)
            if max(lengths) > 1:  # the first token is the prefill's: decode made the rest
                self.time_per_output_token.observe(decode / (max(lengths) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """The engine's gauges and counters, read from its latest stats at every scrape."""

    def __init__(self, engine: AsyncLLMEngine, labels: tuple[str, str]) -> None:
        self.engine, self.labels = engine, list(labels)
        self.num_spec_tokens = engine.engine.resolved.num_speculative_tokens  # 0: spec decoding off
        self._highest: dict[tuple[str, ...], float] = {}  # (counter, label values...) -> highest total seen

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Number of waiting requests by "
                                      "reason. Sum of all reasons equals vllm:num_requests_waiting.",
                                      labels=[*LABELS, "reason"])
        by_reason.add_metric([*self.labels, "capacity"], s.num_waiting)  # waiting for blocks or a seat
        by_reason.add_metric([*self.labels, "deferred"], 0)  # vLLM's LoRA budget or KV transfer: none here
        yield by_reason
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
        if s.expert_load_total:  # a mixture of experts, once a step has run
            yield self._counter("minivllm:moe_expert_routes", "Routes to each expert, summed over the MoE layers.",
                                {(str(e),): n for e, n in enumerate(s.expert_load_total)}, "expert")

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


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10
