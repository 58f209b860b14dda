"""Per-step overhead outside the forward, at a small and a GPU-sized KV pool (not run in CI).

    python benchmarks/step_overhead.py [--blocks 2048 262144] [--requests 16] [--max-tokens 64]

A one-layer random model keeps the forward tiny, so what is left is the engine's own bookkeeping:
scheduling, packing, sampling, committing, and the step's transaction. That bookkeeping must cost
what the step touches, not what the pool holds: the ratio printed last should stay near 1.

Each line also gives the whole step's time: what "the forward" counts has moved between versions
(the attention backend's per-step plan is built inside `ModelRunner.forward` since the forward became
the one path every rank runs), so two versions are compared on the whole step, which that move does
not change. Compare two checkouts by running this script with each on PYTHONPATH, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from minivllm import LLM, SamplingParams
from minivllm.teaching.checkpoints import make_tiny_model


def overhead_per_step_ms(model: str, num_blocks: int, requests: int, max_tokens: int) -> tuple[float, float]:
    """(ms a step outside the forward, ms a whole step)."""
    llm = LLM(model, num_kv_blocks=num_blocks, block_size=16)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 300 for j in range(24 + i)]} for i in range(requests)]
    sp = SamplingParams(temperature=0.8, seed=1, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm caches and allocator
    s0 = llm.get_stats()
    llm.generate(prompts, sp, use_tqdm=False)
    s1 = llm.get_stats()
    steps = s1.num_steps - s0.num_steps
    whole = s1.step_time_s - s0.step_time_s
    outside = whole - (s1.forward_time_s - s0.forward_time_s)
    return 1e3 * outside / steps, 1e3 * whole / steps


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[2048, 262144])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, num_layers=1, hidden_size=64, intermediate_size=128))
        results = {}
        for n in args.blocks:
            runs = [overhead_per_step_ms(model, n, args.requests, args.max_tokens) for _ in range(args.repeats)]
            results[n] = statistics.median(r[0] for r in runs)
            print(f"{n:>8} blocks: {results[n]:.3f} ms per step outside the forward, "
                  f"{statistics.median(r[1] for r in runs):.3f} ms a whole step "
                  f"(median of {args.repeats}: {', '.join(f'{r[0]:.3f}/{r[1]:.3f}' for r in runs)})")
        small, large = results[min(results)], results[max(results)]
        print(f"ratio {max(results)} / {min(results)} blocks: {large / small:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
