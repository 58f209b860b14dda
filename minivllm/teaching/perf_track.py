"""The performance track: how fast a hands-on solution is, once it is correct.

    python -m minivllm.teaching.perf_track attention exercises/hands_on/1_attention/my_attention.py
    python -m minivllm.teaching.perf_track filter    exercises/hands_on/3_filter/my_filter.py
    python -m minivllm.teaching.perf_track allocator exercises/hands_on/4_allocator/my_allocator.py
    python -m minivllm.teaching.perf_track speed     exercises/hands_on/5_speed/my_speed.py   (+ roofline.png beside it)
    python -m minivllm.teaching.perf_track kernel    exercises/hands_on/2_kernel/my_kernel.py   (CUDA only)

Three steps, in this order (docs/performance-track.md is the student's page):
  1. correctness: the part's own grader (grade_hands_on; perf_speed for the speed assignment). A wrong
     solution stops here with the rule it broke and exit status 1: speed is credited only to correct code.
  2. timing: the student's implementation and the engine's own on the same workload (perf_workloads.py),
     each in `--trials` fresh processes, alternating which goes first, medians (perf_measure.py says why).
  3. a table: per case, both times, the ratio (yours / the engine's: below 1 is faster), and where a
     bandwidth limit applies (attention, speed) the fraction of the machine's read bandwidth reached.
     `speed` saves the roofline (perf_roofline.py) as roofline.png beside the student's file, or at --plot.

Speed is credited only to right answers from real work, so two more refusals come after the timing: a
timed call whose result was wrong (the speed workload refills x every round and checks every result: a
cache or a reused output buffer shows up here), and a figure above 100 % of the read bandwidth, which no
code that reads its weight can reach (a cache of results is the likely cause).

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
from minivllm.teaching.submission_rules import AssignmentError

QUICK_BANNER = ("QUICK RUN (--quick): tiny shapes, one trial a side. NOT A SPEED MEASUREMENT: it only shows that "
                "the track runs on your file; time it without --quick")


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


def _times(value: float) -> str:
    """A ratio in a few characters however large: 0.18, 12.5, 1216."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _share(value: float | None) -> str:
    """A fraction of the limit; above 1 marked with '!' (impossible: see `impossible`)."""
    return "-" if value is None else f"{value:.0%}" + ("!" if value > 1 else "")


COLUMNS = (("yours us", 9), ("engine us", 10), ("yours/engine", 12), ("speed", 8), ("yours GB/s", 10),
           ("of limit", 9), ("engine of limit", 15))


def table(result: PerfResult) -> str:
    """The result as a small fixed-width table: times per unit of work in microseconds, their ratio (yours /
    the engine's), speed (the engine's time / yours: the engine's speed is 1.00x), GB/s and shares of the limit.
    Columns are joined by two spaces, so a figure wider than its column pushes the row, never runs into another."""
    width = max(len(c.label) for c in result.cases)
    lines = ["  ".join([f"{'case':<{width}}"] + [f"{name:>{w}}" for name, w in COLUMNS])]
    for c in result.cases:
        gb_s = c.gb_s(c.student_s)
        cells = [_us(c.student_s), _us(c.engine_s), _times(c.ratio), _times(1 / c.ratio) + "x",
                 "-" if gb_s is None else f"{gb_s:.1f}", _share(result.of_limit(c.student_s, c)),
                 _share(result.of_limit(c.engine_s, c))]
        lines.append("  ".join([f"{c.label:<{width}}"] + [f"{v:>{w}}" for v, (_, w) in zip(cells, COLUMNS)]))
    return "\n".join(lines)


def impossible(result: PerfResult) -> list[str]:
    """Every figure above 100 % of the read bandwidth, in words: (side, case, share)."""
    found = []
    for c in result.cases:
        for side, seconds in (("yours", c.student_s), ("the engine's", c.engine_s)):
            share = result.of_limit(seconds, c)
            if share is not None and share > 1:
                found.append(f"{side}, {c.label}: {share:.0%} of the read bandwidth")
    return found


