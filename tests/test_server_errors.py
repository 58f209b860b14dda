"""How failures reach a client of the server: a failed request, a failed step, a dead engine, a client
that leaves, a wrong API key. The app runs in this process (uvicorn in a thread, on a real socket)
so that faults can be injected into its engine."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from server_helpers import events, serving
from test_server_tools import SHORT_TEMPLATE

from minivllm import LLMEngine
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.request.errors import EngineDeadError
from minivllm.entrypoints.openai.server import build_app

CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "temperature": 0}


@pytest.fixture()
def engine(qwen3_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=64, max_model_len=256)))
    yield engine
    engine.shutdown()


@pytest.fixture()
def url(engine):
    with serving(build_app(engine, "tiny")) as url:
        yield url


def fail_rows(engine, marker: str, message: str) -> None:
    """Make the engine isolate every request whose prompt holds `marker`, after its first token, the
    way LLMEngine reports a request that failed on its own (finish_reason "error")."""
    step = engine.engine.step

    def isolating_step():
        outputs = step()
        for out in outputs:
            if marker in (out.prompt or "") and out.outputs[0].token_ids and not out.finished:
                engine.engine.abort_request(out.request_id, report=False)
                out.finished, out.error, out.outputs[0].finish_reason = True, message, "error"
        return outputs

    engine.engine.step = isolating_step


def test_a_failed_request_is_an_error_not_a_stop(engine, url):
    fail_rows(engine, "poison", "the sampler produced NaN logits for this request")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "poison", "max_tokens": 8}, timeout=30)
    assert r.status_code == 500 and "NaN logits" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "server_error"
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30,
                      json={**CHAT, "messages": [{"role": "user", "content": "poison"}], "stream": True}) as r:
        got = events(r)
    assert got[-1] == "[DONE]" and "NaN logits" in got[-2]["error"]["message"]
    assert all(c["choices"][0]["finish_reason"] is None for c in got[:-2])  # no silent "stop"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="NaN logits"):
        list(client.completions.create(model="tiny", prompt="poison", max_tokens=8, stream=True))
    # ... and it failed only itself: a request beside it is untouched.
    ok = client.completions.create(model="tiny", prompt="healthy", max_tokens=4)
    assert ok.choices[0].finish_reason == "length"


def test_more_completions_than_max_num_seqs_is_a_400_naming_n(engine, url):
    """n = 20,000 once held every other request for half a minute and grew memory until the worker died."""
    for n in (129, 20_000, 10 ** 9):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": n}, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "n", r.text
        assert f"n={n}" in error["message"] and "max_num_seqs=128" in error["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 3}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3


def test_lists_past_their_bounds_and_max_tokens_past_the_context_are_400s_naming_the_field(engine, url):
    for body, param, needle in [
        ({"stop": [f"s{i}" for i in range(257)]}, "stop", "at most 256 strings"),
        ({"bad_words": ["w"] * 4097}, "bad_words", "at most 4096"),
        ({"max_tokens": 250}, "max_tokens", "maximum context length is 256 tokens"),  # vLLM's answer, not "length"
        ({"prompt": "z" * 400_000}, "prompt", "bytes; no token of this model is longer than"),  # never tokenized
    ]:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello there, how are you", **body}, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and needle in error["message"], r.text
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "stop": ["s"] * 256}, timeout=30)
    assert ok.status_code == 200


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def assert_400(url: str, body: dict, param: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_a_malformed_tool_choice_is_a_400_naming_the_part(url):
    """`"function": "f"` for `"function": {"name": "f"}` was an AttributeError, a 500."""
    for choice, param in [({"type": "function", "function": "f"}, "tool_choice.function"),
                          ({"type": "function", "function": ["f"]}, "tool_choice.function"),
                          ({"type": "function", "function": None}, "tool_choice.function"),
                          ({"type": "function", "function": {"name": "f", "strict": True}}, "tool_choice.function"),
                          ({"type": "function", "function": {"name": 7}}, "tool_choice.function.name"),
                          ({"type": "function", "function": {"name": "g"}}, "tool_choice"),  # no such tool
                          ({"function": {"name": "f"}}, "tool_choice"), ({"type": "function"}, "tool_choice"),
                          ({"type": "allowed_tools", "function": {"name": "f"}}, "tool_choice"), ({}, "tool_choice")]:
        assert_400(url, {"tools": [TOOL], "tool_choice": choice}, param)


def test_a_malformed_tool_call_in_the_history_is_a_400_naming_it(url):
    """An assistant turn's `tool_calls: [{}]`, or a call without function.name, was a KeyError (a 500) where
    the tools went into the system message; with a template of its own, whatever the template made of it."""
    good = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    at = "messages[1].tool_calls"
    for calls, param in [([{}], f"{at}[0]"), ([None], f"{at}[0]"), ("f", at), ({"function": {}}, at),
                         ([good, {"function": "f"}], f"{at}[1]"),
                         ([{"function": {"arguments": "{}"}}], f"{at}[0].function.name"),
                         ([{"function": {"name": "", "arguments": "{}"}}], f"{at}[0].function.name"),
                         ([{"function": {"name": "f"}}], f"{at}[0].function.arguments"),
                         ([{"function": {"name": "f", "arguments": {"x": 1}}}], f"{at}[0].function.arguments"),
                         ([{**good, "type": "code"}], f"{at}[0].type"), ([{**good, "id": 5}], f"{at}[0].id")]:
        messages = [CHAT["messages"][0], {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "user", "content": "and?"}]
        for tools in ({"tools": [TOOL]}, {}):  # tools in the system message, or none (the template's own)
            assert_400(url, {"messages": messages, **tools}, param)


def test_a_tool_schema_that_cannot_constrain_the_call_is_a_400_naming_tools(engine, url):
    """Under a required or named tool_choice the grammar is the tools' parameters: an error names `tools`, not
    `structured_outputs`, a field the client never sent."""
    engine.engine.tokenizer.chat_template = SHORT_TEMPLATE  # a prompt that fits: the schema is at fault, alone
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "tools": [bad], "tool_choice": choice}, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "tools" and "type must be" in error["message"], r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "structured_outputs": {"json": {"type": 5}}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text


def test_a_response_format_schema_that_cannot_compile_is_a_400_naming_response_format(engine, url):
    """A schema sent as response_format names response_format.json_schema.schema (the field sent), in the
    error's param and its message; on completions as on chat."""
    engine.engine.tokenizer.chat_template = SHORT_TEMPLATE
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    for path, body in (("chat/completions", CHAT), ("completions", {"prompt": "hi", "max_tokens": 2})):
        r = httpx.post(f"{url}/v1/{path}", json={**body, "response_format": fmt}, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "response_format.json_schema.schema", r.text
        assert error["message"].startswith("response_format.json_schema.schema is invalid") and \
            "structured_outputs" not in error["message"], r.text


def test_a_length_penalty_whose_score_overflows_is_a_400(url):
    """Beams rank by cum_logprob / length ** length_penalty: 2 ** 1e308 overflowed and 2 ** -1e308 divided
    by zero mid-search (a 500). Siblings: a beam search's other numbers are named as the request names them."""
    beams = {"use_beam_search": True, "n": 2, "max_tokens": 3}
    for penalty in (1e308, -1e308, 300.0, -300.0):  # the bound for max_model_len=256 is +-41.5
        assert_400(url, {**beams, "length_penalty": penalty}, "length_penalty")
    assert_400(url, {**beams, "n": 0}, "n")
    assert_400(url, {**beams, "max_tokens": 0}, "max_tokens")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", **beams, "length_penalty": -1e308}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty", r.text
    for penalty in (0.0, 2.0, -40.0):  # within the bound: answered
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", **beams, "length_penalty": penalty}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_a_failed_step_answers_500_and_the_server_goes_on(engine, url):
    step, failures = engine.engine.step, [RuntimeError("two rows together overflowed")]

    def flaky_step():
        if failures:
            raise failures.pop()
        return step()

    engine.engine.step = flaky_step
    r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and "rolled back" in r.json()["error"]["message"], r.text
    assert "overflowed" in r.json()["error"]["message"]
    failures.append(RuntimeError("again"))
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r:
        got = events(r)
    assert got[-1] == "[DONE]" and "rolled back" in got[-2]["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=30).status_code == 200


@pytest.mark.parametrize("fault", ["step", "has_unfinished_requests"])
def test_a_dead_engine_fails_health_and_every_request(engine, url, fault):
    """step: LLMEngine raises EngineDeadError (device error). has_unfinished_requests: an exception
    escapes the worker loop and the thread dies."""
    armed = threading.Event()
    original = getattr(engine.engine, fault)

    def fatal(*args):
        if not armed.is_set():
            return original(*args)
        if fault == "step":
            raise EngineDeadError("CUDA error: an illegal memory access was encountered")
        raise RuntimeError("bug in the worker loop")

    setattr(engine.engine, fault, fatal)
    long = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            plain = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hello", **long}))
            async with client.stream("POST", "/v1/completions", json={"prompt": "Paged", "stream": True, **long}) as r:
                lines = r.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass  # the stream is running
                armed.set()
                rest = [line async for line in lines if line.startswith("data: ")]
            return await plain, rest

    plain, rest = asyncio.run(asyncio.wait_for(main(), timeout=30))
    needle = "illegal memory access" if fault == "step" else "RuntimeError: bug in the worker loop"
    assert plain.status_code == 503 and needle in plain.json()["error"]["message"], plain.text
    assert rest[-1] == "data: [DONE]" and needle in json.loads(rest[-2][len("data: "):])["error"]["message"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and needle in health.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def slow_steps(engine, seconds: float) -> None:
    step = engine.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.engine.step = slow_step


def wait_until_idle(engine, timeout: float = 120.0) -> bool:  # a bound only a hang reaches
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not engine.engine.has_unfinished_requests() and engine.stats.num_free_blocks == 64:
            return True
        time.sleep(0.05)
    return False


def test_a_client_that_times_out_is_aborted_with_one_log_line(engine, url, caplog):
    caplog.set_level(logging.INFO, logger="minivllm.server")
    slow_steps(engine, 0.02)  # 200 tokens would take over 4 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 200, "ignore_eos": True},
                   timeout=0.3)
    assert wait_until_idle(engine, timeout=120), "the request kept running after its client left"
    assert engine.stats.num_decode_tokens < 100  # stopped early: all 200 tokens would take over 4 s
    notes = [r.getMessage() for r in caplog.records if "client disconnected" in r.getMessage()]
    assert len(notes) == 1, notes
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a disconnect logged an error"


def test_a_client_that_leaves_while_queued_never_runs(engine, url):
    """The worker is busy in a long step when the request arrives: its add waits in the queue."""
    step, gate, in_step, seen = engine.engine.step, threading.Event(), threading.Event(), set()

    def gated_step():
        in_step.set()
        gate.wait(10)  # the first step lasts until the test opens the gate
        outputs = step()
        seen.update(o.request_id for o in outputs)
        return outputs

    engine.engine.step = gated_step
    busy = threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                            kwargs=dict(json={"prompt": "first", "max_tokens": 2}, timeout=30))
    busy.start()
    assert in_step.wait(10)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "queued", "max_tokens": 200, "ignore_eos": True},
                   timeout=0.3)
    time.sleep(0.8)  # the server polls for a disconnect every 0.5 s
    gate.set()
    busy.join()
    assert wait_until_idle(engine)
    assert len(seen) == 1, f"the queued request ran after its client left: {seen}"


