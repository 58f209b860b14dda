"""Where a single stream's decode time goes on this CPU: matmul kernels, other ops, the Python between them.

    python benchmarks/single_stream_profile.py [--model M] [--dtype bfloat16] [--quantization int8]
                                               [--compiled] [--steps 32] [--top 12] [--threads N]

One request decodes `--steps` tokens (batch 1) on the default model (SmolLM2-135M) unless --model.
Printed, with the CPU and the load average (a shared machine slows every figure down):
  * the ceiling: read bandwidth (`x.sum()` over a buffer as large as the weights, roofline.py) / matmul
    weight bytes a token, and the share of it the timed decode reached (no profiler; best of 3);
  * the same steps under torch's profiler (minivllm/teaching/step_cost.py `profile_decode`), split into
    the matmul kernels (step_cost.MATMUL_OPS), decode attention, every other op, and what is left of the
    wall time outside any op: the Python between ops, the dispatcher, the engine's own bookkeeping and
    the profiler's per-op cost. The profiler slows every op a little, so the profiled step is longer than
    the timed one; read the shares, not the absolute milliseconds;
  * the costliest ops by self time.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from minivllm import LLM
from minivllm.entrypoints.roofline import matmul_weights, measure_read_bandwidth
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.teaching.step_cost import OpProfile, achieved, profile_decode, time_decode


def split(profile: OpProfile) -> dict[str, tuple[float, int]]:
    """(seconds, calls) of the matmul kernels, attention, the other ops, and the wall time outside ops."""
    parts = {"matmul kernels": [0.0, 0], "attention": [0.0, 0], "other ops": [0.0, 0]}
    for op in profile.ops:
        key = "matmul kernels" if op.is_matmul else "attention" if "attention" in op.name else "other ops"
        parts[key][0] += op.self_s
        parts[key][1] += op.calls
    inside = sum(seconds for seconds, _ in parts.values())
    parts["between ops (Python, dispatch, profiler)"] = [profile.wall_s - inside, 0]
    return {k: (s, n) for k, (s, n) in parts.items()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--compiled", action="store_true", help="enforce_eager=False, compiled for 1 row")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: min(2, cores), as the bench)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or min(2, os.cpu_count() or 1))

    print(f"{CpuInfo.read()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    compiled = dict(enforce_eager=False, compile_sizes=(1,)) if args.compiled else {}
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, enable_prefix_caching=False,
              **compiled)
    weights = matmul_weights(llm.llm_engine.model)
    read_gb_s = measure_read_bandwidth(max(256 << 20, weights.bytes))
    ceiling = read_gb_s * 1e9 / weights.bytes
    precision = str(llm.llm_engine.dtype).removeprefix("torch.") + (", int8 weights" if args.quantization else "")
    print(f"{llm.llm_engine.spec.architecture}, {precision}{', compiled' if args.compiled else ', eager'}: "
          f"{weights.bytes / 1e6:.1f} MB of matmul weights a token; read bandwidth {read_gb_s:.1f} GB/s "
          f"-> ceiling {ceiling:.1f} tok/s ({1e3 / ceiling:.2f} ms a token)")

    time_decode(llm, 1, 4, repeats=1)  # warm-up: first calls of each kernel
    run = time_decode(llm, 1, args.steps, repeats=3)
    gb_s, _ = achieved(weights, run)
    print(f"timed, best of 3 x {args.steps} steps: {1e3 * run.wall_s / run.steps:.2f} ms a token = "
          f"{run.tok_s:.1f} tok/s = {100 * run.tok_s / ceiling:.0f}% of the ceiling (weights at {gb_s:.1f} GB/s); "
          f"inside step() {run.ms_per_step:.2f} ms, of which the forward {1e3 * run.forward_s / run.steps:.2f} ms")

    profile = profile_decode(llm, 1, args.steps)
    per_step = 1e3 * profile.wall_s / profile.steps
    print(f"profiled, {args.steps} steps: {per_step:.2f} ms a step, {profile.calls / profile.steps:.0f} op calls a step")
    for name, (seconds, calls) in split(profile).items():
        ms = 1e3 * seconds / profile.steps
        calls_text = f"{calls / profile.steps:6.0f} calls a step" if calls else ""
        print(f"  {name:42} {ms:6.2f} ms  {100 * seconds / profile.wall_s:4.0f}%  {calls_text}")
    print(f"the {args.top} costliest ops (self time a step):")
    for op in profile.ops[:args.top]:
        print(f"  {op.name:58} {1e3 * op.self_s / profile.steps:6.3f} ms  {op.calls / profile.steps:5.1f} calls")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
