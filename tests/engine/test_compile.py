"""The compiled forward (models/compiled_forward.py): the compiled engine emits exactly the eager engine's
tokens, with and without padding rows, and padding rows touch nothing but the scratch block.

Every other test runs eagerly (the CPU default); these compile a handful of small sizes once per module
(about 20 s on 2 cores with a cold Inductor cache)."""

from __future__ import annotations

import argparse

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.step_types import ScheduledSequence, SchedulerOutput
from minivllm.engine.worker.loading import compile_decision
from minivllm.engine.worker.warmup import warmup_batch
from minivllm.entrypoints.engine_args import add_engine_args, engine_kwargs
from minivllm.models.compiled_forward import padded_num_tokens

SIZES = (1, 2, 4, 8, 16)
ENGINE = dict(block_size=4, num_kv_blocks=96)


@pytest.fixture(scope="module")
def engines(model_factory):
    path = model_factory("qwen3")
    eager = LLM(path, enforce_eager=True, **ENGINE)
    compiled = LLM(path, enforce_eager=False, compile_sizes=SIZES, **ENGINE)
    yield eager, compiled
    eager.shutdown()
    compiled.shutdown()


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_padded_num_tokens():
    assert [padded_num_tokens(SIZES, n) for n in (1, 2, 3, 5, 16, 17, 40)] == [1, 2, 4, 8, 16, 17, 40]


def test_compiled_engine_is_compiled_and_pads_to_sizes(engines):
    eager, compiled = engines
    assert compiled.llm_engine.model.compiled.sizes == SIZES
    assert compiled.llm_engine.compilation.startswith("compiled")
    assert eager.llm_engine.model.compiled is None and "enforce_eager=True" in eager.llm_engine.compilation
    runner = compiled.llm_engine.model_runner
    assert runner.scratch_block == runner.num_blocks == 96  # one block past those the block manager owns
    assert runner.kv_cache.shape[2] == 97 and compiled.llm_engine.block_manager.num_blocks == 96


@pytest.mark.parametrize("case", ["padded", "exact", "too_large"])
def test_identical_tokens_eager_vs_compiled(engines, case):
    """Greedy and seeded sampling; batches whose rows are padded (3 -> 4, 11 -> 16), fill a size
    exactly (4, 2 x 4 + 8 = 16, then decodes of 2), or exceed the largest size (eager steps in between)."""
    prompts = {"padded": [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16]],
               "exact": [[20, 21, 22, 23], [30, 31, 32, 33]],
               "too_large": [list(range(40, 70)), [3, 4]]}[case]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=11, ignore_eos=True)]
    eager, compiled = engines
    assert _run(compiled, prompts, params) == _run(eager, prompts, params)


def test_identical_tokens_for_a_model_without_qk_norm(model_factory):
    """Llama rotates q's and k's heads in one call (models/llama.py) and hands attention strided views of
    the result; compiled and padded (3 decodes -> 4 rows) it still gives the eager tokens."""
    path = model_factory("llama")
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    params = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)] * 3
    with LLM(path, enforce_eager=False, compile_sizes=(1, 2, 4, 8), **ENGINE) as c, \
            LLM(path, enforce_eager=True, **ENGINE) as e:
        assert _run(c, prompts, params) == _run(e, prompts, params)


def test_identical_tokens_with_forks_and_drafts(engines, model_factory):
    """n > 1 forks (copy-on-write blocks) and speculative verification rows (1 + k rows a sequence)."""
    eager, compiled = engines
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [50, 51, 52]]
    params = [SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    assert _run(compiled, prompts, params) == _run(eager, prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    path = model_factory("qwen3")
    with LLM(path, enforce_eager=False, compile_sizes=SIZES, speculative_config=spec, **ENGINE) as c, \
            LLM(path, enforce_eager=True, speculative_config=spec, **ENGINE) as e:
        greedy = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
        assert _run(c, prompts, greedy) == _run(e, prompts, greedy)


def test_int8_compiles_with_identical_tokens(model_factory):
    """int8 layers run fbgemm's packed weights through an opaque op (layers/quantization.py); the graph
    around them gives the eager engine's tokens, with padding rows (three decodes padded to 4 rows: int8
    rows are quantized on a fixed grid, so the padding cannot shift them) and without."""
    path = model_factory("qwen3")
    with LLM(path, quantization="int8", enforce_eager=False, compile_sizes=(1, 2, 4, 8), **ENGINE) as c, \
            LLM(path, quantization="int8", enforce_eager=True, **ENGINE) as e:
        assert c.llm_engine.model.compiled is not None
        three = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]  # a 9-row prefill (eager), then decodes of 3 -> 4 rows
        params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)] * 3
        before = c.get_stats().num_steps
        padded = c.generate([{"prompt_token_ids": p} for p in three], params, use_tqdm=False)
        assert c.get_stats().num_steps - before == 8
        reference = e.generate([{"prompt_token_ids": p} for p in three], params, use_tqdm=False)
        for got, want in zip(padded, reference):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-4)
        one, single = [list(range(20, 28))], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
        assert _run(c, one, single) == _run(e, one, single)


