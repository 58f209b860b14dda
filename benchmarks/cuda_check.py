"""The GPU checks, as one script of at most ~6 minutes: kernels compiled for real, the decode kernel's
bandwidth, sampling without syncs, the engine on CUDA with CUDA graphs, bf16 speed.

    python benchmarks/cuda_check.py [--out DIR] [--budget-s 360] [--only PART ...] [--dry-run]

Run it from the repository root on a machine with an NVIDIA GPU, where minivllm imports (an editable
install, or `ln -s ../kernels minivllm/kernels`) beside a CUDA build of torch. CI never runs it (CI has no
GPU); its figures go into docs/guides/benchmarks.md. Each part runs in a process of its own with a
timeout (a hung kernel cannot stall the rest; the part's process group is killed), is reported even
when an earlier one failed, and gets no more than what is left of the budget. Parts, in order:

  kernel_bench   kernel_bench.py's batch 1 and batch 32 x 4,096 rows (Hq 32, Hkv 8, D 128, fp16, blocks
                 of 16): the grouped decode kernel against the copy bandwidth and SDPA on unpaged K/V,
                 with the issue's targets (>= 70 % / >= 40 % of copy, <= 1.3x SDPA's time) marked met or not
  fused_moe      fused_moe_bench.py: the MoE kernel on a bf16 Qwen3-30B-A3B layer, 1 to 2,048 tokens, against
                 naive_fused_moe (its result within 3 % of the largest output; its time) and a dense matmul
  sampler_syncs  32 rows over Qwen's 151,936-token vocabulary, both samplers under
                 torch.cuda.set_sync_debug_mode("error"): nothing may wait for the GPU before the ids
  graphs_vs_hf   fp32, compiled forward + CUDA graphs of 1-64 rows (requests finishing one by one, then
                 48 at once: the 64-row graph whose freed metadata once gave an illegal memory access),
                 every token checked against HF by teacher forcing
  kernel_tests   tests/kernels (fast tier) compiled for the GPU: TRITON_INTERPRET unset and
                 MINIVLLM_KERNEL_TEST_DEVICE=cuda (tests/kernels/conftest.py); the C++ CPU kernels' left out
  speed          bf16 on the `minivllm bench` model: eager, compiled, compiled + graphs, against HF
                 `generate` in the same run (target: >= 10x)

The summary, `cuda_check.json` under --out (default $OUT, else ./cuda_check_out), holds each part's
ok / seconds / timed_out / figures. `--dry-run` runs the same machinery on any machine: each part's
process imports what the part needs and reports {"dry_run": true} (tests/test_cuda_check.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PART_TIMEOUTS = {"kernel_bench": 40, "fused_moe": 30, "sampler_syncs": 25, "graphs_vs_hf": 85, "kernel_tests": 100,
                 "speed": 80}
CPU_KERNEL_TESTS = ("test_skinny_gemm_kernel.py", "test_paged_decode_attention_kernel.py",
                    "test_kv_cache_write_cpu_kernel.py", "test_cpu_build.py")
QWEN_VOCAB = 151_936


@dataclass
class PartResult:
    name: str
    ok: bool
    seconds: float
    timed_out: bool = False
    skipped: str | None = None  # why it did not run (the budget was spent)
    error: str | None = None
    figures: dict = field(default_factory=dict)  # what the part measured (its JSON)


def part_timeout(timeout_s: float, remaining_s: float, least_s: float = 10) -> float | None:
    """The part's own timeout, cut to what is left of the budget; None: too little left to start it."""
    allowed = min(timeout_s, remaining_s)
    return allowed if allowed >= least_s else None


