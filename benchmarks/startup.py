"""How long `import minivllm; minivllm.LLM()` takes in a fresh process (not run in CI).

    python benchmarks/startup.py [--model PATH] [--runs 5] [--tuning cached]

Each run is a new Python process, as a user's first command is: it imports torch and minivllm, loads
the weights, loads the C++ kernels and warms up (the kernel choices, read from the tuning cache or
measured). The first run may fill caches that later runs reuse (the kernels' build, the tuning
file, the tokenizer's class); to time a warm start, run the script twice and read the second. Wall
time of the whole process is what a user waits for, so that is what is timed; each run also prints
its phases, timed inside the child (import torch, import transformers, the rest of minivllm's
imports, `LLM()`), to show what is left to cut and what is the libraries' own floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from minivllm.cpu.cpu_info import CpuInfo


# What the child does, timed phase by phase from inside (the whole process is timed from outside). torch and
# transformers are imported first only to time them apart: `import minivllm` would import both anyway.
CHILD = """
import json, sys, time
t = [time.perf_counter()]
import torch; t.append(time.perf_counter())
import transformers; t.append(time.perf_counter())
import minivllm; t.append(time.perf_counter())
minivllm.LLM({args}); t.append(time.perf_counter())
print("PHASES " + json.dumps([b - a for a, b in zip(t, t[1:])]))
"""
PHASES = ("import torch", "import transformers", "import minivllm (the rest)", "LLM()")


def one_start(model: str | None, tuning: str) -> tuple[float, list[float]]:
    """Seconds for one fresh process to import minivllm and build the engine, and its phases; raises if it
    fails."""
    args = [repr(model)] if model else []
    code = CHILD.format(args=", ".join(args + [f"tuning={tuning!r}"]))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"the start failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("PHASES "))
    return seconds, json.loads(line.removeprefix("PHASES "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tuning", default="cached", choices=("cached", "remeasure", "off"))
    args = parser.parse_args()
    print(f"{CpuInfo.read()}; {os.cpu_count()} cores; python {sys.version.split()[0]}")
    print(f"load average {os.getloadavg()[0]:.2f} at start")
    times, phases = [], []
    for i in range(args.runs):
        seconds, split = one_start(args.model, args.tuning)
        times.append(seconds)
        phases.append(split)
        print(f"  run {i + 1}: {seconds:.2f} s (" + ", ".join(f"{n} {s:.2f}" for n, s in zip(PHASES, split)) + ")",
              flush=True)
    print(f"LLM({args.model or ''}) start, tuning={args.tuning!r}, {args.runs} fresh processes: "
          f"median {statistics.median(times):.2f} s, min {min(times):.2f} s, max {max(times):.2f} s; "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    for n, column in zip(PHASES, zip(*phases)):
        print(f"  {n:28} median {statistics.median(column):.2f} s")


if __name__ == "__main__":
    main()
