"""Speculative decoding end to end: exact greedy output, the interplay with every other feature,
and rejected drafts leaving no trace."""

from __future__ import annotations

import pytest
from helpers import run_with_flaky_sampler

from minivllm import LLM, SamplingParams
from minivllm.engine.spec_decode.ngram import ngram_lookup
from minivllm.engine.spec_decode.proposer import Draft, DraftRequest, Proposer
from minivllm.teaching.hf_check import assert_hf_greedy

REPEATING = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]  # n-gram lookup finds continuations here
PROMPTS = [REPEATING, list(range(20, 41)), [3, 4]]


def llm_for(model_factory, spec: dict | None, **kwargs) -> LLM:
    return LLM(model_factory("qwen3"), warmup=False, speculative_config=spec,
               **{"block_size": 4, "num_kv_blocks": 96, **kwargs})


def run(llm: LLM, sp: SamplingParams, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


class Oracle(Proposer):
    """Proposes the tokens a reference run produced, with every k-th one wrong: acceptances AND
    rejections, on demand."""

    def __init__(self, futures: dict[tuple[int, ...], list[int]], wrong_every: int = 3) -> None:
        self.futures, self.wrong_every, self.calls = futures, wrong_every, 0

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            tokens = r.token_ids.tolist()
            future = next((f[len(tokens):] for p, f in self.futures.items()
                           if tokens[:len(p)] == list(p)), [])
            guess = [t if (i + self.calls) % self.wrong_every else (t + 1) % 384
                     for i, t in enumerate(future[:r.max_tokens])]
            self.calls += 1
            drafts.append(Draft(guess))
        return drafts


@pytest.fixture(scope="module")
def reference(model_factory):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = run(llm_for(model_factory, None), sp)
    return {tuple(p): p + o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 2, 3, 1) == [9, 1]
    assert ngram_lookup([1, 2, 3, 4], 2, 3, 1) == []
    assert ngram_lookup([7, 1, 8, 1], 3, 2, 1) == [8, 1]  # falls back to n = 1


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    "draft", "oracle",
])
def test_greedy_output_is_identical_with_speculation(model_factory, hf_factory, reference, spec):
    if spec == "draft":
        spec = {"model": model_factory("qwen3"), "num_speculative_tokens": 3}
    elif spec == "oracle":
        spec = {"proposer": Oracle(reference), "num_speculative_tokens": 4}
    llm = llm_for(model_factory, spec, max_num_batched_tokens=16)  # chunked prefill beside verification
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = run(llm, sp)
    for p, o in zip(PROMPTS, outs):
        assert p + o.outputs[0].token_ids == reference[tuple(p)]
    assert_hf_greedy(hf_factory("qwen3"), PROMPTS[0], outs[0].outputs[0].token_ids)
    stats = llm.get_stats()
    assert stats.num_draft_tokens > 0 and stats.num_steps < 3 * 24  # fewer steps than tokens
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.llm_engine.block_manager.check_invariants([])


def test_a_model_as_its_own_draft_accepts_almost_everything(model_factory):
    llm = llm_for(model_factory, {"model": model_factory("qwen3"), "num_speculative_tokens": 3})
    run(llm, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stats = llm.get_stats()
    assert stats.acceptance_rate >= 0.9, stats
    assert len(stats.acceptance_per_position) == 3


def test_sampling_with_a_self_draft_accepts_everything_and_stays_seeded(model_factory):
    """q == p exactly, so every draft is accepted; a seeded run repeats itself."""
    spec = {"model": model_factory("qwen3"), "num_speculative_tokens": 2}
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=4, max_tokens=16, ignore_eos=True)
    a = run(llm_for(model_factory, spec), sp)
    llm = llm_for(model_factory, spec)
    b = run(llm, sp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert llm.get_stats().acceptance_rate > 0.95


def test_stops_min_tokens_max_tokens_and_logprobs(model_factory, reference):
    oracle = {"proposer": Oracle(reference, wrong_every=100), "num_speculative_tokens": 4}
    full = reference[tuple(REPEATING)][len(REPEATING):]
    stop_tok = full[6]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok], logprobs=1)
    base = run(llm_for(model_factory, None), sp, [REPEATING])[0].outputs[0]
    spec = run(llm_for(model_factory, oracle), sp, [REPEATING])[0].outputs[0]
    # Drafts accepted past the stop token are dropped.
    assert spec.token_ids == base.token_ids == full[:full.index(stop_tok) + 1]
    assert spec.finish_reason == "stop" and spec.stop_reason == stop_tok
    assert [list(e) for e in spec.logprobs] == [list(e) for e in base.logprobs]
    assert spec.cumulative_logprob == pytest.approx(base.cumulative_logprob, abs=1e-4)
    # min_tokens bans the stop token at each draft position too; max_tokens is never exceeded.
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, stop_token_ids=[stop_tok], min_tokens=8)
    a = run(llm_for(model_factory, None), sp, [REPEATING])[0].outputs[0]
    b = run(llm_for(model_factory, oracle), sp, [REPEATING])[0].outputs[0]
    assert a.token_ids == b.token_ids and len(b.token_ids) <= 9
    # Stop strings: tokens accepted after the stop string are cut with it.
    tok = llm_for(model_factory, None).get_tokenizer()
    text = tok.decode(full[:12])
    stop = text[len(tok.decode(full[:5])):][:3]
    if stop.strip():
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
        a = run(llm_for(model_factory, None), sp, [REPEATING])[0].outputs[0]
        b = run(llm_for(model_factory, oracle), sp, [REPEATING])[0].outputs[0]
        assert (a.text, a.finish_reason) == (b.text, b.finish_reason)