def run_part(name: str, cmd: list[str], timeout_s: float, result_file: Path) -> PartResult:
    """Run one part's process (its own process group, killed whole on timeout); its figures are the JSON it
    wrote to `result_file`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return PartResult(name, False, time.perf_counter() - t0, timed_out=True,
                          error=f"timed out after {timeout_s:.0f} s")
    figures = json.loads(result_file.read_text()) if result_file.exists() else {}
    return PartResult(name, code == 0, time.perf_counter() - t0, figures=figures,
                      error=None if code == 0 else f"exit status {code} (its traceback is in the log above)")


# --- the parts: each runs in its own process and returns its figures ---

def kernel_bench(model: str, dry_run: bool) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from kernel_bench import DecodeShape, copy_bandwidth, measure

    importlib.import_module("minivllm.kernels.grouped_decode_attention")  # measure's kernel: fail here if it cannot

    if dry_run:
        return {"dry_run": True}
    dev = torch.device("cuda")
    peak = copy_bandwidth(dev)
    rows = {f"batch {b} x 4096": measure(DecodeShape(b, 4096), peak, dev) for b in (1, 32)}
    targets = {"batch 32: >= 70 % of copy": rows["batch 32 x 4096"].grouped_of_copy >= 0.70,
               "batch 1: >= 40 % of copy": rows["batch 1 x 4096"].grouped_of_copy >= 0.40,
               "<= 1.3x SDPA's time, both": all(r.sdpa_time_ratio <= 1.3 for r in rows.values())}
    return {"rows": {k: r.as_json() for k, r in rows.items()}, "targets_met": targets}


def fused_moe(model: str, dry_run: bool) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fused_moe_bench import check_on_gpu

    return check_on_gpu(dry_run)


def sampler_syncs(model: str, dry_run: bool) -> dict:
    import torch

    from minivllm.layers.sampler import Sampler, SamplingRow, SamplingTensors, TritonSampler

    if dry_run:
        return {"dry_run": True}
    kinds = [(0.0, 0, 1.0, 0.0), (0.8, 50, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.7, 20, 0.95, 0.05)]
    rows = [SamplingRow(*kinds[i % 4], seed=i, position=100 + i) for i in range(32)]
    logits = torch.randn(32, QWEN_VOCAB, device="cuda", dtype=torch.bfloat16) * 3
    found = {}
    for name, sampler in (("pytorch", Sampler()), ("triton", TritonSampler())):
        t = SamplingTensors.from_params(rows, QWEN_VOCAB, torch.device("cuda"))
        sampler(logits, t)  # compile / warm first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        ids = None
        try:
            ids = sampler(logits, t)
            found[name] = "no sync before the ids"
        except RuntimeError as error:  # the debug mode's complaint names the op that synchronised
            found[name] = f"synchronised: {error}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        found[f"{name}_ids"] = ids.tolist()[:4] if ids is not None else None  # the one read-back, after
    if not all(v.startswith("no") for k, v in found.items() if not k.endswith("_ids")):
        raise AssertionError(found)
    return found


def graphs_vs_hf(model: str, dry_run: bool) -> dict:
    """fp32, compiled with CUDA graphs: every output token is HF's argmax (teacher forcing, fp32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from minivllm import LLM, SamplingParams
    from minivllm.teaching.hf_check import assert_hf_greedy

    if dry_run:
        return {"dry_run": True}
    lengths = (5, 40, 130, 300, 17)  # 300 tokens: contexts of 19+ blocks
    prompts = [[(7 * i + 13 * j) % 31000 + 10 for j in range(n)] for i, n in enumerate(lengths)]
    max_tokens = [24, 3, 12, 20, 7]  # requests finish one by one: decode steps of 5 (-> 8), 4, 3 (-> 4), 2, 1 rows
    many = [[(11 * i + 3 * j) % 31000 + 10 for j in range(8 + i % 5)] for i in range(48)]  # 48 rows -> graph of 64
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in max_tokens]
    with LLM(model, device="cuda", dtype="float32", enforce_eager=False, compile_sizes=(1, 2, 4, 8, 64)) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": p} for p in many], greedy[0], use_tqdm=False)
        graphs = llm.llm_engine.model_runner.cuda_graphs
        sizes, replays = sorted(graphs.graphs), graphs.num_replays
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        for p, o in zip(prompts + many, outs):
            assert_hf_greedy(hf, p, o.outputs[0].token_ids)
    assert replays > 0 and 64 in sizes, f"decode steps did not replay a 64-row graph: {sizes}, {replays} replays"
    return {"tokens_hf_exact": sum(len(o.outputs[0].token_ids) for o in outs), "requests": len(outs),
            "graph_sizes": sizes, "replays": replays}


