"""Where two features meet: n > 1 with drafts, a failed commit of one of n sequences, a proposer's
distributions checked, bisection of a failed verification, a proposer's failure after the commit, a
proposer told of every sequence that leaves, `n` against `max_num_seqs`, a scheduling policy that loses
a request, and a cache whose unwritten slots hold NaN. Every test goes through `LLM` / `LLMEngine` (the hybrid model's
crossings are in test_hybrid_engine.py; the random search over all of them in test_engine_machine.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import force_cpu_kernels, varied_prompts

from minivllm import LLM, SamplingParams
from minivllm.engine.core.scheduling_policy import FCFSPolicy, PolicyContractError
from minivllm.engine.spec_decode.proposer import Draft, Proposer
from minivllm.teaching.hf_check import assert_hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tiny(model_factory, **kwargs) -> LLM:
    return LLM(model_factory("qwen3"), warmup=False, **{"block_size": 4, "num_kv_blocks": 64, **kwargs})


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def drain(engine, limit: int = 500) -> dict:
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < limit, "the engine loop did not end"
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


# --- n > 1 meets speculative decoding -------------------------------------------------------------
def test_n_with_speculation_keeps_every_child_when_the_prompt_ends_in_a_one_token_chunk(model_factory):
    """17 tokens with a budget of 16: the prompt's last chunk is one token, which looks like a decode row;
    each of the n sequences samples its own last row, and drafts only once decoding."""
    prompt = {"prompt_token_ids": list(range(5, 11)) * 2 + list(range(5, 10))}
    sp = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)
    alone = tiny(model_factory).generate(prompt, sp, use_tqdm=False)[0]
    llm = tiny(model_factory, max_num_batched_tokens=16,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    out = llm.generate(prompt, sp, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and tokens(out) == tokens(alone)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


# --- a failed commit of one of n sequences --------------------------------------------------------
def test_a_failed_commit_of_one_of_n_sequences_ends_that_completion_alone(model_factory):
    llm = tiny(model_factory)
    engine = llm.llm_engine
    check_strings = engine.scheduler.stop_checker.check_strings
    failed = []

    def once_for_the_parent(seq, num_new):  # the commit's text step: it decodes the new tokens
        if seq.index == 0 and not failed:
            failed.append(seq.request_id)
            raise RuntimeError("the tokenizer broke")
        return check_strings(seq, num_new)

    engine.scheduler.stop_checker.check_strings = once_for_the_parent
    engine.add_request("r", {"prompt_token_ids": [7, 8, 9, 10, 11]}, SamplingParams(n=3, temperature=0, max_tokens=5,
                                                                                    ignore_eos=True))
    final = drain(engine)["r"]
    assert failed and final.finished and "the tokenizer broke" in final.error
    assert [c.finish_reason for c in final.outputs] == ["error", "length", "length"]
    assert not engine.scheduler.running and not engine.scheduler.waiting
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks

# --- a proposer is checked like user input ---------------------------------------------------------
class WithProbs(Proposer):
    """Drafts token 7 (or `token`), with a distribution made by `make(d, V)`."""

    def __init__(self, make, token: int = 7) -> None:
        self.make, self.token = make, token

    def propose(self, requests):
        return [Draft([self.token] * r.max_tokens, self.make(r.max_tokens, 384)) for r in requests]


def one_hot(d: int, V: int, token: int = 7) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.full((d,), token), V).float()


@pytest.mark.parametrize("make, complaint", [
    (lambda d, V: one_hot(1, V).expand(1, V), r"shape \(1, 384\); give one row per draft token: \(3, 384\)"),
    (lambda d, V: one_hot(d, V)[:, :100], r"shape \(3, 100\)"),
    (lambda d, V: one_hot(d, V) * float("nan"), "NaN"),
    (lambda d, V: one_hot(d, V) - 0.5, "negative"),
    (lambda d, V: one_hot(d, V) * 2, "sum to"),
    (lambda d, V: one_hot(d, V, token=8), "probability 0 to its own draft"),
    (lambda d, V: [[1.0]], "not a floating-point tensor"),
])
def test_a_proposers_distributions_are_checked_naming_it(model_factory, make, complaint):
    llm = tiny(model_factory, speculative_config={"proposer": WithProbs(make), "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=f"WithProbs returned Draft.probs for .*{complaint}"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    stats = llm.get_stats()  # the failed step was rolled back, the request aborted by generate()
    assert stats.num_free_blocks == stats.num_total_blocks and not llm.llm_engine.requests


def test_bisection_re_verifies_drafts_with_their_own_distributions(model_factory):
    """A verification that fails because of one request's draft distribution is blamed on that request
    alone: the re-runs of bisection must verify with the same distributions as the step did."""
    marked = 0.25  # the mark of the request whose distribution the verifier chokes on

    class Marked(Proposer):
        def propose(self, requests):
            drafts = []
            for r in requests:
                q = one_hot(r.max_tokens, 384)
                if r.token_ids[0] == 99:
                    q[:, 7], q[:, 8] = 1 - marked, marked
                drafts.append(Draft([7] * r.max_tokens, q))
            return drafts

    llm = tiny(model_factory, speculative_config={"proposer": Marked(), "num_speculative_tokens": 2})
    runner = llm.llm_engine.model_runner
    verify = runner.rejection_sampler

    def choking(p, q, *rest):
        if q is not None and bool((q == marked).any()):
            raise FloatingPointError("this distribution cannot be verified")
        return verify(p, q, *rest)

    runner.rejection_sampler = choking
    outs = llm.generate([{"prompt_token_ids": [99, 5, 6]}, {"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "cannot be verified" in outs[0].error
    alone = tiny(model_factory).generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0]
    assert outs[1].outputs[0].finish_reason == "length" and tokens(outs[1]) == tokens(alone)


def test_a_proposer_failing_after_the_commit_loses_no_output(model_factory):
    class FailingOnCommit(Proposer):
        def propose(self, requests):
            return [Draft([]) for _ in requests]

        def on_commit(self, seq_ids, num_computed):
            raise RuntimeError("the proposer's bookkeeping broke")

    prompts = varied_prompts(5, 384, seed=1)
    requests = {f"r{i}": SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(5)}
    llm = tiny(model_factory, speculative_config={"proposer": FailingOnCommit(), "num_speculative_tokens": 2})
    engine = llm.llm_engine
    for (rid, sp), p in zip(requests.items(), prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    finals, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError:
            failures += 1
            continue
        finals.update({o.request_id: o for o in outs if o.finished})
    assert failures > 0 and sorted(finals) == sorted(requests)
    plain = tiny(model_factory)
    for (rid, sp), p in zip(requests.items(), prompts):
        assert tokens(finals[rid]) == tokens(plain.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0])


def test_the_proposer_forgets_every_sequence_that_leaves(model_factory):
    """A draft model keeps how far its own K/V go per sequence id; an aborted, failed or finished sequence
    must leave nothing behind (a request id used again would trust another request's draft K/V)."""
    llm = tiny(model_factory, speculative_config={"model": model_factory("qwen3"), "num_speculative_tokens": 2})
    engine = llm.llm_engine
    proposer = engine.speculator.proposer
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8]}, long)
    for _ in range(4):
        engine.step()
    assert "a" in proposer.computed
    engine.abort_request("a")
    assert "a" not in proposer.computed
    engine.add_request("a", {"prompt_token_ids": [9, 10, 11]}, GREEDY)  # the same id, another request
    finals = drain(engine)
    alone = tiny(model_factory).generate({"prompt_token_ids": [9, 10, 11]}, GREEDY, use_tqdm=False)[0]
    assert tokens(finals["a"]) == tokens(alone) and proposer.computed == {}


