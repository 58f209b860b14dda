"""CUDA graphs for decode steps (engine/worker/cuda_graphs.py), without a GPU: `replay_by_rerun` stands in for the
recording, so the static buffers, the padding rows and the graph's attention plan are what these test.
The Triton backend runs in its interpreter; the forward runs eagerly over the compiled sizes' padding
(what is compiled is tested in test_compile.py). benchmarks/cuda_check.py runs the real graphs on a GPU."""

from __future__ import annotations

import pytest
from helpers import varied_prompts

from minivllm import LLM, SamplingParams
from minivllm.engine.worker.cuda_graphs import replay_by_rerun
from minivllm.engine.worker.runner_builder import enable_cuda_graphs
from minivllm.teaching.hf_check import assert_hf_greedy

SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def graphed(model_factory):
    llm = LLM(model_factory("qwen3"), attention_backend="triton", enforce_eager=False, compile_sizes=SIZES,
              warmup=False, block_size=16, num_kv_blocks=32, max_num_batched_tokens=64)
    llm.llm_engine.model.compiled.runs = lambda num_tokens: False  # eager forward, padded to the sizes
    enable_cuda_graphs(llm.llm_engine.model_runner, replay_by_rerun)
    yield llm
    llm.shutdown()


def test_decode_steps_replay_graphs_and_match_hf(graphed, hf_factory, monkeypatch):
    """Three requests of different lengths: a long prompt's chunks run beside the others' decodes (mixed
    steps: no graph), then decodes of 3 rows (padded to 4), 2 and 1 replay their graphs, each size
    recorded once. Padding rows sit in rows real requests used in earlier steps. Each graph runs the grouped
    decode kernel with its split count from the rows alone (8 "SMs" on CPU, 2 KV heads: 8, 4 and 2 splits)."""
    from minivllm.kernels import grouped_decode_attention as gd

    graphs = graphed.llm_engine.model_runner.cuda_graphs
    splits = {}  # rows -> split counts seen
    original = gd.grouped_decode_attention
    monkeypatch.setattr(gd, "grouped_decode_attention", lambda q, kc, vc, bt, cl, scale, n, *args:
                        splits.setdefault(q.shape[0], set()).add(n) or original(q, kc, vc, bt, cl, scale, n, *args))
    long_prompt = varied_prompts(9, 384, seed=11)[-1]  # 70 tokens: two chunks
    prompts = [[3, 4, 5], [6, 7, 8, 9], long_prompt]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 7, 10)]
    outs = graphed.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert_hf_greedy(hf_factory("qwen3"), p, o.outputs[0].token_ids)
    assert sorted(graphs.graphs) == [1, 2, 4]
    assert graphs.num_replays >= 5
    assert splits == {1: {8}, 2: {4}, 4: {2}}  # eager decode-only steps never ran: every one replayed
    # A real graph reads the tensors of its metadata where they were when it was recorded: the runner keeps
    # them (on an H200 the freed tile lists of a 4-row plan were reused: illegal access).
    four = graphs.metadata[4]
    assert four.plan.tiles is None and four.plan.num_splits == 2
    assert sorted(graphs.metadata) == [1, 2, 4] and four.block_tables.data_ptr() == graphs.block_tables.data_ptr()
    assert graphed.get_stats().num_mixed_steps > 0


def test_padding_rows_write_only_the_scratch_block(graphed):
    """A graph step's padding rows store their K/V in the scratch block alone: every other free block of
    the pool is as it was."""
    runner = graphed.llm_engine.model_runner
    before = runner.kv_cache[:, :, :runner.num_blocks].clone()
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    graphed.generate([{"prompt_token_ids": [11, 12, 13]}] * 3, sp, use_tqdm=False)  # 3 decodes -> 4 rows
    used = {b for b in range(runner.num_blocks) if not (runner.kv_cache[:, :, b] == before[:, :, b]).all()}
    assert len(used) <= 3  # the three requests' own blocks (prefix caching may share one)


def test_graphs_need_a_compiled_triton_engine(model_factory):
    with LLM(model_factory("qwen3"), enforce_eager=True, num_kv_blocks=16) as llm:
        with pytest.raises(ValueError, match="CUDA graphs need the compiled forward"):
            enable_cuda_graphs(llm.llm_engine.model_runner, replay_by_rerun)
        assert llm.llm_engine.model_runner.cuda_graphs is None  # CPU: never on by itself


def test_compiled_forward_replays_without_compiling_again(model_factory, hf_factory):
    """With the compiled forward, a graph's size is already compiled (warm-up) and the static buffers must
    pass its guards: buffers made outside inference mode failed them ("Recompilation triggered")."""
    with LLM(model_factory("qwen3"), attention_backend="triton", enforce_eager=False, compile_sizes=(1, 2),
             block_size=16, num_kv_blocks=32) as llm:
        enable_cuda_graphs(llm.llm_engine.model_runner, replay_by_rerun)
        graphs = llm.llm_engine.model_runner.cuda_graphs
        assert graphs.input_ids.is_inference() and graphs.block_tables.is_inference()
        prompts = [[3, 4, 5], [6, 7]]
        sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 5)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    for p, o in zip(prompts, outs):
        assert_hf_greedy(hf_factory("qwen3"), p, o.outputs[0].token_ids)
    assert sorted(graphs.graphs) == [1, 2] and graphs.num_replays > 0


def _padded_triton_llm(model_factory, max_num_batched_tokens: int = 64) -> LLM:
    """Triton backend, the compiled sizes' padding, the forward run eagerly (no compiling), no graphs."""
    llm = LLM(model_factory("qwen3"), attention_backend="triton", enforce_eager=False, compile_sizes=SIZES,
              warmup=False, block_size=16, num_kv_blocks=64, max_num_batched_tokens=max_num_batched_tokens)
    llm.llm_engine.model.compiled.runs = lambda num_tokens: False
    llm.llm_engine.model_runner.cuda_graphs = None
    return llm


def test_split_kv_decode_skips_padding_rows_without_graphs(model_factory, hf_factory, monkeypatch):
    """Three long decodes padded to 4 rows take the grouped split-KV kernel outside a graph: the kernel must see
    only the 3 requests' rows (the padding row has no block table or length; reading them was out of bounds)."""
    from minivllm.kernels import grouped_decode_attention as gd

    rows = []
    original = gd.grouped_decode_attention
    monkeypatch.setattr(gd, "grouped_decode_attention",
                        lambda q, *args: rows.append(q.shape[0]) or original(q, *args))
    prompts = [[(7 * i + 5 * j) % 380 + 3 for j in range(130 + i)] for i in range(3)]  # 9 blocks each: split-KV
    assert min(map(len, prompts)) >= 129
    with _padded_triton_llm(model_factory, max_num_batched_tokens=512) as llm:  # one prefill step, then decodes
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert_hf_greedy(hf_factory("qwen3"), p, o.outputs[0].token_ids)
    assert 3 in rows


def test_a_failed_recording_leaves_the_step_and_later_ones_running(model_factory, hf_factory, caplog):
    def failing(forward):
        raise RuntimeError("out of memory (a test)")

    with _padded_triton_llm(model_factory) as llm:
        enable_cuda_graphs(llm.llm_engine.model_runner, failing)
        graphs = llm.llm_engine.model_runner.cuda_graphs
        prompts = [[3, 4, 5], [6, 7, 8, 9]]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    for p, o in zip(prompts, outs):
        assert_hf_greedy(hf_factory("qwen3"), p, o.outputs[0].token_ids)
    assert 2 not in graphs.sizes and not graphs.graphs and not graphs.metadata
    assert "no CUDA graph for 2 rows" in caplog.text
