"""What tensor parallelism costs on CPU: one all-reduce, and a whole step at TP=2 against TP=1 (not run in CI).

    python benchmarks/tensor_parallel.py [--hidden 576 2048] [--tokens 1 16 128 1024] [--repeats 200]

1. all-reduce: two local processes (gloo, loopback TCP) sum a (T, hidden) fp32 tensor, as the model
   does after o_proj and after down_proj (two per layer). The median of `--repeats` calls, after a warm-up.
2. step time: a random Qwen3 (hidden 512, 4 layers) decoding a batch of 8 and prefilling 256 tokens,
   TP=1 on 1 and on 2 threads against TP=2 on 1 thread per rank (the whole machine, split).
The figures in docs/concepts/tensor-parallelism.md come from this script.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _all_reduce_rank(rank: int, port: int, shapes: list[tuple[int, int]], repeats: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    for shape in shapes:
        x = torch.randn(shape)
        times = []
        for i in range(repeats + 10):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if i >= 10:
                times.append(time.perf_counter() - t0)
        if rank == 0:
            out[shape] = statistics.median(times)
    dist.destroy_process_group()


def all_reduce_times(shapes: list[tuple[int, int]], repeats: int) -> dict[tuple[int, int], float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_all_reduce_rank, args=(port, shapes, repeats, out), nprocs=2, join=True)
    return dict(out)


def step_times(model: str, tp: int, threads: int) -> tuple[float, float]:
    """(decode step of 8 sequences, prefill of 256 tokens), median seconds per step."""
    from minivllm import LLM, SamplingParams

    torch.set_num_threads(threads)
    with LLM(model, tensor_parallel_size=tp, num_kv_blocks=512, block_size=16) as llm:
        engine = llm.llm_engine
        sp = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
        decode, prefill = [], []
        for round_ in range(3):
            prompt = {"prompt_token_ids": [3 + (round_ * 31 + j) % 300 for j in range(256)]}
            engine.add_request(f"p{round_}", prompt, SamplingParams(temperature=0, max_tokens=1))
            t0 = time.perf_counter()
            engine.step()  # one prefill of 256 tokens (prefix caching cannot help: new tokens each round)
            prefill.append(time.perf_counter() - t0)
            engine.step()
        for i in range(8):
            engine.add_request(f"d{i}", {"prompt_token_ids": [5 + i, 6, 7, 8]}, sp)
        engine.step()  # their prefills
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            decode.append(time.perf_counter() - t0)
    return statistics.median(decode), statistics.median(prefill)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[576, 2048])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024])
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)

    shapes = [(t, h) for h in args.hidden for t in args.tokens]
    print("all_reduce of a (T, hidden) fp32 tensor, gloo, 2 local processes (median):")
    for (t, h), s in sorted(all_reduce_times(shapes, args.repeats).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"  T={t:5d} hidden={h:5d} ({t * h * 4 / 1024:8.1f} KiB): {s * 1e6:8.0f} us")

    from minivllm.teaching.checkpoints import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        model = str(make_tiny_model(d, family="qwen3", hidden_size=512, intermediate_size=1536, num_layers=4,
                                    num_heads=8, num_kv_heads=4))
        print("step time, random Qwen3 (hidden 512, 4 layers, 8 heads), median:")
        for tp, threads in ((1, 1), (1, 2), (2, 1)):
            decode, prefill = step_times(model, tp, threads)
            print(f"  TP={tp}, {threads} thread(s) per rank: decode step (8 seqs) {decode * 1e3:6.2f} ms, "
                  f"prefill step (256 tokens) {prefill * 1e3:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
