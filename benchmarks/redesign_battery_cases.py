"""The redesign battery's cases: what is run on every model family (benchmarks/redesign_battery.py records
and compares it).

Each `Case` is a name, the engine options it needs over the battery's base ones, and a function that
drives a fresh `LLM` through the public API and returns its outputs (`RequestOutput`s, or
`BeamSearchOutput`s) with a few counters (`info`: preemptions, cache hits, drafts accepted) that say the
case did exercise what it names. The counters are reported, never compared: a redesign may preempt or
cache differently and still owe the same tokens.

The prompts are chosen for block_size 8: lengths 3, 8, 9, 17 and 30 end inside a block, on its edge and
just past it (a child of an n > 1 request then recomputes, or shares, a partial last block).

Failures are injected through the `sampling_filter` seam (docs/concepts/seams.md), the one public place
where code of ours runs inside a step: `PoisonFilter` fails one request's rows (bisection must fail it
alone while the others go on), `FlakyFilter` fails two steps outright (each must be rolled back whole and
its retry give the tokens a clean run gives).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from minivllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from minivllm.layers.sampler import SamplingFilter, SamplingTensors, TopKTopPMinP


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]  # 0-2 are the tiny tokenizer's special tokens


PROMPTS = [ids(3, 1), ids(8, 2), ids(9, 3), ids(17, 4), ids(30, 5)]
TEXTS = ["The capital of France is", "def add(a, b):"]
REPEATING = [5, 6, 7, 8, 9, 10] * 4  # the n-gram proposer finds continuations in it
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"]}
POISON_TOP_K = 13  # the one request PoisonFilter fails carries this top_k


class Outcome(NamedTuple):
    outputs: list[Any]  # RequestOutput or BeamSearchOutput, in request order
    info: dict[str, Any]  # counters showing the case did what it names (reported, not compared)


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[LLM], Outcome]
    # LLM options over the base ones, given the draft checkpoint's folder; a function, so that every engine
    # gets objects of its own (a filter that counts its calls)
    engine: Callable[[str], dict[str, Any]] = lambda draft: {}


def gen(llm: LLM, prompts: list[list[int] | str], sp: SamplingParams | list[SamplingParams]) -> list[Any]:
    return llm.generate([p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts], sp,
                        use_tqdm=False)


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kw})


def seeded(seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, "seed": seed, "max_tokens": 12, "ignore_eos": True, **kw})


# --- plain sampling ------------------------------------------------------------------------------
def greedy_logprobs(llm: LLM) -> Outcome:
    return Outcome(gen(llm, PROMPTS + TEXTS, greedy(logprobs=3, prompt_logprobs=2)), {})


def seeded_sampling(llm: LLM) -> Outcome:
    sps = [seeded(100 + i, top_k=40, top_p=0.9, logprobs=1) for i in range(len(PROMPTS))]
    return Outcome(gen(llm, PROMPTS, sps), {})


def n4_seeded(llm: LLM) -> Outcome:
    return Outcome(gen(llm, PROMPTS[1:4], seeded(7, n=4, logprobs=2, prompt_logprobs=1)), {})


def n3_greedy(llm: LLM) -> Outcome:
    return Outcome(gen(llm, PROMPTS[:3], greedy(n=3, logprobs=1)), {})


def n3_unseeded(llm: LLM) -> Outcome:
    """No seed: each sequence's noise comes from the engine's seed and the request's arrival."""
    sps = [SamplingParams(temperature=1.0, n=3, max_tokens=10, ignore_eos=True, logprobs=1)] * 3
    return Outcome(gen(llm, PROMPTS[1:5], sps + [SamplingParams(temperature=1.0, max_tokens=10)]), {})


