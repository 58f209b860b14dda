"""The GPU checks, as one script: Triton kernels compiled for real, the engine on CUDA with CUDA graphs.

    python benchmarks/cuda_check.py [--num-requests 32] [--skip-tests]

Run it from the repository root on a machine with an NVIDIA GPU, where minivllm imports (an editable
install, or `ln -s ../kernels minivllm/kernels`) beside a CUDA build of torch. CI never runs it (CI has no
GPU); its figures go into the project's notes. Three parts, each reported even when an earlier one failed:
  1. The Triton kernel tests (`tests/kernels/`) compiled for the GPU: TRITON_INTERPRET unset and
     MINIVLLM_KERNEL_TEST_DEVICE=cuda (tests/kernels/conftest.py runs each launcher on the GPU against the
     CPU references). The C++ CPU kernels' tests are left out.
  2. Correctness of the compiled forward with CUDA graphs (engine/cuda_graphs.py), fp32: requests of
     different lengths finishing one by one (decode steps of several sizes, padded, split-KV in the
     graphs), then 48 at once (a graph of the one-pass kernel), each output checked against HF
     transformers by teacher forcing; the graphs must have been replayed.
  3. Speed, bf16, the `minivllm bench` model (a random ~30M Qwen3): the throughput workload and a single
     stream, eager (`enforce_eager=True`), compiled without graphs, and compiled with graphs; HF
     `generate` on the same workload; all measured in this run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

CPU_KERNEL_TESTS = ("test_skinny_gemm_kernel.py", "test_paged_decode_attention_kernel.py",
                    "test_kv_cache_write_cpu_kernel.py", "test_cpu_build.py")


def kernel_tests() -> bool:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", MINIVLLM_KERNEL_TEST_DEVICE="cuda")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels",
           *(f"--ignore=tests/kernels/{name}" for name in CPU_KERNEL_TESTS)]
    print("$ MINIVLLM_KERNEL_TEST_DEVICE=cuda", " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, env=env, timeout=300).returncode == 0
    except subprocess.TimeoutExpired:
        print("kernel tests: timed out after 300 s", flush=True)
        return False


def graphs_match_hf(path: str) -> bool:
    """fp32, compiled with CUDA graphs: every output token is HF's argmax (teacher forcing, fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    from minivllm import LLM, SamplingParams
    from minivllm.teaching.hf_check import assert_hf_greedy

    lengths = (5, 40, 130, 300, 17)  # 300 tokens: contexts of 19+ blocks
    prompts = [[(7 * i + 13 * j) % 31000 + 10 for j in range(n)] for i, n in enumerate(lengths)]
    max_tokens = [24, 3, 12, 20, 7]  # requests finish one by one: decode steps of 5 (-> 8), 4, 3 (-> 4), 2, 1 rows
    # then 48 short requests at once: decode steps of 48 rows padded to 64, a graph of the one-pass kernel
    # (few rows x heads take split-KV)
    many = [[(11 * i + 3 * j) % 31000 + 10 for j in range(8 + i % 5)] for i in range(48)]
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in max_tokens]
    with LLM(path, device="cuda", dtype="float32", enforce_eager=False, compile_sizes=(1, 2, 4, 8, 64)) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": p} for p in many], greedy[0], use_tqdm=False)
        graphs = llm.llm_engine.model_runner.cuda_graphs
        print(f"forward: {llm.llm_engine.compilation}\n{graphs!r}, {graphs.num_replays} replays", flush=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for p, o in zip(prompts + many, outs):
            assert_hf_greedy(hf, p, o.outputs[0].token_ids)
    assert graphs.num_replays > 0 and 64 in graphs.graphs, "decode steps did not replay graphs"
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"fp32 with CUDA graphs: all {num_tokens} tokens of {len(outs)} requests are HF's argmax", flush=True)
    return True


def speed(path: str, num_requests: int) -> None:
    from transformers import AutoModelForCausalLM

    from minivllm import LLM, SamplingParams
    from minivllm.entrypoints.bench import BENCH_MODEL, run_hf_generate, workload

    prompts, outputs = workload(num_requests, BENCH_MODEL["vocab_size"])
    warm = workload(num_requests, BENCH_MODEL["vocab_size"], seed=1)

    def greedy(lengths: list[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in lengths]

    def measure(llm: LLM) -> tuple[float, float, list[list[int]]]:
        llm.generate([{"prompt_token_ids": p} for p in warm[0]], greedy(warm[1]), use_tqdm=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(outputs), use_tqdm=False)
        torch.cuda.synchronize()
        t_batch = time.perf_counter() - t0
        single = greedy([128])[0]
        llm.generate({"prompt_token_ids": prompts[0]}, single, use_tqdm=False)  # warm the single stream
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompts[1]}, single, use_tqdm=False)
        torch.cuda.synchronize()
        return sum(outputs) / t_batch, 128 / (time.perf_counter() - t0), [o.outputs[0].token_ids for o in outs]

    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64) if s <= max(32, num_requests))
    results = {}
    with LLM(path, device="cuda", dtype="bfloat16", enforce_eager=True) as llm:
        results["eager"] = measure(llm)
    with LLM(path, device="cuda", dtype="bfloat16", enforce_eager=False, compile_sizes=sizes) as llm:
        runner = llm.llm_engine.model_runner
        results["compiled + CUDA graphs"] = measure(llm)
        print(f"{runner.cuda_graphs!r}, {runner.cuda_graphs.num_replays} replays", flush=True)
        runner.cuda_graphs = None  # the same compiled forward, every step launched from Python
        results["compiled, no graphs"] = measure(llm)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    hf_tps = sum(outputs) / run_hf_generate(hf, prompts, outputs, warm)
    print(f"\nGPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, {num_requests} requests, "
          f"{sum(outputs)} output tokens")
    print(f"{'':26}{'throughput tok/s':>18}{'x HF':>7}{'single stream tok/s':>22}{'same tokens as eager':>23}")
    for name, (tps, single, toks) in results.items():
        same = sum(a == b for a, b in zip(toks, results["eager"][2]))
        print(f"{name:26}{tps:18.1f}{tps / hf_tps:7.2f}{single:22.1f}{same:>17}/{len(toks)}")
    print(f"{'HF generate':26}{hf_tps:18.1f}{1:7.2f}")
    g, c = results["compiled + CUDA graphs"], results["compiled, no graphs"]
    print(f"CUDA graphs / no graphs: {g[0] / c[0]:.2f}x throughput, {g[1] / c[1]:.2f}x single stream", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--skip-tests", action="store_true", help="only the engine checks")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script is the GPU check (CPU runs are `minivllm bench`)")
    from minivllm.entrypoints.bench import BENCH_MODEL
    from minivllm.teaching.checkpoints import make_tiny_model

    passed = {}
    if not args.skip_tests:
        passed["kernel tests"] = kernel_tests()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model(tmp, **BENCH_MODEL))
        for name, check in (("graphs match HF", lambda: graphs_match_hf(path)),
                            ("speed", lambda: speed(path, args.num_requests) or True)):
            try:
                passed[name] = check()
            except Exception:  # report, then go on to the next part
                traceback.print_exc()
                passed[name] = False
    print("\n" + ", ".join(f"{name}: {'ok' if ok else 'FAILED'}" for name, ok in passed.items()))
    if not all(passed.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
