"""Hands-on 5, speed: the few-row matmul a decode step runs for every weight, graded for correctness first.

A decode step multiplies a few rows of activations (1 per request; 1 + k for a speculative verify) by
every weight of the model: y = x W^T, x (rows <= 8, in), W (out, in). Each weight byte is used once per
row, so the product is bound by READING W from memory, and the speed to aim for is the machine's read
bandwidth (kernels/skinny_gemm.py says how the engine's own kernel gets close to it). The student's file
defines two functions:

    pack_weight(weight) -> packed              once per weight, untimed (the engine packs at load time);
                                               optional: without it `packed` is the weight itself
    few_row_matmul(x, packed, out_features)    (rows, in) -> (rows, out_features), timed

x is always contiguous (row-major, x[m][k] at m * in + k): the engine's Linear layers receive fresh
activations (a norm's, an activation's, attention's output), and its own kernel calls x.contiguous() anyway,
so the probes never pass a strided view: a kernel may read x through its data pointer.

Credit for speed goes only to correct code, so the probes below run first, each adding one idea to the
ones before it, so the first that fails names the rule (as the other hands-on graders do). Two call twice, as
the engine does: it refills one activation buffer with each step's x (a result cached by pointer is stale),
and it still holds a result when it asks for the next (an output buffer reused across calls overwrites it).
The expected answer is `naive_skinny_gemm`, which the engine's kernel is tested against. A submission that
uses the engine's own kernel (`skinny_gemm`, `torch.ops.minivllm_cpu`) is refused: ratio 1.0 by copying. The rule
is the hands-on graders' (submission_rules.py, `RULES["speed"]`): the source, its classes, and a watch on every
call (Python frames; the dispatcher for compiled ops), so a name built at run time is caught when it is called.

    python -m minivllm.teaching.perf_speed exercises/hands_on/5_speed/my_speed.py     # the probes alone
    python -m minivllm.teaching.perf_track speed exercises/hands_on/5_speed/my_speed.py   # then the timing
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm.kernels.skinny_gemm import naive_skinny_gemm
from minivllm.teaching.submission_rules import RULES, AssignmentError, check_classes, check_source
from minivllm.teaching.submission_watch import Watch

MATMUL_FUNCTION, PACK_FUNCTION = "few_row_matmul", "pack_weight"
ENGINE_OPS = "minivllm_cpu"  # the namespace of the engine's compiled ops (torch.ops.minivllm_cpu)
# y ~ N(0, 1) (W is scaled by in ** -0.5). fp32: another summation order moves y by ~in * 6e-8 < 1e-4.
# bf16: both sides sum in fp32 and round once, so they differ by at most an ulp of y (2 ** -7 at 1-2);
# summing in bf16 instead drifts by ~sqrt(in) * 2 ** -9 ~ 0.08 over 1536 terms, five times the tolerance.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}
# 'bf16 round once', derived: x = +-1 and W in multiples of 1/16 in [1, 2], so every partial sum (< 2 ** 12) is
# exact in fp32 in any order, and rounding it once is off by <= one ulp of y <= 2 ** -7 |y| (8 significant bits).
# A bf16 running sum climbs to ~1500 (ulp 8) before the second half of k cancels it to |y| < 4: 64-wide blocks
# summed in bf16 ended 18 off (a per-element bf16 sum 515), about a thousand ulps of y.
ROUND_ONCE_ULP = 2 ** -7


class Calls(Enum):
    """How a probe calls the solution: once; twice on one x buffer refilled in place; twice on two x."""
    ONCE = "once"
    X_REFILLED = "x refilled"
    TWO_RESULTS = "two results"


class SpeedSolution(NamedTuple):
    """A few-row matmul in two steps: `pack(weight)` once, untimed; `matmul(x, packed, out_features)` timed."""

    name: str
    pack: Callable[[torch.Tensor], object]
    matmul: Callable[[torch.Tensor, object, int], torch.Tensor]


@dataclass(frozen=True)
class SpeedProbe:
    """One product: x (rows, in) @ W (out, in)^T in `dtype`; the rule its failure names."""

    name: str
    rule: str
    rows: int
    out_features: int
    in_features: int
    dtype: torch.dtype = torch.float32
    calls: Calls = Calls.ONCE
    exact_sums: bool = False  # operands whose fp32 sums are exact (the round-once probe)


SPEED_PROBES = (
    SpeedProbe("one row", "y[m][n] = sum over k of x[m][k] * W[n][k]: W is (out, in), so y = x @ W^T (not x @ W, "
               "not W's first `in` values read as an (in, out) matrix)", 1, 16, 32),
    SpeedProbe("rows", "each row of x gets its own row of y: y[m] = W @ x[m] for every m", 4, 16, 32),
    SpeedProbe("rows 1-8", "every row up to 8 is computed (a speculative verify sends 1 + k rows): a kernel that "
               "takes rows in tiles must also do the last, partial tile", 7, 32, 64),
    SpeedProbe("ragged out", "out_features need not be a multiple of your block of columns: the last columns "
               "(here 40 = 2 x 16 + 8) are computed too, and y has exactly out_features columns", 3, 40, 64),
    SpeedProbe("ragged in", "in_features need not be a multiple of your vector width: the tail of each dot product "
               "(here 37 = 4 x 8 + 5) is summed too", 2, 32, 37),
    SpeedProbe("bf16 sums", "bf16 x and W are multiplied and SUMMED in fp32, and y is rounded to bf16 once at the "
               "end (a bf16 running sum keeps 8 bits: over 1536 terms it drifts by ~0.1)", 3, 64, 1536,
               torch.bfloat16),
    SpeedProbe("bf16 round once", "the fp32 sum runs over ALL of k and is rounded to bf16 once, at the end: a "
               "running sum kept in bf16 (even per block of k) loses the low bits of every addition once it is "
               "large, and here the partial sums reach ~1500 (bf16 ulp 8) before cancelling to |y| < 4",
               2, 48, 2048, torch.bfloat16, exact_sums=True),
    SpeedProbe("x refilled", "every call computes from x as it is NOW: the engine refills the same activation "
               "buffer with the next step's x, so a result cached by x's data_ptr, shape or id is the previous "
               "step's answer", 3, 32, 64, calls=Calls.X_REFILLED),
    SpeedProbe("results kept", "each call returns a NEW tensor: the engine still holds the previous result "
               "(the residual, the next layer's input) when it calls again, so an output buffer reused across "
               "calls overwrites it", 3, 32, 64, calls=Calls.TWO_RESULTS),
    SpeedProbe("SmolLM2 shapes", "the model's own shapes, at 1, 5 and 8 rows, in fp32 and bf16 (everything "
               "above at once)", 8, 576, 576, torch.bfloat16),
)
SHAPES_RULE = "few_row_matmul returns a new (rows, out_features) tensor of x's dtype, and changes neither x nor W"
# The last probe's extra products: (rows, out, in, dtype), SmolLM2-135M's q/o, k/v, gate/up and down weights.
MIXES = ((1, 192, 576, torch.float32), (5, 1536, 576, torch.float32), (8, 576, 1536, torch.bfloat16),
         (1, 3072, 576, torch.bfloat16), (5, 576, 576, torch.float32))


class EngineOps(TorchDispatchMode):
    """Records the engine's compiled ops run while open: the watch sees only Python frames, the dispatcher every op
    (one reached by a name built at run time too)."""

    def __init__(self) -> None:
        super().__init__()
        self.used: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == ENGINE_OPS:
            self.used.append(f"torch.ops.{func.namespace}.{func.__name__}")
        return func(*args, **(kwargs or {}))

    def check(self, who: str) -> None:
        if self.used:
            raise AssignmentError(f"{who} broke a RULE: {RULES['speed'].rule}.\n  while the grader ran your code, "
                                  f"it ran {self.used[0]}")


def check_engine_ops_unloaded(who: str) -> None:
    """Raise `AssignmentError` if the engine's compiled kernel is loaded in this process: the timed rounds run
    unwatched (a hook would slow them), and the student's trial never loads the ops itself, so code honest only
    while a trace hook is set (`sys.gettrace()`) is caught after its timing."""
    if hasattr(getattr(torch.ops, ENGINE_OPS), "skinny_gemm"):
        raise AssignmentError(f"{who} broke a RULE: {RULES['speed'].rule}.\n  the engine's compiled kernel "
                              f"(torch.ops.{ENGINE_OPS}) was loaded in your timed process")


def watched(who: str, function: Callable, *args: object) -> object:
    """`function(*args)` under the speed rule's watch: a call into the engine's kernels (its Python, its compiled
    ops) raises `AssignmentError` after it returns, however the name was reached."""
    with Watch(RULES["speed"]) as watch, EngineOps() as ops:
        result = function(*args)
    watch.check(who)
    ops.check(who)
    return result


def load_speed_solution(path: str | Path) -> SpeedSolution:
    """The two functions the file at `path` defines (pack_weight optional), after the rule on the engine's kernel."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (the starter is exercises/hands_on/5_speed/my_speed.py)")
    check_source(path, RULES["speed"])
    name = f"hands_on_speed_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    watched(str(path), spec.loader.exec_module, module)
    check_classes(module, RULES["speed"])
    matmul = getattr(module, MATMUL_FUNCTION, None)
    if not callable(matmul):
        raise AssignmentError(f"{path}: define a function `{MATMUL_FUNCTION}(x, packed, out_features)` (the starter "
                              "has its signature)")
    pack = getattr(module, PACK_FUNCTION, None)
    return SpeedSolution(path.stem, pack if callable(pack) else (lambda weight: weight), matmul)


