"""Grammars that never stall the other requests (issue 41): the first mask loads no compiler, a grammar that
cannot run (or can only write EOS, or costs more than the mask budget) is refused before queueing with a short
message, a request whose mask runs over its budget mid-output ends alone while the others keep their tokens
(counted in steps), and JSON schemas are strict by default (structured_outputs.strict_schema)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time

import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.config import EngineConfig
from minivllm.engine.structured_output.grammar import MAX_ERROR_CHARS, GrammarCompiler, GrammarMatcher
from minivllm.entrypoints.engine_args import add_engine_args, engine_kwargs
from minivllm.schema_strictness import strict_schema

PROMPT = {"prompt_token_ids": [5, 17, 33, 48, 9]}
CANNOT_RUN = {  # each compiles, then explodes at its first token, or can only end at once
    "requires_itself": dict(json={"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    "only_eos_schema": dict(json={"$ref": "#"}),
    "endless_lark": dict(grammar='start: "a" start'),
    "huge_repeat": dict(regex="a{1000000}"),
    "5000_alternatives": dict(grammar="start: " + " | ".join(f'"w{i}"' for i in range(5000))),
    "only_eos_regex": dict(regex=r"[^\s\S]"),
}


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, warmup=False, max_num_seqs=8, grammar_mask_budget_ms=20.0)


def test_the_first_mask_of_a_process_loads_no_compiler(qwen3_dir):
    """The first structured request used to import llguidance.torch (torch.compile at import) inside the
    engine's step: seconds during which every stream stood still."""
    probe = textwrap.dedent(f"""
        import sys
        from minivllm.engine.processing.tokenizer import get_tokenizer
        from minivllm.engine.structured_output.grammar import GrammarCompiler
        from minivllm.structured_outputs import StructuredOutputsParams
        tok = get_tokenizer({qwen3_dir!r})
        m = GrammarCompiler(tok, 384, frozenset([tok.eos_token_id])).matcher(StructuredOutputsParams(regex="ab+"))
        assert m.bitmasks().any()
        print(sorted(x for x in ("torch._dynamo", "llguidance.torch") if x in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", CANNOT_RUN)
def test_a_grammar_that_cannot_run_is_refused_before_queueing_in_a_few_words(llm, name):
    so = StructuredOutputsParams(**CANNOT_RUN[name])
    with pytest.raises(ValueError, match=f"structured_outputs.{so.kind.value} ") as refused:
        llm.generate([PROMPT], SamplingParams(structured_outputs=so, max_tokens=8), use_tqdm=False)
    message = str(refused.value)
    assert len(message) <= MAX_ERROR_CHARS + 100 and "<state>" not in message and "Parser: {" not in message
    assert not llm.llm_engine.has_unfinished_requests()
    # and without any budget: llguidance's own limits (or the EOS rule) refuse it, whatever this CPU's speed
    tok = llm.get_tokenizer()
    unbounded = GrammarCompiler(tok, llm.llm_engine.spec.vocab_size, frozenset([tok.eos_token_id]))
    with pytest.raises(ValueError, match="cannot be used|allows no output"):
        unbounded.matcher(so)
    with pytest.raises(ValueError, match="cannot be used|allows no output"):  # a refusal is remembered
        unbounded.matcher(so)


def test_a_grammar_over_the_budget_is_refused_with_the_budget_named(qwen3_dir):
    tight = LLM(qwen3_dir, warmup=False, grammar_mask_budget_ms=1e-6)  # no mask takes under a nanosecond of CPU
    so = StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(ValueError, match="over the budget of 1e-06 ms .*grammar_mask_budget_ms"):
        tight.generate([PROMPT], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not tight.llm_engine.has_unfinished_requests()


def test_a_refusal_over_the_budget_is_not_cached(llm):
    """The budget's refusal is a timing: one slow probe on a busy CPU was cached as a permanent 400 for that spec.
    Refusals that say what the grammar is (invalid, only EOS) are still cached: compiled once."""
    compiler = llm.llm_engine.input_processor.grammars
    so = StructuredOutputsParams(choice=["a costly moment", "not cached"])
    compiler.mask_budget_ms = 1e-6  # no mask takes under a nanosecond of CPU: the probe is "slow" this once
    try:
        with pytest.raises(ValueError, match="over the budget"):
            compiler.matcher(so)
    finally:
        compiler.mask_budget_ms = llm.llm_engine.config.grammar_mask_budget_ms
    assert compiler.matcher(so) is not None  # timed again, within the budget now
    compiles = []
    compile_ = compiler._compile
    compiler._compile = lambda params: compiles.append(params) or compile_(params)
    try:
        for _ in range(2):
            with pytest.raises(ValueError, match="is invalid"):
                compiler.matcher(StructuredOutputsParams(regex="(unclosed, never cached before"))
    finally:
        del compiler._compile
    assert len(compiles) == 1


class SlowAfter(GrammarMatcher):
    """A matcher whose masks burn `burn_ms` of CPU once its output has `after` tokens (a grammar that turns
    costly mid-output, made deterministic: CPU time is what the budget counts)."""

    def __init__(self, inner: GrammarMatcher, after: int, burn_ms: float) -> None:
        super().__init__(inner._m, inner.vocab_size, inner.reasoning, inner.phase, inner.mask_budget_ms)
        self.after, self.burn_ms, self.accepted, self.slow_fills = after, burn_ms, 0, 0

    def accept(self, token_id: int) -> bool:
        self.accepted += 1
        return super().accept(token_id)

    def fill_bitmask(self, out) -> None:
        super().fill_bitmask(out)
        if self.accepted >= self.after:
            self.slow_fills += 1
            end = time.thread_time() + self.burn_ms / 1e3
            while time.thread_time() < end:
                pass


def test_a_costly_request_is_charged_to_its_own_budget_while_another_streams(llm, monkeypatch):
    plain = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].token_ids
    grammars = llm.llm_engine.input_processor.grammars
    made: list[SlowAfter] = []
    compile_matcher = grammars.matcher

    def slow_matcher(params, *args):
        made.append(SlowAfter(compile_matcher(params, *args), after=3, burn_ms=2 * grammars.mask_budget_ms))
        return made[-1]

    monkeypatch.setattr(grammars, "matcher", slow_matcher)
    engine = llm.llm_engine
    engine.add_request("stream", PROMPT, plain)
    engine.add_request("costly", PROMPT, SamplingParams(max_tokens=12, seed=1, ignore_eos=True,
                                                        structured_outputs=StructuredOutputsParams(regex="[a-z]+")))
    finished, stream_tokens = {}, []  # the stream's output length after each step
    while engine.has_unfinished_requests():
        outs = {out.request_id: out for out in engine.step()}
        finished.update({rid: out for rid, out in outs.items() if out.finished})
        if "stream" in outs:
            stream_tokens.append(len(outs["stream"].outputs[0].token_ids))
        elif not finished.get("stream"):
            stream_tokens.append(stream_tokens[-1] if stream_tokens else 0)
    costly = finished["costly"]
    assert costly.outputs[0].finish_reason == "error" and len(costly.outputs[0].token_ids) == 3
    assert "over the budget of 20 ms" in costly.error and "grammar_mask_budget_ms" in costly.error
    assert made[0].slow_fills == 1  # charged once: its first costly mask ended it
    stream = finished["stream"].outputs[0]
    assert stream.token_ids == alone and stream.finish_reason == "length"
    # the stream never waited: a token every step, but for the one step the costly request failed (taken back,
    # run again without it: no token lost, nothing drawn twice)
    assert stream_tokens == [1, 2, 3, 3] + list(range(4, 13)), stream_tokens  # the 4th step: its 4th mask


def test_strict_schema_closes_named_objects_at_every_depth():
    item = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "properties": {
        "a": item, "b": {"type": "array", "items": item}, "c": {"anyOf": [item, {"type": "null"}]},
        "d": {"$ref": "#/$defs/d"}, "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "properties": {"type": "object", "properties": {"y": {}}}, "loose": {"type": "object"},
        "both": {"allOf": [item, {"properties": {"z": {}}}]}},
        "$defs": {"d": item}}
    strict = strict_schema(schema)
    closed = {"additionalProperties": False}
    assert strict["additionalProperties"] is False
    props = strict["properties"]
    assert props["a"] == {**item, **closed} and props["b"]["items"] == {**item, **closed}
    assert props["c"]["anyOf"] == [{**item, **closed}, {"type": "null"}] and strict["$defs"]["d"] == {**item, **closed}
    assert props["open"]["additionalProperties"] is True and props["loose"] == {"type": "object"}
    assert props["properties"] == {"type": "object", "properties": {"y": {}}, **closed}  # a property's name is no keyword
    assert props["both"]["allOf"] == [item, {"properties": {"z": {}}}]  # each member names only its share
    assert "additionalProperties" not in schema and "additionalProperties" not in item  # a copy
    assert strict_schema({"type": "string"}) == {"type": "string"}


COMPOSED = {  # valid schemas whose objects share their instance: closing any of them refuses valid outputs
    "allOf_ref": ({"$defs": {"Base": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}},
                   "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
                  '{"a":"x","b":1}'),
    "anyOf_beside_properties": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                 "anyOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]},
                                           {"properties": {"c": {"type": "integer"}}, "required": ["c"]}]},
                                '{"a":1,"c":2}'),
    "ref_chain_beside_keywords": ({"$defs": {"B": {"$ref": "#/$defs/C"}, "C": {"properties": {"a": {"type": "integer"}}}},
                                   "$ref": "#/$defs/B", "properties": {"b": {"type": "integer"}}, "required": ["a", "b"]},
                                  '{"a":1,"b":2}'),
    "allOf_in_a_choice": ({"$defs": {"A": {"properties": {"a": {"type": "integer"}}, "required": ["a"]}},
                           "anyOf": [{"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {"type": "integer"}}}]},
                                     {"type": "null"}]},
                          '{"a":1,"b":2}'),
}


@pytest.mark.parametrize("name", COMPOSED)
def test_strict_schema_leaves_objects_that_share_their_instance_open(llm, name):
    """A strict default that closed every object it reached (but direct allOf members) turned these valid
    schemas into ones no output fits (a 400 on the server). The rewrite leaves them as they are, and the
    engine's grammar takes the valid output whole."""
    schema, valid = COMPOSED[name]
    assert strict_schema(schema) == schema
    m = llm.llm_engine.input_processor.grammars.matcher(StructuredOutputsParams(json=schema))
    tokens = llm.get_tokenizer().encode(valid, add_special_tokens=False)
    assert all(m.accept(t) for t in tokens) and m.is_complete


def test_strict_schema_still_closes_a_choice_and_the_models_it_names():
    """pydantic's Optional[Model] (`anyOf` of a $ref and null, beside only a default) is a choice: the model's
    $defs entry is the whole of its instance and is closed; one also used as an allOf member stays open."""
    closed = {"additionalProperties": False}
    model = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"$defs": {"M": model, "Shared": model}, "type": "object", "properties": {
        "m": {"anyOf": [{"$ref": "#/$defs/M"}, {"type": "null"}], "default": None},
        "s": {"allOf": [{"$ref": "#/$defs/Shared"}, {"properties": {"y": {}}}]}, "t": {"$ref": "#/$defs/Shared"}}}
    strict = strict_schema(schema)
    assert strict["$defs"] == {"M": {**model, **closed}, "Shared": model} and strict["additionalProperties"] is False
    assert strict["properties"]["s"] == schema["properties"]["s"]
    then = {"properties": {"a": {}}, "if": {"properties": {"a": {"const": 1}}}, "then": {"properties": {"b": {}}}}
    assert strict_schema(then) == then  # llguidance compiles no if/then; the rule still reads them
    anchored = {"properties": {"a": model}, "allOf": [{"$ref": "#anchor"}]}  # a $ref it cannot follow: all open
    assert strict_schema(anchored) == anchored


