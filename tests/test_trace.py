"""The per-step trace (the hook the notebooks draw from), and the pictures drawn from it."""

from __future__ import annotations

import gc

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.teaching.viz import plot_block_map, plot_cache_hits, plot_timeline  # noqa: E402


def test_trace_records_what_each_step_did(qwen3_dir):
    llm = LLM(qwen3_dir, block_size=4, num_kv_blocks=10, max_num_batched_tokens=8, record_trace=True)
    prompts = [{"prompt_token_ids": list(range(10 + 30 * i, 10 + 30 * i + n))} for i, n in enumerate([6, 10, 3])]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    trace = llm.get_trace()
    stats = llm.get_stats()
    assert len(trace) == stats.num_steps
    assert all(st.num_batched_tokens <= 8 for st in trace)
    assert sum(len(st.preempted) for st in trace) == stats.num_preemptions > 0
    assert sum(s.num_new_tokens for st in trace for s in st.scheduled if not s.is_prefill) == stats.num_decode_tokens
    assert {rid for st in trace for rid in st.finished} == {o.request_id for o in outs}
    for st in trace:  # block tables and the free list partition the pool
        owned = {b for table in st.block_tables.values() for b in table}
        assert owned.isdisjoint(st.free_blocks) and len(owned) + len(st.free_blocks) == st.num_total_blocks
    for draw in (lambda: plot_timeline(trace), lambda: plot_block_map(trace[3]), lambda: plot_cache_hits(outs)):
        assert draw() is not None


def test_trace_is_off_by_default(qwen3_dir):
    llm = LLM(qwen3_dir, num_kv_blocks=8)
    with pytest.raises(ValueError, match="record_trace=True"):
        llm.get_trace()


def test_gc_freeze_after_warmup_and_unfreeze_on_shutdown(qwen3_dir):
    gc.unfreeze()
    llm = LLM(qwen3_dir, num_kv_blocks=8)
    assert gc.get_freeze_count() > 0
    llm.shutdown()
    assert gc.get_freeze_count() == 0
