"""How long `import minivllm; minivllm.LLM()` takes in a fresh process (not run in CI).

    python benchmarks/startup.py [--model PATH] [--runs 5] [--tuning cached]

Each run is a new Python process, as a user's first command is: it imports torch and minivllm, loads
the weights, loads the C++ kernels and warms up (the kernel choices, read from the tuning cache or
measured). The first run may fill caches that later runs reuse (the kernels' build, the tuning
file); to time a warm start, run the script twice and read the second. Wall time of the whole
process is what a user waits for, so that is what is timed, not a span inside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from minivllm.layers.matmul_plan import CpuInfo


def one_start(model: str | None, tuning: str) -> float:
    """Seconds for one fresh process to import minivllm and build the engine; raises if it fails."""
    args = [repr(model)] if model else []
    code = f"import minivllm; minivllm.LLM({', '.join(args + [f'tuning={tuning!r}'])})"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"the start failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tuning", default="cached", choices=("cached", "remeasure", "off"))
    args = parser.parse_args()
    print(f"{CpuInfo.read()}; {os.cpu_count()} cores; python {sys.version.split()[0]}")
    times = []
    for i in range(args.runs):
        times.append(one_start(args.model, args.tuning))
        print(f"  run {i + 1}: {times[-1]:.2f} s", flush=True)
    print(f"LLM({args.model or ''}) start, tuning={args.tuning!r}, {args.runs} fresh processes: "
          f"median {statistics.median(times):.2f} s, min {min(times):.2f} s, max {max(times):.2f} s")


if __name__ == "__main__":
    main()
