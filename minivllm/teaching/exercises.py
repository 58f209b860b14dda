"""Checks for the notebooks' exercises: your answer, compared with the engine's on many cases.

    from minivllm.teaching.exercises import check
    check("blocks_needed", my_blocks_needed)   # prints ✓, or raises AssertionError naming the RULE
                                               # your answer broke, with a smallest counter-example

How a check teaches:
  * `_cases(name)` draws the cases: seeded, so every student sees the same ones, and chosen to hit
    the edges (a prompt of whole blocks, a budget that runs out mid-request, a near-tie);
  * `REFERENCES[name]` (teaching/references.py) is the engine's answer to each case;
  * an answer is first brought to the engine answer's type (a tuple for a list, a numpy mask for a
    bool tensor); a wrong type or shape is told what to return, never reported as a broken rule;
  * `RULES[name]` (teaching/exercise_rules.py) says, in words, what a wrong answer broke (an
    exception raised by the answer is named by the rule it breaks too). The first rule whose test fits the
    smallest failing case is the one reported, so the rules go from the most specific to the most
    general, and a student learns what to fix, not only that something is wrong.

Solutions are not here. Teachers: `pytest exercises/` runs every check against `exercises/student.py`;
the answers are in `tests/exercise_solutions.py` (see docs/teachers.md).
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable
from typing import Any

import torch

from minivllm.teaching.exercise_rules import RULES, Rule
from minivllm.teaching.references import REFERENCES


# --- cases ------------------------------------------------------------------------------------------
def _probs(rng: random.Random, n: int) -> torch.Tensor:
    p = torch.tensor([rng.random() ** 3 + 1e-3 for _ in range(n)])
    return p / p.sum()


def _sse_lines(rng: random.Random) -> list[str]:
    import json

    pieces = ["Pa", "ris", " is", "", " the", " capital."][: rng.randint(2, 6)]
    lines = [f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}}]})}", ""]
    for p in pieces:
        lines += [f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': p}}]})}", ""]
    return lines + ["data: [DONE]", ""]


def _penalty_case(rng: random.Random, which: str) -> tuple:
    logits = torch.tensor([rng.uniform(-3, 3) for _ in range(10)])
    prompt, output = [rng.randrange(10) for _ in range(4)], [rng.randrange(10) for _ in range(rng.randint(0, 6))]
    rep = rng.choice([1.2, 1.5, 2.0]) if which in ("rep", "all") else 1.0
    freq = rng.choice([0.3, 0.5, 1.0]) if which in ("freq", "all") else 0.0
    pres = rng.choice([0.3, 0.5, 1.0]) if which in ("pres", "all") else 0.0
    return logits, prompt, output, rep, freq, pres


def _greedy_case(rng: random.Random) -> tuple:
    k = rng.randint(0, 5)
    target = [rng.randrange(5) for _ in range(k + 1)]
    drafts = [t if rng.random() < 0.7 else rng.randrange(5) for t in target[:k]]
    return drafts, target


def _can_ever_run_edge(rng: random.Random) -> tuple:
    """A pool that holds the final length minus one token exactly: one token more needs one more block."""
    block_size, num_blocks = rng.choice([4, 8, 16]), rng.randint(1, 12)
    final = num_blocks * block_size + 1
    prompt = rng.randint(1, final - 1)
    max_tokens = final - prompt + rng.choice([0, 0, rng.randint(1, 20)])
    return prompt, max_tokens, num_blocks, block_size, rng.choice([final, final, final + rng.randint(1, 30)])


def _cases(name: str, rng: random.Random) -> list[tuple]:
    if name == "blocks_needed":
        return [(rng.randint(0, 200), rng.choice([1, 4, 16, 32])) for _ in range(200)]
    if name == "slot":
        return [(p, [rng.randrange(100) for _ in range(p // 4 + 1)], 4) for p in range(40)]
    if name == "cacheable_tokens":
        return [(n, b) for n in range(1, 40) for b in (1, 4, 8)]
    if name == "is_decode":
        return [(rng.randint(0, 30), rng.randint(1, 3), rng.randint(1, 30)) for _ in range(200)]
    if name == "plan_step":
        return [([rng.randint(1, 3) for _ in range(rng.randint(0, 4))],
                 [rng.randint(1, 20) for _ in range(rng.randint(0, 4))], rng.randint(1, 30)) for _ in range(60)]
    if name == "can_ever_run":
        return [(rng.randint(1, 80), rng.randint(1, 80), rng.randint(1, 12), rng.choice([4, 8, 16]),
                 rng.randint(16, 100)) for _ in range(200)] + [_can_ever_run_edge(rng) for _ in range(100)]
    if name == "logits_indices":
        return [([rng.randint(1, 9) for _ in range(k)], [rng.random() < 0.7 for _ in range(k)]) for k in range(1, 8)]
    if name == "causal_mask":
        return [(q, c) for c in range(1, 12) for q in range(1, c + 1)]
    if name == "top_p_keep":
        return [(_probs(rng, 12), rng.choice([0.1, 0.5, 0.8, 0.95])) for _ in range(40)]
    if name == "min_p_keep":
        return [(_probs(rng, 12), rng.choice([0.05, 0.1, 0.3, 0.9])) for _ in range(40)]
    if name == "overhead_fraction":
        return [(s, s * rng.random()) for s in (0.5, 1.0, 3.2)]
    if name == "sse_text":
        return [(_sse_lines(rng),) for _ in range(10)]
    if name == "blocks_after_fan_out":  # no block_size 1: there every prompt is whole blocks, and the
        # smallest case could not tell "everything shared" apart from "the last full block shared"
        return [(p, b, n) for p in range(1, 21) for b in (2, 3, 4, 8) for n in (1, 2, 3)]
    if name == "penalized_logits":
        return [_penalty_case(rng, w) for w in ("rep", "freq", "pres", "all") for _ in range(10)]
    if name == "greedy_accept":
        return [_greedy_case(rng) for _ in range(100)]
    if name == "kv_heads_of_rank":  # every split that ShardLayout accepts: one divides the other
        return [(kv, r, n) for kv in (1, 2, 3, 4, 8) for n in (1, 2, 4, 8) if kv % n == 0 or n % kv == 0
                for r in range(n)]
    raise KeyError(name)



def _as_expected(got: Any, expected: Any) -> tuple[Any, str | None]:
    """`got` in the engine answer's type, when it is the same data in another container (a tuple for a
    list, a numpy mask for a bool tensor, a 0-d tensor for a number); else what to return instead. A
    wrong type or shape is a Python matter, reported before any rule of the engine."""
    if isinstance(expected, torch.Tensor):
        what = f"a {expected.dim()}-D {'bool' if expected.dtype == torch.bool else 'float'} tensor"
        if not isinstance(got, torch.Tensor):
            try:  # numpy arrays, lists and tuples of numbers
                got = torch.as_tensor(got)
            except (TypeError, ValueError, RuntimeError):
                return got, f"return {what}; you returned a {type(got).__name__}"
        if expected.dtype == torch.bool and got.dtype != torch.bool:
            return got, f"return {what} (True = kept); you returned dtype {got.dtype}"
        if got.shape != expected.shape:
            return got, f"return {what} of shape {tuple(expected.shape)}; you returned shape {tuple(got.shape)}"
        return got, None
    if isinstance(expected, list):
        if isinstance(got, (set, frozenset, dict)):
            return got, f"return a list (in order); a {type(got).__name__} has no order"
        if isinstance(got, torch.Tensor) and got.dim() == 1 or type(got).__name__ == "ndarray":
            got = got.tolist()
        if not isinstance(got, (list, tuple)):
            return got, f"return a list; you returned a {type(got).__name__}"
        try:
            return [operator.index(x) for x in got], None
        except TypeError:
            return got, f"return a list of ints; you returned {got!r}"
    if isinstance(expected, bool):  # numpy's bool and a one-element bool tensor are the same answer
        if isinstance(got, bool) or str(getattr(got, "dtype", "")) in ("bool", "torch.bool") and _numel(got) == 1:
            return bool(got), None
        return got, f"return True or False; you returned a {type(got).__name__} ({got!r})"
    if isinstance(expected, int) and not isinstance(got, bool):
        try:  # an int, a numpy int, a one-element int tensor
            return operator.index(got), None
        except TypeError:
            pass
    if isinstance(expected, int):
        return got, f"return an int; you returned a {type(got).__name__} ({got!r})"
    if isinstance(expected, float) and not isinstance(got, (str, bytes)):
        try:
            return float(got), None
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(expected, float):
        return got, f"return a number; you returned a {type(got).__name__} ({got!r})"
    if isinstance(expected, str) and not isinstance(got, str):
        return got, f"return a str; you returned a {type(got).__name__}"
    return got, None


def _numel(v: Any) -> int:
    size = getattr(v, "numel", None) or getattr(v, "size", 1)
    return size() if callable(size) else size


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return bool((a == b).all()) if b.dtype == torch.bool else torch.allclose(a.float(), b.float(), atol=1e-5)
    if isinstance(b, float):
        return abs(a - b) < 1e-6  # a float32 answer is the same answer
    return a == b


def _show(v: Any) -> str:
    """Compact: a bool mask as 0/1 rows, a float tensor rounded, an exception as its type and message."""
    if isinstance(v, Exception):
        return f"{type(v).__name__}: {v}"
    if not isinstance(v, torch.Tensor):
        return repr(v)
    if v.dtype == torch.bool:
        rows = v.reshape(-1, v.shape[-1]) if v.dim() else v.reshape(1, 1)
        return "mask " + " / ".join("".join("1" if x else "0" for x in r.tolist()) for r in rows)
    return "tensor(" + repr([round(float(x), 3) for x in v.flatten()]) + ")"


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(_show(v) for v in args)})"


def check(name: str, fn: Callable[..., Any], seed: int = 0) -> None:
    """Run `fn` on the exercise's cases and compare with the engine. An answer of the wrong type or
    shape is told what to return; otherwise, on a disagreement (or an exception in `fn`), raise an
    AssertionError naming the rule that was broken, with the smallest case that shows it."""
    cases = _cases(name, random.Random(seed))
    failures, misshapen = [], []
    for args in cases:
        expected = REFERENCES[name](*args)
        try:
            got = fn(*args)
        except NotImplementedError:  # not written yet: `pytest exercises/` skips it
            raise
        except Exception as error:  # a crash breaks a rule too: the rules are asked with the exception
            failures.append((args, expected, error))
            continue
        got, problem = _as_expected(got, expected)
        if problem is not None:
            misshapen.append((args, problem))
        elif not _same(got, expected):
            failures.append((args, expected, got))
    if misshapen:
        args, problem = min(misshapen, key=lambda f: len(_call(name, f[0])))
        raise AssertionError(f"✗ {name}: {len(misshapen)} of {len(cases)} answers have the wrong type or shape "
                             f"(no rule of the engine is broken yet; the check cannot compare them).\n"
                             f"  {problem[0].upper() + problem[1:]}.\n  Smallest case: {_call(name, args)}")
    if not failures:
        print(f"✓ {name}: all {len(cases)} cases agree with the engine")
        return
    args, expected, got = min(failures, key=lambda f: len(_call(name, f[0])))
    rule = next(r for r in RULES[name] if _rule_applies(r, args, expected, got))
    returned = f"your code raised {_show(got)}" if isinstance(got, Exception) else f"you returned {_show(got)}"
    raise AssertionError(f"✗ {name}: {len(failures)} of {len(cases)} cases disagree with the engine.\n"
                         f"  Rule broken: {rule.text}.\n"
                         f"  Smallest case: {_call(name, args)}: {returned}, the engine says {_show(expected)}")


def _rule_applies(rule: Rule, args: tuple, expected: Any, got: Any) -> bool:
    try:
        return bool(rule.broken(args, expected, got))
    except Exception:  # a malformed answer (wrong type, wrong length): try the next rule
        return False
