"""Prefix caching for a hybrid model (Qwen3.5): KV blocks plus state snapshots every `stride` prompt
tokens (engine/core/state_cache.py). Same tokens as with caching off and as HF, a shared system prompt
computed once, the snapshot cache under the step's journal and under budget pressure."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import run_with_flaky_sampler

from minivllm import LLM, SamplingParams
from minivllm.engine.request.state_layout import snapshot_bytes
from minivllm.teaching.checkpoints import make_tiny_model
from minivllm.teaching.hf_check import assert_hf_greedy

torch.set_num_threads(1)  # tiny tensors: threads only add overhead on 2 cores
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("qwen3_5_pc"), family="qwen3_5", num_layers=4))


@pytest.fixture(scope="module")
def hf(hybrid_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32).eval()


def hybrid(path: str, **kwargs) -> LLM:
    return LLM(path, warmup=False, dtype="float32", **{"block_size": 16, "num_kv_blocks": 256, **kwargs})


def rand(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def tokens(llm: LLM, prompts: list[list[int]], sp: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_a_shared_system_prompt_is_computed_once(hybrid_dir, hf, capsys):
    """The issue's case: 8 requests of a 480-token system prompt + 4 tokens of their own, after one
    request warmed the cache. Counted (not timed): prompt tokens computed in prefill chunks."""
    system = rand(480, seed=11)
    prompts = [system + rand(4, seed=100 + i) for i in range(8)]
    llm = hybrid(hybrid_dir)
    assert llm.llm_engine.config.enable_prefix_caching  # on by default for hybrids now
    assert "a state snapshot every 64 prompt tokens" in capsys.readouterr().err
    tokens(llm, [system + [1, 2, 3, 4]])  # warms the cache: KV blocks and snapshots of the system prompt
    before = llm.get_stats()
    cached = tokens(llm, prompts)
    after = llm.get_stats()
    computed = after.num_prefill_tokens - before.num_prefill_tokens
    assert computed <= 0.25 * sum(map(len, prompts)), computed  # 8 x 36 = 288 of 3,872 (hits at 448)
    assert computed == 8 * (484 - 448)
    assert after.state_snapshot_hits - before.state_snapshot_hits == 8
    assert after.state_cache_bytes > 0 and after.state_snapshots_cached == 7  # 64, 128, ..., 448
    off = hybrid(hybrid_dir, enable_prefix_caching=False)
    assert tokens(off, prompts) == cached
    for p, out in zip(prompts, cached):
        assert_hf_greedy(hf, p, out)


def test_hits_need_a_snapshot_and_chunked_prefill_keeps_them(hybrid_dir):
    """Prompts sharing prefixes of several lengths, prefilled in chunks that do not line up with the
    stride: a hit resumes at the last stride position both caches hold; tokens equal caching off."""
    base = rand(300, seed=3)
    prompts = [base[:n] + [7, 8, 9] for n in (200, 130, 64, 63, 300, 200)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    on = hybrid(hybrid_dir, max_num_batched_tokens=50, max_num_seqs=2)
    got = [tokens(on, [p], sp)[0] for p in prompts]  # one at a time: each can hit the ones before
    assert got == tokens(hybrid(hybrid_dir, enable_prefix_caching=False), prompts, sp)
    stats = on.get_stats()
    # 130 hits at 128, 64 at none (a hit leaves one token: 64 + 3 tokens hit at 64), 300 at 192, 200 at 192
    assert stats.state_snapshot_hits == 4
    on.llm_engine.state_pool.cache.check_invariants()


def test_a_failed_step_leaves_the_state_cache_unchanged(hybrid_dir):
    shared = rand(150, seed=5)
    prompts = [shared, shared[:140] + [9, 9]] + [rand(150 - 10 * i, seed=60 + i) for i in range(4)]
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    clean = hybrid(hybrid_dir, max_num_batched_tokens=40).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm = hybrid(hybrid_dir, max_num_batched_tokens=40)
    engine = llm.llm_engine
    cache, tensors = engine.state_pool.cache, engine.model_runner.state_tensors
    pools = tensors.snapshot_recurrent_pools + tensors.snapshot_conv_pools

    def state():  # the books, and what every entry's slot holds (a failed step may write free slots only)
        return ({k: (slot, cache.last_used[k]) for k, slot in cache.entries.items()}, sorted(cache.free + cache.reserved),
                cache.clock, cache.num_hits, {k: [p[slot].clone() for p in pools] for k, slot in cache.entries.items()})

    def unchanged(before):
        entries, free, clock, hits, held = before
        assert ({k: (slot, cache.last_used[k]) for k, slot in cache.entries.items()}, sorted(cache.free + cache.reserved),
                cache.clock, cache.num_hits) == (entries, free, clock, hits)
        assert all(torch.equal(a, p[cache.entries[k]]) for k, saved in held.items() for a, p in zip(saved, pools))

    requests = {f"r{i}": (p, sp) for i, p in enumerate(prompts)}
    finals, failures = run_with_flaky_sampler(engine, requests, every=3, phase=2, before_step=state,
                                              on_failure=unchanged)
    assert failures > 0 and len(cache.entries) > 0
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == \
        [o.outputs[0].token_ids for o in clean]


def test_eviction_under_budget_pressure(hybrid_dir):
    """A budget of 5 snapshots: the least recently used ones go; hits remain exact, ownership of the
    snapshot slots is conserved."""
    llm0 = hybrid(hybrid_dir)
    budget = 5 * snapshot_bytes(llm0.llm_engine.spec, torch.float32)
    # a 64-token budget: one stride position a step, which the one snapshot a step keeps
    llm = hybrid(hybrid_dir, state_cache_bytes=budget, state_cache_stride=64, max_num_batched_tokens=64)
    cache = llm.llm_engine.state_pool.cache
    assert (cache.cfg.num_snapshots, cache.cfg.max_per_step) == (5, 1)  # 4 entries kept, a step's 1 slot free
    prompts = [rand(140, seed=90 + i) for i in range(4)]
    first = [tokens(llm, [p])[0] for p in prompts]  # 8 snapshots for 4 entries: evictions
    cache.check_invariants()
    assert cache.num_evictions >= 4 and len(cache.entries) == 4
    again = [tokens(llm, [p + [5]])[0] for p in reversed(prompts)]  # the newest still hit
    cache.check_invariants()
    off = hybrid(hybrid_dir, enable_prefix_caching=False)
    assert first == tokens(off, prompts)
    assert again == tokens(off, [p + [5] for p in reversed(prompts)])
    assert cache.num_hits >= 2


def test_state_cache_options_are_checked(hybrid_dir):
    with pytest.raises(ValueError, match="multiple of block_size"):
        hybrid(hybrid_dir, state_cache_stride=24)
    with pytest.raises(ValueError, match="state_cache_bytes"):
        hybrid(hybrid_dir, state_cache_bytes=1000)
    assert hybrid(hybrid_dir, enable_prefix_caching=False).llm_engine.state_pool.cache is None
