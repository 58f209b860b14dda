"""The step is a transaction: a failure in the forward pass or the sampler changes nothing.

The injected failures need two requests together (a batch of >= 2 rows), so the engine's bisection
finds no single culprit and re-raises them: the case where the whole step must be rolled back."""

from __future__ import annotations

import pytest
from helpers import varied_prompts

from minivllm import LLM, SamplingParams


class Boom(RuntimeError):
    pass


def state_of(engine):
    sched, bm = engine.scheduler, engine.block_manager
    return (
        [s.request_id for s in sched.running], [s.request_id for s in sched.waiting],
        [(s.request_id, s.status, s.num_computed_tokens, list(s.block_table), s.num_tokens)
         for s in sched.live_sequences],
        list(bm.ref_counts), list(bm.free_blocks), dict(bm.hash_to_block), sched.num_preemptions,
    )


def run_with_failures(llm: LLM, prompts, sps, fail_at: set[int], where: str):
    """Drive the engine by hand; during the listed step attempts, every model (or sampler) call over
    two or more requests raises."""
    engine = llm.llm_engine
    runner = engine.model_runner
    attempt = {"n": 0}
    target_obj, attr = (runner.model, "forward") if where == "model" else (runner, "sampler")
    original = getattr(target_obj, attr)

    def failing(*args, **kwargs):
        result = original(*args, **kwargs)  # do the work (write K/V), then fail: the worst case
        rows = args[2].cu_seqlens_q.numel() - 1 if where == "model" else args[0].shape[0]
        if attempt["n"] in fail_at and rows >= 2:
            raise Boom(f"injected failure in step attempt {attempt['n']}")
        return result

    setattr(target_obj, attr, failing)
    try:
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        finished, failures = {}, 0
        while engine.has_unfinished_requests():
            attempt["n"] += 1
            before = state_of(engine)
            try:
                outs = engine.step()
            except Boom:
                failures += 1
                after = state_of(engine)
                # Nothing moved, except that a free cached block the failed step overwrote is no
                # longer findable (its content is no longer what its hash promises).
                assert after[:5] + after[6:] == before[:5] + before[6:]
                assert after[5].items() <= before[5].items()
                assert all(engine.block_manager.ref_counts[b] == 0 for h, b in before[5].items()
                           if h not in after[5])
                engine.block_manager.check_invariants(engine.scheduler.live_sequences)
                continue
            for o in outs:
                if o.finished:
                    finished[o.request_id] = o.outputs[0].token_ids
        return [finished[f"r{i}"] for i in range(len(prompts))], failures
    finally:
        if where == "model":
            del runner.model.forward  # back to the class's method
        else:
            runner.sampler = original


@pytest.mark.parametrize("where", ["model", "sampler"])
def test_failed_steps_leave_no_trace(where, model_factory):
    prompts = varied_prompts(8, 384, seed=5)
    sps = [SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, max_tokens=12, ignore_eos=True)
           for i in range(len(prompts))]
    kwargs = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=24)  # chunking + preemption
    clean, failures = run_with_failures(LLM(model_factory("qwen3"), warmup=False, **kwargs), prompts, sps, set(),
                                        where)
    assert failures == 0
    llm = LLM(model_factory("qwen3"), warmup=False, **kwargs)
    faulty, failures = run_with_failures(llm, prompts, sps, {1, 2, 5, 9, 10, 17, 30}, where)
    assert failures >= 4  # the armed attempts whose step ran two or more requests
    assert faulty == clean
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.llm_engine.block_manager.check_invariants([])
