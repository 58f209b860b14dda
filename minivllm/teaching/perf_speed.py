"""Hands-on 5, speed: the few-row matmul a decode step runs for every weight, graded for correctness first.

A decode step multiplies a few rows of activations (1 per request; 1 + k for a speculative verify) by
every weight of the model: y = x W^T, x (rows <= 8, in), W (out, in). Each weight byte is used once per
row, so the product is bound by READING W from memory, and the speed to aim for is the machine's read
bandwidth (kernels/skinny_gemm.py says how the engine's own kernel gets close to it). The student's file
defines two functions:

    pack_weight(weight) -> packed              once per weight, untimed (the engine packs at load time);
                                               optional: without it `packed` is the weight itself
    few_row_matmul(x, packed, out_features)    (rows, in) -> (rows, out_features), timed

Credit for speed goes only to correct code, so the probes below run first, each adding one idea to the
ones before it, so the first that fails names the rule (as the other hands-on graders do). The expected
answer is `naive_skinny_gemm`, the reference the engine's kernel is tested against. A submission that
uses the engine's own kernel (`skinny_gemm`, `torch.ops.minivllm_cpu`) is refused: ratio 1.0 by copying.

    python -m minivllm.teaching.perf_speed exercises/hands_on/5_speed/my_speed.py     # the probes alone
    python -m minivllm.teaching.perf_track speed exercises/hands_on/5_speed/my_speed.py --plot roofline.png
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from minivllm.kernels.skinny_gemm import naive_skinny_gemm
from minivllm.teaching.hands_on import AssignmentError

MATMUL_FUNCTION, PACK_FUNCTION = "few_row_matmul", "pack_weight"
# What a submission's code may not name (its comments and docstrings may): the engine's kernel, its packing,
# its op library, the package they live in, and the graders with their reference solutions.
ENGINE_NAMES = frozenset({"skinny_gemm", "pack_skinny_weight", "minivllm_cpu"})
REFUSED_PACKAGES = ("minivllm.kernels", "minivllm.teaching", "tests")
# y ~ N(0, 1) (W is scaled by in ** -0.5). fp32: another summation order moves y by ~in * 6e-8 < 1e-4.
# bf16: both sides sum in fp32 and round once, so they differ by at most an ulp of y (2 ** -7 at 1-2);
# summing in bf16 instead drifts by ~sqrt(in) * 2 ** -9 ~ 0.08 over 1536 terms, five times the tolerance.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}


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
    SpeedProbe("SmolLM2 shapes", "the model's own shapes, at 1, 5 and 8 rows, in fp32 and bf16 (everything "
               "above at once)", 8, 576, 576, torch.bfloat16),
)
SHAPES_RULE = "few_row_matmul returns a new (rows, out_features) tensor of x's dtype, and changes neither x nor W"
# The last probe's extra products: (rows, out, in, dtype), SmolLM2-135M's q/o, k/v, gate/up and down weights.
MIXES = ((1, 192, 576, torch.float32), (5, 1536, 576, torch.float32), (8, 576, 1536, torch.bfloat16),
         (1, 3072, 576, torch.bfloat16), (5, 576, 576, torch.float32))


def engine_name_used(source: str) -> str | None:
    """The first name of the engine's kernel that `source`'s code imports or uses (not its comments), or None:
    an import of its package (or of the graders'), a name or attribute `skinny_gemm` / `minivllm_cpu`, or
    such a string."""
    def engine(word: object) -> bool:
        return isinstance(word, str) and (word in ENGINE_NAMES or any(
            word == package or word.startswith(package + ".") for package in REFUSED_PACKAGES))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and engine(node.module):
            return node.module
        if isinstance(node, ast.Import | ast.ImportFrom):
            words = [a.name for a in node.names]
        elif isinstance(node, ast.Name | ast.Attribute | ast.Constant):
            words = [getattr(node, {ast.Name: "id", ast.Attribute: "attr", ast.Constant: "value"}[type(node)])]
        else:
            continue
        found = [w for w in words if engine(w)]
        if found:
            return found[0]
    return None


def load_speed_solution(path: str | Path) -> SpeedSolution:
    """The two functions the file at `path` defines (pack_weight optional), after the rule on the engine's kernel."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (the starter is exercises/hands_on/5_speed/my_speed.py)")
    named = engine_name_used(path.read_text())
    if named:
        raise AssignmentError(f"{path}: rule 'own kernel': the speed assignment is your own matmul; it may not "
                              f"use the engine's or the graders' (your code names {named!r}): that would score "
                              "their speed, not yours")
    name = f"hands_on_speed_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    matmul = getattr(module, MATMUL_FUNCTION, None)
    if not callable(matmul):
        raise AssignmentError(f"{path}: define a function `{MATMUL_FUNCTION}(x, packed, out_features)` (the starter "
                              "has its signature)")
    pack = getattr(module, PACK_FUNCTION, None)
    return SpeedSolution(path.stem, pack if callable(pack) else (lambda weight: weight), matmul)


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


def make_operands(rows: int, out_features: int, in_features: int, dtype: torch.dtype,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, in) ~ N(0, 1) and W (out, in) ~ N(0, 1 / in), so y ~ N(0, 1) whatever the shape."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).to(dtype)
    return x, weight


def check_product(solution: SpeedSolution, rows: int, out_features: int, in_features: int, dtype: torch.dtype,
                  rule: str, name: str, seed: int = 0) -> None:
    """One product against the reference; raise `AssignmentError` naming `rule` (or the shapes rule)."""
    x, weight = make_operands(rows, out_features, in_features, dtype, seed)
    x_before, weight_before = x.clone(), weight.clone()
    where = (f"probe '{name}' ({rows} row{'s' * (rows > 1)}, W {out_features} x {in_features}, "
             f"{str(dtype).removeprefix('torch.')})")
    try:
        y = solution.matmul(x, solution.pack(weight), out_features)
    except NotImplementedError:
        raise
    except Exception as error:  # a crash is reported under the probe's rule, with its message
        raise AssignmentError(f"{where}: rule: {rule}\n  your code raised {type(error).__name__}: {error}") from error
    if not isinstance(y, torch.Tensor) or y.shape != (rows, out_features) or y.dtype != dtype:
        got = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise AssignmentError(f"{where}: rule: {SHAPES_RULE}\n  expected ({rows}, {out_features}) {dtype}, got {got}")
    if not (torch.equal(x, x_before) and torch.equal(weight, weight_before)):
        raise AssignmentError(f"{where}: rule: {SHAPES_RULE}\n  x or W changed during the call")
    want = naive_skinny_gemm(x, weight)  # (rows, out)
    diff = (y.float() - want.float()).abs()
    tol = TOLERANCE[dtype] * (1 + want.float().abs())
    if not bool((diff <= tol).all()):  # NaN fails here too
        row, col = divmod(int((diff - tol).nan_to_num(float("inf")).argmax()), out_features)
        raise AssignmentError(f"{where}: rule: {rule}\n  y[{row}][{col}] = {float(y[row, col]):.5g}, expected "
                              f"{float(want[row, col]):.5g} (tolerance {TOLERANCE[dtype]:g} relative)")


def check_speed_probes(solution: SpeedSolution) -> None:
    """Every probe in order, the last with its mixes; raise `AssignmentError` at the first rule broken."""
    for probe in SPEED_PROBES:
        check_product(solution, probe.rows, probe.out_features, probe.in_features, probe.dtype, probe.rule, probe.name)
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
