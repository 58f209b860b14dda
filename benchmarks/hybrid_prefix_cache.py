"""What state snapshots buy a hybrid model's prefix caching, and what keeping them costs.

    python benchmarks/hybrid_prefix_cache.py [--system 480] [--requests 8] [--repeats 3]

Tiny random models of the same sizes (hidden 64, 4 layers, block 16): a Qwen3.5 hybrid (gated DeltaNet
+ full attention) and a pure-attention Qwen3.
  1. shared system prompt (issue 31's case): one request warms the cache with the system prompt, then
     `--requests` requests of the system prompt + 4 tokens of their own. Counted: prompt tokens computed
     in prefill (the rest came from the cache), for the hybrid with prefix caching on and off, and for
     Qwen3; and the seconds of the batch (best of `--repeats`, fresh engines), as ratios in the same run.
  2. the cost of keeping snapshots: one cold 2,048-token prompt prefilled with prefix caching on (the
     chunked rule keeps the state every 64 tokens, the commit copies 32 snapshots into the cache) and
     off, best of `--repeats`; the ratio on / off.
The numbers in docs/guides/benchmarks.md came from here.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams
from minivllm.teaching.checkpoints import make_tiny_model

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def shared_prompt(model_dir: str, system_len: int, requests: int, repeats: int, **engine: object) -> dict:
    """The batch after the warm-up request, in a fresh engine each time: best seconds of `repeats`."""
    seconds = []
    for _ in range(repeats):
        llm = LLM(model_dir, warmup=False, dtype="float32", block_size=16, **engine)
        system = prompt(system_len, seed=1)
        llm.generate([{"prompt_token_ids": system + [1, 2, 3, 4]}], SP, use_tqdm=False)  # warms the cache
        prompts = [{"prompt_token_ids": system + prompt(4, seed=100 + i)} for i in range(requests)]
        before, start = llm.get_stats(), time.perf_counter()
        llm.generate(prompts, SP, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        computed = llm.get_stats().num_prefill_tokens - before.num_prefill_tokens
    return dict(computed=computed, total=requests * (system_len + 4), seconds=min(seconds))


def cold_prefill(model_dir: str, length: int, repeats: int, caching: bool) -> float:
    best = float("inf")
    for r in range(repeats):
        llm = LLM(model_dir, warmup=False, dtype="float32", block_size=16, enable_prefix_caching=caching,
                  max_num_batched_tokens=length)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt(length, seed=7 + r)}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", type=int, default=480)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)  # tiny tensors: on a busy 2-core machine a second thread only waits
    folder = Path(tempfile.mkdtemp())
    hybrid = str(make_tiny_model(folder / "hybrid", "qwen3_5", num_layers=4, max_position_embeddings=4096))
    qwen3 = str(make_tiny_model(folder / "qwen3", "qwen3", num_layers=4, max_position_embeddings=4096))
    shared_prompt(hybrid, args.system, args.requests, 1)  # first use in the process (lazy initialisation)
    rows = {"Qwen3.5, snapshots": shared_prompt(hybrid, args.system, args.requests, args.repeats),
            "Qwen3.5, caching off": shared_prompt(hybrid, args.system, args.requests, args.repeats,
                                                  enable_prefix_caching=False),
            "Qwen3 (attention only)": shared_prompt(qwen3, args.system, args.requests, args.repeats)}
    off = rows["Qwen3.5, caching off"]["seconds"]
    print(f"{args.requests} requests of a {args.system}-token system prompt + 4 tokens, after one warm-up request")
    print("| engine | prompt tokens computed | of | share | seconds | vs caching off |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['computed']} | {r['total']} | {r['computed'] / r['total']:.1%} | "
              f"{r['seconds']:.3f} | {off / r['seconds']:.2f}x |")
    on, plain = (cold_prefill(hybrid, 2048, args.repeats, caching) for caching in (True, False))
    print(f"cold 2,048-token prefill, best of {args.repeats}: snapshots kept {on:.3f} s, caching off {plain:.3f} s, "
          f"ratio {on / plain:.3f}")


if __name__ == "__main__":
    main()