def make_operands(rows: int, out_features: int, in_features: int, dtype: torch.dtype,
                  seed: int = 0, exact_sums: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, in) ~ N(0, 1) and W (out, in) ~ N(0, 1 / in), so y ~ N(0, 1) whatever the shape; contiguous.
    `exact_sums`: x = +1 over the first half of k and -1 over the second, W in {1, 1 + 1/16, ..., 2} with its
    second half within 1/16 of its first, so the partial sums climb high and cancel (see ROUND_ONCE_ULP)."""
    g = torch.Generator().manual_seed(seed)
    if exact_sums:
        half = in_features // 2  # the probe's in_features is even
        x = torch.cat([torch.ones(rows, half), -torch.ones(rows, half)], dim=1)  # (rows, in)
        first = 1 + torch.randint(0, 16, (out_features, half), generator=g) / 16  # (out, half)
        second = first + torch.randint(-1, 2, (out_features, half), generator=g) / 16
        return x.to(dtype), torch.cat([first, second], dim=1).to(dtype)  # (out, in)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).to(dtype)
    return x, weight


def mismatch(y: torch.Tensor, want: torch.Tensor, exact_sums: bool = False) -> str | None:
    """Where `y` is furthest outside the tolerance around `want` (both (rows, out)), in words; None if nowhere."""
    diff = (y.float() - want.float()).abs()
    if exact_sums:
        tol, says = ROUND_ONCE_ULP * (want.float().abs() + 1 / 16), "one bf16 ulp of y"
    else:
        tol, says = TOLERANCE[want.dtype] * (1 + want.float().abs()), f"{TOLERANCE[want.dtype]:g} relative"
    if bool((diff <= tol).all()):  # NaN fails here too
        return None
    row, col = divmod(int((diff - tol).nan_to_num(float("inf")).argmax()), want.shape[1])
    return f"y[{row}][{col}] = {float(y[row, col]):.5g}, expected {float(want[row, col]):.5g} (tolerance {says})"


def crash_named(where: str, rule: str, function: Callable, *args: object) -> object:
    """`function(*args)` watched, a crash reported under the probe's rule with its message (not written yet: as
    is)."""
    try:
        return watched(where, function, *args)
    except (NotImplementedError, AssignmentError):
        raise
    except Exception as error:
        raise AssignmentError(f"{where}: rule: {rule}\n  your code raised {type(error).__name__}: {error}") from error


def call_once(solution: SpeedSolution, x: torch.Tensor, packed: object, weight: torch.Tensor, where: str,
              rule: str) -> torch.Tensor:
    """One call, its crash reported under `rule`, its result's shape and dtype and its inputs checked."""
    rows, out_features = x.shape[0], weight.shape[0]
    x_before, weight_before = x.clone(), weight.clone()
    y = crash_named(where, rule, solution.matmul, x, packed, out_features)
    if not isinstance(y, torch.Tensor) or y.shape != (rows, out_features) or y.dtype != x.dtype:
        got = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise AssignmentError(f"{where}: rule: {SHAPES_RULE}\n  expected ({rows}, {out_features}) {x.dtype}, "
                              f"got {got}")
    if not (torch.equal(x, x_before) and torch.equal(weight, weight_before)):
        raise AssignmentError(f"{where}: rule: {SHAPES_RULE}\n  x or W changed during the call")
    return y


