"""A mixture of experts through every path of the engine (issue 45, item 4), on tiny random Qwen3-MoE and
Qwen2-MoE checkpoints (tests/moe_helpers.py): greedy tokens equal a lone run's, and each lone run is HF's
argmax token by token (teacher-forced), under chunked prefill beside other requests, prefix-cache hits,
preemption, n > 1, speculative decoding (n-gram, and a dense Qwen3 draft of the same vocabulary), structured
outputs (a JSON schema: each token HF's argmax among those the grammar allows), and batch invariance (a
prompt's tokens and logprob bits alone and inside any batch: layers/batch_invariance.py `TiledMoeMethod`)."""

from __future__ import annotations

import json
import random
from typing import NamedTuple

import jsonschema
import pytest
import torch
from moe_helpers import hf_moe_model, tiny_moe_checkpoint

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.layers.logits_processors import unpack_bitmask
from minivllm.teaching.hf_check import assert_hf_greedy

torch.set_num_threads(1)  # tiny tensors: threads only add overhead on 2 cores
SHARED = list(range(20, 41))  # 21 tokens: five blocks of 4 a later request finds cached
PROMPTS = [SHARED + [7, 8], [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 4], SHARED + [50, 51, 52],
           random.Random(0).choices(range(3, 384), k=37)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "tag"], "additionalProperties": False}  # bounded: a greedy output completes it


class Moe(NamedTuple):
    path: str
    hf: object  # HF transformers' model of the checkpoint, fp32
    lone: dict[tuple[int, ...], list[int]]  # prompt -> its greedy tokens, run alone (each checked against HF)


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, warmup=False, dtype="float32", **{"block_size": 4, "num_kv_blocks": 96, **kwargs})


def generate(llm: LLM, prompts: list[list[int]], sp: SamplingParams = GREEDY) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe(request, tmp_path_factory) -> Moe:
    path = str(tiny_moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param))
    hf, llm = hf_moe_model(path), engine(path, enable_prefix_caching=False)
    lone = {}
    for p in PROMPTS:
        lone[tuple(p)] = generate(llm, [p])[0].outputs[0].token_ids
        assert_hf_greedy(hf, p, lone[tuple(p)])
    return Moe(path, hf, lone)


def assert_lone(moe: Moe, prompts: list[list[int]], outs: list) -> None:
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            assert c.token_ids == moe.lone[tuple(p)], (p, c.index)


def test_chunked_prefill_beside_other_requests(moe):
    llm = engine(moe.path, max_num_batched_tokens=8, enable_prefix_caching=False)  # the 37-token prompt: 5 chunks
    assert_lone(moe, PROMPTS, generate(llm, PROMPTS))
    assert llm.get_stats().num_mixed_steps > 0  # prompt chunks and decodes in one step


def test_prefix_cache_hits_give_the_same_tokens(moe):
    llm = engine(moe.path)
    assert_lone(moe, PROMPTS[:1], generate(llm, PROMPTS[:1]))
    assert_lone(moe, PROMPTS, generate(llm, PROMPTS))  # the first again, and one more sharing its prefix
    assert llm.get_stats().prefix_cache_hits >= 2 * 20  # both found SHARED's five blocks


def test_preemption_in_a_tiny_pool(moe):
    llm = engine(moe.path, block_size=2, num_kv_blocks=32, max_num_seqs=4)  # 64 slots for ~180 tokens
    assert_lone(moe, PROMPTS, generate(llm, PROMPTS))
    s = llm.get_stats()
    assert s.num_preemptions > 0 and s.num_free_blocks == s.num_total_blocks


def test_n_completions_share_the_prompt(moe):
    llm = engine(moe.path, max_num_batched_tokens=16)
    outs = generate(llm, PROMPTS[:3], SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True))
    assert [len(o.outputs) for o in outs] == [3, 3, 3]
    assert_lone(moe, PROMPTS[:3], outs)
    sampled = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=8, ignore_eos=True)
    first = [c.token_ids for c in generate(llm, PROMPTS[1:2], sampled)[0].outputs]
    again = [c.token_ids for c in generate(llm, PROMPTS[:3], sampled)[1].outputs]  # seeded: beside others too
    assert first == again and len({tuple(t) for t in first}) > 1  # three draws, not one repeated


@pytest.mark.parametrize("proposer", ["ngram", "dense draft"])
def test_speculative_decoding_keeps_greedy_tokens(moe, proposer, model_factory):
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3} if proposer == "ngram" else
            {"model": model_factory("qwen3"), "num_speculative_tokens": 2})  # a dense Qwen3, the same 384 tokens
    llm = engine(moe.path, speculative_config=spec, max_num_batched_tokens=16)  # chunks beside verifications
    assert_lone(moe, PROMPTS, generate(llm, PROMPTS))
    s = llm.get_stats()
    assert s.num_draft_tokens > 0 and s.num_free_blocks == s.num_total_blocks
    if proposer == "ngram":
        assert s.num_accepted_tokens > 0  # the repeating prompt's continuation is found in it


def test_structured_outputs_are_hf_greedy_among_the_allowed_tokens(moe):
    llm = engine(moe.path, max_num_batched_tokens=16)
    so = StructuredOutputsParams(json=SCHEMA)
    outs = generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=48, structured_outputs=so))
    for prompt, (c,) in zip(PROMPTS, (o.outputs for o in outs)):
        matcher = llm.llm_engine.input_processor.grammars.matcher(so)  # the grammar alone, walked token by token
        allowed = []
        for tok in c.token_ids:
            allowed.append(unpack_bitmask(matcher.bitmasks()[:1], llm.llm_engine.spec.vocab_size)[0])  # (V,) bool
            assert allowed[-1][tok] and matcher.accept(tok), (c.text, tok)
        assert_hf_greedy(moe.hf, prompt, c.token_ids, allowed=allowed)
        assert c.finish_reason == "stop" and matcher.is_complete, c
        jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not CpuInfo.read().native_bf16, reason="this CPU does not compute bf16 natively"))])
def test_batch_invariance_a_prompt_alone_and_in_any_batch(moe, dtype):
    """tests/test_batch_invariance.py's check on an MoE: its experts serve other row counts in every batch."""
    llm = LLM(moe.path, warmup=False, dtype=dtype, block_size=4, num_kv_blocks=512, max_num_batched_tokens=12,
              enable_prefix_caching=False, batch_invariant=True)
    rng = random.Random(7)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    target = PROMPTS[-1]

    def tokens_and_logprobs(prompts: list[list[int]], at: int) -> tuple[list[int], list]:
        out = generate(llm, prompts, params)[at].outputs[0]
        return out.token_ids, out.logprobs

    alone = tokens_and_logprobs([target], 0)
    if dtype == "float32":
        assert alone[0] == moe.lone[tuple(target)]
    for others in (1, 5, 16):
        batch = [[rng.randrange(3, 384) for _ in range(rng.choice((1, 2, 5, 9, 16, 23)))] for _ in range(others)]
        at = rng.randrange(others + 1)
        assert tokens_and_logprobs(batch[:at] + [target] + batch[at:], at) == alone, f"{others} others, at {at}"
