"""Beam search (minivllm/beam_search.py): HF transformers' beams, blocks shared through the prefix cache
and all given back, the ranking rules on made-up outputs, and the server's `use_beam_search`."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch
from server_helpers import events, serving

from minivllm import LLM, BeamSearchParams, LLMEngine
from minivllm.beam_search import BeamSearch, BeamSearchFailed, new_search, step_sampling_params
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.beam_search import beam_search
from minivllm.entrypoints.openai.server import build_app
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput

MAX_TOKENS = 6


def tiny(path: str, **kwargs) -> LLM:
    return LLM(path, warmup=False, **{"block_size": 4, "num_kv_blocks": 128, **kwargs})


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_beams_are_hfs(model_factory, hf_factory, family):
    """ignore_eos, length_penalty 1: the k beams are HF's num_beams=k beams, in HF's order (best first)."""
    llm, hf = tiny(model_factory(family)), hf_factory(family)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 4, 5, 9, 14)]  # around block edges
    for k in (2, 4):
        params = BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, ignore_eos=True, length_penalty=1.0)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([prompt]), num_beams=k, do_sample=False, early_stopping=True,
                              max_new_tokens=MAX_TOKENS, length_penalty=1.0, eos_token_id=None,
                              num_return_sequences=k, output_scores=True, return_dict_in_generate=True)
            assert [s.tokens for s in out.sequences] == ref.sequences.tolist()
            for s, score in zip(out.sequences, ref.sequences_scores.tolist()):  # HF: sum / generated length
                assert s.cum_logprob / MAX_TOKENS == pytest.approx(score, abs=1e-4)
                assert s.finish_reason == "length" and s.text == llm.get_tokenizer().decode(s.tokens)
        stats = llm.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks and not llm.llm_engine.requests


def test_beams_share_their_common_prefix_blocks(model_factory):
    """While a step runs, the beams' requests hold the blocks of their common prefix once (prefix-cache
    hits), and each its own tail block; between steps the search holds nothing (pruned beams are gone)."""
    llm = tiny(model_factory("qwen3"), num_kv_blocks=32)
    engine, bm = llm.llm_engine, llm.llm_engine.block_manager
    execute, during = engine.executor.execute_model, []

    def watched(plan):  # the blocks are held from schedule() until the one-token requests finish
        during.append(([(s.token_ids.tolist(), list(s.block_table)) for s in (x.seq for x in plan.scheduled)],
                       bm.num_blocks - bm.num_free_blocks, list(bm.ref_counts)))
        return execute(plan)

    engine.executor.execute_model = watched
    search = new_search(engine, {"prompt_token_ids": list(range(40, 50))}, BeamSearchParams(4, 5, ignore_eos=True))
    sp = step_sampling_params(search.params)
    while not search.done:
        ids = [f"s{search.num_steps}-b{i}" for i in range(len(search.beams))]
        for rid, prompt in zip(ids, search.step_prompts()):
            engine.add_request(rid, prompt, sp)
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        search.advance([finals[rid] for rid in ids])
        assert bm.num_free_blocks == bm.num_blocks  # nothing held between steps
    assert len(during) == 5  # one engine step per search step: every beam admitted together
    for beams, used, ref_counts in during[1:]:
        assert len(beams) == 4
        tokens, tables = zip(*beams)
        full = (len(tokens[0]) - 1) // 4  # blocks hit: all full ones but a last one holding the last token
        common = min(next((i for i in range(len(tokens[0])) if len({t[i] for t in tokens}) > 1)), full * 4) // 4
        assert common >= 2  # the prompt's two full blocks at least
        assert all(t[:common] == tables[0][:common] for t in tables)  # one copy of the common prefix...
        assert all(ref_counts[b] == 4 for b in tables[0][:common])
        assert len({b for t in tables for b in t[common:]} | set(tables[0][:common])) == used  # ...no other
        assert len({t[-1] for t in tables}) == 4  # the tails: one each


def test_an_interrupted_search_aborts_every_beam(model_factory):
    llm = tiny(model_factory("qwen3"))
    engine, step = llm.llm_engine, llm.llm_engine.step
    calls = {"n": 0}

    def interrupted_step():
        calls["n"] += 1
        if calls["n"] == 3:  # mid-search: four beams in flight
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        llm.beam_search([{"prompt_token_ids": [5, 6, 7, 8, 9]}], BeamSearchParams(4, 8, ignore_eos=True))
    assert not engine.requests and engine.scheduler.is_finished()
    assert llm.get_stats().num_free_blocks == llm.get_stats().num_total_blocks


def _out(top: dict[int, float], reason: str = "length") -> RequestOutput:
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    logprobs = {t: Logprob(lp, r) for r, (t, lp) in enumerate(ranked, start=1)}
    return RequestOutput("r", None, [1], [CompletionOutput(0, "", [ranked[0][0]], reason, None, ranked[0][1],
                                                           [logprobs])], True)


def test_eos_completes_a_beam_and_length_penalty_ranks_them():
    eos = frozenset({0})
    search = BeamSearch([1, 2], BeamSearchParams(2, 3), eos)
    search.advance([_out({0: -0.1, 5: -1.0, 6: -2.0, 7: -3.0})])  # EOS is the best: complete, not extended
    assert [b.tokens for b in search.completed] == [[1, 2, 0]]
    assert [b.tokens for b in search.beams] == [[1, 2, 5], [1, 2, 6]]
    search.advance([_out({8: -0.5, 9: -0.6, 0: -4.0, 10: -5.0}), _out({8: -0.1, 9: -3.0, 0: -3.5, 10: -6.0})])
    assert [b.tokens for b in search.beams] == [[1, 2, 5, 8], [1, 2, 5, 9]]  # -1.5, -1.6 beat -2.1
    best = search.output(type("T", (), {"decode": staticmethod(lambda ids, **kw: str(ids))})()).sequences
    assert [b.tokens for b in best] == [[1, 2, 0], [1, 2, 5, 8]]  # -0.1 / 2 (the EOS is not counted)
    assert best[0].finish_reason == "stop" and best[0].stop_reason is None and best[1].finish_reason == "length"
    # A length penalty of 0 ranks by cumulative logprob; a large one prefers the longer beam.
    long = BeamSearch([1, 2], BeamSearchParams(2, 3, length_penalty=8.0), eos)
    long.advance([_out({0: -0.1, 5: -0.2, 6: -2.0, 7: -3.0})])
    long.advance([_out({8: -0.2, 9: -0.3, 0: -4.0, 10: -5.0}), _out({8: -3.0, 9: -3.0, 0: -3.5, 10: -6.0})])
    assert long.score(long.beams[0]) > long.score(long.completed[0])  # -0.4 / 4**8 > -0.1 / 2**8
    with pytest.raises(BeamSearchFailed, match="abort"):
        search.advance([_out({1: -1.0}, "abort"), _out({1: -1.0})])


def test_bad_params_and_prompts_are_refused_saying_what_to_change(model_factory):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(2, 4, temperature=0.7)
    llm = tiny(model_factory("qwen3"), max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([{"prompt_token_ids": [5] * 20}], BeamSearchParams(2, 13))
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.beam_search("Hello", BeamSearchParams(11, 4))  # 22 candidates a beam
    for penalty in (1e308, -1e308, 70.0):  # finite, but not the score: 32 ** 70 > 1e100 (2 ** 1e308 overflows)
        with pytest.raises(ValueError, match="length_penalty"):
            llm.beam_search("Hello", BeamSearchParams(2, 4, length_penalty=penalty))
    assert not llm.llm_engine.requests


def test_server_use_beam_search(qwen3_dir, model_factory):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=128, max_model_len=256)))
    try:
        with serving(build_app(engine, "tiny")) as url:
            body = {"prompt": [5, 6, 7, 8, 9, 10], "n": 3, "max_tokens": 5, "use_beam_search": True, "ignore_eos": True,
                    "return_token_ids": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            offline = tiny(qwen3_dir).beam_search({"prompt_token_ids": body["prompt"]},
                                                  BeamSearchParams(3, 5, ignore_eos=True))[0]
            assert [c["token_ids"] for c in r.json()["choices"]] == [s.tokens[6:] for s in offline.sequences]
            assert r.json()["usage"]["completion_tokens"] == 15
            texts = [c["text"] for c in r.json()["choices"]]
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
                chunks = [e["choices"][0] for e in events(streamed) if e != "[DONE]"]
            assert sorted((c["index"], c["text"], c["finish_reason"]) for c in chunks) == \
                [(i, t, "length") for i, t in enumerate(texts)]  # each choice once, when the search is done
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "n": 2, "max_tokens": 3, "use_beam_search": True})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
            for field, value in (("temperature", 0.8), ("seed", 1), ("logprobs", 0), ("stop", "x")):
                r = httpx.post(f"{url}/v1/completions", json={**body, field: value})
                assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "length_penalty": 0.5})
            assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
    finally:
        engine.shutdown()
    assert engine.engine.get_stats().num_free_blocks == 128


def test_a_cancelled_server_search_aborts_every_beam(qwen3_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=128, max_model_len=256)))

    async def cancel_mid_search() -> None:
        params = BeamSearchParams(4, 40, ignore_eos=True)
        search = beam_search(engine, {"prompt_token_ids": [5, 6, 7, 8, 9]}, params, "b")
        task = asyncio.ensure_future(search.__anext__())
        while engine.stats.num_steps < 6:  # several steps in: four beams at a time
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the aborts are applied by the engine's thread
            if not engine.engine.requests:
                break
            await asyncio.sleep(0.02)

    try:
        asyncio.run(cancel_mid_search())
        assert not engine.engine.requests
        assert engine.engine.get_stats().num_free_blocks == 128
    finally:
        engine.shutdown()
