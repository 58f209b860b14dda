"""The GPU checks, as one script: Triton kernels compiled for real, the engine on CUDA eager and compiled.

    python benchmarks/cuda_check.py [--num-requests 32] [--skip-tests]

Run it on a machine with an NVIDIA GPU, in an environment where `pip install -e ".[dev]"` (and a CUDA
build of torch) is installed. CI never runs it (CI has no GPU); its figures go into the project's notes.
  1. The kernel tests (`tests/kernels/`, `tests/test_triton_backend.py`) with Triton compiling for the
     GPU: TRITON_INTERPRET unset, so the interpreter that CPU runs use is out of the picture.
  2. The engine on CUDA, the `minivllm bench` model (a random ~30M Qwen3) in bf16: the throughput
     workload and a single stream, with `enforce_eager=True` and with the compiled forward
     (`enforce_eager=False`, models/compiled_forward.py). Greedy tokens must be identical; tok/s of each
     and of HF `generate` on the same workload, measured in this run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch


def kernel_tests() -> int:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/kernels", "tests/test_triton_backend.py"]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env={**env, "HF_HUB_OFFLINE": "1"}).returncode


def engine_checks(num_requests: int) -> None:
    from transformers import AutoModelForCausalLM

    from minivllm import LLM, SamplingParams
    from minivllm.entrypoints.bench import BENCH_MODEL, run_hf_generate, workload
    from minivllm.teaching.checkpoints import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model(tmp, **BENCH_MODEL))
        prompts, outputs = workload(num_requests, BENCH_MODEL["vocab_size"])
        warm = workload(num_requests, BENCH_MODEL["vocab_size"], seed=1)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in outputs]
        single = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, detokenize=False)
        results, tokens = {}, {}
        for eager in (True, False):
            llm = LLM(path, device="cuda", dtype="bfloat16", enforce_eager=eager)
            print(f"forward: {llm.llm_engine.compilation}", flush=True)
            warm_params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False)
                           for m in warm[1]]
            llm.generate([{"prompt_token_ids": p} for p in warm[0]], warm_params, use_tqdm=False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            torch.cuda.synchronize()
            t_batch = time.perf_counter() - t0
            tokens[eager] = [o.outputs[0].token_ids for o in outs]
            llm.generate({"prompt_token_ids": prompts[0]}, single, use_tqdm=False)  # warm the single stream
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": prompts[1]}, single, use_tqdm=False)
            torch.cuda.synchronize()
            t_single = time.perf_counter() - t0
            results[eager] = (sum(outputs) / t_batch, 128 / t_single)
            llm.shutdown()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
        t_hf = run_hf_generate(hf, prompts, outputs, warm)
    same = tokens[True] == tokens[False]
    print(f"\nGPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, {num_requests} requests")
    print(f"greedy tokens eager == compiled: {same}")
    print(f"{'':24}{'throughput tok/s':>18}{'single stream tok/s':>22}")
    for eager, name in ((True, "eager"), (False, "compiled")):
        print(f"{name:24}{results[eager][0]:18.1f}{results[eager][1]:22.1f}")
    print(f"{'HF generate':24}{sum(outputs) / t_hf:18.1f}")
    print(f"compiled / eager: {results[False][0] / results[True][0]:.2f}x throughput, "
          f"{results[False][1] / results[True][1]:.2f}x single stream; "
          f"minivllm (compiled) / HF generate: {results[False][0] * t_hf / sum(outputs):.2f}x")
    if not same:
        raise SystemExit("compiled tokens differ from eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--skip-tests", action="store_true", help="only the engine checks")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script is the GPU check (CPU runs are `minivllm bench`)")
    failed = 0 if args.skip_tests else kernel_tests()
    engine_checks(args.num_requests)
    if failed:
        raise SystemExit(f"kernel tests failed (exit code {failed})")


if __name__ == "__main__":
    main()
