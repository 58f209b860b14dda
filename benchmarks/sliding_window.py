"""What KV-cache groups buy a sliding-window model: requests held at once in the same KV memory.

    python benchmarks/sliding_window.py [--budget-kib 3072] [--requests 16] [--prompt 400]

One tiny random Gemma 3 (6 layers: 5 sliding-window layers with W = 64, then a full one; block 16),
run twice with the same `cpu_kv_cache_bytes`:
  * groups   — as minivllm runs it: the sliding layers in a pool of their own, a window per request;
  * one pool — the same shapes with every layer marked full attention (`layer_types`), so every layer
               keeps every token: what a single paged pool holds. (Its tokens differ: a different
               model; only memory and time are compared.)
Printed: each pool's blocks, the most requests running at once, steps, and generated tokens per second,
with the ratio of the two in the same run. The numbers in docs/guides/benchmarks.md came from here.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams
from minivllm.teaching.checkpoints import make_tiny_model


def run(model_dir: str, budget: int, requests: int, prompt_len: int, max_tokens: int) -> dict:
    llm = LLM(model_dir, warmup=False, dtype="float32", block_size=16, cpu_kv_cache_bytes=budget,
              max_num_seqs=requests, max_num_batched_tokens=512)
    engine = llm.llm_engine
    bm = engine.block_manager
    pools = {str(k): g.num_blocks for k, g in bm.groups.items()} if hasattr(bm, "groups") else {
        "full_attention": bm.num_blocks}
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(requests):
        prompt = [(7 * i + 13 * t) % 380 + 3 for t in range(prompt_len)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sp)
    peak, steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, len(engine.scheduler.running))
    seconds = time.perf_counter() - start
    return dict(pools=pools, peak_running=peak, steps=steps, tok_s=requests * max_tokens / seconds,
                preemptions=llm.get_stats().num_preemptions)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-kib", type=int, default=3072)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    folder = Path(tempfile.mkdtemp())
    groups = make_tiny_model(folder / "groups", "gemma3", num_layers=6, sliding_window=64, sliding_window_pattern=6)
    one_pool = folder / "one_pool"
    make_tiny_model(one_pool, "gemma3", num_layers=6, sliding_window=64, sliding_window_pattern=6)
    cfg = json.loads((one_pool / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * 6  # every layer keeps every token
    (one_pool / "config.json").write_text(json.dumps(cfg))
    budget = args.budget_kib * 1024
    results = {name: run(str(path), budget, args.requests, args.prompt, args.max_tokens)
               for name, path in (("groups", groups), ("one pool", one_pool))}
    print(f"{args.requests} requests of {args.prompt} + {args.max_tokens} tokens, {args.budget_kib} KiB of KV")
    print("| engine | pools (blocks) | most running at once | steps | preemptions | generated tok/s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['pools']} | {r['peak_running']} | {r['steps']} | {r['preemptions']} | {r['tok_s']:.0f} |")
    g, o = results["groups"], results["one pool"]
    print(f"groups / one pool: {g['peak_running'] / o['peak_running']:.2f}x requests at once, "
          f"{g['tok_s'] / o['tok_s']:.2f}x tokens per second")


if __name__ == "__main__":
    main()