def check_product(solution: SpeedSolution, rows: int, out_features: int, in_features: int, dtype: torch.dtype,
                  rule: str, name: str, seed: int = 0, calls: Calls = Calls.ONCE, exact_sums: bool = False) -> None:
    """One probe against the reference; raise `AssignmentError` naming `rule` (or the shapes rule)."""
    x, weight = make_operands(rows, out_features, in_features, dtype, seed, exact_sums)
    where = (f"probe '{name}' ({rows} row{'s' * (rows > 1)}, W {out_features} x {in_features}, "
             f"{str(dtype).removeprefix('torch.')})")
    packed = crash_named(where, rule, solution.pack, weight)
    y = call_once(solution, x, packed, weight, where, rule)
    wrong = mismatch(y, naive_skinny_gemm(x, weight), exact_sums)
    if wrong is None and calls is not Calls.ONCE:
        x2 = make_operands(rows, out_features, in_features, dtype, seed + 100)[0]  # (rows, in): other values
        if calls is Calls.X_REFILLED:
            x.copy_(x2)  # the same buffer, the next step's values
            again = call_once(solution, x, packed, weight, where, rule)
            wrong = mismatch(again, naive_skinny_gemm(x, weight))
            wrong = wrong and f"second call, after x was refilled in place with new values: {wrong}"
        else:
            want_first = naive_skinny_gemm(x, weight)
            call_once(solution, x2, packed, weight, where, rule)
            wrong = mismatch(y, want_first)
            wrong = wrong and f"the FIRST call's result, read after a second call with another x: {wrong}"
    if wrong:
        raise AssignmentError(f"{where}: rule: {rule}\n  {wrong}")