def test_template_error_is_a_400(engine):
    engine.engine.tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with serving(build_app(engine, "tiny")) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages"


def test_api_key_guards_v1_only(engine):
    with serving(build_app(engine, "tiny", api_key="s3cret")) as url:
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="Hello", max_tokens=2).choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})  # no header at all
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/health", "/metrics", "/version"):  # probes and scrapers need no key
            assert httpx.get(f"{url}{path}").status_code == 200, path


def test_serve_flags_and_environment_reach_the_app(qwen3_dir, monkeypatch):
    """`minivllm serve --max-request-bytes N` and MINIVLLM_API_KEY, through run_server to the app."""
    from minivllm.entrypoints import cli

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_: apps.append(app))
    monkeypatch.setenv("MINIVLLM_API_KEY", "from-env")
    assert cli.main(["serve", "--model", qwen3_dir, "--max-request-bytes", "100", "--num-kv-blocks", "16"]) == 0
    with serving(apps[0]) as url:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        headers = {"Authorization": "Bearer from-env"}
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 200
        r = httpx.post(f"{url}/v1/completions", headers=headers, json={"prompt": "x" * 200})
        assert r.status_code == 413 and "100 bytes" in r.json()["error"]["message"]
    assert cli.main(["serve", "--model", qwen3_dir, "--max-request-bytes", "0"]) == 1  # refused, says why


