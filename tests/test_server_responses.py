"""POST /v1/responses with the official `openai` client (`client.responses.create`), streamed and not, on tiny
models: text and message-list input, instructions, max_output_tokens (status "incomplete"), previous_response_id
(the conversation kept, bounded, evicted oldest first, store: false), function calls as output items (auto, forced
by a regex; named, constrained) and their results sent back, text.format, reasoning items with the reasoning
parser, the Responses event types; the fields refused by name; a "required" tool on the default model."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from reasoning_helpers import make_thinking_qwen3
from server_helpers import serving
from test_server_reasoning import served as served_with
from test_server_tools import HERMES_TEMPLATE, TIME, WEATHER, assert_idle, served

from minivllm.entrypoints.openai.server import build_app

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}</tool_call>'
FORCE_CALL = {"structured_outputs": {"regex": "Checking\\. " + CALL.replace("{", "\\{").replace("}", "\\}")}}


@pytest.fixture(scope="module")
def tiny(qwen3_dir):
    """A tiny Qwen3 with a hermes-style template, served; (client, url, engine)."""
    engine = served(qwen3_dir, HERMES_TEMPLATE)
    try:
        with serving(build_app(engine, "tiny", max_stored_responses=2)) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), url, engine
    finally:
        engine.shutdown()


def prompt_tokens(url: str, messages: list[dict], **fields) -> int:
    """How many tokens the chat template makes of `messages` (/tokenize, as a chat request renders them)."""
    r = httpx.post(f"{url}/tokenize", json={"messages": messages, **fields})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_text_input_whole_and_streamed(tiny):
    client, url, engine = tiny
    ask = dict(model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=6, temperature=0.0)
    r = client.responses.create(**ask)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.instructions == "Be brief."
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "incomplete" and r.output_text == item.content[0].text and item.content[0].text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert r.usage.input_tokens == prompt_tokens(url, messages) and r.usage.output_tokens == 6
    assert r.usage.total_tokens == r.usage.input_tokens + 6 and r.usage.output_tokens_details.reasoning_tokens == 0

    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text == events[-4].text  # greedy: the same text as the whole answer
    assert events[-1].response.output_text == streamed and events[-1].response.usage.output_tokens == 6
    assert_idle(engine)


def test_previous_response_id_keeps_the_conversation_bounded(tiny):
    client, url, _ = tiny
    first = client.responses.create(model="tiny", input="Hi", instructions="Be brief.", max_output_tokens=4)
    turn = [{"role": "user", "content": [{"type": "input_text", "text": "And?"}]}]
    second = client.responses.create(model="tiny", input=turn, previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id
    # the earlier input and output, then the new turn; the earlier instructions are not carried over
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And?"}]
    assert second.usage.input_tokens == prompt_tokens(url, conversation)

    third = client.responses.create(model="tiny", input="Go on", previous_response_id=second.id, max_output_tokens=2)
    assert third.usage.input_tokens > second.usage.input_tokens
    # the server keeps 2 (max_stored_responses): the first is evicted; store: false keeps none
    for gone in (first.id, client.responses.create(model="tiny", input="x", max_output_tokens=1, store=False).id):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model="tiny", input="more", previous_response_id=gone, max_output_tokens=1)
        assert e.value.body["param"] == "previous_response_id" and gone in e.value.body["message"]


def test_function_calls_are_output_items_and_their_results_go_back(tiny):
    client, url, engine = tiny
    r = client.responses.create(model="tiny", input="weather in Rome?", tools=[TOOL], max_output_tokens=150,
                                extra_body=FORCE_CALL)
    message, call = r.output
    assert r.status == "completed" and message.type == "message" and r.output_text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Rome", "unit": "F"}
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"

    events = list(client.responses.create(model="tiny", input="weather in Rome?", tools=[TOOL],
                                          max_output_tokens=150, extra_body=FORCE_CALL, stream=True))
    kinds = [e.type for e in events]
    at = kinds.index("response.function_call_arguments.delta")
    assert kinds[at - 1] == "response.output_item.added" and events[at - 1].item.type == "function_call"
    assert kinds[at + 1:] == ["response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"]
    assert json.loads(events[at].delta) == {"city": "Rome", "unit": "F"} == json.loads(events[at + 1].arguments)
    assert [o.type for o in events[-1].response.output] == ["message", "function_call"]

    # the call and its result sent back as input items: rendered as the assistant's call and a "tool" turn
    follow = [{"role": "user", "content": "weather in Rome?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 75F"}]
    r = client.responses.create(model="tiny", input=follow, tools=[TOOL], max_output_tokens=2)
    chat = [{"role": "user", "content": "weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                   "function": {"name": call.name,
                                                                                "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 75F"}]
    assert r.usage.input_tokens == prompt_tokens(url, chat, tools=[WEATHER])

    named = {"type": "function", **TIME["function"]}
    r = client.responses.create(model="tiny", input="time?", tools=[named], max_output_tokens=60,
                                tool_choice={"type": "function", "name": "get_time"}, temperature=0.0)
    (call,) = r.output  # greedy: the grammar ends the arguments well before max_output_tokens
    assert r.status == "completed" and call.type == "function_call" and call.name == "get_time"
    assert isinstance(json.loads(call.arguments)["zone"], str)
    assert_idle(engine)


def test_text_format_is_the_chats_grammar(tiny):
    client, _, _ = tiny
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="a?", max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    assert r.status == "completed" and json.loads(r.output_text)["a"] in ("x", "y")
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("body, param", [
    ({"background": True}, "background"), ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"), ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"max_tool_calls": 1}, "max_tool_calls"), ({"n": 2}, "n"),
    ({"frobnicate": 1}, "frobnicate"), ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"), ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]"), ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"max_output_tokens": 5000}, "max_output_tokens"), ({"seed": "1"}, "seed"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "y", "bogus": 1}]}, "input[0].bogus"),
    ({"input": [{"type": "reasoning", "summary": 5}]}, "input[0].summary"),
])
def test_what_is_not_implemented_is_refused_by_name(tiny, body, param):
    _, url, _ = tiny
    r = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and "max_tokens" not in error["message"], error


def test_reasoning_output_items_with_the_reasoning_parser(tmp_path):
    path, _, end = make_thinking_qwen3(tmp_path / "thinking")
    engine = served_with(path, reasoning_parser="deepseek_r1")  # R1: the output starts inside the reasoning
    ask = dict(model="tiny", input="a number?", max_output_tokens=60, temperature=1.0)
    extra = {"logit_bias": {str(end): 4}, "structured_outputs": {"regex": "[0-9]{1,4}"}}  # the answer: digits
    try:
        with serving(build_app(engine, "tiny")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for seed in range(8):  # a seed whose reasoning is not empty
                r = client.responses.create(**ask, extra_body={**extra, "seed": seed})
                if r.output[0].type == "reasoning" and r.output[0].content[0].text:
                    break
            thought, message = r.output
            assert thought.id.startswith("rs_") and thought.summary == [] and r.status == "completed"
            assert re.fullmatch("[0-9]{1,4}", r.output_text) and message.type == "message"
            assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens

            events = list(client.responses.create(**ask, stream=True, extra_body={**extra, "seed": seed}))
            kinds = [e.type for e in events]
            assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
            assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
            reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
            assert reasoning == thought.content[0].text  # the same seed: the same output
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text

            hidden = client.responses.create(**ask, extra_body={**extra, "seed": seed, "include_reasoning": False})
            assert [o.type for o in hidden.output] == ["message"] and hidden.output_text == r.output_text
            assert_idle(engine)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_a_required_tool_on_the_default_model():
    from minivllm.default_model import default_model_dir

    engine = served(str(default_model_dir()))
    try:
        with serving(build_app(engine, "smol")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            tools = [TOOL, {"type": "function", **TIME["function"]}]
            r = client.responses.create(model="smol", input="What is the weather in Paris?", tools=tools,
                                        tool_choice="required", max_output_tokens=120, temperature=0.0)
            calls = [o for o in r.output if o.type == "function_call"]
            assert r.status == "completed" and calls and all(c.name in ("get_weather", "get_time") for c in calls)
            for c in calls:
                json.loads(c.arguments)
            events = list(client.responses.create(model="smol", input="What is the weather in Paris?", tools=tools,
                                                  tool_choice="required", max_output_tokens=120, temperature=0.0,
                                                  stream=True))
            done = events[-1].response
            assert done.status == "completed" and [o.name for o in done.output] == [c.name for c in calls]
            assert_idle(engine)
    finally:
        engine.shutdown()


def test_output_items_sent_back_make_one_assistant_turn():
    from minivllm.entrypoints.openai.responses_protocol import ResponsesRequest

    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        call, {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "1"}]}]})
    user, turn, result = req.conversation()
    assert user == {"role": "user", "content": "q"} and result == {"role": "tool", "tool_call_id": "call_1",
                                                                   "content": "1"}
    assert turn == {"role": "assistant", "content": "Sure.", "reasoning_content": "hm", "tool_calls": [
        {"id": f"call_{k}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for k in (1, 2)]}


def test_a_request_id_never_replaces_a_stored_response(tiny):
    """vLLM's request_id names the response ("resp_<id>"): one already stored, or the request's own
    previous_response_id, would make two responses share an id (the second overwriting the first's conversation)."""
    _, url, _ = tiny
    ask = {"input": "hi", "max_output_tokens": 1}
    assert httpx.post(f"{url}/v1/responses", json={**ask, "request_id": "dup"}).status_code == 200
    for body in ({"request_id": "dup"}, {"request_id": "loop", "previous_response_id": "resp_loop"}):
        r = httpx.post(f"{url}/v1/responses", json={**ask, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text


def test_a_tool_error_shows_this_endpoint_s_flat_tool_shape(tiny):
    _, url, _ = tiny
    named = {"tools": [TOOL], "tool_choice": {"type": "function", "name": "x"}}
    for body in ({"tools": [{"type": "function"}]}, named):
        r = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 2, **body})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and '"function": {' not in message, r.text
        assert '{"type": "function", "name": ...' in message, r.text

