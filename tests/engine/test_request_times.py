"""Per-request times (vLLM's `RequestOutput.metrics`): written by the scheduler at admission and at the commit,
undone with a failed step, ordered arrival <= first scheduled <= first token <= finished."""

from __future__ import annotations

from minivllm import LLMEngine, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.core.block_manager import BlockManager
from minivllm.engine.core.scheduler import Scheduler
from minivllm.engine.request.sequence import Sequence


def test_times_are_present_and_ordered_for_plain_and_n_requests(qwen3_dir):
    engine = LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=32, max_model_len=128, max_num_seqs=3))
    engine.add_request("one", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=3, ignore_eos=True))
    three = SamplingParams(max_tokens=4, n=3, ignore_eos=True)
    engine.add_request("three", {"prompt_token_ids": [5, 6, 9]}, three)  # one of its sequences waits for a seat
    finals, first_seen = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            m = out.metrics
            assert m is not None and m.arrival_time <= (m.first_scheduled_time or m.arrival_time)
            first_seen.setdefault(out.request_id, m)
            if out.finished:
                finals[out.request_id] = out
    for rid, out in finals.items():
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time, (rid, m)
        assert m.time_in_queue == m.first_scheduled_time - m.arrival_time >= 0
        assert first_seen[rid].first_scheduled_time == m.first_scheduled_time  # the first admission's, kept
    # n=3 with two seats left: its last sequence waits for "one" to finish; the request finishes with it
    assert finals["three"].metrics.finished_time >= finals["one"].metrics.finished_time
    engine.add_request("never", {"prompt_token_ids": [5]}, SamplingParams(n=4))  # more than max_num_seqs: refused
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert out.metrics.first_scheduled_time is None and out.metrics.time_in_queue is None
    assert out.metrics.finished_time >= out.metrics.arrival_time


def test_a_rolled_back_admission_leaves_no_first_scheduled_time():
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2))
    sched.add_sequence(seq)
    sched.begin_step()
    sched.schedule()
    assert seq.first_scheduled_time is not None
    sched.rollback_step()  # the forward failed: the admission never happened
    assert seq.first_scheduled_time is None and seq.first_token_time is None
    sched.begin_step()
    sched.schedule()
    sched.commit_step()
    assert seq.first_scheduled_time is not None