def test_padding_rows_write_only_the_scratch_block(model_factory):
    llm = LLM(model_factory("qwen3"), enforce_eager=False, compile_sizes=SIZES, warmup=False, **ENGINE)
    runner = llm.llm_engine.model_runner
    seq = Sequence("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=1))
    seq.block_table = [10, 11]
    plan = SchedulerOutput([ScheduledSequence(seq, 0, 5)])  # 5 rows -> padded to 8
    inputs = runner.prepare_inputs(plan).inputs
    assert inputs.input_ids.shape == (8,) and inputs.attn_metadata.num_tokens == 5
    bs, scratch = runner.block_size, runner.scratch_block
    assert (inputs.attn_metadata.slot_mapping[5:] // bs == scratch).all()
    assert inputs.attn_metadata.block_tables.shape[0] == 1  # the scratch block is in no request's table
    before = runner.kv_cache.clone()
    llm.llm_engine.executor.execute_model(plan)
    changed = (runner.kv_cache != before).flatten(3).any(-1).any(0).any(0)  # (num_blocks + 1,) per block
    assert set(changed.nonzero().flatten().tolist()) == {10, 11, scratch}
    llm.shutdown()


def test_compile_decision_and_validation(model_factory):
    cpu = torch.device("cpu")
    path = model_factory("qwen3")
    llm = LLM(path, warmup=False, **ENGINE)  # the default: None
    model = llm.llm_engine.model
    assert llm.llm_engine.config.enforce_eager is None and model.compiled is None
    assert "enforce_eager=None on CPU" in compile_decision(model, EngineConfig(path), cpu)[1]
    assert compile_decision(model, EngineConfig(path), torch.device("cuda"))[0]
    assert compile_decision(model, EngineConfig(path, enforce_eager=False, quantization="int8"), cpu)[0]
    assert not compile_decision(model, EngineConfig(path, enforce_eager=False, tensor_parallel_size=2), cpu)[0]
    llm.shutdown()
    for bad in ((), (0, 4), (1, "2"), 8):
        with pytest.raises(ValueError, match="compile_sizes"):
            EngineConfig(path, compile_sizes=bad)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(path, enforce_eager="yes")
    assert EngineConfig(path, compile_sizes=[4, 1]).compile_sizes == (4, 1)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--no-enforce-eager", "--compile-sizes", "1,2,4"])
    assert engine_kwargs(args) == {"enforce_eager": False, "compile_sizes": (1, 2, 4)}


def test_warmup_splits_a_compiled_size_longer_than_the_model_positions(engines):
    """A compiled size may exceed max_position_embeddings (several sequences share a step); its warm-up
    step must not read RoPE past the table (in a compiled kernel that aborts the process)."""
    runner = engines[1].llm_engine.model_runner
    cap = 100  # as if the model had 100 positions (the pool holds 384 tokens)
    n = 2 * cap + 5
    batch = warmup_batch(n, runner.block_size, runner.num_blocks, cap)
    assert sum(s.num_new_tokens for s in batch) == n and len(batch) > 1
    assert all(s.num_new_tokens <= cap and s.start == 0 for s in batch)
    blocks = [b for s in batch for b in s.seq.block_table]
    assert len(blocks) == len(set(blocks)) and max(blocks) < runner.num_blocks
    huge = warmup_batch(10 ** 6, runner.block_size, runner.num_blocks, runner.spec.max_position_embeddings)
    assert sum(s.num_new_tokens for s in huge) <= runner.num_blocks * runner.block_size
