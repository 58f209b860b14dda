"""A request can only fail itself: validation at the boundary, bisection of a failed step, an isolated
commit, fatal device errors, and the step's bookkeeping cost independent of the pool's size."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import varied_prompts

from minivllm import LLM, SamplingParams
from minivllm.engine.request.errors import EngineDeadError


def tiny(model_factory, **kwargs) -> LLM:
    return LLM(model_factory("qwen3"), warmup=False, **{"block_size": 4, "num_kv_blocks": 64, **kwargs})


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], after_add=lambda: None):
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    after_add()
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 500, "the engine loop did not end"
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


# --- validation at the boundary -----------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan), ("min_p", -math.inf),
    ("temperature", True), ("top_k", True), ("max_tokens", 2.0), ("seed", False), ("min_tokens", math.nan),
    ("ignore_eos", 1), ("stop_token_ids", [True]), ("stop_token_ids", "12"), ("stop", 5),
])
def test_bad_numbers_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_numpy_numbers_are_accepted_as_python_numbers():
    sp = SamplingParams(max_tokens=np.int64(5), top_k=np.int32(3), temperature=np.float32(0.5), seed=np.uint8(7),
                        stop_token_ids=[np.int64(2)])
    assert (sp.max_tokens, sp.top_k, sp.seed, sp.all_stop_token_ids) == (5, 3, 7, (2,))
    assert type(sp.max_tokens) is int and type(sp.temperature) is float and type(sp.all_stop_token_ids[0]) is int


def test_token_ids_are_checked_against_the_vocabulary(model_factory):
    llm = tiny(model_factory)
    engine, vocab = llm.llm_engine, llm.llm_engine.spec.vocab_size
    with pytest.raises(ValueError, match=r"stop_token_ids \[1000000\] are outside the vocabulary"):
        engine.add_request("a", {"prompt_token_ids": [1, 2]}, SamplingParams(stop_token_ids=[1000000], min_tokens=1))
    for bad in ([vocab], [-1], [True], [1.0]):
        with pytest.raises(ValueError, match="prompt_token_ids"):
            engine.add_request("a", {"prompt_token_ids": bad}, SamplingParams())
    assert not engine.has_unfinished_requests()  # nothing half-added
    engine.add_request("ok", {"prompt_token_ids": np.array([1, 2, 3])}, SamplingParams(max_tokens=2))
    assert engine.requests["ok"].seqs[0].prompt_token_ids == [1, 2, 3]


# --- bisection: the culprit fails, the others continue unchanged ---------------------------------
def slip_past_validation(sp: SamplingParams, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    """What a validation bug would let through (validation now refuses it)."""
    object.__setattr__(sp, "_stop_token_ids", stop_token_ids)
    return sp


def test_a_request_that_fails_the_step_fails_alone(model_factory):
    prompts = varied_prompts(6, 384, seed=3)
    sps = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10, ignore_eos=True)
           for i in range(len(prompts))]
    good = {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))}
    clean = run(tiny(model_factory).llm_engine, good)

    llm = tiny(model_factory)
    bad_sp = SamplingParams(min_tokens=1, max_tokens=10, stop_token_ids=[2])
    finals = run(llm.llm_engine, {**dict(list(good.items())[:3]), "bad": ([5, 6, 7], bad_sp),
                                  **dict(list(good.items())[3:])},
                 after_add=lambda: slip_past_validation(bad_sp, (1_000_000,)))
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert "IndexError" in finals["bad"].error
    for rid, out in clean.items():
        assert finals[rid].outputs[0].token_ids == out.outputs[0].token_ids, rid
        assert finals[rid].outputs[0].finish_reason == "length"
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.llm_engine.block_manager.check_invariants([])


def test_a_failure_no_single_request_reproduces_is_raised(model_factory):
    llm = tiny(model_factory)
    engine = llm.llm_engine
    original = engine.model_runner.sampler
    state = {"armed": True, "calls": 0}

    def needs_two(logits, t):  # fails only when two rows are sampled together
        state["calls"] += 1
        if state["armed"] and logits.shape[0] >= 2:
            raise RuntimeError("needs two")
        return original(logits, t)

    engine.model_runner.sampler = needs_two
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": [3 + i, 4, 5]}, SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="needs two"):
        engine.step()
    assert state["calls"] > 1  # it was bisected: the batch, its halves, then single requests
    assert all(st.seqs[0].num_computed_tokens == 0 for st in engine.requests.values())  # rolled back
    state["armed"] = False
    finals = run(engine, {})
    assert sorted(finals) == ["r0", "r1", "r2", "r3"]
    assert all(o.outputs[0].finish_reason == "length" for o in finals.values())


def test_device_errors_are_fatal_and_never_bisected(model_factory):
    engine = tiny(model_factory).llm_engine
    calls = {"n": 0}

    def device_error(*args, **kwargs):
        calls["n"] += 1
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    engine.model_runner.model.forward = device_error
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": [3, 4, 5 + i]}, SamplingParams(max_tokens=3))
    with pytest.raises(EngineDeadError, match="illegal memory access"):
        engine.step()
    assert calls["n"] == 1


# --- the commit is per request -------------------------------------------------------------------
def test_a_failing_detokenizer_fails_only_its_request(model_factory):
    llm = tiny(model_factory)
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": [3, 4, 5 + i]}, SamplingParams(max_tokens=4, ignore_eos=True))
    detok = engine.requests["r1"].seqs[0].detokenizer

    def broken(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    detok.update = broken
    finals = run(engine, {})
    assert finals["r1"].outputs[0].finish_reason == "error" and "UnicodeDecodeError" in finals["r1"].error
    assert [finals[r].outputs[0].finish_reason for r in ("r0", "r2")] == ["length", "length"]
    assert not engine.requests
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_failure_on_the_last_token_is_an_error_not_a_short_length(model_factory):
    """The token that reaches max_tokens finishes the request ("length") before its text is decoded: a
    failure decoding it must still say "error", not end the request one token short of its text."""
    llm = tiny(model_factory)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=4, ignore_eos=True))
    seq = engine.requests["r"].seqs[0]
    update = seq.detokenizer.update

    def fails_on_the_last(token_id):
        if seq.num_output_tokens == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return update(token_id)

    seq.detokenizer.update = fails_on_the_last
    finals = run(engine, {})
    assert finals["r"].outputs[0].finish_reason == "error" and "UnicodeDecodeError" in finals["r"].error
    assert not engine.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_failure_after_an_earlier_request_committed_loses_no_output(model_factory):
    """A request's commit (here: what its forward computed becomes its own, `_advance`) fails after the row
    before it finished: the finished one is reported with its tokens, the failing one with its error."""
    prompts = {"done": [3, 4, 5], "bad": [3, 4, 6], "other": [3, 4, 7]}
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    clean = run(tiny(model_factory).llm_engine, {rid: (p, sp) for rid, p in prompts.items()})
    llm = tiny(model_factory)
    engine = llm.llm_engine
    advance = engine.scheduler._advance

    def fails_for_bad(sched, out):
        advance(sched, out)  # done, then it fails: the worst case
        if sched.seq.request_id == "bad":
            raise RuntimeError("injected in the commit")

    engine.scheduler._advance = fails_for_bad
    finals = run(engine, {rid: (p, sp) for rid, p in prompts.items()})
    assert finals["bad"].outputs[0].finish_reason == "error" and "injected in the commit" in finals["bad"].error
    for rid in ("done", "other"):
        assert finals[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids, rid
        assert finals[rid].outputs[0].finish_reason == "length"
    assert not engine.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("when", ["final", "running"])
def test_a_request_whose_output_fails_ends_with_an_error_alone(model_factory, when):
    """`OutputProcessor.output` raises for one request, on its final output (it has left `engine.requests`
    already: the worst case) or while it runs: it ends with finish_reason "error" and the message, reported
    once; the others are reported as usual and nothing stays held."""
    prompts = {"a": [3, 4, 5], "bad": [3, 4, 6], "c": [3, 4, 7]}
    requests = {rid: (p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)) for rid, p in prompts.items()}
    clean = run(tiny(model_factory).llm_engine, requests)
    llm = tiny(model_factory)
    engine = llm.llm_engine
    output = engine.output_processor.output

    def fails_for_bad(state):
        if state.request_id == "bad" and (state.finished if when == "final" else state.seqs[0].num_output_tokens == 1):
            raise RuntimeError("injected in the output")
        return output(state)

    engine.output_processor.output = fails_for_bad
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    finals = []
    for _ in range(50):  # 3 tokens each: a few steps
        finals += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert sorted(o.request_id for o in finals) == ["a", "bad", "c"]  # each reported once
    bad = next(o for o in finals if o.request_id == "bad")
    assert bad.outputs[0].finish_reason == "error" and "injected in the output" in bad.error
    assert bad.outputs[0].token_ids == clean["bad"].outputs[0].token_ids[:3 if when == "final" else 1]
    for o in finals:
        if o.request_id != "bad":
            assert o.outputs[0] == clean[o.request_id].outputs[0] and o.error is None
    assert not engine.has_unfinished_requests() and not engine.requests
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory) -> str:
    from minivllm.teaching.checkpoints import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("isolation_qwen3_5"), family="qwen3_5", num_layers=4))


def test_a_failure_in_the_commits_tail_reports_every_request(hybrid_model):
    """The commit's tail (after every request's own part: a hybrid's state snapshots join the prefix cache)
    fails in the step where one request finishes: that request is reported with its tokens, the step's
    others end with the error, and nothing is left held (blocks, state pairs) or unreported."""
    sps = {"short": SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
           "long": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)}
    requests = {rid: ([3, 4, 5 + i] * 3, sp) for i, (rid, sp) in enumerate(sps.items())}
    clean = run(LLM(hybrid_model, warmup=False, block_size=4, num_kv_blocks=32).llm_engine, requests)
    llm = LLM(hybrid_model, warmup=False, block_size=4, num_kv_blocks=32)
    engine = llm.llm_engine
    publish, calls = engine.state_pool.publish_snapshots, []

    def fails_once(scheduled):
        publish(scheduled)
        calls.append(len(scheduled))
        if len(calls) == 1:
            raise RuntimeError("injected in the commit's tail")

    engine.state_pool.publish_snapshots = fails_once
    finals = run(engine, requests)
    assert calls[0] == 2  # both requests were in the failed step
    assert finals["short"].outputs[0] == clean["short"].outputs[0]
    assert finals["long"].outputs[0].finish_reason == "error" and "injected in the commit's tail" in finals["long"].error
    assert not engine.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert engine.state_pool.num_free == engine.state_pool.num_pairs


# --- a stop string completed by the last allowed token -------------------------------------------
def test_stop_string_completed_by_the_max_tokens_token(model_factory):
    llm = tiny(model_factory)
    prompt = {"prompt_token_ids": [11, 12, 13, 14]}
    for n in range(3, 12):
        prev = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n - 1, ignore_eos=True), use_tqdm=False)
        full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        before, text = prev[0].outputs[0].text, full[0].outputs[0].text
        stop = text[max(0, len(before) - 1):]
        if len(text) > len(before) and text.find(stop) == len(text) - len(stop):
            break
    else:
        pytest.skip("no token of this random model completes a fresh string")
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, text[:len(text) - len(stop)])
    streamed = [o for _, o in llm.generate_stream(prompt, sp)]
    last = streamed[-1].outputs[0]
    assert (last.finish_reason, last.text) == ("stop", out.text)
    assert all(stop not in o.outputs[0].text for o in streamed)


# --- bookkeeping costs what the step touches ------------------------------------------------------
def test_the_journal_does_not_grow_with_the_pool(model_factory):
    sizes = []
    for num_blocks in (64, 65536):
        engine = tiny(model_factory, num_kv_blocks=num_blocks).llm_engine
        for i in range(4):
            engine.add_request(f"r{i}", {"prompt_token_ids": [3, 4, 5 + i] * 3}, SamplingParams(max_tokens=4))
        touched = []
        journal = engine.scheduler.journal
        original = journal.commit

        def commit():
            touched.append(journal.size)
            original()

        journal.commit = commit
        run(engine, {})
        sizes.append(touched)
    assert sizes[0] == sizes[1]


def test_cpu_kv_pool_is_committed_lazily(model_factory):
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    model = model_factory("qwen3")
    LLM(model, warmup=False, num_kv_blocks=8).llm_engine.shutdown()  # a first engine imports ~100 MB of code
    before = rss()
    llm = LLM(model, warmup=False, cpu_kv_cache_bytes=512 << 20)
    pool = llm.llm_engine.model_runner.kv_cache
    assert pool.numel() * pool.element_size() >= 500 << 20
    assert rss() - before < 100 << 20  # the model is tiny: almost all of the growth would be the pool
    assert float(pool[:, :, -1].abs().sum()) == 0.0  # and an untouched block reads as zeros
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
