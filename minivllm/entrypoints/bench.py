"""Benchmarks: minivllm against HF transformers on the same model and workload, in one process.

`throughput` (the core-engine workload): a random ~30M-parameter Qwen3 in fp32 (or --model), 32
requests, prompts of 16-128 tokens and outputs of 8-128 tokens (uniform, seeded), greedy, EOS
ignored so every system does the same work, token ids in and out (minivllm with detokenize=False:
HF returns ids too). tok/s count the generated tokens that were asked for.
  * minivllm        LLM.generate over all requests (continuous batching, paged KV)
  * HF generate     one static batch, left-padded; it runs until the longest output is done
  * HF continuous   transformers' own continuous batching (`init_continuous_batching`), with each
                    request's own max_new_tokens
Each system first runs a warm-up workload of the same shape with other tokens. Also printed: the
share of minivllm's step time spent outside the model forward.

`single_stream`: one request, 64 new tokens, batch 1, on the default model (SmolLM2-135M) unless
--model: local chat speed, minivllm with its defaults (dtype "auto") against HF `generate` in fp32.
It also prints the single-stream ceiling on this CPU: the measured read bandwidth / the matmul weight
bytes a token streams (as the run stores them: fp32, bf16 or int8), and the fraction of it reached.
The prompt's step streams the weights once too, so N new tokens stream them N times.

Both first print the CPU (model name, AMX, avx512_bf16), the dtype, and the matmul form minivllm chose
by measurement for each weight shape and row bucket (see `minivllm/cpu/matmul_plan.py`); after the
run, the achieved weight bandwidth and matmul FLOP/s against the machine's peaks, measured at start
(`roofline.py`). Every engine flag is passed on: `--dtype bfloat16`, `--quantization int8`,
`--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'`, ...

    minivllm bench [--num-requests 32] [--no-hf-cb] [--model PATH] [engine flags]
    minivllm bench --single-stream [--model PATH] [engine flags]
"""

from __future__ import annotations

import os
import random
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.bench_peers import level_line
from minivllm.entrypoints.roofline import ceiling_report, matmul_weights, measure_peaks, report, single_stream_ceiling
from minivllm.layers.fused_moe import count_experts
from minivllm.cpu.attach import describe
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.teaching.checkpoints import make_tiny_model

BENCH_MODEL = dict(family="qwen3", vocab_size=32000, hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2,
                   head_dim=64, intermediate_size=1536, tie_word_embeddings=True, max_position_embeddings=1024)


def workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(16, 128))] for _ in range(n)]
    outputs = [rng.randint(8, 128) for _ in range(n)]
    return prompts, outputs


def _greedy(outputs: list[int]) -> list[SamplingParams]:
    # Token ids only (detokenize=False), as HF generate returns them: text is not what is compared.
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in outputs]


def print_matmul_plan(llm: LLM) -> None:
    """Print what warm-up attached to the model (the CPU matmul plan, the ways RMSNorm, RoPE and silu·mul run:
    cpu/attach.py) and the ways decode attention and greedy sampling run."""
    model = llm.llm_engine.model
    print("\n".join(describe(model, model.lm_head_layer)))
    decode_kernel = getattr(llm.llm_engine.model_runner.backend, "decode_kernel", None)  # the PyTorch backend's
    if decode_kernel is not None:
        print(decode_kernel)
    greedy_kernel = getattr(llm.llm_engine.model_runner.sampler, "greedy_kernel", None)  # the PyTorch sampler's
    if greedy_kernel is not None:
        print(greedy_kernel)
    print(f"forward: {llm.llm_engine.compilation}")


def run_minivllm(llm: LLM, prompts, outputs, warmup) -> tuple[float, dict]:
    llm.generate([{"prompt_token_ids": p} for p in warmup[0]], _greedy(warmup[1]), use_tqdm=False)
    before = llm.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(outputs), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == outputs
    after = llm.get_stats()
    step = after.step_time_s - before.step_time_s
    fwd = after.forward_time_s - before.forward_time_s
    rows = (after.num_prefill_tokens + after.num_decode_tokens) - (before.num_prefill_tokens + before.num_decode_tokens)
    return elapsed, {"steps": after.num_steps - before.num_steps, "overhead": 1 - fwd / step,
                     "outside_step": 1 - step / elapsed, "rows": rows}


@torch.inference_mode()
def run_hf_generate(model, prompts, outputs, warmup=None) -> float:
    if warmup is not None:
        run_hf_generate(model, *warmup)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    cfg = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=None, pad_token_id=0)
    ids, mask = ids.to(model.device), mask.to(model.device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=mask, generation_config=cfg)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - t0


@torch.inference_mode()
def run_hf_continuous(model, prompts, outputs) -> float:
    cfg = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=600) as manager:
        ids = [manager.add_request(p, max_new_tokens=m) for p, m in zip(prompts, outputs)]
        done = 0
        while done < len(ids):
            result = manager.get_result(timeout=600)
            if result is not None and result.is_finished():
                done += 1
    return time.perf_counter() - t0


