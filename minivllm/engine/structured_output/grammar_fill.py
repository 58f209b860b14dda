"""One step's grammar masks, filled by one function: a batch of matchers in, one bitmask tensor out.

    fill_bitmask([GrammarRows(request_id, matcher, drafts), ...], vocab_size)
        -> StepBitmask(bitmask (R, W) int32,  rows[i] = request i's 1 + d row indices (None: unconstrained),
                       failures = the requests that cannot go on, each with a short message)

    request 0: 1 row      request 1: 1 + 2 drafts     request 2 (inside <think>): 1 row
    bitmask:   [ row 0 ] [ row 1 | row 2 | row 3 ] [ row 4: unused ]          rows = [[0], [1, 2, 3], [None]]

What it owes the other requests of the step: a request costs them at most its budget. Each request's
masks are timed in CPU time (`time.thread_time`: llguidance computes on the calling thread, with the GIL
dropped; a busy neighbour on the machine does not count against the request); one that takes more than
its matcher's `mask_budget_ms` a mask (EngineConfig.grammar_mask_budget_ms), or whose grammar fails (a
llguidance limit hit mid-output, a draft it refused), is a failure of its own: the caller ends it with
finish_reason "error" and the message, and the others go on with exactly their tokens.

It reads the matchers and writes the tensor, nothing else (drafts are consumed and rolled back). The
scheduler calls it once a step, for its plan (`grammar_bitmask`, vLLM's `get_grammar_bitmask`): the
masks travel in the `SchedulerOutput`, and the model runner only applies them to the rows it packs
(engine/worker/sampling_metadata.py). A failure found here ends its request before anything runs
(`LLMEngine.step`).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from minivllm.engine.request.step_types import GrammarBitmask, ScheduledSequence
from minivllm.engine.structured_output.grammar import GrammarMatcher, bitmask_width, short_error


class GrammarRows(NamedTuple):
    """One request's share of a step: its matcher and the drafts the step verifies (none: one row)."""

    request_id: str
    matcher: GrammarMatcher
    drafts: list[int]


class GrammarFailure(NamedTuple):
    request_id: str
    message: str  # short: what happened, and what to change


@dataclass
class StepBitmask:
    bitmask: torch.Tensor  # (R, W) int32 on the CPU, R = sum of 1 + d over the requests; bit t = token t allowed
    rows: list[list[int | None]]  # per request, its 1 + d rows in `bitmask` (None: inside reasoning, anything goes)
    failures: list[GrammarFailure] = field(default_factory=list)  # their rows are not to be used


def fill_bitmask(requests: list[GrammarRows], vocab_size: int) -> StepBitmask:
    """Every row of every request, each request timed against its own budget (see the module docstring).
    Python's garbage collector is paused meanwhile: a full collection it sets off (a few hundred ms on a
    large heap) would be charged to whichever request was being timed."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _fill(requests, vocab_size)
    finally:
        if was_enabled:
            gc.enable()


def _fill(requests: list[GrammarRows], vocab_size: int) -> StepBitmask:
    num_rows = sum(1 + len(r.drafts) for r in requests)
    bitmask = torch.zeros(num_rows, bitmask_width(vocab_size), dtype=torch.int32)  # (R, W)
    out = StepBitmask(bitmask, [])
    first = 0
    for r in requests:
        n = 1 + len(r.drafts)
        start = time.thread_time()
        try:
            masks = r.matcher.row_masks(r.drafts, bitmask[first:first + n])
            failure = None
        except Exception as e:  # e.g. a draft llguidance had validated and then refused: this request's alone
            masks = [None] * n
            failure = f"its structured_outputs grammar failed: {short_error(f'{type(e).__name__}: {e}')}"
        took_ms = (time.thread_time() - start) * 1e3
        num_masks = sum(m is not None for m in masks)
        if failure is None and r.matcher.error:  # a llguidance limit hit mid-output: its mask is no answer
            failure = f"its structured_outputs grammar failed after the output so far: {r.matcher.error}"
        elif failure is None and num_masks and took_ms / num_masks > r.matcher.mask_budget_ms:
            failure = (f"its structured_outputs grammar took {took_ms / num_masks:.0f} ms of CPU for one token's "
                       f"mask, over the budget of {r.matcher.mask_budget_ms:g} ms (grammar_mask_budget_ms): it "
                       "would slow every request beside it; simplify the grammar")
        if failure is not None:
            out.failures.append(GrammarFailure(r.request_id, failure))
        out.rows.append([first + j if m is not None else None for j, m in enumerate(masks)])
        first += n
    return out


def grammar_bitmask(scheduled: list[ScheduledSequence]) -> GrammarBitmask | None:
    """The plan's masks: every structured request that samples in this step, its 1 + d masks (d: the drafts
    it verifies), filled in one call; None when no row needs one."""
    rows = [GrammarRows(s.seq.request_id, s.seq.grammar, s.seq.spec_token_ids[:s.num_spec_tokens])
            for s in scheduled if s.seq.grammar is not None and s.samples]
    if not rows:
        return None
    step = fill_bitmask(rows, rows[0].matcher.vocab_size)
    failures = {f.request_id: f.message for f in step.failures}
    masks = {r.request_id: [None if i is None else step.bitmask[i] for i in index]  # (W,) each
             for r, index in zip(rows, step.rows) if r.request_id not in failures}
    return GrammarBitmask(masks, failures)
