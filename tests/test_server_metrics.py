"""GET /metrics: vLLM's metric names, labels and meanings (so a vLLM dashboard works), counters that
equal the engine's commit-time totals and never go down, and the speculative-decoding counters."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from server_helpers import metric, scrape, serving

from minivllm import LLMEngine
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.metrics.stats import EngineStats
from minivllm.entrypoints.openai.metrics import EngineCollector
from minivllm.entrypoints.openai.server import build_app

MODEL = "tiny"


def serve(model_dir: str, **config):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, max_model_len=256, **config)))
    return engine, serving(build_app(engine, MODEL))


def two_prompts_and_a_chat(client) -> list:
    """Two completion requests of 5 tokens, then one chat request with two completions of 3."""
    no_eos = {"ignore_eos": True}
    return [client.completions.create(model=MODEL, prompt=["Hello there", "Paged attention"], max_tokens=5,
                                      extra_body=no_eos),
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           n=2, extra_body=no_eos)]


def test_vllm_names_labels_and_meanings(qwen3_dir):
    engine, server = serve(qwen3_dir)
    with server as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answers = two_prompts_and_a_chat(client) + [
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=5,  # stops at its first token
                                      extra_body={"allowed_token_ids": [65], "stop_token_ids": [65]})]
        prompt = "A scheduler decides which requests run in each step of the engine. " * 2
        answers += [client.completions.create(model=MODEL, prompt=prompt, max_tokens=1) for _ in range(2)]
        m, s = scrape(url), engine.stats
    engine.shutdown()
    labels = {"model_name": MODEL, "engine": "0"}
    assert metric(m, "vllm:prompt_tokens_total", **labels) == s.num_prompt_tokens_total \
        == sum(a.usage.prompt_tokens for a in answers)
    assert metric(m, "vllm:generation_tokens_total", **labels) == s.num_generation_tokens_total \
        == sum(a.usage.completion_tokens for a in answers)
    assert metric(m, "vllm:prefix_cache_queries_total", **labels) == s.prefix_cache_queries
    assert metric(m, "vllm:prefix_cache_hits_total", **labels) == s.prefix_cache_hits >= 16  # the repeated prompt
    assert metric(m, "vllm:num_preemptions_total", **labels) == 0
    finished = {reason: metric(m, "vllm:request_success_total", finished_reason=reason, **labels)
                for reason in ("stop", "length", "abort", "error")}
    assert finished == {"stop": 1, "length": 5, "abort": 0, "error": 0}  # requests (n=2 is one request)
    assert metric(m, "vllm:e2e_request_latency_seconds_count", **labels) == 6
    assert metric(m, "vllm:time_to_first_token_seconds_count", **labels) == 6
    assert metric(m, "vllm:inter_token_latency_seconds_count", **labels) >= 2 * 4 + 2
    assert metric(m, "vllm:num_requests_running", **labels) == metric(m, "vllm:num_requests_waiting", **labels) == 0
    assert metric(m, "vllm:kv_cache_usage_perc", **labels) == 1 - s.num_free_blocks / s.num_total_blocks
    assert not any("spec_decode" in series for series in m)  # only with speculative decoding on


def test_per_request_histograms_prompt_sources_and_cache_info(qwen3_dir):
    """vLLM's per-request metrics, each equal to what the answers' usage says."""
    engine, server = serve(qwen3_dir)
    with server as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answers = two_prompts_and_a_chat(client)
        prompt = "A scheduler decides which requests run in each step of the engine. " * 2
        answers += [client.completions.create(model=MODEL, prompt=prompt, max_tokens=1) for _ in range(2)]
        m = scrape(url)
    engine.shutdown()
    labels = {"model_name": MODEL, "engine": "0"}
    prompt_tokens = sum(a.usage.prompt_tokens for a in answers)
    cached = sum(a.usage.prompt_tokens_details.cached_tokens for a in answers if a.usage.prompt_tokens_details)
    assert cached >= 16  # the repeated prompt
    assert metric(m, "vllm:request_prompt_tokens_count", **labels) == 5  # requests
    assert metric(m, "vllm:request_prompt_tokens_sum", **labels) == prompt_tokens
    assert metric(m, "vllm:request_generation_tokens_sum", **labels) == sum(a.usage.completion_tokens for a in answers)
    assert metric(m, "vllm:request_max_num_generation_tokens_sum", **labels) == 5 + 5 + 3 + 1 + 1
    assert metric(m, "vllm:request_params_n_sum", **labels) == 1 + 1 + 2 + 1 + 1
    assert metric(m, "vllm:request_params_max_tokens_sum", **labels) == 5 + 5 + 3 + 1 + 1
    assert metric(m, "vllm:request_decode_time_seconds_count", **labels) == 5
    assert metric(m, "vllm:request_time_per_output_token_seconds_count", **labels) == 3  # those with > 1 token
    assert metric(m, "vllm:prompt_tokens_cached_total", **labels) == cached
    assert metric(m, "vllm:prompt_tokens_by_source_total", source="local_cache_hit", **labels) == cached
    assert metric(m, "vllm:prompt_tokens_by_source_total", source="local_compute", **labels) == prompt_tokens - cached
    assert metric(m, "vllm:request_prefill_kv_computed_tokens_sum", **labels) == prompt_tokens - cached
    assert prompt_tokens == metric(m, "vllm:prompt_tokens_total", **labels)  # the engine's count agrees
    for reason in ("capacity", "deferred"):
        assert metric(m, "vllm:num_requests_waiting_by_reason", reason=reason, **labels) == 0
    assert metric(m, "vllm:cache_config_info", block_size="16", num_gpu_blocks="64", enable_prefix_caching="True",
                  engine="0") == 1


def test_counters_never_go_down(qwen3_dir):
    """A failed step is rolled back with its counts; a Prometheus counter must not follow it down."""
    stats = EngineStats(0, 0, 0, 0, 0, prefix_cache_queries=40, prefix_cache_hits=16, num_free_blocks=8,
                        num_total_blocks=8, num_running=0, num_waiting=0, step_time_s=0, forward_time_s=0,
                        num_prompt_tokens_total=40, finished_requests={"stop": 2})
    engine = SimpleNamespace(stats=stats, engine=SimpleNamespace(resolved=SimpleNamespace(num_speculative_tokens=0)))
    collector = EngineCollector(engine, ("m", "0"))

    def counters() -> dict[str, float]:
        return {f"{family.name}{sample.labels.get('finished_reason', '')}": sample.value
                for family in collector.collect() if family.type == "counter" for sample in family.samples}

    assert counters()["vllm:prefix_cache_queries"] == 40 and counters()["vllm:request_successstop"] == 2
    engine.stats = dataclasses.replace(stats, prefix_cache_queries=24, num_prompt_tokens_total=30)  # rolled back
    assert counters()["vllm:prefix_cache_queries"] == 40 and counters()["vllm:prompt_tokens"] == 40
    engine.stats = dataclasses.replace(stats, prefix_cache_queries=56, finished_requests={"stop": 3})  # redone, more
    assert counters()["vllm:prefix_cache_queries"] == 56 and counters()["vllm:request_successstop"] == 3


@pytest.fixture(scope="module")
def spec_decode_server(qwen3_dir):
    # The model as its own draft: (nearly) every draft token is accepted.
    engine, server = serve(qwen3_dir, speculative_config={"model": qwen3_dir, "num_speculative_tokens": 3})
    with server as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        client.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9, 10], max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
        yield engine, scrape(url)
    engine.shutdown()


def test_spec_decode_counters(spec_decode_server):
    engine, m = spec_decode_server
    s = engine.stats
    assert metric(m, "vllm:spec_decode_num_draft_tokens_total") == s.num_draft_tokens > 0
    assert metric(m, "vllm:spec_decode_num_accepted_tokens_total") == s.num_accepted_tokens > 0
    per_position = [metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos))
                    for pos in range(3)]
    assert per_position == sorted(per_position, reverse=True)  # accepting position j needs all before it
    assert metric(m, "vllm:spec_decode_num_drafts_total", model_name=MODEL) >= 0


def test_spec_decode_drafts_and_acceptance_per_position(spec_decode_server):
    engine, m = spec_decode_server
    s = engine.stats
    drafts = metric(m, "vllm:spec_decode_num_drafts_total")
    per_position = [metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos))
                    for pos in range(3)]
    assert drafts == s.num_drafts > 0 and sum(per_position) == s.num_accepted_tokens


def test_metrics_need_no_api_key(qwen3_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=16, max_model_len=64)))
    with serving(build_app(engine, MODEL, api_key="k")) as url:
        assert "vllm:num_requests_running" in httpx.get(f"{url}/metrics").text
    engine.shutdown()


def test_request_times_iteration_tokens_and_success_per_reason(qwen3_dir):
    """vLLM's count test, with the official client: 10 requests of 10 tokens (and one stopped at its first), each
    observed once in the engine-time histograms, each step once in iteration_tokens, each finish counted under its
    reason by the time its answer is back."""
    engine, server = serve(qwen3_dir)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    with server as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        steps = engine.stats.num_steps
        for i in range(10):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, extra_body={"ignore_eos": True})
            m = scrape(url)  # right after the answer: already counted
            assert metric(m, "vllm:request_success_total", finished_reason="length") == i + 1
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5,
                                  extra_body={"allowed_token_ids": [65], "stop_token_ids": [65]})
        m, s = scrape(url), engine.stats
    engine.shutdown()
    assert {r: metric(m, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")
            } == {"stop": 1, "length": 10, "abort": 0, "error": 0}
    e2e_le = ["0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0", "40.0", "50.0",
              "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf"]
    for name in ("queue_time", "prefill_time", "inference_time"):
        full = f"vllm:request_{name}_seconds"
        assert metric(m, f"{full}_count") == 11 and metric(m, f"{full}_sum") >= 0
        assert [series.split('le="')[1].split('"')[0] for series in m if series.startswith(f"{full}_bucket")] == e2e_le
    assert metric(m, "vllm:request_inference_time_seconds_sum") >= metric(m, "vllm:request_prefill_time_seconds_sum")
    # one observation per step (10 per request of 10 tokens, run one at a time; 1 for the stopped one), of the
    # tokens it committed: vLLM's sum, prompt + max_tokens per request
    assert metric(m, "vllm:iteration_tokens_total_count") == s.num_steps - steps == 10 * 10 + 1
    hi_prompt = s.num_prompt_tokens_total - 10 * len(prompt)
    assert metric(m, "vllm:iteration_tokens_total_sum") == s.committed_tokens == 10 * (len(prompt) + 10) + hi_prompt + 1
    assert [series.split('le="')[1].split('"')[0] for series in m if series.startswith("vllm:iteration_tokens_total_b")
            ] == ["1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0", "4096.0",
                  "8192.0", "16384.0", "+Inf"]


def test_a_request_its_client_left_counts_as_abort(qwen3_dir):
    engine, server = serve(qwen3_dir)
    with server as url:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
            next(r.iter_lines())  # one event, then the client goes
        deadline = time.time() + 30
        while engine.engine.has_unfinished_requests() and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)  # the worker publishes its stats after applying the abort
        m = scrape(url)
    engine.shutdown()
    assert metric(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(m, "vllm:request_success_total", finished_reason="length") == 0
