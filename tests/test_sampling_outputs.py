"""Sampling outputs with vLLM's names: logprobs, prompt logprobs, penalties and biases, bad words,
allowed ids, truncation, and `n > 1` as n sequences sharing the prompt's KV blocks."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from minivllm import LLM, SamplingParams
from minivllm.layers.logits_processors import (BadWords, RequestLogitRules, RowProcessing, apply_logits_processing,
                                               banned_by_bad_words)

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def tiny(model_factory, **kwargs) -> LLM:
    return LLM(model_factory("qwen3"), warmup=False, **{"block_size": 4, "num_kv_blocks": 64, **kwargs})


def gen(llm: LLM, sp: SamplingParams, prompt=PROMPT):
    return llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]


# --- logprobs against HF ---------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_logprobs_are_the_models_raw_log_softmax(model_factory, hf_factory, temperature):
    llm, hf = tiny(model_factory), hf_factory("qwen3")
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=8, logprobs=3, ignore_eos=True,
                        repetition_penalty=1.3, top_k=20)  # processing must not change the reported logprobs
    c = gen(llm, sp).outputs[0]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + c.token_ids])).logits[0].float().log_softmax(-1)  # (L, V)
    assert len(c.logprobs) == len(c.token_ids)
    total = 0.0
    for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(PROMPT) - 1 + j]
        top = row.topk(3)
        assert [t for t, lp in entry.items() if lp.rank is not None and lp.rank <= 3][:3] == top.indices.tolist()
        for t, lp in entry.items():
            assert abs(lp.logprob - float(row[t])) < 1e-4
            assert lp.rank == int((row > row[t]).sum()) + 1
            assert lp.decoded_token == llm.get_tokenizer().decode([t])
        assert tok in entry
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_match_hf_and_bypass_the_prefix_cache(model_factory, hf_factory):
    llm, hf = tiny(model_factory, max_num_batched_tokens=4), hf_factory("qwen3")  # chunked prefill
    prompt = list(range(20, 33))
    gen(llm, SamplingParams(max_tokens=2), prompt)  # now the prompt's blocks are cached
    out = gen(llm, SamplingParams(max_tokens=2, prompt_logprobs=2), prompt)
    assert out.num_cached_tokens == 0
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert abs(entry[prompt[p]].logprob - float(ref[p - 1, prompt[p]])) < 1e-4
        assert [t for t, lp in entry.items() if lp.rank in (1, 2)] == ref[p - 1].topk(2).indices.tolist()
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_prompt_logprobs_are_recorded_once_across_preemption(model_factory):
    llm = tiny(model_factory, num_kv_blocks=12, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": list(range(30 + i, 45 + i))} for i in range(3)]
    sp = SamplingParams(max_tokens=16, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert len(o.prompt_logprobs) == len(p["prompt_token_ids"])
    # Counted at commit: the recomputed prompts and tokens of preempted requests do not count twice.
    assert stats.num_prompt_tokens_total == sum(len(p["prompt_token_ids"]) for p in prompts)
    assert stats.num_generation_tokens_total == 3 * 16
    assert stats.finished_requests == {"length": 3}


# --- logits processing against HF's processors and vLLM's formulas ---------------------------------
def test_repetition_penalty_is_hfs():
    torch.manual_seed(0)
    logits = torch.randn(2, 30)
    seen = [[1, 5, 5, 9], [2, 3]]
    hf = RepetitionPenaltyLogitsProcessor(1.7)
    expected = torch.stack([hf(torch.tensor([s]), logits[i:i + 1].clone())[0] for i, s in enumerate(seen)])
    from array import array
    rows = [RowProcessing(repetition_penalty=1.7, prompt_token_ids=array("i", s[:1]), output_token_ids=s[1:])
            for s in seen]
    assert torch.allclose(apply_logits_processing(logits, rows), expected)


def test_presence_and_frequency_penalties_are_vllms_formula():
    torch.manual_seed(1)
    logits = torch.randn(1, 20)
    output = [3, 3, 3, 7, 11]
    row = RowProcessing(presence_penalty=0.5, frequency_penalty=0.25, output_token_ids=output)
    expected = logits.clone()
    counts = torch.bincount(torch.tensor(output), minlength=20).float()
    expected[0] -= 0.25 * counts + 0.5 * (counts > 0).float()
    assert torch.allclose(apply_logits_processing(logits, [row]), expected)


def test_masks_and_bias():
    logits = torch.zeros(1, 10)
    rules = RequestLogitRules.build(10, allowed_token_ids=[1, 2, 3], logit_bias={3: 2.5, 4: 9.0})
    row = RowProcessing(banned_token_ids=[1], rules=rules)
    out = apply_logits_processing(logits, [row])[0]
    assert out[2] == 0 and out[3] == 2.5
    assert torch.isinf(out[[0, 1, 4, 5, 9]]).all()


def test_the_bad_words_table_bans_what_the_plain_rule_bans():
    """`BadWords` looks up one prefix per word length instead of comparing every word (a request with
    80,000 bad words once held the others for seconds a step): the same bans as the reference."""
    rng = random.Random(0)
    words = [[rng.randrange(6) for _ in range(rng.randint(1, 4))] for _ in range(300)]
    table = BadWords(words)
    assert table.lengths == (1, 2, 3)
    for _ in range(300):
        output = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
        assert set(table.banned(output)) == set(banned_by_bad_words(words, output))


def test_bad_words_ban_the_last_token_of_a_matching_prefix():
    words = [[4], [7, 8, 9]]
    assert banned_by_bad_words(words, []) == [4]
    assert banned_by_bad_words(words, [1, 7, 8]) == [4, 9]
    assert banned_by_bad_words(words, [8]) == [4]
    hf = NoBadWordsLogitsProcessor(words, eos_token_id=0)
    scores = hf(torch.tensor([[1, 7, 8]]), torch.zeros(1, 12))
    assert torch.isinf(scores[0, [4, 9]]).all() and torch.isfinite(scores[0, [7, 8]]).all()


def test_processing_reaches_the_engine(model_factory):
    llm = tiny(model_factory)
    greedy = gen(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)).outputs[0].token_ids
    first = greedy[0]
    # A huge negative bias on the greedy choice changes it; allowed ids confine every token.
    biased = gen(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={first: -100}))
    assert biased.outputs[0].token_ids[0] != first
    allowed = gen(llm, SamplingParams(temperature=0.9, seed=1, max_tokens=8, ignore_eos=True,
                                      allowed_token_ids=[40, 41, 42]))
    assert set(allowed.outputs[0].token_ids) <= {40, 41, 42} and len(allowed.outputs[0].token_ids) == 8
    # A strong repetition penalty: greedy never repeats a token of the prompt or output here.
    rep = gen(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1e6))
    ids = rep.outputs[0].token_ids
    assert len(set(ids)) == len(ids) and not set(ids) & set(PROMPT)
    # Bad words: a bias makes one word greedy's every choice; banning the word wins over the bias.
    tok = llm.get_tokenizer()
    paris = next(t for t in range(100, 384) if (w := tok.decode([t])).isalpha() and len(w) > 2
                 and tok.encode(w, add_special_tokens=False) == [t])
    word = tok.decode([paris])
    forced = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={paris: 100})
    assert gen(llm, forced).outputs[0].token_ids == [paris] * 4
    banned = gen(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={paris: 100},
                                     bad_words=[word]))
    assert paris not in banned.outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_end(model_factory):
    out = gen(tiny(model_factory), SamplingParams(max_tokens=2, truncate_prompt_tokens=3))
    assert out.prompt_token_ids == PROMPT[-3:]


def test_fields_with_token_ids_are_checked(model_factory):
    llm = tiny(model_factory)
    for sp in (SamplingParams(allowed_token_ids=[10_000]), SamplingParams(logit_bias={10_000: 1.0})):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            gen(llm, sp)
    with pytest.raises(ValueError, match="max_logprobs"):
        gen(llm, SamplingParams(logprobs=21))


# --- n > 1: n sequences sharing the prompt's blocks through the prefix cache ---------------------------
def test_n_sequences_share_the_prompt_blocks(model_factory):
    llm = tiny(model_factory, max_num_batched_tokens=64)
    engine = llm.llm_engine
    prompt = list(range(40, 50))  # 10 tokens: 2 full blocks of 4 and a partial block (2 tokens)
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=5, ignore_eos=True))
    seqs = engine.requests["r"].seqs
    assert [s.request_id for s in seqs] == ["r", "1_r", "2_r", "3_r"] and [s.seed for s in seqs] == [0, 1, 2, 3]
    engine.step()  # all four admitted in one step: the first computes the prompt, the others hit its blocks
    shared = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in seqs)  # full blocks: shared, not recomputed
    assert len({s.block_table[2] for s in seqs}) == 4  # the partial block: each computes its own
    assert all(engine.block_manager.ref_counts[b] == 4 for b in shared)
    assert engine.block_manager.num_free_blocks == 64 - 6
    assert engine.get_stats().num_prefill_tokens == len(prompt) + 3 * 2  # + each sibling's partial block
    kv = engine.model_runner.kv_cache
    for s in seqs[1:]:  # the same two prompt tokens, the same K/V
        torch.testing.assert_close(kv[:, :, s.block_table[2], :2], kv[:, :, seqs[0].block_table[2], :2])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == 64


def test_child_i_draws_like_a_request_seeded_seed_plus_i(model_factory):
    llm = tiny(model_factory)
    sp = dict(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=1)
    forked = gen(llm, SamplingParams(n=3, seed=11, **sp))
    assert [c.index for c in forked.outputs] == [0, 1, 2]
    for i, c in enumerate(forked.outputs):
        alone = gen(llm, SamplingParams(seed=11 + i, **sp)).outputs[0]
        assert c.token_ids == alone.token_ids
        assert c.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-4)


def test_children_are_independent_under_preemption_stop_and_abort(model_factory):
    sp = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=24, ignore_eos=True)
    clean = gen(tiny(model_factory), sp)
    # A pool too small for three children: they are preempted and recomputed, tokens unchanged.
    small = tiny(model_factory, num_kv_blocks=12)
    pressured = gen(small, sp)
    assert small.get_stats().num_preemptions > 0
    assert [c.token_ids for c in pressured.outputs] == [c.token_ids for c in clean.outputs]
    assert small.get_stats().num_free_blocks == 12
    # One child hits a stop token: it stops; the others run to max_tokens.
    stop_tok = clean.outputs[1].token_ids[3]
    others = [c for c in clean.outputs if stop_tok not in c.token_ids]
    if others:
        stopped = gen(tiny(model_factory), SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=24,
                                                          ignore_eos=True, stop_token_ids=[stop_tok]))
        assert stopped.outputs[1].finish_reason == "stop"
        for c in others:
            assert stopped.outputs[c.index].token_ids == c.token_ids
    # Abort ends every child and frees every block.
    llm = tiny(model_factory)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": PROMPT}, sp)
    engine.step()
    engine.step()
    engine.abort_request("r")
    final = engine.step()[0]
    assert final.finished and {c.finish_reason for c in final.outputs} == {"abort"}
    assert llm.get_stats().num_free_blocks == 64
