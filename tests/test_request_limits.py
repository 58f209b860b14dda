"""What one request may ask, and what it costs the others: lists bounded or prepared once, prompts refused
before they are tokenized when their bytes prove them too long, prompt logprobs a chunk at a time, and the
Python API's leftover holes (a lone surrogate, seeds past 64 bits, speculative options named in errors)."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.worker import sampling_metadata
from minivllm.sampling_params import MAX_BAD_WORDS, MAX_STOP_STRINGS


def tiny(model_factory, **kwargs) -> LLM:
    return LLM(model_factory("qwen3"), warmup=False, **{"block_size": 4, "num_kv_blocks": 64, **kwargs})


def test_lists_whose_cost_grows_every_step_are_bounded_naming_the_limit():
    with pytest.raises(ValueError, match=rf"SamplingParams.stop=<{MAX_STOP_STRINGS + 1} strings.* at most "
                                         rf"{MAX_STOP_STRINGS} strings"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match="at most 1000 characters"):
        SamplingParams(stop=["x" * 1001])
    with pytest.raises(ValueError, match=rf"SamplingParams.bad_words=<{MAX_BAD_WORDS + 1} words> is invalid"):
        SamplingParams(bad_words=["w"] * (MAX_BAD_WORDS + 1))
    SamplingParams(stop=["s"] * MAX_STOP_STRINGS, bad_words=["w"] * MAX_BAD_WORDS)  # at the limit: fine


def test_a_requests_lists_are_prepared_once_and_shared(model_factory, monkeypatch):
    """Bad words are tokenized and allowed ids turned into a mask once per SamplingParams (the server does it
    off the engine's thread, which then reuses it), not at every admission or step."""
    from minivllm.engine.processing import input_processor

    calls = []
    tokenize = input_processor.bad_words_token_ids
    monkeypatch.setattr(input_processor, "bad_words_token_ids",
                        lambda tok, words: calls.append(1) or tokenize(tok, words))
    llm = tiny(model_factory)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=["the", "cat"],
                        allowed_token_ids=list(range(30, 300)))
    outs = llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)], sp, use_tqdm=False)
    assert len(calls) == 1
    assert all(set(o.outputs[0].token_ids) <= set(range(30, 300)) for o in outs)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


def test_many_allowed_ids_and_bad_words_cost_a_step_what_a_few_do(model_factory):
    """The per-step work of a request does not grow with its lists: the same processing tensors whatever
    their length (a step's time is not measured: that would be a timed test)."""
    from minivllm.engine.worker.sampling_metadata import row_processing

    llm = tiny(model_factory)
    engine = llm.llm_engine
    words = [f"w{i}" for i in range(2000)]
    sp = SamplingParams(allowed_token_ids=list(range(384)) * 200, bad_words=words, max_tokens=4)
    seq = engine.make_sequence("big", {"prompt_token_ids": [5, 6, 7]}, sp)
    row = row_processing(seq, engine.eos_token_ids)
    assert row.rules.allowed.shape == (384,) and row.rules.allowed.dtype == torch.bool
    assert len(row.rules.bad_words.lengths) <= 4  # one lookup per distinct word length, not per word


def test_a_prompt_whose_bytes_prove_it_too_long_is_refused_before_tokenizing(model_factory, monkeypatch):
    llm = tiny(model_factory, max_model_len=64)
    engine = llm.llm_engine
    seen = []
    tokenizer = engine.input_processor.tokenizer
    monkeypatch.setattr(engine.input_processor, "tokenizer", lambda text: seen.append(len(text)) or tokenizer(text))
    monkeypatch.setattr(engine.input_processor, "_max_token_bytes", 16)
    with pytest.raises(ValueError, match=r"the prompt is 2000 bytes.*over 125 tokens, more than max_model_len=64"):
        engine.add_request("long", "a" * 2000)
    assert seen == []  # refused without tokenizing
    engine.add_request("kept", "a" * 2000, SamplingParams(truncate_prompt_tokens=8, max_tokens=2))  # it keeps 8


def test_a_lone_surrogate_is_a_clear_error(model_factory):
    llm = tiny(model_factory)
    with pytest.raises(ValueError, match=r"not valid Unicode: '\\ud800' at character 6 is a lone surrogate"):
        llm.generate("Hello \ud800 world", use_tqdm=False)
    assert not llm.llm_engine.requests


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64 + 5])
def test_seeds_past_64_bits_are_refused(seed):
    with pytest.raises(ValueError, match="SamplingParams.seed=.*64-bit integer"):
        SamplingParams(seed=seed)
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=-(2**63))


@pytest.mark.parametrize("change, complaint", [
    ({"prompt_lookup_max": "abc"}, r"speculative_config.prompt_lookup_max='abc': give an integer in \[1, 64\]"),
    ({"prompt_lookup_max": 4.9}, r"speculative_config.prompt_lookup_max=4.9: give an integer"),
    ({"prompt_lookup_min": True}, r"speculative_config.prompt_lookup_min=True: give an integer"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min=5 exceeds prompt_lookup_max=2"),
    ({"num_speculative_tokens": 3.0}, r"num_speculative_tokens=3.0: give an integer in \[1, 16\]"),
])
def test_speculative_options_are_named_in_their_errors(model_factory, change, complaint):
    with pytest.raises(ValueError, match=complaint):
        tiny(model_factory, speculative_config={"method": "ngram", "num_speculative_tokens": 2, **change})


def test_a_draft_model_path_that_is_a_file_says_so(model_factory):
    config = f"{model_factory('qwen3')}/config.json"
    with pytest.raises(ValueError, match=r"speculative_config.model='.*config.json' is not a folder"):
        tiny(model_factory, speculative_config={"model": config, "num_speculative_tokens": 2})


def test_prompt_logprobs_are_computed_a_chunk_at_a_time(model_factory, monkeypatch):
    """The same logprobs whatever the chunk (so a 4,000-token prompt never holds them all in float32 at once)."""
    prompt = {"prompt_token_ids": list(range(5, 75))}
    sp = SamplingParams(max_tokens=1, prompt_logprobs=5)
    whole = tiny(model_factory, max_num_batched_tokens=128).generate(prompt, sp, use_tqdm=False)[0].prompt_logprobs
    monkeypatch.setattr(sampling_metadata, "PROMPT_LOGPROBS_CHUNK", 7)
    chunked = tiny(model_factory, max_num_batched_tokens=128).generate(prompt, sp, use_tqdm=False)[0].prompt_logprobs
    assert len(chunked) == 70 and chunked[0] is None
    for a, b in zip(whole[1:], chunked[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank for t in a)
