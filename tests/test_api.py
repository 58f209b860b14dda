"""The offline API: inputs, outputs, stop conditions, chat, stats, bad inputs."""

from __future__ import annotations

import json
import shutil

import pytest

from minivllm import LLM, LLMEngine, RequestOutputKind, SamplingParams
from minivllm.config import EngineConfig


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, block_size=4, num_kv_blocks=64, max_model_len=96)


def test_outputs_in_input_order_with_text(llm):
    prompts = ["The capital of France is", {"prompt_token_ids": [5, 6, 7]}, "Hello world"]
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 4)]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 4]
    assert outs[0].prompt == "The capital of France is" and outs[1].prompt is None
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_engine_step_is_incremental(qwen3_dir):
    engine = LLMEngine(EngineConfig(model=qwen3_dir, block_size=4, num_kv_blocks=32))
    engine.add_request("a", {"prompt_token_ids": [5, 6]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append((out.request_id, len(out.outputs[0].token_ids), out.finished))
    assert seen == [("a", 1, False), ("a", 2, False), ("a", 3, True)]
    engine.add_request("b", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("b")
    [out] = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 32
    engine.shutdown()


def _run_engine(engine: LLMEngine, sp: SamplingParams, prompt: str) -> list:
    engine.add_request("r", prompt, sp)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def test_output_kinds_cumulative_delta_final_only(qwen3_dir):
    """vLLM's `output_kind`: the deltas of a request (n=2, stop string, logprobs, prompt logprobs) add up to
    its cumulative output; FINAL_ONLY gives only that final output."""
    engine = LLMEngine(EngineConfig(model=qwen3_dir, block_size=4, num_kv_blocks=64))
    base = dict(temperature=0.8, seed=3, n=2, max_tokens=10, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    ref = first = None
    for kind in RequestOutputKind:
        outs = _run_engine(engine, SamplingParams(**base, output_kind=kind), "Hello world")
        if kind is RequestOutputKind.CUMULATIVE:
            ref = outs[-1]
            stop = ref.outputs[0].text[3:5]  # a stop string the next runs meet
            base["stop"] = [stop]
            ref = (outs := _run_engine(engine, SamplingParams(**base, output_kind=kind), "Hello world"))[-1]
            assert len(outs) > 1 and ref.outputs[0].finish_reason == "stop"
        elif kind is RequestOutputKind.DELTA:
            assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
            for i, c in enumerate(ref.outputs):
                parts = [d for o in outs for d in o.outputs if d.index == i]
                assert "".join(d.text for d in parts) == c.text
                assert [t for d in parts for t in d.token_ids] == c.token_ids
                assert [lp for d in parts for lp in d.logprobs] == c.logprobs
                assert parts[-1].finish_reason == c.finish_reason
                assert parts[-1].cumulative_logprob == c.cumulative_logprob
            assert outs[0].prompt_logprobs == ref.prompt_logprobs and all(o.prompt_logprobs is None for o in outs[1:])
        else:
            [first] = outs
    assert first.finished and first.outputs == ref.outputs
    with pytest.raises(ValueError, match="SamplingParams.output_kind='delta' is invalid"):
        SamplingParams(output_kind="delta")
    engine.shutdown()


def test_delta_sends_prompt_logprobs_once_even_for_a_one_token_prompt(qwen3_dir):
    engine = LLMEngine(EngineConfig(model=qwen3_dir, block_size=4, num_kv_blocks=16))
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1,
                        output_kind=RequestOutputKind.DELTA)
    outs = _run_engine(engine, sp, {"prompt_token_ids": [5]})
    assert outs[0].prompt_logprobs == [None] and [o.prompt_logprobs for o in outs[1:]] == [None, None]
    engine.shutdown()


def test_generate_asks_for_final_outputs_only(llm, monkeypatch):
    reported = []
    original = llm.llm_engine.output_processor.output
    monkeypatch.setattr(llm.llm_engine.output_processor, "output",
                        lambda state: reported.append(state.finished) or original(state))
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)  # CUMULATIVE, as a caller leaves it
    [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)
    assert reported == [True] and len(out.outputs[0].token_ids) == 5
    assert sp.output_kind is RequestOutputKind.CUMULATIVE  # the caller's params are not changed
    streamed = list(llm.generate_stream([{"prompt_token_ids": [5, 6, 7]}], sp))
    assert len(streamed) == 5 and streamed[-1][1].outputs[0].token_ids == out.outputs[0].token_ids


def first_greedy_tokens(llm, prompt_ids, n=8):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt_ids}], sp, use_tqdm=False)[0].outputs[0]


