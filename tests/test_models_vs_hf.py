"""Every greedy token minivllm produces is an HF transformers argmax (teacher-forced, fp32)."""

from __future__ import annotations

import pytest
from helpers import varied_prompts

from minivllm import LLM, SamplingParams
from minivllm.teaching.hf_check import assert_hf_greedy

FAMILIES = ["qwen3", "qwen2", "llama", "llama_mha_tied_llama3", "llama_biased", "qwen3_biased", "mistral"]


def check_all(llm: LLM, hf, prompts, outputs) -> None:
    for p, out in zip(prompts, outputs):
        assert out.prompt_token_ids == p
        assert_hf_greedy(hf, p, out.outputs[0].token_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_matches_hf(family, model_factory, hf_factory):
    """Varied lengths in one batch with a small token budget: chunked prefill and mixed steps."""
    llm = LLM(model_factory(family), block_size=4, num_kv_blocks=128, max_num_batched_tokens=32)
    prompts = varied_prompts(9, llm.llm_engine.spec.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    check_all(llm, hf_factory(family), prompts, outs)
    stats = llm.get_stats()
    assert stats.num_prefill_tokens >= sum(map(len, prompts))
    assert stats.num_mixed_steps > 0  # prefill chunks and decodes shared steps
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.llm_engine.block_manager.check_invariants([])
    llm.shutdown()


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_prefix_cache_hits_match_hf(family, model_factory, hf_factory):
    llm = LLM(model_factory(family), block_size=4, num_kv_blocks=128)
    shared = varied_prompts(9, llm.llm_engine.spec.vocab_size, seed=1)[-1][:30]
    prompts = [shared + [5 + i] * (i + 1) for i in range(4)]
    first = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert all(o.num_cached_tokens == 28 for o in outs)  # 7 full blocks of the shared 30 tokens
    assert outs[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    check_all(llm, hf_factory(family), prompts, outs)
    stats = llm.get_stats()
    assert stats.prefix_cache_hits >= 4 * 28 and stats.prefix_cache_hit_rate > 0.5
    # A prompt entirely cached still computes its last token (there must be logits to sample).
    again = llm.generate([{"prompt_token_ids": prompts[0][:28]}], greedy(3), use_tqdm=False)[0]
    assert again.num_cached_tokens == 24
    check_all(llm, hf_factory(family), [prompts[0][:28]], [again])


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_preemption_matches_hf(family, model_factory, hf_factory):
    """A pool too small for the batch forces recompute preemption; outputs are unchanged."""
    prompts = varied_prompts(8, 384, seed=2)
    sp = greedy(20)
    roomy = LLM(model_factory(family), block_size=4, num_kv_blocks=256)
    expected = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                               use_tqdm=False)]
    tight = LLM(model_factory(family), block_size=4, num_kv_blocks=24)
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    stats = tight.get_stats()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    check_all(tight, hf_factory(family), prompts, outs)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_no_chunked_prefill_and_no_prefix_cache_match_hf(model_factory, hf_factory):
    llm = LLM(model_factory("qwen3"), block_size=16, num_kv_blocks=64, enable_chunked_prefill=False,
              enable_prefix_caching=False, max_num_batched_tokens=128)
    prompts = varied_prompts(9, 384, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)
    check_all(llm, hf_factory("qwen3"), prompts, outs)
    assert llm.get_stats().prefix_cache_queries == 0


def test_sampled_outputs_independent_of_scheduling(model_factory):
    """Seeded sampling gives the same tokens with or without chunking, caching and preemption."""
    prompts = varied_prompts(8, 384, seed=4)
    sps = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=15, ignore_eos=True)
           for i in range(len(prompts))]
    results = []
    for kwargs in (dict(num_kv_blocks=256), dict(num_kv_blocks=24, max_num_batched_tokens=16),
                   dict(num_kv_blocks=256, enable_prefix_caching=False, enable_chunked_prefill=False,
                        max_num_batched_tokens=256)):
        llm = LLM(model_factory("qwen3"), block_size=4, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1] == results[2]
