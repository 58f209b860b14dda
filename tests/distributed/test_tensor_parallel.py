"""Tensor parallelism end to end on CPU: 2 ranks (gloo) against 1, token for token, on every model
family, with replicated KV heads, and under every feature of the step. Each TP=2 engine spawns a
worker (seconds), so each test builds one engine and asks it everything."""

from __future__ import annotations

import pytest
from tp_helpers import child_pids, shard_summary

from minivllm import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 80, 120, 7], list(range(40, 61)), [3], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=s, max_tokens=16, ignore_eos=True)
          for s in range(len(PROMPTS))]
ENGINE = dict(block_size=4, num_kv_blocks=64)


def generate(llm: LLM, params, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
@pytest.mark.parametrize("variant", ["qwen3", "llama", "qwen2", "kv1"])
def test_two_ranks_generate_what_one_does(variant, model_factory, kv1_dir, one_thread_per_rank):
    """Greedy and seeded samples identical to TP=1; each rank holds its slices and its KV heads only;
    leaving the `with` block ends the worker."""
    path = kv1_dir if variant == "kv1" else model_factory(variant)
    one = LLM(path, warmup=False, **ENGINE)
    greedy, seeded = generate(one, GREEDY), generate(one, SEEDED)
    shapes_one = one.collective_rpc(shard_summary)
    one.shutdown()

    before = child_pids()
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:  # warm-up on: one step through both ranks
        workers = {p.pid for p in llm.llm_engine.executor.worker_processes}
        assert len(workers) == 1 and workers <= child_pids() - before
        assert generate(llm, GREEDY) == greedy
        assert generate(llm, SEEDED) == seeded
        shards = llm.collective_rpc(shard_summary)
    assert not child_pids() - before, "a worker outlived the engine"

    (full,) = shapes_one
    L, two, blocks, bs, kv_heads, D = full["kv_cache"]
    for rank, shard in enumerate(shards):
        assert shard["rank"] == rank
        assert shard["kv_cache"] == (L, two, blocks, bs, max(1, kv_heads // 2), D)  # same pool size, its heads
        q_rows = full["o_proj"][1] // 2
        assert shard["qkv"] == (q_rows + 2 * max(1, kv_heads // 2) * D, full["qkv"][1])
        assert shard["o_proj"] == (full["o_proj"][0], q_rows)
        assert shard["gate_up"] == (full["gate_up"][0] // 2, full["gate_up"][1])
        assert shard["embed"] == (full["embed"][0] // 2, full["embed"][1])
        assert shard["lm_head"] == (full["lm_head"][0] // 2, full["lm_head"][1])


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
def test_every_feature_of_the_step_works_on_two_ranks(model_factory, one_thread_per_rank):
    """Chunked prefill, prefix caching, preemption, logprobs and prompt logprobs, n > 1, and a draft
    model (unsharded, on rank 0) for speculative decoding: all rank-0 logic, the same with 2 ranks."""
    shared = list(range(200, 216))  # a 16-token prefix (4 blocks) shared by three prompts
    prompts = [shared + [7, 8], shared + [9], shared + list(range(60, 90)), list(range(10, 45)), [3, 4]]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=20, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.7, top_k=40, seed=9, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=12, ignore_eos=True)]
    config = dict(block_size=4, num_kv_blocks=30, max_num_batched_tokens=16, max_num_seqs=8, warmup=False,
                  speculative_config={"model": model_factory("llama"), "num_speculative_tokens": 2})
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def run(tp: int):
        with LLM(model_factory("qwen3"), tensor_parallel_size=tp, **config) as llm:
            outs = llm.generate(inputs, params, use_tqdm=False)
            outs += llm.generate(inputs[:2], params[:2], use_tqdm=False)  # again: prefix-cache hits
            return outs, llm.get_stats()

    (one, stats_one), (two, stats_two) = run(1), run(2)
    for a, b in zip(one, two):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            if ca.logprobs is not None:
                for ea, eb in zip(ca.logprobs, cb.logprobs):
                    assert ea.keys() == eb.keys()
                    assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea)
        if a.prompt_logprobs is not None:
            assert [e and set(e) for e in a.prompt_logprobs] == [e and set(e) for e in b.prompt_logprobs]
    assert stats_two.num_preemptions > 0 and stats_two.prefix_cache_hits > 0 and stats_two.num_draft_tokens > 0
    assert stats_two.num_mixed_steps > 0  # chunks of prefill beside decodes
    for field in ("num_steps", "num_preemptions", "prefix_cache_hits", "num_draft_tokens", "num_accepted_tokens"):
        assert getattr(stats_one, field) == getattr(stats_two, field), field


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
def test_a_request_that_fails_on_rank_0_fails_alone(model_factory, one_thread_per_rank):
    """A failure outside the ranks' lockstep (here, rank 0's logits processing) is an ordinary one: the
    step is bisected, each trial run going through both ranks, and only the culprit fails."""
    good = [SamplingParams(temperature=0.9 if i % 2 else 0, seed=i, max_tokens=8, ignore_eos=True) for i in range(4)]
    bad = SamplingParams(min_tokens=1, max_tokens=8, stop_token_ids=[2])
    with LLM(model_factory("qwen3"), tensor_parallel_size=2, **ENGINE) as llm:
        clean = generate(llm, good, PROMPTS)
        engine, finals = llm.llm_engine, {}
        for i, (p, sp) in enumerate(zip(PROMPTS + [[5, 6, 7]], good + [bad])):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        object.__setattr__(bad, "_stop_token_ids", (1_000_000,))  # what a validation bug would let through
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        assert generate(llm, good, PROMPTS) == clean  # the engine and its worker are still in step
    culprit = finals.pop(f"r{len(PROMPTS)}")
    assert culprit.outputs[0].finish_reason == "error" and "IndexError" in culprit.error
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == clean
