"""Gemma 3 in the engine: exact against HF transformers (tiny random configs, a window of 8 tokens, far
shorter than the prompts), with the sliding-window layers in a KV-cache group of their own."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import varied_prompts
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.engine.core.block_manager import NULL_BLOCK
from minivllm.models.hf_config import parse_model_spec
from minivllm.teaching.checkpoints import make_tiny_model
from minivllm.teaching.hf_check import assert_hf_greedy

torch.set_num_threads(1)  # tiny tensors: threads only add overhead on 2 cores
WINDOW, BLOCK = 8, 4
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    # local RoPE default, global RoPE linearly scaled (Gemma 3's own recipe: the scaling on full layers only)
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    return str(make_tiny_model(tmp_path_factory.mktemp("gemma3"), family="gemma3", num_layers=4, rope_scaling=rope))


@pytest.fixture(scope="module")
def hf(gemma_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def gemma(path: str, **kwargs) -> LLM:
    return LLM(path, warmup=False, dtype="float32", **{"block_size": BLOCK, "num_kv_blocks": 64, **kwargs})


def greedy_ok(llm: LLM, hf, prompts: list[list[int]], sp: SamplingParams = GREEDY) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            assert_hf_greedy(hf, p, c.token_ids)
    return outs


def test_greedy_matches_hf_across_the_window_with_chunks_mixed_batches_and_preemption(gemma_dir, hf):
    prompts = varied_prompts(8, 384, seed=3)
    assert max(map(len, prompts)) > 2 * WINDOW
    # a small budget cuts prompts into chunks across the window's edge; a small pool preempts
    llm = gemma(gemma_dir, max_num_batched_tokens=12, num_kv_blocks=22)
    greedy_ok(llm, hf, prompts)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.num_mixed_steps > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.kv_blocks_in_use == {"full_attention": 0, "sliding_attention": 0}


def test_the_sliding_group_holds_a_window_of_blocks_mid_decode(gemma_dir, hf):
    llm = gemma(gemma_dir)
    engine = llm.llm_engine
    prompt = varied_prompts(8, 384, seed=11)[-1][:20]
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30,
                                                                             ignore_eos=True))
    bound = -(-WINDOW // BLOCK) + 1
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        for seq in engine.scheduler.running:
            held = [b for b in seq.sliding_block_table if b != NULL_BLOCK]
            assert len(held) <= bound, (seq.num_tokens, seq.sliding_block_table)
            assert len(seq.block_table) == -(-seq.num_computed_tokens // BLOCK) or seq.num_output_tokens == 0
            stats = llm.get_stats()
            assert stats.kv_blocks_in_use == {"full_attention": len(seq.block_table), "sliding_attention": len(held)}
    assert_hf_greedy(hf, prompt, outs[0].outputs[0].token_ids)


def test_prefix_caching_hits_and_gives_the_same_tokens_as_without(gemma_dir, hf):
    shared = varied_prompts(8, 384, seed=5)[-1][:24]
    prompts = [shared + [7 + i, 30 + i, 50] for i in range(4)]
    on = gemma(gemma_dir)
    first = greedy_ok(on, hf, prompts[:1])
    rest = greedy_ok(on, hf, prompts[1:])
    assert on.get_stats().prefix_cache_hits >= 3 * 24
    off = gemma(gemma_dir, enable_prefix_caching=False)
    again = off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in again]


def test_forks_and_ngram_drafts_match_hf(gemma_dir, hf):
    prompts = [p + p[:6] * 2 for p in varied_prompts(3, 384, seed=9)]  # repeats: the n-gram proposer drafts
    llm = gemma(gemma_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    greedy_ok(llm, hf, prompts, SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True))
    stats = llm.get_stats()
    assert stats.num_draft_tokens > 0 and stats.num_free_blocks == stats.num_total_blocks


def test_the_multimodal_checkpoint_and_transformers_4_keys_load_the_same_decoder(gemma_dir, hf, tmp_path):
    """Gemma3ForConditionalGeneration as transformers 4 saved it: weights under language_model.model., a vision
    tower beside them, the text keys under text_config with rope_theta / rope_local_base_freq / rope_scaling."""
    cfg = json.loads(open(f"{gemma_dir}/config.json").read())
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "rope_parameters", "layer_types")}
    text.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                rope_scaling={"rope_type": "linear", "factor": 4.0}, sliding_window_pattern=2)
    folder = tmp_path / "mm"
    shutil.copytree(gemma_dir, folder)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                    "text_config": text, "eos_token_id": cfg["eos_token_id"]}))
    weights = load_file(str(folder / "model.safetensors"))
    renamed = {"language_model." + k: v for k, v in weights.items()}
    renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(folder / "model.safetensors"))
    prompts = varied_prompts(3, 384, seed=4)
    greedy_ok(gemma(str(folder)), hf, prompts)


def test_unsupported_gemma_settings_are_refused_by_name(gemma_dir):
    cfg = json.loads(open(f"{gemma_dir}/config.json").read())
    for key, value, match in (("final_logit_softcapping", 30.0, "final_logit_softcapping"),
                              ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
                              ("use_bidirectional_attention", True, "bidirectional"),
                              ("layer_types", ["sliding_attention"] * 4, "at least one full-attention layer"),
                              ("sliding_window", None, "sliding_window")):
        with pytest.raises(ValueError, match=match):
            parse_model_spec({**cfg, key: value})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(gemma_dir, warmup=False, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="sliding-window layers"):
        LLM(gemma_dir, warmup=False, batch_invariant=True, device="cpu")


def test_the_cpu_decode_kernel_honours_the_window(gemma_dir, hf):
    from minivllm.kernels.cpu_build import load_cpu_kernels
    from minivllm.layers.torch_attention import DECODE_CANDIDATES
    from minivllm.cpu.tuner import forced

    if not load_cpu_kernels().available:
        pytest.skip("the C++ CPU kernels cannot be built here")
    llm = gemma(gemma_dir)
    backend = llm.llm_engine.model_runner.backend
    backend.decode_kernel = forced(DECODE_CANDIDATES, "kernel", "forced by the test")  # decode rows: the C++ kernel, window W
    greedy_ok(llm, hf, varied_prompts(8, 384, seed=6)[4:])


@pytest.mark.slow  # ~15 s: the Triton interpreter
def test_the_triton_kernels_honour_the_window(gemma_dir, hf, monkeypatch):
    """The Triton backend (the interpreter on CPU): paged attention over chunks, and the grouped decode kernel
    cut into splits (a context of 9 blocks, few rows), both with the window; blocks of 16 tokens, twice the
    window."""
    from minivllm.kernels import grouped_decode_attention as gd

    monkeypatch.setattr(gd, "MIN_KEYS_PER_SPLIT", 32)  # split these short contexts too (GPU: >= 128 keys a split)
    llm = gemma(gemma_dir, attention_backend="triton", block_size=16, max_num_batched_tokens=48)
    long_prompt = varied_prompts(9, 384, seed=12)[-1] * 2  # 140 tokens: chunks, then split decodes
    greedy_ok(llm, hf, [long_prompt, long_prompt[:20] + [5, 6]], SamplingParams(temperature=0, max_tokens=4,
                                                                                 ignore_eos=True))
    assert llm.get_stats().prefix_cache_hits == 16


def test_a_trace_and_a_llama_draft_model_work_beside_the_groups(gemma_dir, hf, model_factory):
    """A Gemma target with a Qwen3 draft (same tokenizer and vocabulary): the draft keeps its own pool, indexed by
    the full group's tables; a Gemma draft is refused by name. The trace draws the full group's pool."""
    llm = gemma(gemma_dir, record_trace=True, speculative_config={"model": model_factory("qwen3"),
                                                                  "num_speculative_tokens": 2})
    greedy_ok(llm, hf, varied_prompts(8, 384, seed=8)[5:])
    trace = llm.get_trace()
    assert trace and trace[0].num_total_blocks == llm.llm_engine.block_manager.full.num_blocks
    assert llm.get_stats().num_draft_tokens > 0
    with pytest.raises(ValueError, match="sliding-window layers"):
        gemma(gemma_dir, speculative_config={"model": gemma_dir, "num_speculative_tokens": 2})


def test_a_mistral_checkpoint_with_a_window_is_refused_by_name(model_factory):
    cfg = json.loads(open(f"{model_factory('mistral')}/config.json").read())
    assert cfg["architectures"] == ["MistralForCausalLM"] and parse_model_spec(cfg).sliding_window is None
    with pytest.raises(ValueError, match="sliding_window=4096"):
        parse_model_spec({**cfg, "sliding_window": 4096})


def test_a_gemma_whose_layers_are_all_full_has_one_group(gemma_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "all_full"
    shutil.copytree(gemma_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "layer_types": ["full_attention"] * 4}))
    llm = gemma(str(folder))
    assert llm.get_stats().kv_blocks_in_use == {"full_attention": 0}  # a plain BlockManager
    greedy_ok(llm, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
              varied_prompts(8, 384, seed=2)[6:])


def test_the_memory_budget_gives_the_sliding_pool_its_windows_but_at_most_half(gemma_dir):
    from minivllm.config import EngineConfig
    from minivllm.engine.worker.kv_cache import kv_block_bytes, num_kv_blocks_for

    spec = parse_model_spec(json.loads(open(f"{gemma_dir}/config.json").read()))
    full = kv_block_bytes(spec, BLOCK, torch.float32)
    sliding = kv_block_bytes(spec, BLOCK, torch.float32, len(spec.sliding_attention_layers))
    for budget in (2**16, 2**20, 2**26):  # the half binds; then the windows' bound does
        config = EngineConfig(model=gemma_dir, block_size=BLOCK, cpu_kv_cache_bytes=budget)
        pools = num_kv_blocks_for(config, spec, torch.device("cpu"), torch.float32)
        used = pools.num_blocks * full + pools.num_sliding_blocks * sliding
        assert pools.num_sliding_blocks * sliding <= budget // 2 and pools.num_sliding_blocks <= pools.num_blocks
        assert budget - full < used <= budget  # nothing idle but less than a block
    assert pools.num_sliding_blocks == config.max_num_seqs * (WINDOW // BLOCK + 3) + -(
        -config.max_num_batched_tokens // BLOCK)

