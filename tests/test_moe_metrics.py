"""The expert load of a mixture-of-experts model (engine/worker/expert_load.py): per step and in total in
`EngineStats`, on `/metrics` as `minivllm:moe_expert_routes_total{expert}`, equal to the routes HF's own router
picks for the same rows, and under tensor parallelism (gloo, 2 ranks) to one rank's; nothing of it for a dense
model."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
import torch
from moe_helpers import hf_moe_model, tiny_moe_checkpoint
from server_helpers import metric, scrape, serving

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.metrics.stats import EngineCounters
from minivllm.engine.worker.expert_load import ExpertLoad
from minivllm.entrypoints.openai.server import build_app

MODEL = "tiny-moe"
K, LAYERS, EXPERTS = 2, 2, 8  # tiny_moe_checkpoint's defaults: experts per token, sparse layers, experts


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(tiny_moe_checkpoint(tmp_path_factory.mktemp("moe_metrics")))


def hf_routes(path: str, rows: list[int]) -> list[int]:
    """Routes per expert of HF's routers over `rows` (one sequence), summed over the layers."""
    with torch.no_grad():
        logits = hf_moe_model(path)(torch.tensor([rows]), output_router_logits=True).router_logits  # (T, E) each
    ids = torch.cat([torch.topk(layer.float().softmax(-1), K, dim=-1).indices.flatten() for layer in logits])
    return torch.bincount(ids, minlength=EXPERTS).tolist()


def test_the_load_is_the_routes_hf_picks_for_the_rows_computed(moe_dir):
    """One request, no draft, no cache hit: the engine computes the prompt and every output token but the last,
    and the routes it counts are those HF's routers choose for those rows, expert by expert."""
    llm = LLM(moe_dir, warmup=False, dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    prompt = [5, 9, 30, 31, 7, 8, 200, 17, 17, 4, 90]  # 11 tokens: chunks of 8 and 3
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    s = llm.get_stats()
    rows = prompt + out[:-1]
    assert s.num_prefill_tokens + s.num_decode_tokens == len(rows)
    assert list(s.expert_load_total) == hf_routes(moe_dir, rows)
    assert sum(s.expert_load_total) == len(rows) * K * LAYERS
    assert len(s.expert_load) == EXPERTS and sum(s.expert_load) == 1 * K * LAYERS  # the last step: one decode row
    assert s.as_dict()["expert_load_total"] == s.expert_load_total


def test_every_row_computed_counts_drafts_and_recomputes_too(moe_dir):
    """Speculative decoding and a pool that preempts: the load counts the forward's rows, not the tokens kept."""
    llm = LLM(moe_dir, warmup=False, dtype="float32", block_size=2, num_kv_blocks=12, max_num_seqs=3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    prompts = [[7, 8, 9, 10, 7, 8, 9], list(range(20, 31)), [5, 6, 5, 6, 5]]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    s = llm.get_stats()
    assert s.num_draft_tokens > 0 and s.num_preemptions > 0  # both paths were crossed
    assert sum(s.expert_load_total) == (s.num_prefill_tokens + s.num_decode_tokens) * K * LAYERS


def test_a_dense_model_reports_no_expert_load(qwen3_dir):
    llm = LLM(qwen3_dir, warmup=False, block_size=4, num_kv_blocks=32)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)
    s = llm.get_stats()
    assert s.num_steps > 0 and s.expert_load == s.expert_load_total == ()
    assert ExpertLoad(llm.llm_engine.model).layers == [] and llm.llm_engine.model_runner.expert_load.read() == ()


def test_the_load_sums_layers_and_the_total_sums_steps():
    def layer(*load):
        return SimpleNamespace(last_load=torch.tensor(load))

    model = SimpleNamespace(expert_layers=lambda: [layer(3, 0, 1, 2), layer(2, 1, 3, 0)])
    assert ExpertLoad(model).read() == (5, 1, 4, 2)  # the module docstring's example
    assert ExpertLoad(SimpleNamespace(expert_layers=lambda: [])).read() == ()
    c = EngineCounters()
    c.count_step(3, 0, 0.0, 0.0, (5, 1, 4, 2))
    c.count_step(0, 1, 0.0, 0.0, ())  # a dense step (never for one model; the total is untouched)
    c.count_step(0, 1, 0.0, 0.0, (0, 2, 0, 2))
    assert (c.expert_load, c.expert_load_total) == ((0, 2, 0, 2), (5, 3, 4, 4))


def test_metrics_export_the_total_per_expert(moe_dir, qwen3_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=moe_dir, dtype="float32", num_kv_blocks=64,
                                                   max_model_len=256)))  # warmed up: the CPU's MoE method
    with serving(build_app(engine, MODEL)) as url:
        assert not any(series.startswith("minivllm:moe") for series in scrape(url))  # no step yet
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        client.completions.create(model=MODEL, prompt=["Hello there", "Experts"], max_tokens=5,
                                  extra_body={"ignore_eos": True})
        m, s = scrape(url), engine.stats
    engine.shutdown()
    labels = {"model_name": MODEL, "engine": "0"}
    routes = [metric(m, "minivllm:moe_expert_routes_total", expert=str(e), **labels) for e in range(EXPERTS)]
    assert routes == list(s.expert_load_total)
    assert sum(routes) == (s.num_prefill_tokens + s.num_decode_tokens) * K * LAYERS
    assert sum(1 for series in m if series.startswith("minivllm:moe_expert_routes_total")) == EXPERTS

    dense = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=16, max_model_len=64)))
    with serving(build_app(dense, MODEL)) as url:
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).completions.create(
            model=MODEL, prompt="Hi", max_tokens=2)
        assert not any(series.startswith("minivllm:moe") for series in scrape(url))
    dense.shutdown()


def test_under_tensor_parallelism_rank_0_reports_the_models_load(moe_dir):
    """Every rank routes every token alike (the router is replicated): rank 0's counts are the one-rank run's."""
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 33, 80, 120, 7], list(range(40, 61)), [3])]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers take rank 0's thread count: two ranks on two cores
    try:
        one = LLM(moe_dir, warmup=False, dtype="float32", block_size=4, num_kv_blocks=64)
        one.generate(prompts, sp, use_tqdm=False)
        expected = one.get_stats()
        one.shutdown()
        with LLM(moe_dir, warmup=False, dtype="float32", block_size=4, num_kv_blocks=64, tensor_parallel_size=2) as llm:
            llm.generate(prompts, sp, use_tqdm=False)
            s = llm.get_stats()
    finally:
        torch.set_num_threads(threads)
    assert s.expert_load_total == expected.expert_load_total and sum(s.expert_load_total) > 0
    assert s.num_steps == expected.num_steps and s.expert_load == expected.expert_load