def kernel_tests(model: str, dry_run: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", MINIVLLM_KERNEL_TEST_DEVICE="cuda")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", "tests/kernels",
           *(f"--ignore=tests/kernels/{name}" for name in CPU_KERNEL_TESTS)]
    if dry_run:
        cmd += ["--collect-only"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    print(run.stdout[-3000:], run.stderr[-2000:], flush=True)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    if run.returncode != 0:
        raise AssertionError(f"kernel tests: {summary}")
    return {"summary": summary, **({"dry_run": True} if dry_run else {})}


def speed(model: str, dry_run: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from minivllm import LLM, SamplingParams
    from minivllm.entrypoints.bench import BENCH_MODEL, run_hf_generate, workload

    if dry_run:
        return {"dry_run": True}
    prompts, outputs = workload(32, BENCH_MODEL["vocab_size"])
    warm = workload(32, BENCH_MODEL["vocab_size"], seed=1)
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in outputs]
    warm_greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in warm[1]]

    def tokens_per_s(llm: LLM) -> float:
        llm.generate([{"prompt_token_ids": p} for p in warm[0]], warm_greedy, use_tqdm=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        torch.cuda.synchronize()
        return sum(outputs) / (time.perf_counter() - t0)

    figures = {}
    with LLM(model, device="cuda", dtype="bfloat16", enforce_eager=True) as llm:
        figures["eager"] = tokens_per_s(llm)
    with LLM(model, device="cuda", dtype="bfloat16", enforce_eager=False, compile_sizes=(1, 8, 32)) as llm:
        figures["compiled + CUDA graphs"] = tokens_per_s(llm)
        llm.llm_engine.model_runner.cuda_graphs = None  # the same compiled forward, launched from Python
        figures["compiled, no graphs"] = tokens_per_s(llm)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to("cuda").eval()
    figures["HF generate"] = sum(outputs) / run_hf_generate(hf, prompts, outputs, warm)
    x_hf = {name: tps / figures["HF generate"] for name, tps in figures.items()}
    return {"tokens_per_s": figures, "x_hf": x_hf, "output_tokens": sum(outputs),
            "targets_met": {">= 10x HF generate (compiled + graphs)": x_hf["compiled + CUDA graphs"] >= 10}}


PARTS = {"kernel_bench": kernel_bench, "fused_moe": fused_moe, "sampler_syncs": sampler_syncs,
         "graphs_vs_hf": graphs_vs_hf, "kernel_tests": kernel_tests, "speed": speed}


def run_one(part: str, model: str, result: Path, dry_run: bool) -> int:
    """Inside a part's process: run it, write its figures, exit 0 (passed) or 1."""
    try:
        figures = PARTS[part](model, dry_run)
    except Exception:
        traceback.print_exc()
        return 1
    result.write_text(json.dumps(figures, indent=1, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "cuda_check_out")),
                        help="where cuda_check.json goes (default: $OUT, else ./cuda_check_out)")
    parser.add_argument("--budget-s", type=float, default=360, help="the whole run's wall-clock limit")
    parser.add_argument("--only", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--timeout", nargs="+", default=[], metavar="PART=S",
                        help="a part's own timeout in seconds, e.g. kernel_tests=150 (still within the budget)")
    parser.add_argument("--dry-run", action="store_true", help="the machinery only: parts import, report nothing")
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # inside a part's process
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        return run_one(args.part, args.model, args.result, args.dry_run)
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit("no CUDA device: this script is the GPU check (pass --dry-run to check the script itself)")
    timeouts = dict(PART_TIMEOUTS)
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--timeout {item!r}: write PART=SECONDS with PART one of {', '.join(PARTS)}")
        timeouts[name] = float(seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = tmp  # a dry run makes no model
        if not args.dry_run and {"graphs_vs_hf", "speed"} & set(args.only):
            from minivllm.entrypoints.bench import BENCH_MODEL
            from minivllm.teaching.checkpoints import make_tiny_model

            model = str(make_tiny_model(tmp, **BENCH_MODEL))
        for name in args.only:
            timeout = part_timeout(timeouts[name], args.budget_s - (time.perf_counter() - start))
            if timeout is None:
                results.append(PartResult(name, False, 0.0, skipped="the budget was spent"))
                continue
            result_file = args.out / f"part_{name}.json"
            result_file.unlink(missing_ok=True)
            print(f"\n=== {name} (timeout {timeout:.0f} s) ===", flush=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--model", model,
                   "--result", str(result_file), *(["--dry-run"] if args.dry_run else [])]
            results.append(run_part(name, cmd, timeout, result_file))
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (dry run)",
               "torch": torch.__version__, "dry_run": args.dry_run, "budget_s": args.budget_s,
               "wall_s": time.perf_counter() - start, "parts": [asdict(r) for r in results]}
    (args.out / "cuda_check.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n" + ", ".join(f"{r.name}: {'ok' if r.ok else r.skipped or r.error or 'FAILED'} ({r.seconds:.0f} s)"
                           for r in results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