def test_stop_token_ids_and_eos(llm):
    ref = first_greedy_tokens(llm, [9, 10, 11])
    stop_tok = ref.token_ids[3]
    first = ref.token_ids.index(stop_tok)
    out = llm.generate([{"prompt_token_ids": [9, 10, 11]}],
                       SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok and c.token_ids == ref.token_ids[:first + 1]
    # min_tokens masks the stop token: generation goes past where it stopped.
    out = llm.generate([{"prompt_token_ids": [9, 10, 11]}],
                       SamplingParams(temperature=0, max_tokens=8, min_tokens=first + 2, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= first + 2
    assert stop_tok not in out.outputs[0].token_ids[:first + 2]


def test_stop_strings_truncate_text(llm):
    ref = first_greedy_tokens(llm, [20, 21, 22], n=12)
    text = ref.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"reference text too short to test: {text!r}"
    cut = text.index(stop)
    for include in (False, True):
        out = llm.generate([{"prompt_token_ids": [20, 21, 22]}],
                           SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True,
                                          include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (text[:cut + len(stop)] if include else text[:cut])


def test_detokenize_false_returns_token_ids_only(llm):
    """vLLM's `detokenize=False`: the same tokens and logprobs, no text (and no stop strings)."""
    kw = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    with_text, ids_only = (llm.generate([{"prompt_token_ids": [20, 21, 22]}], SamplingParams(**kw, detokenize=d),
                                        use_tqdm=False)[0].outputs[0] for d in (True, False))
    assert ids_only.token_ids == with_text.token_ids and ids_only.text == "" and with_text.text
    assert [{t: lp.logprob for t, lp in d.items()} for d in ids_only.logprobs] == \
        [{t: lp.logprob for t, lp in d.items()} for d in with_text.logprobs]
    assert all(lp.decoded_token is None for d in ids_only.logprobs for lp in d.values())
    with pytest.raises(ValueError, match="SamplingParams.stop=.*detokenize"):
        SamplingParams(stop=["."], detokenize=False)
    assert SamplingParams(stop_token_ids=[3], detokenize=False).detokenize is False


def test_max_model_len_stops_with_length(llm):
    out = llm.generate([{"prompt_token_ids": list(range(5, 95))}],
                       SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6


def test_chat_uses_the_template(llm):
    outs = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=4),
                    use_tqdm=False)
    assert outs[0].prompt.startswith("<|im_start|>user\nHello<|im_end|>") and outs[0].prompt.endswith("assistant\n")
    two = llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]],
                   SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(two) == 2


def test_get_stats_counts(llm):
    before = llm.get_stats()
    llm.generate([{"prompt_token_ids": [3, 4, 5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    after = llm.get_stats()
    assert after.num_steps == before.num_steps + 4
    assert after.num_decode_tokens - before.num_decode_tokens == 3
    assert after.num_free_blocks == after.num_total_blocks == 64
    assert set(after.as_dict()) >= {"num_preemptions", "prefix_cache_hits", "prefix_cache_queries",
                                    "num_free_blocks", "num_total_blocks", "num_steps"}


# --- requests that can never run -----------------------------------------------------------------
def test_never_runnable_requests_finish_with_an_error(qwen3_dir):
    llm = LLM(qwen3_dir, block_size=4, num_kv_blocks=8, max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": list(range(3, 73))},  # longer than max_model_len
                         {"prompt_token_ids": [3, 4]},  # needs 40 tokens = 10 blocks > 8
                         {"prompt_token_ids": [3, 4, 5]}],
                        [SamplingParams(max_tokens=4), SamplingParams(max_tokens=38), SamplingParams(max_tokens=3)],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "max_model_len" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "error" and "num_kv_blocks" in outs[1].error
    assert outs[2].outputs[0].finish_reason == "length" and outs[2].error is None


# --- bad inputs: clear errors, engine unchanged ----------------------------------------------------
@pytest.mark.parametrize("prompt,sp,match", [
    ("", None, "empty"),
    ({"prompt_token_ids": []}, None, "empty"),
    ({"prompt_token_ids": [1, 10_000]}, None, "outside the vocabulary"),
    ({"prompt_token_ids": [1, -1]}, None, "outside the vocabulary"),
    (42, None, "prompt is a str"),
])
def test_bad_prompts_raise_and_leave_engine_usable(llm, prompt, sp, match):
    before = llm.get_stats()
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate(["fine prompt", prompt], sp, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.get_stats() == before
    assert llm.generate("still works", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0), ("max_tokens", 0),
    ("min_tokens", -1), ("stop", [""]), ("stop_token_ids", [-3]), ("seed", "x"), ("detokenize", 0),
])
def test_bad_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_sampling_params_list_length_must_match(llm):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size"), (dict(dtype="float8"), "dtype"),
    (dict(attention_backend="cuda"), "attention_backend"),
    (dict(max_num_seqs=-1), "max_num_seqs"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
])
def test_bad_engine_options(kwargs, match, qwen3_dir):
    with pytest.raises(ValueError, match=match):
        LLM(qwen3_dir, **kwargs)


def test_missing_corrupt_and_unknown_checkpoints(tmp_path, qwen3_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="corrupt"):
        LLM(str(broken))
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(broken))
    shutil.copy(f"{qwen3_dir}/model.safetensors", broken / "model.safetensors")
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unknown architecture"):
        LLM(str(broken))
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(broken))
    cfg.pop("layer_types", None)
    (broken / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="lacks weights"):
        LLM(str(broken))
