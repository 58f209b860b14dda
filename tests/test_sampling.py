"""Sampling: greedy, per-request seeds, and the distributions of temperature/top-k/top-p/min-p."""

from __future__ import annotations

import pytest
import torch
from helpers import expected_distribution, varied_prompts

from minivllm import LLM, SamplingParams
from minivllm.layers.sampler import Sampler, SamplingRow, SamplingTensors, argmax_rows


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (1.7, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0),
    (1.0, 0, 0.7, 0.0), (1.0, 0, 1.0, 0.2), (0.8, 5, 0.9, 0.05),
])
def test_sampler_draws_from_the_filtered_distribution(temperature, top_k, top_p, min_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8])
    n = 12000
    rows = [SamplingRow(temperature, top_k, top_p, min_p, 1234, pos) for pos in range(n)]
    t = SamplingTensors.from_params(rows, vocab_size=8, device=torch.device("cpu"))
    tokens = Sampler()(logits.expand(n, -1).clone(), t)
    freq = torch.bincount(tokens, minlength=8).float() / n
    expected = expected_distribution(logits, temperature, top_k, top_p, min_p)
    assert torch.all(freq[expected == 0] == 0), "a filtered token was drawn"
    # 12k draws: the standard error is <= 0.0046 per token; allow ~4 sigma.
    assert torch.allclose(freq, expected, atol=0.018), (freq, expected)


def test_greedy_rows_ignore_noise_in_a_mixed_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(0.0 if i % 2 else 1.0, 0, 1.0, 0.0, i, 0) for i in range(6)]
    out = Sampler()(logits, SamplingTensors.from_params(rows, 50, torch.device("cpu")))
    assert out[1::2].tolist() == logits[1::2].argmax(-1).tolist()


def test_top_k_1_equals_greedy(qwen3_dir):
    llm = LLM(qwen3_dir, block_size=4, num_kv_blocks=64)
    prompts = [{"prompt_token_ids": p} for p in varied_prompts(5, 384, seed=7)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, seed=3, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_seed_reproduces_whatever_the_batch_companions(qwen3_dir):
    llm = LLM(qwen3_dir, block_size=4, num_kv_blocks=128)
    target = {"prompt_token_ids": varied_prompts(6, 384, seed=8)[5]}
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in varied_prompts(9, 384, seed=9)]
    other_sps = [SamplingParams(temperature=0.7, seed=i, max_tokens=5 + i, ignore_eos=True) for i in range(9)]
    crowded = llm.generate(others[:4] + [target] + others[4:], other_sps[:4] + [sp] + other_sps[4:],
                           use_tqdm=False)[4].outputs[0].token_ids
    assert alone == crowded
    unseeded = [llm.generate([target], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1], "unseeded requests must not all draw the same stream"


def test_argmax_rows_is_argmax():
    """The blockwise CPU argmax gives torch's argmax exactly: first index of the maximum, NaN first."""
    torch.manual_seed(0)
    x = torch.randn(6, 1024)
    x[0, 5] = x[0, 700] = 50.0  # a tie across blocks: the first wins
    x[1, 130] = x[1, 131] = 50.0  # a tie inside a block
    x[2] = float("-inf")  # a row with everything filtered
    x[3, 900] = float("nan")  # NaN counts as the maximum, as in torch.argmax
    x[3, 300] = float("nan")
    for logits in (x, x.to(torch.bfloat16), x[:, :1000], x.t().contiguous().t()):  # V % 128 != 0, strided
        assert torch.equal(argmax_rows(logits), logits.argmax(-1))
