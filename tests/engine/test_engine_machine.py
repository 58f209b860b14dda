"""The whole engine under a random search: where its paths cross.

teaching/scheduler_machine.py drives the scheduler alone, with made-up tokens. This machine drives a
real `LLMEngine` on a tiny model, where the bugs of the last reviews lived: n > 1 requests (n sequences
sharing the prompt through blocks cached at allocation) with drafts, chunk boundaries, a pool under
pressure (preemption, siblings admitted in different steps), failed steps
(a request to blame, or none), failed commits, a proposer that fails, aborts, a hybrid model's
state pool with its prefix caching (state snapshots: hits, evictions, rollbacks) and drafts (candidate
states), a sliding-window model's second KV-cache group (Gemma 3, window 8: blocks given back
as they leave the window, prefix hits that need the window's blocks), and a mixture of experts (Qwen3-MoE,
Qwen2-MoE with its shared expert: the experts a step activates depend on the whole batch; a dense Qwen3
drafts for it; batch-invariant, its experts' products tiled). hypothesis picks an engine
configuration and a sequence of actions:

    add        a request: shared prefixes (prefix hits), n in 1..3, greedy or seeded sampling, or
               "poisoned" (its first chunk fails the forward: bisection must blame it alone), or
               structured (a regex: every token allowed where drawn, "stop" exactly when complete); with
               the reasoning parser (setup "reasoning"), its prompt may open or close a <think> block, and
               the regex holds on what follows </think> only
    step       one engine step; an injected failure must leave the engine exactly as it was
    arm_*      the next step fails: a batch of two rows (no single culprit: rolled back, re-raised),
               a sequence's commit (that sequence fails, its siblings go on: in its text, in the token
               that finishes it — "error", never "length" one token short — or before its tokens), the
               commit's tail after every request's own part (the step's finished requests are reported,
               its others fail; nothing escapes the committed step), the proposer
    over budget
               a structured request's masks go over its budget once it has k tokens (k = 0 or 2; drawn
               with the request, so no rule's share of the search shrinks): engine/structured_output/grammar_fill.py's
               real check, its budget made negative. The plan's one fill names it, the engine finishes it
               with "error" and that message in that step, running nothing (no forward, no bisection)
    abort      a live request
    beam       a beam search (minivllm/beam_search.py): each step's beams join the load as one-token
               requests; a step whose beam failed or was aborted ends the search and aborts its siblings

After every action: every sequence the scheduler holds belongs to a live request that knows it, blocks,
state pairs and a hybrid's snapshot slots are conserved (and, at the end, a mixture of experts' routes: k per
sparse layer for every row the engine counts as computed), no more than max_num_seqs sequences run, no
step's transaction is left open, and a draft model keeps nothing for a sequence that left. At the end
every request has exactly one final output, every block and state pair is free, and every completion
of a greedy request is what a lone run gives: each token HF's argmax, teacher-forced (within 1e-3, so
that a near-tie may go either way). A beam search that finished has beam_width beams of max_tokens
tokens, best first, each one's cum_logprob HF's (teacher-forced), the best as good as HF's `generate`
beam search's best (within 1e-3).
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from minivllm.beam_search import BeamSearch, new_search, step_sampling_params
from minivllm.engine.core.kv_cache_groups import KVCacheCoordinator
from minivllm.engine.core.state_cache import StateCache
from minivllm.engine.request.sequence import Sequence, SequenceStatus
from minivllm.engine.request.state_layout import snapshot_bytes
from minivllm.engine.spec_decode.proposer import Draft, Proposer
from minivllm.layers.logits_processors import unpack_bitmask
from minivllm.models.hf_config import load_model_spec
from minivllm.reasoning import ReasoningPhase
from minivllm.teaching.checkpoints import make_tiny_model
from minivllm.teaching.hf_check import assert_hf_greedy
from moe_helpers import tiny_moe_checkpoint
from reasoning_helpers import make_thinking_qwen3

POISON = 3  # a prompt that starts with it fails the forward of its first chunk, alone or not
PREFIXES = [[], list(range(20, 32)), [7, 8, 9, 10, 7, 8, 9]]  # shared: prefix-cache hits; repeats: n-gram drafts


REQUESTS = st.fixed_dictionaries(dict(
    prefix=st.sampled_from(PREFIXES), extra=st.lists(st.integers(5, 40), min_size=1, max_size=9),
    n=st.sampled_from([1, 1, 2, 3]), greedy=st.booleans(), max_tokens=st.sampled_from([1, 3, 6, 9, 12, 12]),
    poisoned=st.sampled_from([False] * 8 + [True]), restricted=st.sampled_from([False] * 3 + [True]),
    structured=st.sampled_from([False] * 3 + [True]), think=st.sampled_from([None, "open", "open", "closed"]),
    over_budget=st.sampled_from([None] * 5 + [0, 2])))
# A structured request's output matches this (structured outputs: engine/structured_output/grammar.py); it may end
# early, "stop"
STRUCTURED = StructuredOutputsParams(regex=r"[a-e ]{1,24}\.?")
ALLOWED = list(range(5, 200))  # a restricted (sampled) request draws only these; never a bad word's last token


class Injected(RuntimeError):
    """A failure this machine injected."""


class ProposerFailed(Injected):
    """The proposer's own failure: raised after the step's commit (drafts are proposed for the next step)."""


class NoisyProposer(Proposer):
    """Drafts drawn from a random distribution over the vocabulary, which it returns as `Draft.probs`: drafts
    a target rarely accepts, and a q that rejection sampling must honour. Fails when armed."""

    def __init__(self) -> None:
        self.rng = torch.Generator().manual_seed(0)
        self.fail = False

    def propose(self, requests):
        if self.fail:
            self.fail = False
            raise ProposerFailed("the proposer failed")
        drafts = []
        for r in requests:
            q = torch.softmax(torch.randn(r.max_tokens, 384, generator=self.rng) * 3, -1)  # (d, V)
            drafts.append(Draft(torch.multinomial(q, 1, generator=self.rng)[:, 0].tolist(), q))
        return drafts


@dataclass(frozen=True)
class Setup:
    name: str
    hybrid: bool = False
    spec: str | None = None  # None, "ngram", "noisy" (NoisyProposer), "draft" (the model drafts for itself)
    engine: dict = field(default_factory=dict)
    sliding: bool = False  # Gemma 3: a sliding-window KV-cache group beside the full one
    snapshots: int | None = None  # a hybrid's state cache: room for this many snapshots (engine/core/state_cache.py)
    reasoning: bool = False  # the tiny Qwen3 with <think> tokens (tests/reasoning_helpers.py), reasoning_parser on
    moe: str | None = None  # a mixture of experts: "qwen3_moe" or "qwen2_moe" (tests/moe_helpers.py)

    @property
    def model(self) -> str:
        if self.moe is not None:
            return self.moe
        return "hybrid" if self.hybrid else "gemma3" if self.sliding else "thinking" if self.reasoning else "qwen3"


SETUPS = [
    Setup("plain", engine=dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4)),
    Setup("ngram", spec="ngram", engine=dict(block_size=2, num_kv_blocks=28, max_num_batched_tokens=8, max_num_seqs=5)),
    Setup("noisy", spec="noisy", engine=dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=12, max_num_seqs=4)),
    Setup("draft", spec="draft", engine=dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)),
    Setup("unchunked", engine=dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=3,
                                   enable_chunked_prefill=False)),
    Setup("batch-invariant", engine=dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=12, max_num_seqs=4,
                                         batch_invariant=True)),  # tiled matmuls, per-row attention
    Setup("hybrid", hybrid=True, engine=dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=12, max_num_seqs=4)),
    Setup("hybrid-small", hybrid=True, engine=dict(block_size=2, num_kv_blocks=24, max_num_batched_tokens=8,
                                                   max_num_seqs=3)),
    # prefix caching with a state snapshot every block and room for 8: hits, evictions, loads under rollback
    Setup("hybrid-prefix", hybrid=True, snapshots=8, engine=dict(block_size=4, num_kv_blocks=20,
                                                                 max_num_batched_tokens=12, max_num_seqs=4,
                                                                 state_cache_stride=4)),
    # drafts verified by a hybrid (candidate states, rejections roll the state back), with and without prefix caching
    Setup("hybrid-ngram", hybrid=True, spec="ngram", snapshots=6,
          engine=dict(block_size=2, num_kv_blocks=28, max_num_batched_tokens=8, max_num_seqs=4, state_cache_stride=2)),
    Setup("hybrid-draft", hybrid=True, spec="draft", engine=dict(block_size=4, num_kv_blocks=24,
                                                                 max_num_batched_tokens=16, max_num_seqs=4,
                                                                 enable_prefix_caching=False)),
    Setup("sliding", sliding=True, engine=dict(block_size=2, num_kv_blocks=24, max_num_batched_tokens=8,
                                               max_num_seqs=4)),
    Setup("sliding-ngram", sliding=True, spec="ngram", engine=dict(block_size=4, num_kv_blocks=16,
                                                                   max_num_batched_tokens=12, max_num_seqs=3)),
    Setup("reasoning", reasoning=True, spec="ngram", engine=dict(block_size=4, num_kv_blocks=20, max_num_seqs=4,
                                                                 max_num_batched_tokens=12, reasoning_parser="qwen3")),
    # a mixture of experts: the attention setups' paths; "draft" is a dense Qwen3 (the same vocabulary)
    Setup("moe", moe="qwen3_moe", engine=dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=12,
                                              max_num_seqs=4)),
    Setup("moe-ngram", moe="qwen3_moe", spec="ngram", engine=dict(block_size=2, num_kv_blocks=28,
                                                                   max_num_batched_tokens=8, max_num_seqs=5)),
    Setup("moe-draft", moe="qwen3_moe", spec="draft", engine=dict(block_size=4, num_kv_blocks=24,
                                                                   max_num_batched_tokens=16, max_num_seqs=4)),
    Setup("moe-batch-invariant", moe="qwen3_moe", engine=dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=12,
                                                               max_num_seqs=4, batch_invariant=True)),
    Setup("moe-shared-noisy", moe="qwen2_moe", spec="noisy", engine=dict(block_size=4, num_kv_blocks=20,
                                                                          max_num_batched_tokens=12, max_num_seqs=4)),
]


@dataclass
class BeamRun:
    search: BeamSearch
    ids: list[str]  # the request ids of its current step's beams
    failed: bool = False


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    poisoned: bool
    finals: list = field(default_factory=list)
    aborted: bool = False


def engine_machine(paths: dict[str, str], hf_models: dict[str, object], setups: list[Setup],
                   reach: collections.Counter[str]) -> type:
    class EngineMachine(RuleBasedStateMachine):
        @initialize(setup=st.sampled_from(setups), seed=st.integers(0, 10_000),
                    first=st.lists(REQUESTS, min_size=3, max_size=6))
        def build(self, setup: Setup, seed: int, first: list[dict]) -> None:
            self.setup, self.rng = setup, random.Random(seed)
            spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
                    "noisy": {"proposer": NoisyProposer(), "num_speculative_tokens": 3},
                    "draft": {"model": paths["qwen3"], "num_speculative_tokens": 2},
                    None: None}[setup.spec]
            cache = {}
            if setup.snapshots is not None:
                each = snapshot_bytes(load_model_spec(Path(paths[setup.model])), torch.float32)
                cache = dict(state_cache_bytes=setup.snapshots * each)
            self.llm = LLM(paths[setup.model], warmup=False, speculative_config=spec,
                           seed=seed, **setup.engine, **cache)
            self.engine = engine = self.llm.llm_engine
            self.requests: dict[str, Request] = {}
            self.beam_runs: list[BeamRun] = []
            self.fail_batch = False  # the next forward of two rows or more raises (once)
            # (sequence, where): its commit raises there, once ("last token": the next sequence a token finishes)
            self.fail_commit: tuple[str | None, str] | None = None
            self.fail_tail = False  # the next commit's tail raises, after its work (once)
            self.failed_last: set[tuple[str, int]] = set()  # (request, completion) whose last token's commit raised
            self.over_budget: dict[tuple[str, int], Sequence] = {}  # (request, completion): grammar over budget
            self.over_budget_at: dict[str, tuple[Sequence, int]] = {}  # its grammar goes over budget at k tokens
            self.num_executes = 0  # forwards asked of the executor, the recovery's re-runs included
            execute_model = engine.executor.execute_model

            def counted_execute_model(plan):
                self.num_executes += 1
                return execute_model(plan)

            engine.executor.execute_model = counted_execute_model
            forward = engine.model_runner.model.forward

            def injected_forward(*args, **kwargs):
                out = forward(*args, **kwargs)  # the work is done (K/V written), then it fails: the worst case
                ids, positions = args[0], args[1]
                if bool(((ids == POISON) & (positions == 0)).any()):
                    raise Injected("a poisoned prompt")
                if self.fail_batch and args[2].cu_seqlens_q.numel() > 2:
                    self.fail_batch = False
                    raise Injected("two requests together")
                return out

            engine.model_runner.model.forward = injected_forward
            check_strings = engine.scheduler.stop_checker.check_strings

            def injected_check_strings(seq, num_new):  # the commit's text step (it decodes the new tokens)
                rid, where = self.fail_commit or ("", None)
                if (where == "text" and rid == seq.request_id) or (where == "last token" and seq.is_finished):
                    if where == "last token":  # the token that finished it ("length", "stop") came, then this
                        self.failed_last.add((seq.group_id, seq.index))
                        reach["last token failed"] += 1
                    self.fail_commit = None
                    raise Injected("a commit")
                return check_strings(seq, num_new)

            engine.scheduler.stop_checker.check_strings = injected_check_strings
            advance, commit_tail = engine.scheduler._advance, engine.scheduler._commit_tail

            def injected_advance(sched, out):  # the commit's first part: the forward's work becomes the sequence's
                advance(sched, out)
                if self.fail_commit == (sched.seq.request_id, "advance"):
                    self.fail_commit = None
                    raise Injected("a commit's advance")

            def injected_commit_tail(plan):  # after every request's own commit: what the step's rows share
                commit_tail(plan)
                if self.fail_tail:
                    self.fail_tail = False
                    reach["tail failed"] += 1
                    raise Injected("the commit's tail")

            engine.scheduler._advance, engine.scheduler._commit_tail = injected_advance, injected_commit_tail
            for request in first:  # a load from the start: pool pressure needs several requests at once
                self.add(**request)

        # --- actions -------------------------------------------------------------------------------
        @rule(request=REQUESTS)
        def add_request(self, request: dict) -> None:
            self.add(**request)

        def add(self, prefix: list[int], extra: list[int], n: int, greedy: bool, max_tokens: int,
                poisoned: bool, restricted: bool, structured: bool, think: str | None, over_budget: int | None) -> None:
            reasoning = self.engine.resolved.reasoning
            if reasoning is not None and think is not None:  # the prompt opens (or closes) a <think> block
                prefix = prefix + [reasoning.start_token_id if think == "open" else reasoning.end_token_id]
            prompt = ([POISON] if poisoned else []) + prefix + extra
            rules = dict(allowed_token_ids=ALLOWED, logit_bias={7: 3.0, 150: -5.0}, bad_words=["ab", "cd e"])
            rules = rules if restricted else {}
            if reasoning is not None and not restricted and not greedy:  # a push towards </think> (not for
                rules = dict(logit_bias={reasoning.end_token_id: 5.0})  # greedy: checked against HF's argmax)
            params = SamplingParams(n=n, temperature=0 if greedy and not restricted else 0.9,
                                    seed=None if greedy else len(self.requests), max_tokens=max_tokens,
                                    ignore_eos=True, **rules,
                                    structured_outputs=STRUCTURED if structured else None)
            rid = f"r{len(self.requests)}"
            self.requests[rid] = Request(prompt, params, poisoned)
            self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            if structured and over_budget is not None and rid in self.engine.requests:
                self.over_budget_at[rid] = (self.engine.requests[rid].seqs[0], over_budget)
                self._arm_over_budget()

        def _arm_over_budget(self) -> None:
            """A sequence with its k tokens (and still running) costs more than its budget a mask from now on."""
            for rid, (seq, k) in list(self.over_budget_at.items()):
                if seq.is_finished or seq.num_output_tokens >= k:
                    del self.over_budget_at[rid]
                if not seq.is_finished and seq.num_output_tokens >= k:
                    seq.grammar.mask_budget_ms = -1.0  # any CPU time measured is over it
                    self.over_budget[seq.group_id, seq.index] = seq

        @rule(prefix=st.sampled_from(PREFIXES), extra=st.lists(st.integers(5, 40), min_size=1, max_size=6),
              width=st.sampled_from([2, 3]), max_tokens=st.sampled_from([2, 4]))
        def add_beam_search(self, prefix: list[int], extra: list[int], width: int, max_tokens: int) -> None:
            params = BeamSearchParams(width, max_tokens, ignore_eos=True)
            run = BeamRun(new_search(self.engine, {"prompt_token_ids": prefix + extra}, params), [])
            self.beam_runs.append(run)
            self._send_beams(run)

        def _send_beams(self, run: BeamRun) -> None:
            """The search's next step: its live beams, as requests among the others."""
            sp, j = step_sampling_params(run.search.params), self.beam_runs.index(run)
            run.ids = [f"beam{j}-s{run.search.num_steps}-b{i}" for i in range(len(run.search.beams))]
            for rid, prompt in zip(run.ids, run.search.step_prompts()):
                self.requests[rid] = Request(prompt["prompt_token_ids"], sp, False)
                self.engine.add_request(rid, prompt, sp)

        def _drive_beams(self) -> None:
            """After a step: a search whose beams are all done goes on; one whose beam failed or was aborted
            ends, and aborts the beams still running (as the server does)."""
            for run in self.beam_runs:
                if run.failed or run.search.done:
                    continue
                finals = [self.requests[rid].finals for rid in run.ids]
                if any(f and f[0].outputs[0].finish_reason != "length" for f in finals):
                    run.failed = True
                    for rid in run.ids:
                        if rid in self.engine.requests:
                            self.requests[rid].aborted = True
                            self.engine.abort_request(rid)
                elif all(finals):
                    run.search.advance([f[0] for f in finals])
                    if not run.search.done:
                        self._send_beams(run)

        @rule()
        def step(self) -> None:
            if not self.engine.has_unfinished_requests():
                return
            before, executes = self._snapshot(), self.num_executes
            marked = [s for s in self.over_budget.values() if not s.is_finished]
            sched, victims = self.engine.scheduler, []

            def rollback_step(plan=None):  # the preemptions a rollback keeps (engine/core/overwritten.py)
                victims.extend(type(sched).rollback_step(sched, plan))
                return victims

            sched.rollback_step = rollback_step
            try:
                outs = self.engine.step()
            except ProposerFailed:  # after the commit: the step stands, its outputs come with the next step
                reach["proposer failed"] += 1
                return
            except Injected:
                reach["rolled back"] += 1
                after = self._snapshot()  # rolled back: nothing moved but an overwritten cached block's hash
                kept = {s.request_id for s in victims}
                if kept:  # a preemption whose blocks the failed step gave another sequence stands (overwritten.py)
                    reach["preemption kept"] += 1
                    assert all(s[1:4] == (SequenceStatus.WAITING, 0, []) for s in after[0] if s[0] in kept), after[0]
                    before, after = ([s for s in x[0] if s[0] not in kept] for x in (before, after))
                    assert after == before, "a failed step left a trace"
                    return
                assert after[:-1] == before[:-1], "a failed step left a trace"
                assert after[-1].items() <= before[-1].items()
                return
            for out in outs:
                if out.finished:
                    self.requests[out.request_id].finals.append(out)
                if out.error is not None and "grammar_mask_budget_ms" in out.error:  # never one that was not armed
                    assert any(g == out.request_id for g, _ in self.over_budget), (out.request_id, out.error)
            for seq in marked:  # over budget in this step: named by the plan's fill, finished, nothing run
                if seq.is_finished and "grammar_mask_budget_ms" in (seq.error or ""):
                    reach["grammar over budget"] += 1
                    assert self.num_executes == executes, "a step whose plan named a request ran (or was bisected)"
            self._arm_over_budget()
            self._drive_beams()

        @rule()
        def arm_batch_failure(self) -> None:
            self.fail_batch = True

        @precondition(lambda self: bool(self.engine.scheduler.running))
        @rule(data=st.data(), where=st.sampled_from(["text", "last token", "advance", "tail"]))
        def arm_commit_failure(self, data: st.DataObject, where: str) -> None:
            """The commit's fault points: a running sequence's text or advance, the next token that finishes a
            sequence, the step's tail. One rule for all: as a rule of its own, the tail (which fails every
            request still running in its step) left too few requests for the pool to ever preempt."""
            if where == "tail":
                self.fail_tail = True
                return
            running = [s.request_id for s in self.engine.scheduler.running]
            self.fail_commit = (None if where == "last token" else data.draw(st.sampled_from(running)), where)

        @precondition(lambda self: self.setup.spec == "noisy")
        @rule()
        def arm_proposer_failure(self) -> None:
            self.engine.speculator.proposer.fail = True

        @precondition(lambda self: bool(self.engine.requests))
        @rule(data=st.data())
        def abort(self, data: st.DataObject) -> None:
            rid = data.draw(st.sampled_from(sorted(self.engine.requests)))
            self.requests[rid].aborted = True
            self.engine.abort_request(rid)

        # --- after every action --------------------------------------------------------------------
        @invariant()
        def bookkeeping_is_conserved(self) -> None:
            if not hasattr(self, "engine"):
                return
            engine, sched = self.engine, self.engine.scheduler
            live = sched.live_sequences
            for seq in live:  # nobody runs for nobody
                state = engine.requests.get(seq.group_id)
                assert state is not None and any(s is seq for s in state.seqs), f"{seq} belongs to no live request"
            engine.block_manager.check_invariants(live)
            assert not sched.journal.is_open, "a step's transaction was left open"
            assert len(sched.running) <= engine.config.max_num_seqs, \
                f"{len(sched.running)} sequences for max_num_seqs={engine.config.max_num_seqs}"
            pool = engine.state_pool
            if pool is not None:
                held = [p for s in live if s.state_slots is not None for p in s.state_slots]
                assert sorted(held + pool.free) == list(range(pool.num_pairs)), "state pairs lost or shared"
                if pool.cache is not None:  # snapshot slots: each free or one entry's, never lost
                    pool.cache.check_invariants()
            if self.setup.spec == "draft":
                kept = set(engine.speculator.proposer.computed)
                assert kept <= {s.request_id for s in live}, f"the draft model keeps {kept} for sequences gone"

        def teardown(self) -> None:
            if not hasattr(self, "engine"):
                return
            # A commit fault armed last (the next finishing token's, the tail's) is spent in the drain below: lost
            # whenever the search ended right after arming it, those paths were the ones a run could miss.
            self.fail_batch = False
            self.fail_commit = self.fail_commit if self.fail_commit and self.fail_commit[1] == "last token" else None
            if self.setup.spec == "noisy":
                self.engine.speculator.proposer.fail = False
            for _ in range(500):
                if not self.engine.has_unfinished_requests():
                    break
                self.step()
            assert not self.engine.has_unfinished_requests(), "the engine did not drain"
            stats = self.llm.get_stats()
            # what this run reached: the search must cross these paths (checked after the search)
            reach[f"setup {self.setup.name}"] += 1
            reach["steps"] += stats.num_steps
            for reached, what in ((stats.num_preemptions, "preempted"), (stats.num_accepted_tokens, "drafts accepted"),
                                  (stats.prefix_cache_hits, "prefix hit"), (stats.num_mixed_steps, "mixed steps"),
                                  (any(len(r.finals[0].outputs) > 1 for r in self.requests.values()), "n > 1"),
                                  (any(r.finals[0].error and not r.poisoned for r in self.requests.values()),
                                   "a request failed on its own")):
                if reached:
                    reach[what] += 1
            assert stats.num_free_blocks == stats.num_total_blocks
            if (moe := self.engine.spec.moe) is not None:  # each row counted computed: k routes per sparse layer
                sparse = sum(map(moe.is_sparse, range(self.engine.spec.num_hidden_layers)))
                assert sum(stats.expert_load_total) == \
                    (stats.num_prefill_tokens + stats.num_decode_tokens) * moe.num_experts_per_tok * sparse
            if self.engine.state_pool is not None:
                assert self.engine.state_pool.num_free == self.engine.state_pool.num_pairs
                cache = self.engine.state_pool.cache
                if cache is not None and cache.num_hits:
                    reach["state snapshot hit"] += 1
                if cache is not None and cache.num_evictions:
                    reach["state snapshot evicted"] += 1
            hf = hf_models[self.setup.model]
            self._check_beams(hf, reach)
            for rid, r in self.requests.items():
                assert len(r.finals) == 1, f"{rid}: {len(r.finals)} final outputs"
                out = r.finals[0]
                reasons = [c.finish_reason for c in out.outputs]
                if r.poisoned:  # blamed alone: never ran a token (or aborted, or refused, first)
                    # (n > 1: every one of its n sequences carries the poison, each blamed alone)
                    assert len(reasons) == r.params.n and set(reasons) <= {"error", "abort"} \
                        and not any(c.token_ids for c in out.outputs)
                    assert r.aborted or set(reasons) == {"error"}, (rid, reasons, out.error)
                    continue
                for c in out.outputs:
                    if c.finish_reason == "error" or (r.aborted and c.finish_reason == "abort"):
                        continue
                    room = self.engine.config.max_model_len - len(r.prompt)  # max_model_len ends it too
                    allowed = self._grammar_masks(r, c) if r.params.structured_outputs is not None else None
                    if c.finish_reason != "stop":  # "stop": the grammar is complete (checked by _grammar_masks)
                        assert c.finish_reason == "length" and len(c.token_ids) == min(r.params.max_tokens, room), \
                            (rid, c)
                    if r.params.allowed_token_ids is not None:  # masks reach every path (drafts, n > 1, recomputes)
                        assert set(c.token_ids) <= set(ALLOWED), (rid, c.token_ids)
                    if r.params.temperature == 0:
                        assert_hf_greedy(hf, r.prompt, c.token_ids, allowed=allowed)
                if not r.aborted and out.error is None:
                    ended = {"length", "stop"} if r.params.structured_outputs is not None else {"length"}
                    assert len(out.outputs) == r.params.n and set(reasons) <= ended, (rid, reasons)
            for rid, index in self.failed_last:  # its last token came, then its commit raised: an error, not "length"
                c = next(c for c in self.requests[rid].finals[0].outputs if c.index == index)
                assert c.finish_reason == "error" and self.requests[rid].finals[0].error, (rid, c)
            for rid, index in self.over_budget:  # every mask it needed after that was over budget (none inside <think>)
                c = next(c for c in self.requests[rid].finals[0].outputs if c.index == index)
                assert c.finish_reason in ("error", "abort") or self.setup.reasoning, (rid, c)

        def _grammar_masks(self, r: Request, c) -> list[torch.Tensor]:
            """A structured completion walked through a fresh matcher: every token allowed where it was
            drawn, the grammar complete iff it ended with "stop"; the allowed set at each token, (V,) bool."""
            reach["structured"] += 1
            matcher = self.engine.input_processor.grammars.matcher(r.params.structured_outputs)  # the grammar alone
            vocab, reasoning = self.engine.spec.vocab_size, self.engine.resolved.reasoning
            phase = reasoning.prompt_phase(r.prompt) if reasoning is not None else ReasoningPhase.ENDED
            masks = []
            for tok in c.token_ids:  # inside reasoning anything goes; the grammar starts after </think>
                if phase is ReasoningPhase.INSIDE:
                    masks.append(torch.ones(vocab, dtype=torch.bool))
                    if tok == reasoning.end_token_id:
                        phase = ReasoningPhase.ENDED
                        reach["reasoning ended"] += 1
                    continue
                masks.append(unpack_bitmask(matcher.bitmasks()[:1], vocab)[0])
                if phase is ReasoningPhase.MAY_OPEN:  # the first token may open the reasoning instead
                    masks[-1][reasoning.start_token_id] = True
                    phase = ReasoningPhase.INSIDE if tok == reasoning.start_token_id else ReasoningPhase.ENDED
                    if phase is ReasoningPhase.INSIDE:
                        continue
                assert masks[-1][tok] and matcher.accept(tok), (c.token_ids, tok)
            complete = phase is ReasoningPhase.ENDED and matcher.is_complete
            assert complete == (c.finish_reason == "stop"), (c, complete)
            return masks

        @torch.no_grad()
        def _check_beams(self, hf: object, reach: collections.Counter[str]) -> None:
            for run in self.beam_runs:
                search, params = run.search, run.search.params
                assert run.failed or search.done, "a beam search stopped half-way"
                if run.failed:
                    continue
                reach["beam search"] += 1
                beams = search.output(self.llm.get_tokenizer()).sequences
                assert len(beams) == params.beam_width and beams == sorted(beams, key=search.score, reverse=True)
                n = len(search.prompt_token_ids)
                for b in beams:  # the logprobs came through prefix-cache hits, under all of the above
                    assert len(b.tokens) == n + params.max_tokens
                    lp = hf(torch.tensor([b.tokens])).logits[0, n - 1:-1].float().log_softmax(-1)  # (T, V)
                    assert abs(float(lp.gather(1, torch.tensor(b.tokens[n:])[:, None]).sum()) - b.cum_logprob) < 1e-3
                if not self.setup.hybrid:  # the best beam: as good as HF's beam search finds
                    ref = hf.generate(torch.tensor([search.prompt_token_ids]), num_beams=params.beam_width,
                                      do_sample=False, early_stopping=True, max_new_tokens=params.max_tokens,
                                      eos_token_id=None, output_scores=True, return_dict_in_generate=True)
                    assert beams[0].cum_logprob >= float(ref.sequences_scores[0]) * params.max_tokens - 1e-3

        def _snapshot(self) -> tuple:
            engine, bm = self.engine, self.engine.block_manager
            seqs = [(s.request_id, s.status, s.num_computed_tokens, list(s.block_table), list(s.sliding_block_table),
                     s.num_tokens, None if s.state_slots is None else list(s.state_slots),
                     s.first_scheduled_time)  # an admission undone leaves no first-scheduled time
                    for s in engine.scheduler.live_sequences]
            pool = engine.state_pool
            groups = list(bm.groups.values()) if isinstance(bm, KVCacheCoordinator) else [bm]  # every pool
            hashes = {(i, h): b for i, g in enumerate(groups) for h, b in g.hash_to_block.items()}
            return (seqs, [(list(g.ref_counts), list(g.free_blocks)) for g in groups], sorted(engine.requests),
                    None if pool is None else (list(pool.free), list(pool.current), _cache_state(pool.cache)), hashes)

    return EngineMachine


