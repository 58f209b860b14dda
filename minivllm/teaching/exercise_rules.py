"""The rules of the engine each exercise is about, in words: what a wrong answer broke.

`RULES[name]` lists the rules of one exercise, from the most specific to the most general. For the
smallest case where a student's answer disagrees with the engine, `check` (teaching/exercises.py)
reports the first rule whose `broken(args, expected, got)` says True; `got` is what the student's
function returned, or the exception it raised (so a crash is named by the rule it breaks too: parsing
`data: [DONE]` as JSON is "skip the [DONE] sentinel", not a raw JSONDecodeError).

A rule says what the engine does and why, never the formula: the student writes that.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple


class Rule(NamedTuple):
    """A rule of the engine, and when a failing case shows that it was broken. `broken(args,
    expected, got)` is asked of a failing case only; the first rule that says True is reported."""

    text: str
    broken: Callable[[tuple, Any, Any], bool] = lambda args, expected, got: True


def _plan(lens: list[int], budget: int) -> list[int]:
    """Greedy shares of one budget, in the order given (to recognise a plan made in the wrong order)."""
    out = []
    for n in lens:
        if budget == 0:
            break
        out.append(min(n, budget))
        budget -= out[-1]
    return out


def _parsed(got: Any, what: str) -> bool:
    """Did the student's code raise parsing `what` as JSON?"""
    return isinstance(got, json.JSONDecodeError) and got.doc.strip().removeprefix("data:").strip() == what



RULES: dict[str, list[Rule]] = {
    "blocks_needed": [
        Rule("no tokens need no blocks", lambda a, e, g: a[0] == 0),
        Rule("a partly filled last block is still a whole block: round UP", lambda a, e, g: a[0] % a[1] != 0),
        Rule("tokens that fill their blocks exactly need no extra block"),
    ],
    "slot": [
        Rule("a slot counts from the start of the PHYSICAL block the table names (block ids number whole "
             "blocks of block_size slots), plus where the position falls inside its block",
             lambda a, e, g: a[0] < a[2]),
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
        Rule("running requests come first, then waiting ones with what is left: a running request holds "
             "blocks and is mid-generation, a waiting one can wait",
             lambda a, e, g: list(g) == _plan(a[1] + a[0], a[2])),
        Rule("requests are served in the order given (running oldest first, then waiting in line)",
             lambda a, e, g: sorted(g) == sorted(e)),
        Rule("with chunked prefill a request takes min(its tokens, what is left of the budget): the last "
             "one admitted may get a partial chunk"),
    ],
    "can_ever_run": [
        Rule("a prompt of max_model_len tokens or more leaves no room to generate", lambda a, e, g: a[0] >= a[4]),
        Rule("max_model_len caps the final length: the request stops there even when max_tokens is larger",
             lambda a, e, g: a[0] + a[1] > a[4]),
        Rule("the last generated token is never fed back into the model, so it needs no KV"),
    ],
    "logits_indices": [
        Rule("a request that does not sample has no logits row, but its rows still shift the ones after it",
             lambda a, e, g: not all(a[1])),
        Rule("the sampled row of a request is the LAST row of its chunk, and the chunks sit end to end in "
             "one flat batch"),
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
        Rule("min-p is relative: the threshold scales with the most likely token's probability; min_p "
             "alone is not the threshold"),
    ],
    "overhead_fraction": [
        Rule("overhead is the share of the step's time NOT spent in the forward pass: a fraction of the "
             "step, between 0 and 1, not a time"),
    ],
    "sse_text": [
        Rule("'data: [DONE]' ends the stream and is not JSON: skip the [DONE] sentinel",
             lambda a, e, g: _parsed(g, "[DONE]")),
        Rule("blank lines separate events and carry no data: only 'data: ' lines hold JSON",
             lambda a, e, g: _parsed(g, "")),
        Rule("the JSON starts after the 'data: ' prefix", lambda a, e, g: isinstance(g, json.JSONDecodeError)),
        Rule("the first delta carries the role and no content: a delta without content adds no text",
             lambda a, e, g: isinstance(g, (KeyError, TypeError))),
        Rule("the text is the concatenation of choices[0].delta.content over the 'data: ' lines"),
    ],
    "blocks_after_fan_out": [
        Rule("n = 1 is a plain request: one sequence holding its prompt's blocks, a partly filled last one "
             "included", lambda a, e, g: a[2] == 1),
        Rule("at least one prompt token is always computed, so a prompt of whole blocks cannot take its last "
             "block from the prefix cache: every sequence computes that block again, in a block of its own",
             lambda a, e, g: a[0] % a[1] == 0 and g < e),
        Rule("the n sequences share the prompt's full blocks through the prefix cache (ref counts): a shared "
             "block counts once", lambda a, e, g: g > e),
        Rule("each sequence holds its own last prompt block (it writes its next token there): only the full "
             "blocks before it are shared"),
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
        Rule("with fewer KV heads than ranks, each rank holds exactly ONE KV head, the one its query heads read "
             "(so each KV head is copied on a run of neighbouring ranks)", lambda a, e, g: a[0] < a[2]),
        Rule("each rank holds an equal share of CONSECUTIVE heads (numbered as in the checkpoint), rank 0 the "
             "first ones: the KV heads of its query heads' GQA groups"),
    ],
}