def check_speed_probes(solution: SpeedSolution) -> None:
    """Every probe in order, the last with its mixes; raise `AssignmentError` at the first rule broken."""
    for probe in SPEED_PROBES:
        check_product(solution, probe.rows, probe.out_features, probe.in_features, probe.dtype, probe.rule, probe.name,
                      calls=probe.calls, exact_sums=probe.exact_sums)
    last = SPEED_PROBES[-1]
    for seed, (rows, out_f, in_f, dtype) in enumerate(MIXES, start=1):
        check_product(solution, rows, out_f, in_f, dtype, last.rule, last.name, seed)


def grade_speed(path: str | Path) -> SpeedSolution:
    """Load and check the file at `path`; print the ✓ line; return the solution (for timing)."""
    solution = load_speed_solution(path)
    check_speed_probes(solution)
    probes = ", ".join(p.name for p in SPEED_PROBES)
    print(f"✓ {solution.name}: {len(SPEED_PROBES)} probes and {len(MIXES)} mixes against naive_skinny_gemm "
          f"({probes})")
    return solution


def main(argv: list[str] | None = None) -> int:
    """Exit status as grade_hands_on's: 0 passed, 1 a rule broken, 2 not written yet."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m minivllm.teaching.perf_speed <your file> (the starter: "
              "exercises/hands_on/5_speed/my_speed.py)")
        return 2
    try:
        grade_speed(args[0])
    except NotImplementedError:
        print(f"{args[0]} is not written yet: replace each `raise NotImplementedError` with your code")
        return 2
    except AssertionError as error:
        print(f"✗ {args[0]} failed.\n{error}")
        return 1
    print(f"{args[0]} passed the speed assignment's probes.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
