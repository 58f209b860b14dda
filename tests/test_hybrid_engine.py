"""A hybrid model (Qwen3.5: gated-DeltaNet + full attention) in the engine: exact against HF, with the
linear-attention state in a per-request pool that belongs to the step's transaction."""

from __future__ import annotations

import pytest
import torch
from helpers import run_with_flaky_sampler, varied_prompts

from minivllm import LLM, SamplingParams
from minivllm.teaching.checkpoints import make_tiny_model
from minivllm.teaching.hf_check import assert_hf_greedy

torch.set_num_threads(1)  # tiny tensors: threads only add overhead on 2 cores


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("qwen3_5"), family="qwen3_5", num_layers=4))


@pytest.fixture(scope="module")
def hf(hybrid_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32).eval()


def hybrid(path: str, **kwargs) -> LLM:
    return LLM(path, warmup=False, dtype="float32", **{"block_size": 4, "num_kv_blocks": 64, **kwargs})


def test_greedy_matches_hf_with_chunks_mixed_batches_and_preemption(hybrid_dir, hf):
    prompts = varied_prompts(9, 384, seed=7)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # small budget: chunked prefill carries the state across chunks, prefills mix with decodes;
    # a small pool preempts, and a preempted request's state is recomputed from scratch.
    llm = hybrid(hybrid_dir, max_num_batched_tokens=12, num_kv_blocks=30)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert_hf_greedy(hf, p, o.outputs[0].token_ids)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.num_mixed_steps > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    pool = llm.llm_engine.state_pool
    assert pool.num_free == pool.num_pairs  # every slot released


def test_prefix_caching_is_on_and_speculation_accepted(hybrid_dir, capsys):
    llm = hybrid(hybrid_dir)
    assert llm.llm_engine.config.enable_prefix_caching  # with state snapshots (tests/test_hybrid_prefix_cache.py)
    assert "a state snapshot every" in capsys.readouterr().err
    spec = hybrid(hybrid_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    pool = spec.llm_engine.state_pool  # a candidate slot per draft (tests/test_hybrid_spec_decode.py)
    tensors = spec.llm_engine.model_runner.state_tensors  # the runner's; the scheduler's books hold integers
    assert pool.num_speculative_tokens == 2 and len(tensors.recurrent_pools[0]) == 4 * pool.num_pairs


def test_a_failed_step_leaves_every_published_state_as_it_was(hybrid_dir):
    prompts = varied_prompts(6, 384, seed=2)
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    clean = hybrid(hybrid_dir, max_num_batched_tokens=12).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm = hybrid(hybrid_dir, max_num_batched_tokens=12)
    engine = llm.llm_engine
    pool, tensors = engine.state_pool, engine.model_runner.state_tensors
    def slots(s):  # a sequence's published states, every linear-attention layer
        return [p[pool.read_slot(s)] for p in tensors.recurrent_pools + tensors.conv_pools]

    def published():
        return {s.request_id: [t.clone() for t in slots(s)]
                for s in (st.seqs[0] for st in engine.requests.values()) if s.state_slots}

    def unchanged(before):
        for s in (st.seqs[0] for st in engine.requests.values()):
            if s.request_id in before:
                assert all(torch.equal(a, b) for a, b in zip(slots(s), before[s.request_id]))

    requests = {f"r{i}": (p, sp) for i, p in enumerate(prompts)}
    finals, failures = run_with_flaky_sampler(engine, requests, every=4, phase=2, before_step=published,
                                              on_failure=unchanged)
    assert failures > 0
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == \
        [o.outputs[0].token_ids for o in clean]


def test_sequence_i_of_n_decodes_like_a_request_seeded_seed_plus_i(hybrid_dir):
    prompt = {"prompt_token_ids": list(range(40, 53))}
    llm = hybrid(hybrid_dir)
    many = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    for i, c in enumerate(many.outputs):
        alone = llm.generate(prompt, SamplingParams(temperature=1.0, seed=9 + i, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert c.token_ids == alone.token_ids
    assert llm.llm_engine.state_pool.num_free == llm.llm_engine.state_pool.num_pairs


def test_admission_waits_for_a_free_state_slot(hybrid_dir):
    llm = hybrid(hybrid_dir, max_num_seqs=2)
    sp = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7 + i]} for i in range(3)], sp, use_tqdm=False)
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 4 for c in o.outputs) for o in outs)
    pool = llm.llm_engine.state_pool
    assert pool.num_pairs == 2 and pool.num_free == 2


def test_n_sequences_under_a_small_pool_each_decode_what_a_lone_request_does(hybrid_dir):
    """n = 3 on a hybrid model is three sequences, each with its own state pair: a sibling that hits the
    first one's KV blocks still needs a state for them, so it starts from a snapshot or computes its prompt
    (its recurrent state is never a copy). Under a pool that preempts, each decodes what a lone request does."""
    a = {"prompt_token_ids": list(range(40, 53))}  # 13 tokens: a partial last block
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = hybrid(hybrid_dir).generate(a, greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm = hybrid(hybrid_dir, num_kv_blocks=10)
    outs = llm.generate([a, {"prompt_token_ids": list(range(60, 84))}],
                        [SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True),
                         SamplingParams(max_tokens=1)], use_tqdm=False)
    assert [c.token_ids for c in outs[0].outputs] == [alone] * 3
    stats, pool = llm.get_stats(), llm.llm_engine.state_pool
    assert stats.num_free_blocks == stats.num_total_blocks and pool.num_free == pool.num_pairs


def test_n_above_max_num_seqs_is_refused_before_it_can_block_the_queue(hybrid_dir):
    """n sequences need n state pairs at once; the pool has max_num_seqs. Such a request could never be
    admitted: it is refused at once, and the requests behind it run."""
    llm = hybrid(hybrid_dir, max_num_seqs=2, max_admission_skips=1)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] + [{"prompt_token_ids": [8 + i, 9]} for i in range(3)],
                        [SamplingParams(n=3, max_tokens=2)] + [SamplingParams(max_tokens=3)] * 3, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "n=3" in outs[0].error and "max_num_seqs=2" in outs[0].error
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs[1:])
    pool = llm.llm_engine.state_pool
    assert pool.num_free == pool.num_pairs