def stops(llm: LLM) -> Outcome:
    """EOS allowed, a stop token and a stop string, both taken from a first greedy run."""
    first = gen(llm, PROMPTS[3:5], greedy(ignore_eos=False))
    a, b = (o.outputs[0] for o in first)
    sps = [greedy(ignore_eos=False, logprobs=1),
           greedy(stop_token_ids=a.token_ids[4:5], min_tokens=2, logprobs=1),
           greedy(stop=[b.text[3:6]] if len(b.text) >= 6 else None, include_stop_str_in_output=True)]
    return Outcome(first + gen(llm, [PROMPTS[0], PROMPTS[3], PROMPTS[4]], sps), {})


# --- speculative decoding ------------------------------------------------------------------------
def spec_info(llm: LLM) -> dict[str, Any]:
    s = llm.get_stats()
    return {"num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens}


def ngram_spec(llm: LLM) -> Outcome:
    prompts = [REPEATING, PROMPTS[4], REPEATING, [3, 4, 3, 4, 3], REPEATING]
    sps = [greedy(max_tokens=16, logprobs=2), greedy(), seeded(3, max_tokens=16), seeded(5, n=2, logprobs=1),
           greedy(max_tokens=30, ignore_eos=False,
                  structured_outputs=StructuredOutputsParams(regex=r"(ab ){3,8}end"))]
    return Outcome(gen(llm, prompts, sps), spec_info(llm))


def draft_spec(llm: LLM) -> Outcome:
    sps = [greedy(max_tokens=16, logprobs=1), seeded(9, n=2, logprobs=1)]
    return Outcome(gen(llm, [REPEATING, PROMPTS[3]], sps), spec_info(llm))


# --- structured outputs --------------------------------------------------------------------------
def structured(llm: LLM) -> Outcome:
    so = StructuredOutputsParams
    sps = [seeded(11, max_tokens=60, ignore_eos=False, structured_outputs=so(json=SCHEMA), logprobs=1),
           greedy(max_tokens=30, ignore_eos=False, structured_outputs=so(regex=r"[a-z]{2,6}( [0-9]{1,3}){2}")),
           seeded(12, n=3, ignore_eos=False, structured_outputs=so(choice=["yes", "no", "maybe"])),
           greedy(n=2, max_tokens=30, ignore_eos=False, structured_outputs=so(regex=r"(x|yz){2,5}!"))]
    return Outcome(gen(llm, [PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0]], sps), {})


# --- scheduling: pool pressure, chunked prefill, prefix reuse ----------------------------------------
def pool_pressure(llm: LLM) -> Outcome:
    prompts = PROMPTS + [REPEATING]
    sps = [greedy(max_tokens=16, logprobs=1), seeded(21, max_tokens=16), seeded(22, n=2, max_tokens=16),
           greedy(max_tokens=16), seeded(23, max_tokens=16, logprobs=1), greedy(max_tokens=16, n=2)]
    outs = gen(llm, prompts, sps)
    return Outcome(outs, {"num_preemptions": llm.get_stats().num_preemptions})


def everything_at_once(llm: LLM) -> Outcome:
    """A small pool, a small token budget and drafts together: preempted requests with drafts and grammars."""
    prompts = [REPEATING, PROMPTS[4], PROMPTS[3], [3, 4, 3, 4, 3], REPEATING]
    sps = [greedy(max_tokens=16, logprobs=1), seeded(91, n=2, max_tokens=16), greedy(n=2, max_tokens=16),
           seeded(92, max_tokens=16, logprobs=1),
           greedy(max_tokens=30, ignore_eos=False, structured_outputs=StructuredOutputsParams(regex=r"(ab ){3,8}end"))]
    outs = gen(llm, prompts, sps)
    s = llm.get_stats()
    return Outcome(outs, {**spec_info(llm), "num_preemptions": s.num_preemptions, "num_mixed_steps": s.num_mixed_steps})


def chunked_prefill(llm: LLM) -> Outcome:
    prompts = PROMPTS + [REPEATING]
    sps = [greedy(logprobs=1, prompt_logprobs=1)] * 5 + [seeded(31, n=2, logprobs=1)]
    outs = gen(llm, prompts, sps)
    return Outcome(outs, {"num_mixed_steps": llm.get_stats().num_mixed_steps})


