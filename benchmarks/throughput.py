"""Throughput: minivllm against HF transformers on the same model and workload, in one process.

Workload (the core-engine issue's): a random ~30M-parameter Qwen3 in fp32, 32 requests, prompts of
16-128 tokens and outputs of 8-128 tokens (uniform, seeded), greedy, EOS ignored so every system
does the same work. Reported tok/s count the generated tokens that were asked for.

  * minivllm        LLM.generate over all 32 requests (continuous batching, paged KV)
  * HF generate     one static batch, left-padded; it runs until the longest output is done
  * HF continuous   transformers' own continuous batching (`init_continuous_batching`), with each
                    request's own max_new_tokens

Each system first runs a warm-up workload of the same shape with other tokens. Also printed: the
share of minivllm's step time spent outside the model forward.

    python benchmarks/throughput.py [--num-requests 32] [--skip-hf-cb] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.testing import make_tiny_model  # noqa: E402

BENCH_MODEL = dict(family="qwen3", vocab_size=32000, hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2,
                   head_dim=64, intermediate_size=1536, tie_word_embeddings=True, max_position_embeddings=1024)


def workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(16, 128))] for _ in range(n)]
    outputs = [rng.randint(8, 128) for _ in range(n)]
    return prompts, outputs


def run_minivllm(path: str, prompts, outputs, warmup) -> tuple[float, dict]:
    llm = LLM(path, dtype="float32", device="cpu")
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate([{"prompt_token_ids": p} for p in warmup[0]],  # a different workload: no cache hits
                 [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in warmup[1]], use_tqdm=False)
    before = llm.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == outputs
    after = llm.get_stats()
    step = after.step_time_s - before.step_time_s
    fwd = after.forward_time_s - before.forward_time_s
    llm.shutdown()
    return elapsed, {"steps": after.num_steps - before.num_steps, "overhead": 1 - fwd / step,
                     "outside_step": 1 - step / elapsed}


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
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=mask, generation_config=cfg)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--model", help="checkpoint folder (default: a random ~30M Qwen3 built here)")
    ap.add_argument("--skip-hf-cb", action="store_true", help="skip HF continuous batching (slow)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(make_tiny_model(tmp, **BENCH_MODEL))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        params = sum(p.numel() for p in hf.parameters()) / 1e6
        prompts, outputs = workload(args.num_requests, hf.config.vocab_size)
        warmup = workload(args.num_requests, hf.config.vocab_size, seed=1)  # same sizes class, other tokens
        tokens = sum(outputs)
        print(f"model: {hf.config.architectures[0]} {params:.1f}M params, fp32, {args.threads} threads; "
              f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {tokens} output tokens")
        t_mini, info = run_minivllm(path, prompts, outputs, warmup)
        print(f"minivllm        {tokens / t_mini:8.1f} tok/s  ({t_mini:.2f} s, {info['steps']} steps; "
              f"{100 * info['overhead']:.1f}% of step time outside the model forward, "
              f"{100 * info['outside_step']:.1f}% of wall time outside step())")
        t_gen = run_hf_generate(hf, prompts, outputs, warmup)
        print(f"HF generate     {tokens / t_gen:8.1f} tok/s  ({t_gen:.2f} s)   minivllm is {t_gen / t_mini:.2f}x")
        if not args.skip_hf_cb:
            t_cb = run_hf_continuous(hf, prompts, outputs)
            print(f"HF continuous   {tokens / t_cb:8.1f} tok/s  ({t_cb:.2f} s)   minivllm is {t_cb / t_mini:.2f}x")


if __name__ == "__main__":
    main()
