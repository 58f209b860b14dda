"""Batch invariance (`batch_invariant=True`): a request's tokens, and the bits of its logprobs, do not
depend on the requests that share its steps nor on how its prompt was chunked because of them.

The building blocks bit for bit (the tiled matmul, the per-row attention), each beside its plain
reference; then the engine end to end: one prompt alone and inside batches of 1-16 others of varied
lengths, a small token budget forcing different chunkings, fp32 and bf16; and what the mode refuses."""

from __future__ import annotations

import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.layers.attention_interface import AttentionMetadata
from minivllm.layers.batch_invariance import TiledLinearMethod, reference_linear, tiled_linear
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.layers.per_row_attention import PerRowAttentionBackend

DTYPES = [torch.float32, torch.bfloat16]
needs_bf16 = pytest.mark.skipif(not CpuInfo.read().native_bf16, reason="this CPU does not compute bf16 natively")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, in_features", [(128, 64), (384, 64), (96, 40)])
def test_tiled_linear_gives_a_row_the_same_bits_in_any_batch(dtype, out_features, in_features):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    row = torch.randn(1, in_features, generator=g).to(dtype)
    alone = tiled_linear(row, w, b)  # (1, out)
    torch.testing.assert_close(alone, reference_linear(row, w, b))  # the same product, up to rounding
    for rows in (2, 3, 7, 16, 17, 40):
        batch = torch.randn(rows, in_features, generator=g).to(dtype)
        for at in {0, rows // 2, rows - 1}:  # first, middle and last row; in the first, a middle or the last tile
            batch[at] = row[0]
            assert torch.equal(tiled_linear(batch, w, b)[at], alone[0]), f"row {at} of {rows}"


def _prompt_qkv(n: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(n, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))


def _attend_in_chunks(backend: PerRowAttentionBackend, q, k, v, chunks: list[int], block_size: int = 4):
    """One request's prompt, computed as consecutive chunks (one step each) over a fresh paged cache
    whose blocks are laid out backwards (so a row's keys are not simply contiguous)."""
    n, kv_heads, dim = k.shape
    num_blocks = -(-n // block_size)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim, dtype=q.dtype)
    table = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32)[None]  # (1, num_blocks)
    slots = torch.tensor([int(table[0, p // block_size]) * block_size + p % block_size for p in range(n)])
    outs, done = [], 0
    for c in chunks:
        meta = AttentionMetadata(slots[done:done + c], torch.tensor([0, c], dtype=torch.int32),
                                 torch.tensor([done + c], dtype=torch.int32), table, [c], [done + c], block_size)
        backend.prepare(meta)
        outs.append(backend.forward(q[done:done + c], k[done:done + c], v[done:done + c], cache, meta))
        done += c
    return torch.cat(outs)  # (n, heads * dim)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch_loop"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_row_attention_gives_the_same_bits_under_any_chunking(kernel, dtype):
    if kernel and not load_cpu_kernels().available:
        pytest.skip(load_cpu_kernels().detail)
    backend = PerRowAttentionBackend(4, 2, 16, dtype)
    backend.uses_kernel = kernel  # both paths must be invariant (which one runs is fixed per engine)
    q, k, v = _prompt_qkv(23, 4, 2, 16, dtype)
    whole = _attend_in_chunks(backend, q, k, v, [23])
    for chunks in ([8, 15], [1, 5, 4, 13], [1] * 23):
        assert torch.equal(_attend_in_chunks(backend, q, k, v, chunks), whole), chunks
    # ... and it is causal attention: the plain reference, SDPA with GQA's heads repeated
    qr, kr, vr = (t.float().transpose(0, 1) for t in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)  # (heads, n, dim)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole.float(), ref.transpose(0, 1).reshape(23, -1), **tol)


def _varied(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.choice((1, 2, 5, 9, 16, 23, 31)))] for _ in range(n)]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16)])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_prompt_gets_the_same_tokens_and_logprobs_alone_and_in_any_batch(family, dtype, model_factory):
    """A 37-token prompt alone (chunks of 12, 12, 12, 1), then beside 1-16 others submitted with it, before
    and after it (so it starts at other offsets of the 12-token budget and is chunked otherwise), greedy for
    24 tokens. Prefix caching off: every run computes the prompt anew."""
    llm = LLM(model_factory(family), dtype=dtype, block_size=4, num_kv_blocks=512, max_num_batched_tokens=12,
              enable_prefix_caching=False, batch_invariant=True)
    vocab = llm.llm_engine.spec.vocab_size
    rng = random.Random(7)
    target = [rng.randrange(3, vocab) for _ in range(37)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)

    def tokens_and_logprobs(prompts: list[list[int]], at: int) -> tuple[list[int], list]:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[at].outputs[0]
        return out.token_ids, out.logprobs

    alone = tokens_and_logprobs([target], 0)
    for others in (1, 5, 16):
        batch = _varied(rng, others, vocab)
        at = rng.randrange(others + 1)
        assert tokens_and_logprobs(batch[:at] + [target] + batch[at:], at) == alone, f"{others} others, at {at}"
    llm.shutdown()


def test_the_mode_runs_its_fixed_paths_and_says_so(model_factory):
    llm = LLM(model_factory("qwen3"), block_size=4, num_kv_blocks=64, batch_invariant=True)
    engine = llm.llm_engine
    assert isinstance(engine.model.lm_head_layer.quant_method, TiledLinearMethod)
    assert isinstance(engine.model_runner.backend, PerRowAttentionBackend)
    assert engine.model.compiled is None  # eager
    said = "\n".join(engine.model_runner.measure_cpu_kernels())
    assert "fixed tiles of 16 rows" in said and "nothing measured" in said
    assert engine.model.model.norm.kernels is None and not engine.model_runner.sampler.greedy_kernel.used
    llm.shutdown()


@pytest.mark.parametrize("change, named", [
    (dict(device="cuda"), "device='cuda'"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=2"),
    (dict(enforce_eager=False), "enforce_eager=False"),
    (dict(attention_backend="triton"), "attention_backend='triton'"),
    (dict(quantization="int8"), "quantization='int8'"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
])
def test_the_mode_refuses_what_it_does_not_cover_naming_the_field(change, named):
    with pytest.raises(ValueError, match="batch_invariant=True") as err:
        EngineConfig("some/model", batch_invariant=True, **change)
    assert named in str(err.value) and "batch_invariant=False" in str(err.value)


def test_the_mode_refuses_a_hybrid_model(tmp_path):
    from minivllm.teaching.checkpoints import make_tiny_model

    path = make_tiny_model(tmp_path, family="qwen3_5", num_layers=4)
    with pytest.raises(ValueError, match="batch_invariant=True with Qwen3_5.*chunked gated delta rule"):
        LLM(str(path), warmup=False, dtype="float32", block_size=4, num_kv_blocks=64, batch_invariant=True)


def test_the_flag_is_generated_from_the_field():
    import argparse

    from minivllm.entrypoints.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert "batch_invariant" not in engine_kwargs(parser.parse_args([]))