def prefix_reuse(llm: LLM) -> Outcome:
    """A 40-token prompt warms the cache; then prompts that share 40 and 24 of its tokens, and itself."""
    long = ids(40, 9)
    first = gen(llm, [long], greedy(max_tokens=4))
    prompts = [long + ids(5, 10), long[:24] + ids(3, 11), long, long + ids(2, 12)]
    sps = [greedy(logprobs=1)] * 3 + [seeded(41, n=2, logprobs=1)]
    outs = gen(llm, prompts, sps)
    return Outcome(first + outs, {"num_cached_tokens": [o.num_cached_tokens for o in outs]})


# --- rollback: failures injected in the step ----------------------------------------------------
class PoisonFilter(SamplingFilter):
    """Fails the step whenever the request with top_k == POISON_TOP_K draws at position 14 or later: every
    retry that holds it fails, so bisection must end it alone ("error") and let the others finish."""

    name = "poison"

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        poisoned = (sampling.top_ks == POISON_TOP_K).tolist()
        if any(p and pos >= 14 for p, pos in zip(poisoned, sampling.positions)):
            raise RuntimeError("injected: the poisoned request")
        return TopKTopPMinP()(logits, sampling)


class FlakyFilter(SamplingFilter):
    """Fails its 3rd and 8th calls when they hold two rows or more: a failure no single request
    reproduces, so the step is rolled back whole and raised; the caller steps again."""

    name = "flaky"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        self.calls += 1
        if self.calls in (3, 8) and logits.shape[0] >= 2:
            raise RuntimeError("injected: a flaky step")
        return TopKTopPMinP()(logits, sampling)


def rollback_culprit(llm: LLM) -> Outcome:
    sps = [seeded(50 + i, logprobs=1) for i in range(4)] + [seeded(60, n=2)]
    sps[2] = seeded(52, top_k=POISON_TOP_K)  # PROMPTS[2] has 9 tokens: it fails drawing its 6th
    return Outcome(gen(llm, PROMPTS, sps), {})


def rollback_transient(llm: LLM) -> Outcome:
    """Driven through the engine (`add_request`, `step`): `generate` would abort on the raised step."""
    engine = llm.llm_engine
    sps = [seeded(70 + i, logprobs=1) for i in range(4)] + [seeded(80, n=2)]
    for i, (p, sp) in enumerate(zip(PROMPTS, sps)):
        engine.add_request(f"t{i}", {"prompt_token_ids": p}, sp)
    finals, raised = {}, 0
    while engine.has_unfinished_requests():
        try:
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        except RuntimeError:
            raised += 1
    return Outcome([finals[f"t{i}"] for i in range(len(PROMPTS))], {"steps_raised": raised})


def beam_search(llm: LLM) -> Outcome:
    prompts = [{"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": PROMPTS[3]}]
    return Outcome(llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6)), {})


CASES = [
    Case("greedy_logprobs", greedy_logprobs),
    Case("seeded_sampling", seeded_sampling),
    Case("n4_seeded", n4_seeded),
    Case("n3_greedy", n3_greedy),
    Case("n3_unseeded", n3_unseeded),
    Case("stops", stops),
    Case("ngram_spec", ngram_spec, lambda draft: {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}}),
    Case("draft_spec", draft_spec, lambda draft: {"speculative_config": {
        "model": draft, "num_speculative_tokens": 3}}),
    Case("structured", structured),
    Case("pool_pressure", pool_pressure, lambda draft: {"num_kv_blocks": 14}),
    Case("chunked_prefill", chunked_prefill, lambda draft: {"max_num_batched_tokens": 16}),
    Case("prefix_reuse", prefix_reuse),
    Case("everything_at_once", everything_at_once, lambda draft: {
        "num_kv_blocks": 14, "max_num_batched_tokens": 16,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}),
    Case("rollback_culprit", rollback_culprit, lambda draft: {"sampling_filter": PoisonFilter()}),
    Case("rollback_transient", rollback_transient, lambda draft: {"sampling_filter": FlakyFilter()}),
    Case("beam_search", beam_search),
]
