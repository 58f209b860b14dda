"""The performance track's timing: each side in fresh processes, in alternating order, medians.

Why not time both in one process, one after the other? Because what ran before changes what runs next:
the first side pays for page faults, the allocator's growth and cold caches; the second inherits a warm
heap, a CPU clocked up or down, or a neighbour's burst on a shared machine. CMU 11-868 times submissions
the same way: every trial is a new process (nothing carried over), the order flips every trial
(student, engine; engine, student; ...), so a drift in the machine's speed over the run falls on both
sides equally, and the figure kept is the median of the trials (one stalled trial does not move it).

    python -m minivllm.teaching.perf_measure <part> <student|engine> <file> [--quick --set-mib N --rounds N]

is one trial: it builds the part's workload (teaching/perf_workloads.py), runs a round untimed (first
calls allocate and pick kernels), times `rounds` rounds, and prints one JSON line with two figures:

  * each case's time per unit in its FASTEST round: the code's own cost. On a shared machine a round can
    only gain waits, so the fastest has the fewest (the ceiling below is likewise the fastest of its reads).
  * the read bandwidth, measured after the timing in the same process: `x.sum()` over a buffer as big as
    the working set, the ceiling a reading kernel can hope for FROM THE SAME PLACE. On a 2-core Zen 5 with
    a 32 MiB L3, x.sum() read 64 MiB at ~33 GB/s but 256 MiB at ~18: a ceiling measured on another size
    is another machine's.

`alternate` runs the trials and takes the medians. Only ratios mean anything: on a shared machine every
absolute time includes waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from minivllm.teaching.perf_speed import SpeedSolution, check_engine_ops_unloaded, load_speed_solution
from minivllm.teaching.submission_rules import AssignmentError
from minivllm.teaching.perf_workloads import PerfSettings, TimedCase

PARTS = ("attention", "kernel", "filter", "allocator", "speed")
SIDES = ("student", "engine")
RULE_BROKEN = 3  # a trial's exit status when the student's code broke a rule while it was timed


def engine_speed_solution() -> tuple[SpeedSolution, str]:
    """The engine's own few-row matmul here, and what it is in words: its C++ kernel where built, else F.linear."""
    from minivllm.kernels.cpu_build import isa_level, load_cpu_kernels

    build = load_cpu_kernels()
    if build.available:
        from minivllm.kernels.skinny_gemm import pack_skinny_weight, skinny_gemm

        def matmul(x: torch.Tensor, packed: object, out_features: int) -> torch.Tensor:
            return skinny_gemm(x, packed, out_features, None)

        return SpeedSolution("skinny_gemm", pack_skinny_weight, matmul), f"skinny_gemm ({isa_level()} build)"

    def linear(x: torch.Tensor, weight: object, out_features: int) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight)

    return SpeedSolution("F.linear", lambda weight: weight, linear), f"F.linear (no C++ kernels: {build.detail})"


def build_cases(part: str, side: str, path: str, settings: PerfSettings) -> tuple[list[TimedCase], str]:
    """The part's timed cases for one side, and that side's implementation in words."""
    from minivllm.teaching import perf_workloads as w
    from minivllm.teaching.hands_on import Assignment, load_student

    device = torch.device("cuda" if part == "kernel" else "cpu")
    if part == "speed":
        solution, name = engine_speed_solution() if side == "engine" else (load_speed_solution(path), Path(path).name)
        return w.speed_cases(solution, settings), name
    if part in ("attention", "kernel"):
        if side == "engine":
            make, name = w.engine_attention(device)
        elif part == "kernel":
            from minivllm.teaching.hands_on_attention import kernel_backend

            make, name = kernel_backend(load_student(path, Assignment.KERNEL)), Path(path).name
        else:
            make, name = load_student(path, Assignment.ATTENTION), Path(path).name
        return w.attention_cases(make, settings, device), name
    if part == "filter":
        from minivllm.layers.sampler import TopKTopPMinP

        cls = TopKTopPMinP if side == "engine" else load_student(path, Assignment.FILTER)
        return w.filter_cases(cls(), settings), cls.__name__
    from minivllm.engine.core.block_allocator import LRUAllocator

    cls = LRUAllocator if side == "engine" else load_student(path, Assignment.ALLOCATOR)
    return w.allocator_cases(cls, settings), cls.__name__


def time_case(case: TimedCase, rounds: int) -> tuple[float, str | None]:
    """The fastest of `rounds` timed rounds, in seconds per unit, after one untimed round; and the first wrong
    result the case's check found in any round (None: every round's results were right)."""
    times, wrong = [], None
    for timed in [False] + [True] * rounds:
        if case.refresh:
            case.refresh()  # new inputs, untimed
        start = time.perf_counter()
        case.run_round()
        if case.sync:
            case.sync()
        if timed:
            times.append((time.perf_counter() - start) / case.units)
        if case.check and wrong is None:
            wrong = case.check()  # untimed
    return min(times), wrong