def test_a_proposer_failing_to_forget_a_sequence_leaves_the_engine_whole(model_factory):
    """`on_free` raising is the proposer's failure: the step's outputs still go out, the error is raised, and
    every request ends (the engine's own state was final before the proposer was told)."""
    class FailingOnFree(Proposer):
        def propose(self, requests):
            return [Draft([]) for _ in requests]

        def on_free(self, request_id):
            raise RuntimeError("the proposer's bookkeeping broke")

    llm = tiny(model_factory, speculative_config={"proposer": FailingOnFree(), "num_speculative_tokens": 2})
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": [5 + i, 6, 7]}, SamplingParams(max_tokens=2 + i,
                                                                                       ignore_eos=True))
    finals, failures = {}, 0
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        try:
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        except RuntimeError as e:
            assert "bookkeeping broke" in str(e)
            failures += 1
    assert failures == 3 and sorted(finals) == ["r0", "r1", "r2"]
    assert [len(finals[f"r{i}"].outputs[0].token_ids) for i in range(3)] == [2, 3, 4]
    assert llm.get_stats().num_free_blocks == 64


# --- n against max_num_seqs ------------------------------------------------------------------------
def test_n_above_max_num_seqs_is_refused_and_holds_back_nobody(model_factory):
    llm = tiny(model_factory, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}],
                        [SamplingParams(n=5, max_tokens=2), SamplingParams(n=4, max_tokens=3)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "n=5" in outs[0].error and "max_num_seqs=4" in outs[0].error
    assert [len(c.token_ids) for c in outs[1].outputs] == [3, 3, 3, 3]


def test_a_step_never_runs_more_than_max_num_seqs_sequences(model_factory):
    llm = tiny(model_factory, max_num_seqs=4, record_trace=True)
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": [5 + i, 6, 7]},
                           SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=6, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
        assert len(engine.scheduler.running) <= 4
    assert most == 4 and all(len(step.scheduled) <= 4 for step in llm.get_trace())


# --- a scheduling policy is checked like a proposer ---------------------------------------------------
class DropsTheNewest(FCFSPolicy):
    """A wrong policy: its admission order leaves a waiting request out. That request would stay in the
    engine for ever, run by nobody."""

    name = "drops-the-newest"

    def admission_order(self, waiting):
        return list(waiting)[:-1]


def test_a_policy_that_loses_a_request_is_refused_naming_the_rule(model_factory):
    llm = tiny(model_factory, scheduling_policy=DropsTheNewest())
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    with pytest.raises(PolicyContractError, match="RULE: admission_order must return every waiting request"):
        engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["a"]  # rolled back: as it was
    engine.scheduler.policy.inner.admission_order = lambda waiting: list(waiting)  # mended
    assert drain(engine)["a"].outputs[0].finish_reason == "length"


# --- NaN left in the cache by earlier requests ------------------------------------------------------
@pytest.mark.parametrize("kernels", [False, True])
def test_nan_in_unwritten_cache_slots_never_reaches_a_request(model_factory, hf_factory, kernels):
    """A reused block's tail and the table's padding hold whatever was there before (an earlier request's
    overflow, a failed step): the gather + SDPA decode path must select them away, not multiply by 0."""
    llm = tiny(model_factory, num_kv_blocks=128)
    if kernels:
        from minivllm.kernels.cpu_build import load_cpu_kernels

        if not load_cpu_kernels().available:
            pytest.skip(load_cpu_kernels().detail)
    force_cpu_kernels(llm, kernels)
    llm.llm_engine.model_runner.kv_cache.fill_(float("nan"))
    prompts = varied_prompts(6, 384, seed=8)  # unequal contexts: the decode rows need a mask
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert_hf_greedy(hf_factory("qwen3"), p, out.outputs[0].token_ids)
