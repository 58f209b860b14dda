"""Checks for the notebooks' exercises: your answer, compared with the engine's on many cases.

    from minivllm.teaching.exercises import check
    check("blocks_needed", my_blocks_needed)   # prints ✓, or raises AssertionError naming the RULE
                                               # your answer broke, with a smallest counter-example

How a check teaches:
  * `_cases(name)` draws the cases: seeded, so every student sees the same ones, and chosen to hit
    the edges (a prompt of whole blocks, a budget that runs out mid-request, a near-tie);
  * `REFERENCES[name]` (teaching/references.py) is the engine's answer to each case;
  * `RULES[name]` says, in words, what a wrong answer broke. The first rule whose test fits the
    smallest failing case is the one reported, so the rules go from the most specific to the most
    general, and a student learns what to fix, not only that something is wrong.

Solutions are not here. Teachers: `pytest exercises/` runs every check against `exercises/student.py`;
the answers are in `tests/exercise_solutions.py` (see docs/teachers.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

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
                 rng.randint(16, 100)) for _ in range(300)]
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
    if name == "blocks_after_fork":
        return [(p, b, n) for p in range(1, 21) for b in (1, 4, 8) for n in (1, 2, 3)]
    if name == "penalized_logits":
        return [_penalty_case(rng, w) for w in ("rep", "freq", "pres", "all") for _ in range(10)]
    if name == "greedy_accept":
        return [_greedy_case(rng) for _ in range(100)]
    if name == "kv_heads_of_rank":  # every split that ShardLayout accepts: one divides the other
        return [(kv, r, n) for kv in (1, 2, 3, 4, 8) for n in (1, 2, 4, 8) if kv % n == 0 or n % kv == 0
                for r in range(n)]
    raise KeyError(name)



# --- the rules: what a wrong answer broke, in words ------------------------------------------------
class Rule(NamedTuple):
    """A rule of the engine, and when a failing case shows that it was broken. `broken(args,
    expected, got)` is asked of a failing case only; the first rule that says True is reported."""

    text: str
    broken: Callable[[tuple, Any, Any], bool] = lambda args, expected, got: True


RULES: dict[str, list[Rule]] = {
    "blocks_needed": [
        Rule("no tokens need no blocks", lambda a, e, g: a[0] == 0),
        Rule("a partly filled last block is still a whole block: round UP", lambda a, e, g: a[0] % a[1] != 0),
        Rule("tokens that fill their blocks exactly need no extra block"),
    ],
    "slot": [
        Rule("the slot is the physical block's first slot (block id × block_size) plus the offset "
             "position % block_size", lambda a, e, g: a[0] < a[2]),
        Rule("the LOGICAL block position // block_size is looked up in the block table: consecutive "
             "logical blocks can be anywhere in the pool"),
    ],
    "cacheable_tokens": [
        Rule("at least one prompt token is always computed (its logits give the first output token): "
             "a prompt made of whole blocks cannot take its last block from the cache",
             lambda a, e, g: a[0] % a[1] == 0),
        Rule("only FULL blocks are cached: the tokens of a partly filled last block are computed"),
    ],
    "is_decode": [
        Rule("a chunk that starts inside the prompt is a prefill, even a 1-token one", lambda a, e, g: a[0] < a[2]),
        Rule("a chunk of more than one token is a prefill (a recompute after preemption is one too)",
             lambda a, e, g: a[1] > 1),
        Rule("exactly one token past the prompt is a decode"),
    ],
    "plan_step": [
        Rule("requests that get no token are left out of the list", lambda a, e, g: 0 in list(g)),
        Rule("one token budget is shared by the whole step: the tokens of all requests add up to at most "
             "`budget`", lambda a, e, g: sum(g) > a[2]),
        Rule("running requests come first, in order, then waiting ones with what is left",
             lambda a, e, g: sorted(g) == sorted(e)),
        Rule("with chunked prefill a request takes min(its tokens, what is left of the budget): the last "
             "one admitted may get a partial chunk"),
    ],
    "can_ever_run": [
        Rule("a prompt of max_model_len tokens or more leaves no room to generate", lambda a, e, g: a[0] >= a[4]),
        Rule("max_model_len caps the final length: the request stops there even when max_tokens is larger",
             lambda a, e, g: a[0] + a[1] > a[4]),
        Rule("the last generated token is never fed back, so it needs no KV: count final_len - 1 tokens"),
    ],
    "logits_indices": [
        Rule("a request that does not sample has no logits row, but its rows still shift the ones after it",
             lambda a, e, g: not all(a[1])),
        Rule("the sampled row of a request is the LAST row of its chunk: cumulative query lengths - 1"),
    ],
    "causal_mask": [
        Rule("a fresh prefill (q_len == ctx_len) is lower-triangular: row r sees keys 0..r",
             lambda a, e, g: a[0] == a[1]),
        Rule("query row r is the token at position ctx_len - q_len + r: it sees every key up to that "
             "position, the cached prefix included"),
    ],
    "top_p_keep": [
        Rule("the most likely token is always kept", lambda a, e, g: not bool(g[int(a[0].argmax())])),
        Rule("top-p keeps the most likely tokens until their mass REACHES top_p: a token is kept when the "
             "mass of the tokens more likely than it is still below top_p"),
    ],
    "min_p_keep": [
        Rule("min-p is relative: keep p >= min_p × (the largest probability), not p >= min_p"),
    ],
    "overhead_fraction": [
        Rule("overhead is the share of the step NOT spent in the forward: 1 - forward / step"),
    ],
    "sse_text": [
        Rule("the text is the concatenation of choices[0].delta.content over the 'data: ' lines; the first "
             "delta carries the role and no text, 'data: [DONE]' is not JSON, blank lines separate events"),
    ],
    "blocks_after_fork": [
        Rule("n = 1 is no fork: the prompt's blocks only", lambda a, e, g: a[2] == 1),
        Rule("a prompt of whole blocks has no partial block: the children share every block, nothing is "
             "copied", lambda a, e, g: a[0] % a[1] == 0),
        Rule("full blocks are SHARED (ref counts), never copied: they count once"),
        Rule("the partly filled last block cannot be shared (each sequence writes its next token there): "
             "each of the n sequences holds its own, so n - 1 copies"),
    ],
    "penalized_logits": [
        Rule("repetition penalty (HF's): for ids in the prompt OR the output, a positive logit is divided "
             "by it and a negative one multiplied", lambda a, e, g: a[4] == a[5] == 0),
        Rule("frequency penalty: subtract it once per occurrence of the id in the OUTPUT (the prompt does "
             "not count)", lambda a, e, g: a[3] == 1 and a[5] == 0),
        Rule("presence penalty: subtract it once if the id occurs in the OUTPUT at all",
             lambda a, e, g: a[3] == 1 and a[4] == 0),
        Rule("the order is repetition first, then frequency and presence on the result"),
    ],
    "greedy_accept": [
        Rule("the step always emits one token of the target's own after the accepted drafts: the "
             "correction at the first mismatch, or the bonus token when every draft matched",
             lambda a, e, g: len(g) == len(e) - 1),
        Rule("verification stops at the first draft the target disagrees with: no later draft is accepted",
             lambda a, e, g: len(g) > len(e)),
        Rule("a draft is accepted when it equals the target's argmax at its position"),
    ],
    "kv_heads_of_rank": [
        Rule("one rank holds the whole model: every KV head", lambda a, e, g: a[2] == 1),
        Rule("with fewer KV heads than ranks, each rank holds exactly ONE KV head, the one its query heads read: "
             "head rank × num_kv_heads // world_size (a copy on world_size / num_kv_heads ranks)",
             lambda a, e, g: a[0] < a[2]),
        Rule("each rank holds num_kv_heads / world_size CONSECUTIVE heads (numbered as in the checkpoint), rank r's "
             "from r × num_kv_heads / world_size: its query heads' GQA groups"),
    ],
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return False
        return bool((a == b).all()) if b.dtype == torch.bool else torch.allclose(a.float(), b.float(), atol=1e-5)
    if isinstance(b, float):
        return abs(float(a) - b) < 1e-9
    return a == b


def _show(v: Any) -> str:
    """Compact: a bool mask as 0/1 rows, a float tensor rounded."""
    if not isinstance(v, torch.Tensor):
        return repr(v)
    if v.dtype == torch.bool:
        rows = v.reshape(-1, v.shape[-1]) if v.dim() else v.reshape(1, 1)
        return "mask " + " / ".join("".join("1" if x else "0" for x in r.tolist()) for r in rows)
    return "tensor(" + repr([round(float(x), 3) for x in v.flatten()]) + ")"


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(_show(v) for v in args)})"


def check(name: str, fn: Callable[..., Any], seed: int = 0) -> None:
    """Run `fn` on the exercise's cases and compare with the engine. On a disagreement, raise an
    AssertionError naming the rule that was broken, with the smallest case that shows it."""
    cases = _cases(name, random.Random(seed))
    failures = []
    for args in cases:
        expected, got = REFERENCES[name](*args), fn(*args)
        if not _same(got, expected):
            failures.append((args, expected, got))
    if not failures:
        print(f"✓ {name}: all {len(cases)} cases agree with the engine")
        return
    args, expected, got = min(failures, key=lambda f: len(_call(name, f[0])))
    rule = next(r for r in RULES[name] if _rule_applies(r, args, expected, got))
    raise AssertionError(f"✗ {name}: {len(failures)} of {len(cases)} cases disagree with the engine.\n"
                         f"  Rule broken: {rule.text}.\n"
                         f"  Smallest case: {_call(name, args)}: you returned {_show(got)}, "
                         f"the engine says {_show(expected)}")


def _rule_applies(rule: Rule, args: tuple, expected: Any, got: Any) -> bool:
    try:
        return bool(rule.broken(args, expected, got))
    except Exception:  # a malformed answer (wrong type, wrong length): try the next rule
        return False