def throughput(model: str | None = None, num_requests: int = 32, hf_cb: bool = True, hf: bool = True,
               **engine_kwargs) -> dict:
    """`engine_kwargs` (the CLI's engine flags: --dtype, --quantization, --speculative-config ...) go to
    `LLM`; HF runs in the dtype the engine resolved."""
    with tempfile.TemporaryDirectory() as tmp:
        path = model or str(make_tiny_model(tmp, **BENCH_MODEL))
        llm = LLM(path, **{"device": "cpu", **engine_kwargs})
        spec, dtype = llm.llm_engine.spec, llm.llm_engine.dtype
        prompts, outputs = workload(num_requests, spec.vocab_size)
        warmup = workload(num_requests, spec.vocab_size, seed=1)  # same shape, other tokens: no cache hits
        tokens = sum(outputs)
        weights = matmul_weights(llm.llm_engine.model)
        print(f"model: {spec.architecture} {weights.total_params / 1e6:.1f}M matmul "
              f"params, {_describe(llm)}, {torch.get_num_threads()} threads, {level_line()}; {len(prompts)} requests, "
              f"{sum(map(len, prompts))} prompt tokens, {tokens} output tokens")
        print_matmul_plan(llm)
        peaks = measure_peaks(dtype)
        t_mini, info = run_minivllm(llm, prompts, outputs, warmup)
        llm.shutdown()
        result = {"minivllm_tok_s": tokens / t_mini, "overhead": info["overhead"], "dtype": dtype}
        print(f"minivllm        {tokens / t_mini:8.1f} tok/s  ({t_mini:.2f} s, {info['steps']} steps; "
              f"{100 * info['overhead']:.1f}% of step time outside the model forward, "
              f"{100 * info['outside_step']:.1f}% of wall time outside step())")
        print(report(peaks, weights, t_mini, info["steps"], info["rows"], tokens))
        if not hf:
            return result
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        t_gen = run_hf_generate(hf_model, prompts, outputs, warmup)
        result["vs_hf_generate"] = t_gen / t_mini
        print(f"HF generate     {tokens / t_gen:8.1f} tok/s  ({t_gen:.2f} s, {_name(dtype)})   "
              f"minivllm is {t_gen / t_mini:.2f}x")
        if hf_cb:
            t_cb = run_hf_continuous(hf_model, prompts, outputs)
            result["vs_hf_continuous"] = t_cb / t_mini
            print(f"HF continuous   {tokens / t_cb:8.1f} tok/s  ({t_cb:.2f} s)   minivllm is {t_cb / t_mini:.2f}x")
        return result


def single_stream(model: str | None = None, new_tokens: int = 64, hf: bool = True,
                  prompt: str = "The capital of France is", repeats: int = 3, **engine_kwargs) -> dict:
    """Each system: one warm-up generation of the same length (another prompt), then the median of
    `repeats` timed runs (prefix caching is switched off so every run computes its prompt). minivllm
    runs with its defaults (dtype "auto") and `engine_kwargs`; HF `generate` in fp32, its CPU default."""
    llm = LLM(model, **{"device": "cpu", "enable_prefix_caching": False, **engine_kwargs})
    path = llm.llm_engine.config.model
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    print_matmul_plan(llm)
    weights = matmul_weights(llm.llm_engine.model)
    peaks = measure_peaks(llm.llm_engine.dtype, read_bytes=max(256 << 20, weights.bytes))
    llm.generate("Once upon a time", sp, use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    t_mini = sorted(times)[len(times) // 2]
    print(f"single stream, batch 1, {new_tokens} new tokens, {torch.get_num_threads()} threads, median of {repeats}; "
          f"{level_line()}")
    print(f"minivllm        {new_tokens / t_mini:6.1f} tok/s  ({_describe(llm)})")
    print(report(peaks, weights, t_mini, new_tokens, new_tokens + len(llm.get_tokenizer()(prompt).input_ids),
                 new_tokens))
    print(ceiling_report(CpuInfo.read(), peaks, weights, new_tokens / t_mini, _describe(llm)))
    llm.shutdown()
    ceiling = single_stream_ceiling(peaks, weights)
    result = {"minivllm_tok_s": new_tokens / t_mini, "dtype": llm.llm_engine.dtype, "ceiling_tok_s": ceiling,
              "ceiling_fraction": new_tokens / t_mini / ceiling}
    if hf:
        tok = AutoTokenizer.from_pretrained(path)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        kw = dict(do_sample=False, pad_token_id=tok.pad_token_id or 0, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens)
        times = []
        with torch.inference_mode():
            hf_model.generate(**tok("Once upon a time", return_tensors="pt"), **kw)  # warm-up
            ids = tok(prompt, return_tensors="pt")
            for _ in range(repeats):
                t0 = time.perf_counter()
                hf_model.generate(**ids, **kw)
                times.append(time.perf_counter() - t0)
        t_hf = sorted(times)[len(times) // 2]
        result["vs_hf_generate"] = t_hf / t_mini
        print(f"HF generate     {new_tokens / t_hf:6.1f} tok/s  (float32)   minivllm is {t_hf / t_mini:.2f}x")
    return result


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(llm: LLM) -> str:
    """The precision the engine runs in, e.g. "bfloat16 (dtype auto)" or "bfloat16, int8 weights"."""
    config = llm.llm_engine.config
    quantized = f", {config.quantization} weights" if config.quantization else ""
    if quantized and count_experts(llm.llm_engine.model) is not None:  # int8 leaves them (layers/quantization.py)
        quantized += f", experts {_name(llm.llm_engine.dtype)}"
    return f"{_name(llm.llm_engine.dtype)} (dtype {config.dtype}){quantized}"


def set_threads(threads: int | None) -> None:
    torch.set_num_threads(threads or min(2, os.cpu_count() or 1))
