"""`n > 1` as a fan-out at the front end (vLLM v1's way, `vllm/v1/engine/parallel_sampling.py`).

A request for n completions becomes n plain requests the moment it arrives; the scheduler never
learns that they belong together. What they share, they share through mechanisms that exist anyway:

    "Tell me a joke" (n=3, seed=7)
        -> seq "req"    index 0, seed 7      computes the prompt; its full blocks are cached as they
        -> seq "1_req"  index 1, seed 8      are allocated, so a sibling admitted in the same step (or
        -> seq "2_req"  index 2, seed 9      later) finds them in the prefix cache and computes only
                                             the partly filled last block of the prompt
    outputs: one RequestOutput with 3 CompletionOutputs, gathered by group id (engine/processing/output_processor.py)

Why not fork one sequence inside the core, after its prompt? A fork needs copy-on-write of the last
block, seats held for children that do not exist yet, a block copy after the commit with a failure
path of its own, and a hybrid model's state copied: one more mechanism in every component. The
fan-out costs each child its partial last block (fewer than `block_size` prompt tokens; a prompt of at
most one block, all of it); `docs/guides/benchmarks.md` has the measured prompt cost. Beam search shares
its beams' prompts the same way (minivllm/beam_search.py). A hybrid model costs more: a child needs the
linear-attention state at the end of what it skips, and a snapshot joins the cache only at a commit and
at stride positions (engine/core/state_cache.py), so children admitted beside the first one compute their
prompt from the last snapshot an earlier request left (or from the start).

Seeds: child i draws with `seed + i` (vLLM's rule with a seed); without one, the engine gives the request
a seed of its own (`LLMEngine.enqueue`) and child i draws with that plus i: its own random stream, the
same in every run of the same engine seed.

Prompt logprobs are the request's, not each completion's: only child 0 asks for them, so the other
children can hit the prefix cache (a request that wants every prompt position's logits cannot).
"""

from __future__ import annotations

import dataclasses

from minivllm.engine.request.sequence import Sequence


def fan_out(seq: Sequence) -> list[Sequence]:
    """The request's n sequences: `seq` itself as completion 0, then n - 1 children with the same prompt,
    rules and priority, each with its own seed, grammar state and request id."""
    sp = seq.sampling_params
    if sp.n == 1:
        return [seq]
    child_params = sp if sp.prompt_logprobs is None else dataclasses.replace(sp, prompt_logprobs=None)
    children = [seq]
    for index in range(1, sp.n):
        child = Sequence(f"{index}_{seq.group_id}", seq.token_ids, child_params, prompt=seq.prompt,
                         arrival_index=seq.arrival_index, seed=seq.seed + index, priority=seq.priority)
        child.group_id, child.index = seq.group_id, index
        child.logit_rules = seq.logit_rules  # read-only, prepared once per SamplingParams
        child.grammar = seq.grammar.copy() if seq.grammar is not None else None  # each advances on its own
        children.append(child)
    return children