def test_a_constraint_over_a_cap_names_the_field_it_came_from():
    """StructuredOutputsParams' own caps ("StructuredOutputsParams.json is N characters", too deep) raised
    under a required tool_choice used to name `messages`; they name `tools` (or the response_format's schema)
    as the other grammar errors do."""
    from minivllm.entrypoints.openai.errors import api_error
    from minivllm.entrypoints.openai.preprocess import _constraint_error
    from minivllm.entrypoints.openai.protocol import ChatCompletionRequest

    e = ValueError("StructuredOutputsParams.json is 250123 characters; give at most 200000")
    assert api_error(e, "messages").param == "structured_outputs"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}]
    for req, param in ((ChatCompletionRequest(messages=messages, tools=[tool], tool_choice="required"), "tools"),
                       (ChatCompletionRequest(messages=messages, response_format={"type": "json_schema", "json_schema":
                        {"name": "x", "schema": {}}}), "response_format.json_schema.schema")):
        error = _constraint_error(req, api_error(e, "messages"))
        assert error.param == param and "StructuredOutputsParams" not in error.message, error.message
        assert "250123 characters" in error.message


def test_a_body_the_framework_cannot_parse_and_an_unknown_route_answer_in_openais_error_shape(url):
    """Starlette's own refusals (a body nested past what it parses, a route or method that does not exist)
    come back as OpenAI's error object too, not FastAPI's {"detail": ...}: clients read `error.message`."""
    deep = '{"prompt": "hi", "max_tokens": 1, "stop": ' + "[" * 5000 + "]" * 5000 + "}"
    answers = [httpx.post(f"{url}/v1/completions", content=deep, headers={"content-type": "application/json"}),
               httpx.get(f"{url}/v1/nowhere"), httpx.get(f"{url}/v1/completions")]
    assert [r.status_code for r in answers][1:] == [404, 405] and 400 <= answers[0].status_code < 500
    for r in answers:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], r.text
