"""Tool calling: the hermes parser and the streamed hold-back on fixed strings; through the server with the
official `openai` client, "auto" on a tiny Qwen3 with a hermes-style template (its output forced into a
call by a regex, since a random model cannot be relied on to choose), "required" and a named function on
the default model, tool turns rendered, the engine idle afterwards."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from server_helpers import events, serving

from minivllm import LLMEngine
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.server import build_app
from minivllm.entrypoints.openai.tool_calls import ToolCallStream, ToolMode, parse_hermes, tool_plan
from minivllm.entrypoints.openai.tool_prompt import with_tools_in_system

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
    "additionalProperties": False}}}
HERMES_TEMPLATE = (  # a hermes-style template of our own: tools in the system turn, calls as <tool_call> blocks
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# --- fixed strings -----------------------------------------------------------------------------------------

def test_hermes_parser_takes_well_formed_calls_out_of_the_text():
    text = ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'
            '\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call> <tool_call>{oops}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me look. \n <tool_call>{oops}</tool_call>"  # a block that is no call stays text
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_hermes("no calls here") == ("no calls here", [])


def test_a_block_nested_too_deeply_for_json_stays_text():
    """json.loads raises RecursionError (not JSONDecodeError) on '[' * 3000: it escaped parse_hermes as a 500
    under tool_choice "auto", streamed (ToolCallStream.finish) or not."""
    text = "<tool_call>" + "[" * 3000 + "</tool_call>"
    assert parse_hermes(text) == (text, [])
    stream = ToolCallStream(tool_plan([TIME], "auto", True))
    sent = stream.content(text)
    assert stream.finish("stop") == (text[len(sent):], [], "stop")


@pytest.mark.parametrize("cut", [1, 3, 7, 11])
def test_a_stream_never_sends_a_piece_of_a_call(cut):
    text = 'Sure.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    stream, sent = ToolCallStream(tool_plan([TIME], "auto", True)), ""
    for i in range(0, len(text), cut):
        sent += stream.content(text[i:i + cut])
        assert "<" not in sent
    rest, calls, finish = stream.finish("stop")
    assert sent + rest == "Sure." and finish == "tool_calls" and calls[0]["function"]["name"] == "get_time"
    plain = ToolCallStream(tool_plan([TIME], "auto", True))
    assert plain.content("a <tool") == "a " and plain.finish("length") == ("<tool", [], "length")


def test_tool_choice_is_checked_and_constrains_decoding():
    assert tool_plan(None, None, True).mode is ToolMode.NONE and tool_plan([TIME], None, True).mode is ToolMode.AUTO
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True)
    assert named.constraint().json == TIME["function"]["parameters"]
    required = tool_plan([WEATHER, TIME], "required", False).constraint().json
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    for tools, choice, param in (([], "required", "tool_choice"), ([TIME], {"type": "function", "function":
                                 {"name": "nope"}}, "tool_choice"), ([{"type": "function"}], "auto", "tools[0]"),
                                 ([TIME], "sometimes", "tool_choice"), ([TIME, TIME], "auto", "tools")):
        with pytest.raises(ValueError) as e:
            tool_plan(tools, choice, True)
        assert e.value.param == param


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_constrained_output_cut_short_is_its_text_not_a_call(choice):
    """Cut by a stop string or stop token, or ended inside <think> (nothing after it): no call, and no
    exception; the text stays content, whole and streamed, with the finish_reason it had."""
    plan = tool_plan([WEATHER, TIME], choice, True)
    for text in ('{"city": "Par', '[{"name": "get_weather", "parameters": {"city"', "", "  ", "[", "{}x", "[" * 10**5):
        assert plan.calls(text) == (text or None, [])
        stream = ToolCallStream(plan)
        assert stream.content(text) == "" and stream.finish("stop") == (text, [], "stop")
    whole = '{"city": "Rome", "unit": "F"}' if isinstance(choice, dict) else \
        '[{"name": "get_weather", "parameters": {"city": "Rome", "unit": "F"}}]'
    content, (call,) = plan.calls(whole)
    assert content is None and json.loads(call["function"]["arguments"]) == {"city": "Rome", "unit": "F"}
    # a whole value is a call, whatever JSON its schema allows (a tool's parameters need not be an object)
    plain = {"type": "function", "function": {"name": "echo", "parameters": {"type": "string"}}}
    whole = '"hi"' if isinstance(choice, dict) else '[{"name": "echo", "parameters": "hi"}]'
    _, (call,) = tool_plan([plain], {"type": "function", "function": {"name": "echo"}} if isinstance(choice, dict)
                           else choice, True).calls(whole)
    assert call["function"] == {"name": "echo", "arguments": '"hi"'}


def test_a_template_without_tools_gets_them_as_a_system_message():
    conv = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "1"}]
    out = with_tools_in_system(conv, [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools\n") and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    assert out[3] == conv[2] and "tool_calls" not in out[2]


# --- through the server --------------------------------------------------------------------------------------

# The tiny models' template ignores tools (they would reach it as a ~470-token system message, past the tiny
# max_model_len); this one names them, so that a constrained call fits.
SHORT_TEMPLATE = ("{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant: {% endif %}")


def served(model: str, template: str | None = None):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model, max_model_len=512, num_kv_blocks=96)))
    if template is not None:
        engine.engine.tokenizer.chat_template = template
    return engine


def assert_idle(engine: AsyncLLMEngine) -> None:
    deadline = time.time() + 10
    while engine.engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    stats = engine.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not engine.engine.has_unfinished_requests()


def test_auto_parses_hermes_calls_on_a_tiny_qwen3(qwen3_dir):
    engine = served(qwen3_dir, HERMES_TEMPLATE)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}</tool_call>'
    force = {"structured_outputs": {"regex": "Checking\\. " + call.replace("{", "\\{").replace("}", "\\}")}}
    messages = [{"role": "user", "content": "weather in Rome?"}]
    try:
        with serving(build_app(engine, "tiny")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=150,
                                               extra_body={**force, "return_token_ids": True})
            (choice,) = r.choices
            assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
            (tc,) = choice.message.tool_calls
            assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Rome", "unit": "F"}
            prompt = engine.engine.tokenizer.decode(r.prompt_token_ids)
            assert "Tools:" in prompt and '"get_weather"' in prompt  # the template rendered the tools itself
            stream = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=150,
                                                    extra_body=force, stream=True)
            content, calls, finish = "", {}, None
            for chunk in stream:
                for c in chunk.choices:
                    content += c.delta.content or ""
                    for d in c.delta.tool_calls or []:
                        calls.setdefault(d.index, [d.id, d.function.name, ""])[2] += d.function.arguments or ""
                    finish = c.finish_reason or finish
            assert content.strip() == "Checking." and finish == "tool_calls"  # streamed: the space before the call too
            assert calls[0][0].startswith("chatcmpl-tool-") and calls[0][1] == "get_weather"
            assert json.loads(calls[0][2]) == {"city": "Rome", "unit": "F"}
            # the follow-up turn: the call (content null) and its result (role "tool") render
            turns = messages + [{"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
                                {"role": "tool", "tool_call_id": tc.id, "content": "sunny, 75F"}]
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": turns, "tools": [WEATHER],
                                                               "max_tokens": 3, "return_token_ids": True})
            assert r.status_code == 200, r.text
            prompt = engine.engine.tokenizer.decode(r.json()["prompt_token_ids"])
            assert "<|im_start|>tool\nsunny, 75F" in prompt and '"name": "get_weather"' in prompt
            assert_idle(engine)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_required_and_named_calls_on_the_default_model():
    from minivllm.default_model import default_model_dir

    engine = served(str(default_model_dir()))
    messages = [{"role": "system", "content": "You help with the weather."},
                {"role": "user", "content": "What is the weather in Paris, and what time is it in Rome?"}]
    try:
        with serving(build_app(engine, "smol")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for seed in (0, 1):
                r = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER, TIME], seed=seed,
                                                   tool_choice="required", max_tokens=120, n=2, temperature=0.8)
                for choice in r.choices:
                    assert choice.finish_reason in ("tool_calls", "length")
                    for tc in choice.message.tool_calls or []:
                        tool = {"get_weather": WEATHER, "get_time": TIME}[tc.function.name]
                        jsonschema.validate(json.loads(tc.function.arguments), tool["function"]["parameters"])
                assert any(c.finish_reason == "tool_calls" for c in r.choices)
            named = {"type": "function", "function": {"name": "get_weather"}}
            r = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER, TIME],
                                               tool_choice=named, max_tokens=40)
            (choice,) = r.choices
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (tc,) = choice.message.tool_calls
            assert tc.function.name == "get_weather"
            jsonschema.validate(json.loads(tc.function.arguments), WEATHER["function"]["parameters"])
            stream = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER, TIME],
                                                    tool_choice=named, max_tokens=40, stream=True)
            args = "".join(d.function.arguments or "" for chunk in stream for c in chunk.choices
                           for d in c.delta.tool_calls or [])
            jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
            # An ordinary schema, as clients write them (no additionalProperties): strict by default, as in vLLM,
            # so the model cannot wander into keys it copies from the schema ("maxLength") until max_tokens.
            ordinary = {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}}}
            for choice_ in ("required", named):
                r = client.chat.completions.create(model="smol", messages=messages, tools=[ordinary],
                                                   tool_choice=choice_, max_tokens=60)
                (choice,) = r.choices
                assert choice.finish_reason == "tool_calls", choice
                (tc,) = choice.message.tool_calls
                arguments = json.loads(tc.function.arguments)
                jsonschema.validate(arguments, ordinary["function"]["parameters"])
                assert set(arguments) == {"city", "unit"}  # no key the schema does not name
            # the default model's template ignores tools: they reach it as a system message
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "tools": [WEATHER],
                                                               "tool_choice": "none", "max_tokens": 2,
                                                               "return_token_ids": True})
            prompt = engine.engine.tokenizer.decode(r.json()["prompt_token_ids"])
            assert prompt.startswith("<|im_start|>system\n# Tools\n") and "You help with the weather." in prompt
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "tools": [WEATHER],
                                                               "tool_choice": named, "max_tokens": 4,
                                                               "response_format": {"type": "json_object"}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
            assert_idle(engine)
    finally:
        engine.shutdown()


def whole_and_streamed(url: str, body: dict) -> tuple[dict, tuple[str, list, list]]:
    """One choice asked whole, then streamed: the choice, and the stream's (content, tool_calls deltas,
    finish_reasons); a stream that ends in an error event fails here."""
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        got = events(s)
    assert got[-1] == "[DONE]" and not any("error" in e for e in got[:-1]), got[-3:]
    deltas = [e["choices"][0] for e in got[:-1] if e["choices"]]
    return choice, ("".join(d["delta"].get("content") or "" for d in deltas),
                    [d["delta"]["tool_calls"] for d in deltas if d["delta"].get("tool_calls")],
                    [d["finish_reason"] for d in deltas if d["finish_reason"]])


@pytest.mark.parametrize("cause", ["stop", "stop_token_ids", "max_tokens"])
def test_a_constrained_call_cut_short_answers_its_text_and_finish_reason(qwen3_dir, cause):
    """tool_choice named or "required", cut by the client's stop string, its stop token, or max_tokens: a
    200 with the text as content and the finish_reason that ended it, never a 500 (vLLM's answer)."""
    engine = served(qwen3_dir, SHORT_TEMPLATE)
    tok = engine.engine.tokenizer
    try:
        with serving(build_app(engine, "tiny")) as url:
            for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
                ask = {"messages": [{"role": "user", "content": "weather in Rome?"}], "tools": [WEATHER, TIME],
                       "tool_choice": choice, "temperature": 0, "max_tokens": 120, "return_token_ids": True}
                r = httpx.post(f"{url}/v1/chat/completions", json=ask, timeout=60)
                (uncut,) = r.json()["choices"]  # greedy: the same tokens again, until the cut
                assert uncut["finish_reason"] == "tool_calls", uncut
                text = tok.decode(uncut["token_ids"], skip_special_tokens=True)
                cut, finish = {"stop": ({"stop": [":"]}, "stop"),  # the first key's ':'
                               "stop_token_ids": ({"stop_token_ids": [uncut["token_ids"][2]]}, "stop"),
                               "max_tokens": ({"max_tokens": 3}, "length")}[cause]
                got, (streamed, calls, finishes) = whole_and_streamed(url, {**ask, **cut})
                content = got["message"]["content"]
                assert got["finish_reason"] == finish and "tool_calls" not in got["message"], got
                assert content and text.startswith(content) and len(content) < len(text), (content, text)
                assert streamed == content and calls == [] and finishes == [finish]
            assert_idle(engine)
    finally:
        engine.shutdown()


def test_min_tokens_past_the_grammars_end_answers_the_whole_output(qwen3_dir):
    """min_tokens longer than the constrained output (a named or "required" call, a structured_outputs choice):
    the grammar's end wins, whole and streamed, the same answer as without min_tokens; never a mid-flight
    500 (docs/concepts/structured-outputs.md)."""
    engine = served(qwen3_dir, SHORT_TEMPLATE)
    ask = {"messages": [{"role": "user", "content": "weather in Rome?"}], "temperature": 0, "max_tokens": 120,
           "return_token_ids": True}
    try:
        with serving(build_app(engine, "tiny")) as url:
            for extra in ({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                   "function": {"name": "get_weather"}}},
                          {"tools": [WEATHER, TIME], "tool_choice": "required"},
                          {"structured_outputs": {"choice": ["yes"]}}):
                body = {**ask, **extra}
                r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
                (plain,) = r.json()["choices"]
                assert plain["finish_reason"] in ("tool_calls", "stop"), plain
                held = {**body, "min_tokens": len(plain["token_ids"]) + 5}
                got, (streamed, calls, finishes) = whole_and_streamed(url, held)
                assert got["finish_reason"] == plain["finish_reason"] and finishes == [plain["finish_reason"]]
                assert got["token_ids"] == plain["token_ids"]
                assert got["message"].get("content") == plain["message"].get("content")
                assert [c["function"] for c in got["message"].get("tool_calls") or []] == \
                    [c["function"] for c in plain["message"].get("tool_calls") or []]
                assert streamed == (plain["message"]["content"] or "") and bool(calls) == bool(
                    plain["message"].get("tool_calls"))
            assert_idle(engine)
    finally:
        engine.shutdown()