@dataclass(frozen=True)
class TimedCaseResult:
    """One case in one trial: seconds per unit in the fastest round, bytes a unit must read (None: no
    limit), the first wrong result the case's check found (None: all right)."""

    label: str
    seconds: float
    bytes_per_unit: int | None
    wrong: str | None = None


@dataclass(frozen=True)
class TrialResult:
    """One fresh process's measurement of one side; it crosses the process boundary as one JSON line."""

    side: str
    name: str  # the side's implementation, in words
    cases: list[TimedCaseResult]
    read_gb_s: float  # the read bandwidth measured after the timing, in the same process

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> TrialResult:
        fields = json.loads(line)
        return cls(**{**fields, "cases": [TimedCaseResult(**c) for c in fields["cases"]]})


def trial(part: str, side: str, path: str, settings: PerfSettings) -> TrialResult:
    """One fresh process's measurement (what `main` prints as JSON)."""
    from minivllm.entrypoints.roofline import measure_read_bandwidth

    cases, name = build_cases(part, side, path, settings)
    timed = []
    for c in cases:
        seconds, wrong = time_case(c, settings.rounds)
        timed.append(TimedCaseResult(c.label, seconds, c.bytes_per_unit, wrong))
    if part == "speed" and side == "student":
        check_engine_ops_unloaded(Path(path).name)
    return TrialResult(side, name, timed, measure_read_bandwidth(settings.set_bytes))


@dataclass(frozen=True)
class CaseResult:
    """One case's medians over the trials: seconds per unit on each side, bytes a unit must read (or None);
    `wrong`: what was wrong with the student's timed results in some trial (None: always right)."""

    label: str
    student_s: float
    engine_s: float
    bytes_per_unit: int | None
    wrong: str | None = None

    @property
    def ratio(self) -> float:
        """Your time / the engine's: 1.0 ties it, 2.0 is twice as slow, 0.5 twice as fast."""
        return self.student_s / self.engine_s

    def gb_s(self, seconds: float) -> float | None:
        return None if self.bytes_per_unit is None else self.bytes_per_unit / seconds / 1e9


@dataclass(frozen=True)
class PerfResult:
    """A part's measurement: both sides' names, every case, the median read bandwidth of all trials."""

    part: str
    student_name: str
    engine_name: str
    trials: int
    cases: list[CaseResult]
    read_gb_s: float

    def of_limit(self, seconds: float, case: CaseResult) -> float | None:
        """The fraction of the machine's limit reached: bytes / seconds / read bandwidth (None: no limit)."""
        gb_s = case.gb_s(seconds)
        return None if gb_s is None else gb_s / self.read_gb_s


def run_trial(part: str, side: str, path: str, settings: PerfSettings) -> TrialResult:
    """One trial in a fresh Python process (the environment is inherited: thread counts, ISA caps)."""
    command = [sys.executable, "-m", "minivllm.teaching.perf_measure", part, side, str(path), "--set-mib",
               str(settings.set_mib), "--rounds", str(settings.rounds)] + (["--quick"] if settings.quick else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == RULE_BROKEN:
        raise AssignmentError(done.stderr.strip())
    if done.returncode != 0:
        raise RuntimeError(f"the {side} trial of {part} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return TrialResult.from_json(done.stdout.strip().splitlines()[-1])


def alternate(part: str, path: str, settings: PerfSettings, trials: int) -> PerfResult:
    """`trials` fresh processes a side, student first in even trials and engine first in odd ones; medians."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    runs: dict[str, list[TrialResult]] = {side: [] for side in SIDES}
    for t in range(trials):
        for side in SIDES if t % 2 == 0 else SIDES[::-1]:
            runs[side].append(run_trial(part, side, path, settings))
    cases = []
    for i, first in enumerate(runs["student"][0].cases):
        med = {side: statistics.median(r.cases[i].seconds for r in runs[side]) for side in SIDES}
        wrong = next((r.cases[i].wrong for r in runs["student"] if r.cases[i].wrong), None)
        cases.append(CaseResult(first.label, med["student"], med["engine"], first.bytes_per_unit, wrong))
    read = statistics.median(r.read_gb_s for side in SIDES for r in runs[side])
    return PerfResult(part, runs["student"][0].name, runs["engine"][0].name, trials, cases, read)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one trial of the performance track (perf_track runs these)")
    p.add_argument("part", choices=PARTS)
    p.add_argument("side", choices=SIDES)
    p.add_argument("path")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--set-mib", type=int, default=PerfSettings.set_mib)
    p.add_argument("--rounds", type=int, default=PerfSettings.rounds)
    args = p.parse_args(argv)
    settings = PerfSettings(args.quick, args.set_mib, args.rounds)
    try:
        print(trial(args.part, args.side, args.path, settings).to_json())
    except AssignmentError as error:
        print(error, file=sys.stderr)
        return RULE_BROKEN
    return 0


if __name__ == "__main__":
    sys.exit(main())