@pytest.mark.parametrize("strict", [True, False])
def test_json_schemas_are_strict_by_default(qwen3_dir, llm, strict):
    """vLLM's default backend (xgrammar) allows no property a schema does not name; neither do we, unless
    strict_json_schema=False (--no-strict-json-schema)."""
    engine = llm if strict else LLM(qwen3_dir, warmup=False, strict_json_schema=False)
    assert engine.llm_engine.config.strict_json_schema is strict
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    m = engine.llm_engine.input_processor.grammars.matcher(StructuredOutputsParams(json=schema))
    tokens = engine.get_tokenizer().encode('{"unit":"c"}', add_special_tokens=False)
    taken = 0
    while taken < len(tokens) and m.accept(tokens[taken]):
        taken += 1
    assert (taken < len(tokens)) is strict  # strict: refused at the unnamed key; else the whole object fits


def test_the_two_fields_are_validated_and_are_cli_flags():
    for bad in (0, -1.0, float("inf"), True, "5"):
        with pytest.raises(ValueError, match="grammar_mask_budget_ms"):
            EngineConfig(model="m", grammar_mask_budget_ms=bad)
    with pytest.raises(ValueError, match="strict_json_schema"):
        EngineConfig(model="m", strict_json_schema=1)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kw = engine_kwargs(parser.parse_args(["--no-strict-json-schema", "--grammar-mask-budget-ms", "7.5"]))
    assert kw == {"strict_json_schema": False, "grammar_mask_budget_ms": 7.5}
    assert EngineConfig(model="m").strict_json_schema is True


