"""Structured outputs through the public API, on a tiny random Qwen3 (its byte-level BPE vocabulary):
every kind's output is valid, a complete grammar ends with "stop", invalid specs are refused before
queueing, conflicts fail the request (never NaN), logprobs stay raw, forks and drafts obey the grammar."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.engine.structured_output.grammar import bitmask_width
from minivllm.layers.logits_processors import unpack_bitmask

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["a", "b"]}},
          "required": ["n", "ok", "tag"], "additionalProperties": False}
PROMPT = {"prompt_token_ids": [5, 17, 33, 48, 9]}


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, warmup=False, max_num_seqs=8)


def run(llm, so: StructuredOutputsParams, **kw) -> list:
    kw = {"max_tokens": 40, "temperature": 1.0, **kw}
    out = llm.generate([PROMPT], SamplingParams(structured_outputs=so, **kw), use_tqdm=False)[0]
    return out.outputs


def test_params_are_checked():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="not supported"):
        StructuredOutputsParams.from_dict({"regex": "a", "whitespace_pattern": " "})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    # the cache key does not depend on how the schema was written
    assert StructuredOutputsParams(json=SCHEMA).spec == StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2)).spec


def nested_schema(levels: int) -> dict:
    """An object schema `levels` properties deep (two JSON levels each), built without recursion."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_too_deeply_is_a_value_error_naming_the_field(llm, monkeypatch):
    """A deep schema escaped as RecursionError (a 500 on the server): from json.loads of its text, json.dumps of a
    dict (`spec`), or a pass after it. It is refused by an explicit, iterative check, and any RecursionError left
    in the compile is a ValueError too."""
    from minivllm.engine.structured_output import grammar
    from minivllm.structured_outputs import MAX_SCHEMA_DEPTH

    text = '{"type":"object","properties":{"a":' * 600 + "{}" + "}}" * 600
    for deep in (text, nested_schema(490), nested_schema(5000)):
        with pytest.raises(ValueError, match=r"StructuredOutputsParams\.json nests .* more than 128 levels"):
            StructuredOutputsParams(json=deep)
    StructuredOutputsParams(json=nested_schema(MAX_SCHEMA_DEPTH // 2 - 1))  # the deepest allowed: 127 levels
    with pytest.raises(ValueError, match="128 levels"):
        StructuredOutputsParams(json=nested_schema(MAX_SCHEMA_DEPTH // 2))
    with pytest.raises(ValueError, match="more than 200000 values"):
        StructuredOutputsParams(json={"enum": [0] * 200_001})

    def recurses(*a, **kw):
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(grammar, "strict_schema", recurses)  # the engine's strict default rewrites every schema
    with pytest.raises(ValueError, match="structured_outputs.json is nested too deeply"):
        llm.llm_engine.input_processor.grammars.matcher(StructuredOutputsParams(json={"type": "object", "x": 1}))


def test_bitmask_unpacks_like_the_naive_loop():
    V = 70
    words = torch.randint(-2**31, 2**31 - 1, (3, bitmask_width(V)), dtype=torch.int32)
    naive = torch.tensor([[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(V)] for r in range(3)])
    assert torch.equal(unpack_bitmask(words, V), naive)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_kind_gives_valid_output(llm, seed):
    for c in run(llm, StructuredOutputsParams(json=SCHEMA), seed=seed, max_tokens=60, n=2):
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    (c,) = run(llm, StructuredOutputsParams(json_object=True), seed=seed, max_tokens=200)
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)
    (c,) = run(llm, StructuredOutputsParams(regex=r"(ab|cd)[0-9]{2,4}x"), seed=seed)
    assert c.finish_reason == "stop" and re.fullmatch(r"(ab|cd)[0-9]{2,4}x", c.text), c
    (c,) = run(llm, StructuredOutputsParams(choice=["red wine", "white", "rosé"]), seed=seed)
    assert c.finish_reason == "stop" and c.text in ("red wine", "white", "rosé"), c
    for grammar in ('start: "(" num ("+" num)* ")"\nnum: /[0-9]/', 'root ::= "(" [0-9] ("+" [0-9])* ")"'):
        (c,) = run(llm, StructuredOutputsParams(grammar=grammar), seed=seed, max_tokens=60)
        assert c.finish_reason == "stop" and re.fullmatch(r"\([0-9](\+[0-9])*\)", c.text), (grammar, c)


def test_max_tokens_may_cut_the_output(llm):
    (c,) = run(llm, StructuredOutputsParams(regex=r"[a-z]{30}"), max_tokens=3, temperature=0)
    assert c.finish_reason == "length" and len(c.token_ids) == 3 and re.fullmatch("[a-z]*", c.text)


@pytest.mark.parametrize("so", [StructuredOutputsParams(regex="(ab"), StructuredOutputsParams(json={"type": "nope"}),
                                StructuredOutputsParams(grammar='start: "a" | missing')])
def test_an_invalid_spec_is_refused_before_queueing(llm, so):
    with pytest.raises(ValueError, match=f"structured_outputs.{so.kind.value} is invalid"):
        llm.generate([PROMPT], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_conflicts_fail_the_request_with_a_message(llm):
    # the grammar allows only "yes"/"no" tokens; allowed_token_ids allows none of them
    tok = llm.get_tokenizer()
    letters = set(tok.encode("yesno", add_special_tokens=False))
    other = [t for t in range(5, 60) if t not in letters]
    (c,) = run(llm, StructuredOutputsParams(choice=["yes", "no"]), allowed_token_ids=other)
    assert c.finish_reason == "error" and not c.token_ids
    # the engine is clean afterwards: a plain request still runs
    assert run(llm, StructuredOutputsParams(choice=["y"]))[0].text == "y"
    assert llm.get_stats().num_free_blocks == llm.get_stats().num_total_blocks


@pytest.mark.parametrize("so,text", [(StructuredOutputsParams(choice=["y"]), "y"),
                                     (StructuredOutputsParams(json=SCHEMA), None)])
def test_the_grammars_end_wins_over_min_tokens(llm, so, text):
    """min_tokens longer than the output the grammar allows: the grammar's end wins (min_tokens cannot hold
    open an output with nothing more to write), the request ends "stop" with its whole output, not an error."""
    (plain,) = run(llm, so, temperature=0, max_tokens=60)
    assert plain.finish_reason == "stop"
    (held,) = run(llm, so, temperature=0, max_tokens=60, min_tokens=len(plain.token_ids) + 5)
    assert held.finish_reason == "stop" and held.token_ids == plain.token_ids
    assert held.text == (text if text is not None else plain.text)
    if so.json is not None:
        jsonschema.validate(json.loads(held.text), SCHEMA)
    # where the grammar can go on, min_tokens still holds: "a+" is written for at least 6 tokens
    (more,) = run(llm, StructuredOutputsParams(regex="a+"), temperature=0, max_tokens=30, min_tokens=6)
    assert len(more.token_ids) >= 6 and re.fullmatch("a+", more.text), more
    assert llm.get_stats().num_free_blocks == llm.get_stats().num_total_blocks


def test_logprobs_stay_raw(llm):
    """The grammar decides what is drawn, not the logprobs reported: the top-5 at the first position are
    the model's own, and a forbidden-by-the-model token gets its raw (finite) logprob."""
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False)[0]
    (c,) = run(llm, StructuredOutputsParams(choice=["zz"]), max_tokens=4, temperature=0, logprobs=5)
    assert c.text == "zz"
    assert c.logprobs[0].keys() >= plain.outputs[0].logprobs[0].keys() - {plain.outputs[0].token_ids[0]}
    first = c.logprobs[0][c.token_ids[0]]
    assert math.isfinite(first.logprob) and first.logprob <= max(x.logprob for x in plain.outputs[0].logprobs[0].values())


def test_speculative_decoding_keeps_greedy_output(qwen3_dir, llm):
    so = StructuredOutputsParams(regex=r"(ab ){3,8}(cd ){2,6}end")
    want = run(llm, so, temperature=0, max_tokens=60)[0]
    spec = LLM(qwen3_dir, warmup=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    got = run(spec, so, temperature=0, max_tokens=60)[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert spec.get_stats().num_accepted_tokens > 0  # drafts did go through verification
    for seed in range(3):  # and sampled outputs stay valid when drafts are verified against the mask
        c = run(spec, so, seed=seed, max_tokens=60)[0]
        assert c.finish_reason == "stop" and re.fullmatch(r"(ab ){3,8}(cd ){2,6}end", c.text), c


def test_a_grammar_is_compiled_once(llm):
    compiler = llm.llm_engine.input_processor.grammars
    so = StructuredOutputsParams(regex=r"q{3}")
    run(llm, so)
    size = len(compiler._cache)
    for c in run(llm, StructuredOutputsParams(regex=r"q{3}"), n=3, seed=4):
        assert c.text == "qqq" and c.finish_reason == "stop"
    assert len(compiler._cache) == size


def test_verification_masks_follow_the_drafts_and_leave_the_matcher_as_it_was(llm):
    """Row j is the allowed set after drafts[:j], as a matcher advanced token by token gives it; rows after
    a draft the grammar forbids repeat the row that forbids it; the matcher is where it was afterwards."""
    compiler = llm.llm_engine.input_processor.grammars
    so = StructuredOutputsParams(regex=r"(ab ){3,8}end")
    a, b, space_a = (llm.get_tokenizer().encode(t, add_special_tokens=False) for t in ("a", "b", " a"))
    assert len(a) == len(b) == len(space_a) == 1
    m = compiler.matcher(so)
    before = m.bitmasks()
    drafts = [a[0], b[0], space_a[0], a[0], b[0]]  # "ab a" then a second "a": forbidden at index 3
    masks = m.bitmasks(drafts)
    assert torch.equal(m.bitmasks(), before) and torch.equal(masks[0], before[0])
    step = compiler.matcher(so)
    for j in range(4):
        assert torch.equal(masks[j], step.bitmasks()[0]), j
        if j < 3:
            assert step.accept(drafts[j])
    assert torch.equal(masks[4], masks[3]) and torch.equal(masks[5], masks[3])
    assert not unpack_bitmask(masks[3:4], llm.llm_engine.spec.vocab_size)[0, drafts[3]]


def test_no_verification_row_is_empty_after_a_draft_that_completes_the_grammar(llm):
    compiler = llm.llm_engine.input_processor.grammars
    (y,) = llm.get_tokenizer().encode("y", add_special_tokens=False)
    m = compiler.matcher(StructuredOutputsParams(choice=["y"]))
    masks = m.bitmasks([y, y, y])  # "y" completes the grammar: what follows it is never kept
    assert all(unpack_bitmask(masks, llm.llm_engine.spec.vocab_size).any(-1)) and not m.is_complete


class _EndOnlyMatcher:
    """A matcher stub whose grammar allows `allowed` next (the engine's matchers stop at once after the last
    token; this is the other shape an end can take: a row where only EOS may come)."""

    mask_budget_ms, error = math.inf, ""

    def __init__(self, allowed: list[int], vocab_size: int) -> None:
        self.allowed, self.vocab_size = allowed, vocab_size

    def row_masks(self, drafts, out):
        for t in self.allowed:
            out[0, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)
        return [out[0]]


@pytest.mark.parametrize("allowed,held_after,drawable", [
    ([2], [31], [2]), ([63], [31], [63]), ([2, 31], [31], [2]),  # only an end (and a stop id): EOS's hold lifts
    ([2, 40], [2, 31, 63], [40]),  # the grammar allows more: all held
    ([31], [31], []),  # only the client's stop id (regex "x;y", stop ";"): held, the row has no choice (an error)
])
def test_a_grammar_that_can_only_end_lifts_the_eos_hold(allowed, held_after, drawable):
    """A row holding EOS / stop ids off until min_tokens, whose grammar allows only those: EOS's hold is lifted
    (else the row has nothing to draw and the request fails), never the client's stop_token_ids (lifting
    those ended `x;y` with stop `;` at "x;", before min_tokens); where the grammar allows more, it holds."""
    from minivllm.engine.request.step_types import GrammarBitmask
    from minivllm.engine.structured_output.grammar_fill import GrammarRows, fill_bitmask
    from minivllm.engine.worker.sampling_metadata import SamplingBatch
    from minivllm.layers.logits_processors import RowProcessing, apply_logits_processing, rows_without_choice

    V, held = 70, [2, 31, 63]  # EOS 2 and 63, stop id 31; 31 and 63 are bit 31 of their words (the sign bit)
    step = fill_bitmask([GrammarRows("r", _EndOnlyMatcher(allowed, V), [])], V)  # as the scheduler fills it
    batch = SamplingBatch(processing=[RowProcessing(held_token_ids=held)], grammar_targets={"r": [[0]]})
    batch.apply_grammar_bitmask(GrammarBitmask({"r": [step.bitmask[0]]}, {}), frozenset({2, 63}))
    row = batch.processing[0]
    assert row.held_token_ids == held_after
    logits = apply_logits_processing(torch.zeros(1, V), [row])
    assert rows_without_choice(logits, [row]) == ([] if drawable else [0])
    if drawable:  # (a row without choice is failed by the engine, whatever its logits)
        assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == set(drawable)
