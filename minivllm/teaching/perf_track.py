"""The performance track: how fast a hands-on solution is, once it is correct.

    python -m minivllm.teaching.perf_track attention exercises/hands_on/1_attention/my_attention.py
    python -m minivllm.teaching.perf_track filter    exercises/hands_on/3_filter/my_filter.py
    python -m minivllm.teaching.perf_track allocator exercises/hands_on/4_allocator/my_allocator.py
    python -m minivllm.teaching.perf_track speed     exercises/hands_on/5_speed/my_speed.py --plot roofline.png
    python -m minivllm.teaching.perf_track kernel    exercises/hands_on/2_kernel/my_kernel.py   (CUDA only)

Three steps, in this order (docs/performance-track.md is the student's page):
  1. correctness: the part's own grader (grade_hands_on; perf_speed for the speed assignment). A wrong
     solution stops here with the rule it broke and exit status 1: speed is credited only to correct code.
  2. timing: the student's implementation and the engine's own on the same workload (perf_workloads.py),
     each in `--trials` fresh processes, alternating which goes first, medians (perf_measure.py says why).
  3. a table: per case, both times, the ratio (yours / the engine's: below 1 is faster), and where a
     bandwidth limit applies (attention, speed) the fraction of the machine's read bandwidth reached.
     `--plot PNG` (speed) saves the roofline (perf_roofline.py).

It is a command, never a test: timings depend on the machine and its load, so they are printed, not
asserted. The table's first lines say the CPU, the ISA level (minivllm's kernels and torch's) and the
read bandwidth measured in the same trials, so two runs can be compared only where those agree.
The Triton kernel is timed only where CUDA exists (Triton's interpreter on a CPU says nothing about speed).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from minivllm.teaching.perf_measure import PARTS, PerfResult, alternate
from minivllm.teaching.perf_workloads import PerfSettings


def grade_first(part: str, path: str, engine: bool) -> int:
    """The part's grader, as its own command runs it; its exit status (0: correct)."""
    if part == "speed":
        from minivllm.teaching.perf_speed import main as grade_speed

        return grade_speed([path])
    from minivllm.teaching.grade_hands_on import main as grade_hands_on

    return grade_hands_on([part, path] + ([] if engine else ["--no-engine"]))


def machine_line() -> str:
    """The CPU and both ISA levels: minivllm's kernel build, torch's own kernels."""
    from minivllm.cpu.cpu_info import CpuInfo
    from minivllm.kernels.cpu_build import isa_level

    return f"{CpuInfo.read().model_name}; ISA: minivllm {isa_level()}, torch {torch.backends.cpu.get_cpu_capability()}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}" if seconds < 1e-3 else f"{seconds * 1e6:.0f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def table(result: PerfResult) -> str:
    """The result as a small fixed-width table: times per unit of work in microseconds, their ratio (yours /
    the engine's), speed (the engine's time / yours: the engine's speed is 1.00x), GB/s and shares of the limit."""
    width = max(len(c.label) for c in result.cases) + 2
    lines = [f"{'case':<{width}}{'yours us':>10}{'engine us':>11}{'yours/engine':>14}{'speed':>7}{'yours GB/s':>12}"
             f"{'of limit':>10}{'engine of limit':>17}"]
    for c in result.cases:
        gb_s = c.gb_s(c.student_s)
        lines.append(f"{c.label:<{width}}{_us(c.student_s):>10}{_us(c.engine_s):>11}{c.ratio:>14.2f}"
                     f"{f'{1 / c.ratio:.2f}x':>7}"
                     f"{'-' if gb_s is None else f'{gb_s:.1f}':>12}{_share(result.of_limit(c.student_s, c)):>10}"
                     f"{_share(result.of_limit(c.engine_s, c)):>17}")
    return "\n".join(lines)


def report(result: PerfResult) -> str:
    limited = any(c.bytes_per_unit is not None for c in result.cases)
    head = [f"{result.part}: {result.student_name} vs the engine's {result.engine_name}",
            f"machine: {machine_line()}; {torch.get_num_threads()} thread(s)",
            f"{result.trials} fresh process(es) a side, alternating which goes first; each process's fastest of "
            "its rounds, the median of the trials"]
    if limited:
        head += [f"limit: read bandwidth {result.read_gb_s:.1f} GB/s (x.sum() over the working set, the median of "
                 "every trial)", "of limit = the bytes a unit must read / its time / that bandwidth"]
    else:
        head.append("no bandwidth limit applies to this part: the ratio is the figure")
    return "\n".join(head + [table(result)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=PARTS)
    p.add_argument("path", help="your file (the starters are in exercises/hands_on/)")
    p.add_argument("--trials", type=int, default=5, help="fresh processes a side (default 5)")
    p.add_argument("--rounds", type=int, default=PerfSettings.rounds, help="timed rounds in each process")
    p.add_argument("--set-mib", type=int, default=PerfSettings.set_mib,
                   help="the rotating working set in MiB (>= 2x the CPU's L3; default 64)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: checks that the track runs, times nothing real")
    p.add_argument("--no-engine", action="store_true", help="grade with the quick checks only (part 1)")
    p.add_argument("--plot", metavar="PNG", help="speed: save the roofline plot here")
    args = p.parse_args(argv)
    if args.plot and args.part != "speed":
        p.error("--plot draws the speed assignment's roofline: use it with `speed`")
    if args.plot and not Path(args.plot).parent.is_dir():
        p.error(f"--plot {args.plot}: the folder {Path(args.plot).parent} does not exist; create it or give "
                "another path")
    if args.trials < 1:
        p.error(f"--trials must be at least 1, got {args.trials}")
    if args.part == "kernel" and not torch.cuda.is_available():
        print("kernel: the Triton kernel is timed only where a CUDA GPU exists (Triton's interpreter on a CPU says "
              "nothing about speed); this machine has none, so nothing is timed. Its correctness: "
              f"python -m minivllm.teaching.grade_hands_on kernel {args.path}")
        return 0
    if not torch.cuda.is_available():  # as grade_hands_on: the interpreter, chosen before a kernel is defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
    status = grade_first(args.part, args.path, engine=not args.no_engine)
    if status != 0:
        print(f"no speed measured: {args.path} must pass its grader first (exit {status}); speed is credited only "
              "to correct code")
        return status
    settings = PerfSettings(args.quick, args.set_mib, args.rounds)
    result = alternate(args.part, args.path, settings, args.trials)
    print(report(result))
    if args.plot:
        from minivllm.teaching.perf_roofline import plot_roofline

        print(f"roofline saved to {plot_roofline(result, args.plot, machine_line())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