def test_preemption_prefix_cache_n_and_abort(model_factory, reference):
    oracle = {"proposer": Oracle(reference), "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # A tiny pool: drafts are dropped first, then requests are preempted; output unchanged.
    small = llm_for(model_factory, oracle, num_kv_blocks=14)
    outs = run(small, sp, PROMPTS * 2)  # the repeats also hit the prefix cache
    for p, o in zip(PROMPTS * 2, outs):
        assert p + o.outputs[0].token_ids == reference[tuple(p)]
    stats = small.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.num_accepted_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    # n > 1: each child speculates on its own.
    forked = run(llm_for(model_factory, {"method": "ngram", "num_speculative_tokens": 2}),
                 SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True), [REPEATING])[0]
    alone = run(llm_for(model_factory, None), SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12,
                                                             ignore_eos=True), [REPEATING])[0]
    assert len(forked.outputs) == 2 and all(len(c.token_ids) == 12 for c in forked.outputs)
    assert forked.outputs[0].token_ids[0] == alone.outputs[0].token_ids[0]
    # Abort while drafts are in flight.
    llm = llm_for(model_factory, oracle)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": REPEATING}, sp)
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    engine.step()
    assert llm.get_stats().num_free_blocks == 96


def test_a_failed_verification_step_rolls_back(model_factory, reference):
    oracle = {"proposer": Oracle(reference), "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = llm_for(model_factory, oracle)
    engine = llm.llm_engine

    def rolled_back(_):
        bm = engine.block_manager
        for state in engine.requests.values():  # drafts wait for a step again; no slot is held for them
            seq = state.seqs[0]
            assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens)
        bm.check_invariants(engine.scheduler.live_sequences)

    requests = {f"r{i}": (p, sp) for i, p in enumerate(PROMPTS)}
    finals, failures = run_with_flaky_sampler(engine, requests, every=5, phase=1, on_failure=rolled_back)
    assert failures > 0
    for i, p in enumerate(PROMPTS):
        assert p + finals[f"r{i}"].outputs[0].token_ids == reference[tuple(p)]


def test_trace_shows_drafts_and_acceptances(model_factory, reference):
    llm = llm_for(model_factory, {"proposer": Oracle(reference), "num_speculative_tokens": 3}, record_trace=True)
    run(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), [REPEATING])
    rows = [s for step in llm.get_trace() for s in step.scheduled if s.num_draft_tokens]
    assert rows and all(0 <= s.num_accepted_tokens <= s.num_draft_tokens for s in rows)
    assert sum(s.num_accepted_tokens for s in rows) == llm.get_stats().num_accepted_tokens


def test_bad_configurations_are_refused(model_factory, tmp_path):
    from minivllm.teaching.checkpoints import make_tiny_model

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        llm_for(model_factory, {"method": "ngram"})
    with pytest.raises(ValueError, match="unknown keys"):
        llm_for(model_factory, {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel": 1})
    other = make_tiny_model(tmp_path / "other", vocab_size=400)
    with pytest.raises(ValueError, match="vocabulary"):
        llm_for(model_factory, {"model": str(other), "num_speculative_tokens": 2})

    class TooMany(Proposer):
        def propose(self, requests):
            return [Draft([7] * (r.max_tokens + 1)) for r in requests]

    llm = llm_for(model_factory, {"proposer": TooMany(), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="more than the 2 asked"):
        run(llm, SamplingParams(max_tokens=8))