def _cache_state(cache: StateCache | None) -> tuple | None:
    """What a failed step must leave as it was in a hybrid's state cache."""
    if cache is None:
        return None
    return ({k: (slot, cache.last_used[k]) for k, slot in cache.entries.items()}, sorted(cache.free + cache.reserved),
            cache.clock, cache.num_hits)


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_factory, hf_factory):
    from transformers import AutoModelForCausalLM

    hybrid = str(make_tiny_model(tmp_path_factory.mktemp("machine_qwen3_5"), family="qwen3_5", num_layers=4))
    thinking = make_thinking_qwen3(tmp_path_factory.mktemp("machine_thinking"))[0]  # qwen3's weights, <think> tokens
    gemma = str(make_tiny_model(tmp_path_factory.mktemp("machine_gemma3"), family="gemma3", num_layers=4))
    paths = {"qwen3": model_factory("qwen3"), "hybrid": hybrid, "gemma3": gemma, "thinking": thinking}
    paths |= {moe: str(tiny_moe_checkpoint(tmp_path_factory.mktemp(f"machine_{moe}"), moe))
              for moe in ("qwen3_moe", "qwen2_moe")}
    hf = {name: AutoModelForCausalLM.from_pretrained(paths[name], dtype=torch.float32).eval()
          for name in ("thinking", "hybrid", "gemma3", "qwen3_moe", "qwen2_moe")}
    return paths, hf | {"qwen3": hf_factory("qwen3")}


