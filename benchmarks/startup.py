"""How long `import minivllm; minivllm.LLM()` takes in a fresh process (not run in CI).

    python benchmarks/startup.py [--model PATH] [--runs 5] [--tuning cached]
    MINIVLLM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/startup.py          # the same, as an AVX2-only laptop runs it

Each run is a new Python process, as a user's first command is: it imports minivllm (torch and transformers
with it), loads the weights, loads the C++ kernels and warms up (the kernel choices, read from the tuning
cache or measured). The first run may fill caches that later runs reuse (the kernels' build, the tuning
file, the tokenizer's note); to time a warm start, run the script twice and read the second.

What is timed, from outside, on the one monotonic clock both processes read:
  ready    from the process's spawn to `LLM()` returned: what a user waits for before the first `generate`
  exit     from there to the process's end: the interpreter tearing down torch (~0.5 s of CPU for torch
           alone), paid by a script, not by a notebook or a server
and, inside the child, the phases of `ready`: the interpreter's own start, `import torch` and `import
transformers` (each timed where `import minivllm` first imports it, without the modules they import from
each other), the rest of minivllm's imports, and `LLM()`. Every line names the ISA level minivllm runs at
(kernels/cpu_build.py `isa_level`) and the thread count.
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
from minivllm.kernels.cpu_build import isa_level

# The child imports minivllm first, as a user does (so minivllm's own import-time settings apply to torch's
# import). A finder placed first on sys.meta_path times the first execution of the torch and transformers
# packages wherever it happens; it is asked only about modules not imported yet, so it costs nothing else
# (a wrapper of `builtins.__import__` would cost ~0.25 s of CPU: every import statement would call it).
CHILD = """
import time
t_start = time.monotonic()
import importlib.machinery, json, sys
spent, nested = {{}}, []
class TimedFinder:
    def find_spec(self, name, path=None, target=None):
        if name not in ("torch", "transformers"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module
            def exec_module(module):
                nested.append(0.0)
                t = time.monotonic()
                try:
                    run(module)
                finally:
                    took = time.monotonic() - t
                    spent[name] = took - nested.pop()  # without the other library's import inside it
                    if nested:
                        nested[-1] += took
            spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, TimedFinder())
t_imports = time.monotonic()
import minivllm
t_llm = time.monotonic()
llm = minivllm.LLM({args})  # kept, as a script keeps it until it exits
t_ready = time.monotonic()
libraries = spent.get("torch", 0.0) + spent.get("transformers", 0.0)
print("PHASES " + json.dumps([t_start, t_ready, spent.get("torch", 0.0), spent.get("transformers", 0.0),
                              t_llm - t_imports - libraries, t_ready - t_llm]), flush=True)
"""
PHASES = ("interpreter", "import torch", "import transformers", "import minivllm (rest)", "LLM()")


class Start:
    """One fresh process: `ready` and `exit` (seconds, see the module docstring) and the phases of `ready`."""

    def __init__(self, model: str | None, tuning: str) -> None:
        args = ", ".join(([repr(model)] if model else []) + [f"tuning={tuning!r}"])
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-c", CHILD.format(args=args)], capture_output=True, text=True,
                              env=os.environ.copy())
        t_end = time.monotonic()
        if done.returncode:
            raise RuntimeError(f"the start failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        line = next(x for x in done.stdout.splitlines() if x.startswith("PHASES "))
        t_start, t_ready, *inside = json.loads(line.removeprefix("PHASES "))
        self.ready, self.exit, self.whole = t_ready - t0, t_end - t_ready, t_end - t0
        self.phases = [t_start - t0, *inside]


def level() -> str:
    threads = os.environ.get("OMP_NUM_THREADS", f"default ({os.cpu_count()} cores)")
    return f"ISA level {isa_level()}, OMP_NUM_THREADS={threads}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tuning", default="cached", choices=("cached", "remeasure", "off"))
    args = parser.parse_args()
    print(f"{CpuInfo.read()}; {os.cpu_count()} cores; python {sys.version.split()[0]}; {level()}")
    print(f"load average {os.getloadavg()[0]:.2f} at start")
    starts = []
    for i in range(args.runs):
        s = Start(args.model, args.tuning)
        starts.append(s)
        print(f"  run {i + 1}: ready {s.ready:.2f} s, exit {s.exit:.2f} s (" +
              ", ".join(f"{n} {x:.2f}" for n, x in zip(PHASES, s.phases)) + ")", flush=True)

    def median(values: list[float]) -> float:
        return statistics.median(values)

    ready = [s.ready for s in starts]
    print(f"LLM({args.model or ''}) start, tuning={args.tuning!r}, {level()}, {args.runs} fresh processes: "
          f"ready median {median(ready):.2f} s (min {min(ready):.2f}, max {max(ready):.2f}), exit median "
          f"{median([s.exit for s in starts]):.2f} s, whole process median {median([s.whole for s in starts]):.2f} s; "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    for n, column in zip(PHASES, zip(*(s.phases for s in starts))):
        print(f"  {n:24} median {median(list(column)):.2f} s")


if __name__ == "__main__":
    main()
