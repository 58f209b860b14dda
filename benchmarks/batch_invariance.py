"""What `batch_invariant=True` costs: tokens/s with and without it, same model, same workload, alternating.

    python benchmarks/batch_invariance.py [--model PATH] [--num-requests 16] [--rounds 3] [--single-stream]

Default model: `minivllm bench`'s random ~30M-parameter Qwen3 (entrypoints/bench.py), fp32 unless --dtype.
Batched: `--num-requests` requests of the bench workload (prompts 16-128 tokens, outputs 8-128), greedy.
--single-stream: one request, 64 new tokens. Both engines are built once and warmed up; then the runs
alternate (off, on, off, on, ...) so drift in a shared machine hits both alike; the best of `--rounds`
is reported, with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.bench import BENCH_MODEL, workload
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.teaching.checkpoints import make_tiny_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint folder (default: the bench's random Qwen3)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--single-stream", action="store_true")
    args = p.parse_args()
    model = args.model or str(make_tiny_model(tempfile.mkdtemp(), **BENCH_MODEL))
    engines = {mode: LLM(model, dtype=args.dtype, batch_invariant=mode) for mode in (False, True)}
    vocab = engines[False].llm_engine.spec.vocab_size
    if args.single_stream:
        prompts, outputs = workload(1, vocab, seed=0)
        outputs = [64]
    else:
        prompts, outputs = workload(args.num_requests, vocab, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in outputs]
    requests = [{"prompt_token_ids": q} for q in prompts]
    for llm in engines.values():  # warm-up: the same shapes
        llm.generate(requests, params, use_tqdm=False)
    best = {False: 0.0, True: 0.0}
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            t0 = time.perf_counter()
            llm.generate(requests, params, use_tqdm=False)
            best[mode] = max(best[mode], sum(outputs) / (time.perf_counter() - t0))
    print(CpuInfo.read())
    shape = "single stream" if args.single_stream else f"{len(prompts)} requests"
    print(f"{model if args.model else 'bench model (random Qwen3, ~30M)'}, {args.dtype}, {shape}, best of "
          f"{args.rounds}: off {best[False]:.1f} tok/s, batch_invariant {best[True]:.1f} tok/s "
          f"({best[True] / best[False]:.2f}x)")


if __name__ == "__main__":
    main()
