"""`--reasoning-parser qwen3` through the server with the official `openai` client, on a tiny thinking Qwen3
(tests/reasoning_helpers.py): reasoning_content (and vLLM's `reasoning`) apart from the content, streamed
reasoning first; include_reasoning; structured outputs on the answer only; max_tokens inside the reasoning;
Qwen3's enable_thinking=False; a server without a parser refusing include_reasoning: false."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from reasoning_helpers import make_thinking_qwen3
from server_helpers import serving
from test_server_tools import assert_idle, whole_and_streamed

from minivllm import LLMEngine
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.server import build_app

# The assistant's turn opened with "<think>" (continue_final_message): the output starts inside the reasoning.
OPENED = [{"role": "user", "content": "a number?"}, {"role": "assistant", "content": "<think>I count"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
DIGITS = {"structured_outputs": {"regex": "[0-9]{1,4}"}}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    return make_thinking_qwen3(tmp_path_factory.mktemp("thinking_qwen3_server"))


def served(path: str, **options) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(EngineConfig(model=path, max_model_len=512, num_kv_blocks=96, **options)))


def extra(message_or_delta, name: str):
    return (message_or_delta.model_extra or {}).get(name)


def test_reasoning_apart_from_the_content_whole_and_streamed(thinking):
    path, _, end = thinking
    engine = served(path, reasoning_parser="qwen3")
    tok = engine.engine.tokenizer
    ask = dict(model="tiny", messages=OPENED, max_tokens=60, temperature=1.0, logit_bias={str(end): 4})
    try:
        with serving(build_app(engine, "tiny")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for seed in range(8):  # a seed whose reasoning is not empty (the push on </think> may end it at once)
                ask["seed"] = seed
                r = client.chat.completions.create(**ask, extra_body={**CONTINUE, **DIGITS, "return_token_ids": True})
                (choice,) = r.choices
                if extra(choice.message, "reasoning_content"):
                    break
            reasoning, content = extra(choice.message, "reasoning_content"), choice.message.content
            assert choice.finish_reason == "stop" and re.fullmatch("[0-9]{1,4}", content), choice
            assert reasoning and extra(choice.message, "reasoning") == reasoning
            assert tok.decode(extra(choice, "token_ids"), skip_special_tokens=True) == reasoning + "</think>" + content  # nothing lost

            chunks = list(client.chat.completions.create(**ask, stream=True, extra_body={**CONTINUE, **DIGITS}))
            kinds = [("r" if extra(c.choices[0].delta, "reasoning_content") else "") +
                     ("c" if c.choices[0].delta.content else "") for c in chunks if c.choices]
            kinds = "".join(k for k in kinds if k)
            assert re.fullmatch("r+(rc)?c*", kinds), kinds  # the reasoning first, then the content
            streamed = "".join(extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks if c.choices)
            assert streamed == reasoning
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content

            r = client.chat.completions.create(**ask, extra_body={**CONTINUE, **DIGITS, "include_reasoning": False})
            message = r.choices[0].message
            assert message.content == content and extra(message, "reasoning_content") is None
            assert "reasoning_content" not in message.model_dump(exclude_unset=True)

            schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
            r = client.chat.completions.create(**{**ask, "max_tokens": 100}, extra_body=CONTINUE, response_format={
                "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
            if r.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(r.choices[0].message.content)["n"], int)

            cut = client.chat.completions.create(**{**ask, "max_tokens": 3, "logit_bias": {str(end): -100}},
                                                 extra_body={**CONTINUE, **DIGITS})
            message = cut.choices[0].message
            assert cut.choices[0].finish_reason == "length" and message.content is None
            assert extra(message, "reasoning_content")

            call, tool = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', {"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
            force = {"regex": call.replace("{", "\\{").replace("}", "\\}")}  # the answer after </think> is a call
            r = client.chat.completions.create(**{**ask, "max_tokens": 120}, tools=[tool], extra_body={
                **CONTINUE, "structured_outputs": force})
            (choice,) = r.choices  # the calls are parsed from the content, never from the reasoning
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "f"
            assert extra(choice.message, "reasoning_content") is not None and not choice.message.content

            off = client.chat.completions.create(model="tiny", messages=OPENED[:1], max_tokens=8, temperature=1.0,
                                                 seed=0, extra_body={**DIGITS, "chat_template_kwargs":
                                                                     {"enable_thinking": False}})
            message = off.choices[0].message  # the template closed the reasoning: the grammar from the first token
            assert extra(message, "reasoning_content") is None and re.fullmatch("[0-9]{1,4}", message.content)
            assert_idle(engine)
    finally:
        engine.shutdown()


def test_a_constrained_call_that_ends_inside_the_reasoning_answers_the_reasoning(thinking):
    """tool_choice named or "required" constrains the answer after </think>; an output that ends before it
    (a stop token, max_tokens) has no call to parse: a 200 with the reasoning, no content, its finish_reason."""
    path, start, end = thinking
    engine = served(path, reasoning_parser="qwen3")
    stop = next(i for i in range(100, 200) if i not in (start, end, *engine.engine.eos_token_ids))
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    try:
        with serving(build_app(engine, "tiny")) as url:
            for choice in ({"type": "function", "function": {"name": "f"}}, "required"):
                # min_tokens holds the stop token back for 3 tokens of reasoning; then its bias picks it at once
                for cut, finish in (({"stop_token_ids": [stop], "min_tokens": 3, "max_tokens": 40}, "stop"),
                                    ({"max_tokens": 3}, "length")):
                    ask = {"model": "tiny", "messages": OPENED, "tools": [tool], "tool_choice": choice,
                           "logit_bias": {str(end): -100, str(stop): 30}, **CONTINUE, **cut}
                    got, (content, calls, finishes) = whole_and_streamed(url, ask)
                    assert got["finish_reason"] == finish and "tool_calls" not in got["message"], got
                    assert got["message"]["content"] is None and got["message"]["reasoning_content"]
                    assert content == "" and calls == [] and finishes == [finish]
            assert_idle(engine)
    finally:
        engine.shutdown()


def test_without_a_parser_include_reasoning_false_is_refused(thinking):
    engine = served(thinking[0])
    try:
        with serving(build_app(engine, "tiny")) as url:
            body = {"messages": OPENED[:1], "max_tokens": 2}
            r = httpx.post(f"{url}/v1/chat/completions", json={**body, "include_reasoning": False})
            assert r.status_code == 400 and r.json()["error"]["param"] == "include_reasoning"
            assert "--reasoning-parser" in r.json()["error"]["message"]
            r = httpx.post(f"{url}/v1/chat/completions", json=body)
            assert r.status_code == 200 and "reasoning_content" not in r.json()["choices"][0]["message"]
    finally:
        engine.shutdown()
