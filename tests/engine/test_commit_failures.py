"""The commit's failure handling is idempotent: what fails while a sequence is given back is retried, never
lost between the queues.

`Scheduler.finish` takes a sequence out of RUNNING, then gives back its blocks (`_release`). If that raises,
the commit's recovery (`fail`) finishes it again: the second `finish` must find it out of the queues and not
fail there (a ValueError escaping the commit left it in no queue and never finished: `generate` spun). An
n > 1 request's sequences are committed one by one: a failure ends only the completion it was for.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams

PROMPTS = {"a": [3, 4, 5], "bad": [3, 4, 6], "c": [3, 4, 7]}


def drain(engine) -> dict[str, list]:
    """Step until nothing is left; every final output by request (each must come once)."""
    finals: dict[str, list] = {}
    for _ in range(100):  # a few tokens each: a few steps
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished_requests(), "the engine loop did not end"
    return finals


@pytest.mark.parametrize("failures", [1, 1000])
def test_a_release_that_fails_ends_its_request_once(model_factory, failures):
    """Giving back the blocks of "bad" raises when its last token finishes it: once (the retry gives them
    back: nothing is lost) or every time (it still ends, reported once; only its own blocks stay held)."""
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    clean = drain(_engine(model_factory, PROMPTS, sp))
    llm = LLM(model_factory("qwen3"), warmup=False, block_size=4, num_kv_blocks=64)
    engine, sched = llm.llm_engine, llm.llm_engine.scheduler
    release, left = sched._release, [failures]

    def flaky_release(seq):
        if seq.request_id == "bad" and left[0]:
            left[0] -= 1
            raise RuntimeError("injected in _release")
        release(seq)

    sched._release = flaky_release
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    bad_seq = engine.requests["bad"].seqs[0]
    finals = drain(engine)
    assert sorted(finals) == ["a", "bad", "c"] and all(len(f) == 1 for f in finals.values())
    bad = finals["bad"][0]
    assert bad.outputs[0].finish_reason == "error" and "injected in _release" in bad.error
    for rid in ("a", "c"):
        assert finals[rid][0].outputs[0] == clean[rid][0].outputs[0] and finals[rid][0].error is None
    assert not sched.running and not sched.waiting and not engine.requests
    stats = llm.get_stats()
    if failures == 1:
        assert stats.num_free_blocks == stats.num_total_blocks
    else:  # never given back: its own blocks, nobody else's
        assert stats.num_total_blocks - stats.num_free_blocks == len(bad_seq.block_table) > 0


def test_a_commit_that_fails_for_one_of_n_sequences_ends_only_that_completion(model_factory):
    """n = 2 is two sequences (engine/processing/parallel_sampling.py): the commit fails for the second one only. That
    completion ends with "error", its sibling and the other request go on, and every block comes back."""
    llm = LLM(model_factory("qwen3"), warmup=False, block_size=4, num_kv_blocks=64)
    engine = llm.llm_engine
    trim = engine.block_manager.trim

    def failing_trim(seq, num_tokens):
        if seq.request_id == "1_two" and seq.num_output_tokens == 2:
            raise RuntimeError("injected in the second sequence's commit")
        trim(seq, num_tokens)

    engine.block_manager.trim = failing_trim
    engine.add_request("two", {"prompt_token_ids": [3, 4, 5, 6, 7, 8]},
                       SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4, ignore_eos=True))
    engine.add_request("alone", {"prompt_token_ids": [3, 4, 9]}, SamplingParams(temperature=0, max_tokens=3))
    finals = drain(engine)
    assert sorted(finals) == ["alone", "two"] and all(len(f) == 1 for f in finals.values())
    out = finals["two"][0]
    assert "injected in the second sequence's commit" in out.error
    assert [c.finish_reason for c in out.outputs] == ["length", "error"] and len(out.outputs[0].token_ids) == 4
    assert finals["alone"][0].error is None
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "a sequence's blocks leaked"


def _engine(model_factory, prompts: dict[str, list[int]], sp: SamplingParams):
    engine = LLM(model_factory("qwen3"), warmup=False, block_size=4, num_kv_blocks=64).llm_engine
    for rid, prompt in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    return engine