@pytest.mark.parametrize("strict", [None, True, False])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_tools_strict_decides_its_own_schema(llm, strict, choice):
    """tools[i].function.strict under a required or named tool_choice: false compiles that tool's parameters
    open (JSON Schema's rule, an unnamed argument fits), true or absent closed (the engine's strict default);
    a strict that is no boolean is a 400 naming it; a response_format json_schema's strict works the same."""
    from minivllm.entrypoints.openai.field_policy import RequestError
    from minivllm.entrypoints.openai.structured import structured_outputs_params
    from minivllm.entrypoints.openai.tool_calls import tool_plan

    function = {"name": "f", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    if strict is not None:
        function["strict"] = strict
    tool_so = tool_plan([{"type": "function", "function": function}], choice, True).constraint()
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": function["parameters"]}}
    if strict is not None:
        fmt["json_schema"]["strict"] = strict
    text = '{"unit":"c"}' if isinstance(choice, dict) else '[{"name":"f","parameters":{"unit":"c"}}]'
    for so, written in ((tool_so, text), (structured_outputs_params(fmt, None), '{"unit":"c"}')):
        m = llm.llm_engine.input_processor.grammars.matcher(so)
        tokens = llm.get_tokenizer().encode(written, add_special_tokens=False)
        taken = 0
        while taken < len(tokens) and m.accept(tokens[taken]):
            taken += 1
        assert (taken == len(tokens)) is (strict is False), (so, written, taken)
    for bad, param in (({**function, "strict": "no"}, "tools[0].function.strict"),):
        with pytest.raises(RequestError) as e:
            tool_plan([{"type": "function", "function": bad}], choice, True)
        assert e.value.param == param
    with pytest.raises(RequestError) as e:
        structured_outputs_params({"type": "json_schema", "json_schema": {**fmt["json_schema"], "strict": 1}}, None)
    assert e.value.param == "response_format.json_schema.strict"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_tool_parameters_with_refs_compile_under_required_and_named(llm, choice):
    """pydantic writes nested models as `$defs` + `#/$defs/Loc`. Under "required" each tool's parameters sit at
    items.anyOf[i].properties.parameters, where `#/$defs/Loc` resolved against the array (a 400: "Pointer
    '/$defs/Loc' does not exist") and `#` meant the array; they are hoisted into the root's $defs."""
    from minivllm.entrypoints.openai.tool_calls import tool_plan

    weather = {"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                                  "near": {"$ref": "#/$defs/Loc"}},
                                 "required": ["city"]}},
               "type": "object", "properties": {"where": {"$ref": "#/$defs/Loc"}, "same": {"$ref": "#"}},
               "required": ["where"]}
    other = {"definitions": {"Loc": {"type": "integer"}}, "type": "object",
             "properties": {"n": {"$ref": "#/definitions/Loc"}}, "required": ["n"]}
    tools = [{"type": "function", "function": {"name": name, "parameters": p}}
             for name, p in (("weather", weather), ("other", other))]
    plan = tool_plan(tools, choice, True)
    args = '{"where":{"city":"Rome","near":{"city":"Ostia"}},"same":{"where":{"city":"Bari"}}}'
    text = args if isinstance(choice, dict) else f'[{{"name":"weather","parameters":{args}}},' \
                                                 '{"name":"other","parameters":{"n":3}}]'
    m = llm.llm_engine.input_processor.grammars.matcher(plan.constraint())
    tokens = llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert all(m.accept(t) for t in tokens) and m.is_complete
    m = llm.llm_engine.input_processor.grammars.matcher(plan.constraint())  # strict: no unnamed key in Loc
    bad = llm.get_tokenizer().encode(text.replace('"city":"Rome"', '"city":"Rome","x":1'), add_special_tokens=False)
    assert not all(m.accept(t) for t in bad)
    if not isinstance(choice, dict):
        assert [c["function"]["name"] for c in plan.calls(text)[1]] == ["weather", "other"]