def report(result: PerfResult, quick: bool = False) -> str:
    limited = any(c.bytes_per_unit is not None for c in result.cases)
    head = [QUICK_BANNER] if quick else []
    head += [f"{result.part}: {result.student_name} vs the engine's {result.engine_name}",
             f"machine: {machine_line()}; {torch.get_num_threads()} thread(s)",
             f"{result.trials} fresh process(es) a side, alternating which goes first; each process's fastest of "
             "its rounds, the median of the trials"]
    if limited:
        head += [f"limit: read bandwidth {result.read_gb_s:.1f} GB/s (x.sum() over the working set, the median of "
                 "every trial)", "of limit = the bytes a unit must read / its time / that bandwidth"]
    else:
        head.append("no bandwidth limit applies to this part: the ratio is the figure")
    tail = []
    over = impossible(result)
    if over:
        tail = ["", "!" * 100, "WARNING: above 100 % of the limit, which no code that reads its data can reach: "
                + "; ".join(over), "  the likely cause: results cached or reused instead of computed (or, for the "
                "engine's figure alone, a disturbed measurement: rerun on a quiet machine)", "!" * 100]
    return "\n".join(head + [table(result)] + tail + ([QUICK_BANNER] if quick else []))


# Where a share of the read bandwidth stops being noise and becomes impossible. The engine's own kernel measures
# 96-100 % of it for one fp32 row, and the bandwidth read on a shared machine moves by 10 % between two reads, so
# a correct solution as fast as the engine may print 101 %: it gets a warning ("!"), never a refusal, below this.
IMPOSSIBLE_SHARE = 1.2


def refusal(result: PerfResult) -> str | None:
    """Why the student's figures earn no credit, or None: a timed result was wrong, or a figure is impossible."""
    wrong = [f"{c.label}: {c.wrong}" for c in result.cases if c.wrong]
    if wrong:
        return ("no speed credited: a timed call returned a wrong result (" + wrong[0] + "). The track refills x "
                "before every round and keeps every result: a cache of results or an output buffer reused across "
                "calls is the likely cause (perf_speed's probes 'x refilled' and 'results kept')")
    over = [c.label for c in result.cases if (result.of_limit(c.student_s, c) or 0) > IMPOSSIBLE_SHARE]
    if over:
        return (f"no speed credited: yours is above {IMPOSSIBLE_SHARE:.0%} of the read bandwidth ({', '.join(over)}), "
                "which is "
                "impossible for code that reads the weight: the likely cause is results cached instead of "
                "computed; if your code computes every call, rerun on a quiet machine")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=PARTS)
    p.add_argument("path", help="your file (the starters are in exercises/hands_on/)")
    p.add_argument("--trials", type=int, help="fresh processes a side (default 5; --quick: 1)")
    p.add_argument("--rounds", type=int, default=PerfSettings.rounds, help="timed rounds in each process")
    p.add_argument("--set-mib", type=int, default=PerfSettings.set_mib,
                   help="the rotating working set in MiB (>= 2x the CPU's L3; default 64)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, one trial a side: checks that the track runs, NOT a speed measurement")
    p.add_argument("--no-engine", action="store_true", help="grade with the quick checks only (part 1)")
    p.add_argument("--plot", metavar="PNG", help="speed: save the roofline here (default: roofline.png beside "
                   "your file; --quick draws none unless asked)")
    args = p.parse_args(argv)
    if args.trials is None:
        args.trials = 1 if args.quick else 5
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
    try:
        result = alternate(args.part, args.path, settings, args.trials)
    except AssignmentError as error:  # a rule broken while timed (perf_speed.check_engine_ops_unloaded)
        print(f"✗ {error}\nno speed credited: the rules hold while your code is timed too")
        return 1
    refused = refusal(result)
    if refused:  # wrong results: no table (its figures are not yours); impossible ones: the table, then why
        print(refused if any(c.wrong for c in result.cases) else f"{report(result, args.quick)}\n{refused}")
        return 1
    print(report(result, args.quick))
    plot = args.plot or (None if args.quick or args.part != "speed" else Path(args.path).with_name("roofline.png"))
    if plot:
        from minivllm.teaching.perf_roofline import plot_roofline

        print(f"roofline saved to {plot_roofline(result, plot, machine_line())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