SEEDS = {"attention": 1, "hybrid": 2, "sliding": 3, "reasoning": 4, "moe": 5}  # the search's seed per setup group
GROUPS = {"qwen3": "attention", "thinking": "reasoning", "hybrid": "hybrid", "gemma3": "sliding", "qwen3_moe": "moe",
          "qwen2_moe": "moe"}  # model -> its setup group


@pytest.mark.parametrize("which,examples", [("attention", 150), ("hybrid", 80), ("sliding", 40), ("reasoning", 40),
                                            pytest.param("moe", 60, marks=pytest.mark.slow)])  # ~80 s on 2 cores
def test_engine_machine(models, which, examples):
    from hypothesis.stateful import run_state_machine_as_test

    setups = [s for s in SETUPS if GROUPS[s.model] == which]
    reach: collections.Counter[str] = collections.Counter()
    # One fixed search per setup group (a seed, no example database): CI runs the suite once, so the paths
    # checked below must be crossed in every run, not in most; new bugs come from new code meeting it.
    machine = seed(SEEDS[which])(engine_machine(*models, setups, reach))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds synchronisation
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=examples, stateful_step_count=30, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    finally:
        torch.set_num_threads(threads)
    # The search must cross the paths it exists for (in every run: these counts are tens or more), or it proves
    # nothing about them.
    wanted = ["n > 1", "preempted", "rolled back", "mixed steps", "a request failed on its own", "beam search",
              "structured", "tail failed", "last token failed", "grammar over budget"]
    wanted += ["drafts accepted", "prefix hit"]
    wanted += ["state snapshot hit", "state snapshot evicted"] if which == "hybrid" else []
    if which == "reasoning":  # one setup, fewer runs: its own paths (a structured output crossed </think>)
        wanted = ["n > 1", "rolled back", "structured", "reasoning ended", "drafts accepted", "tail failed",
                  "last token failed", "grammar over budget"]
    wanted += [f"setup {s.name}" for s in setups]  # each setup's paths (e.g. batch-invariant's) were crossed
    assert all(reach[w] for w in wanted), ([w for w in wanted if not reach[w]], dict(reach))
