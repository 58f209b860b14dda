"""Structured outputs through the server, with the official `openai` client, on the default model
(SmolLM2-135M-Instruct): response_format json_schema / json_object and vLLM's structured_outputs (in
extra_body) on completions and chat; every output that ends with "stop" is valid (several seeds, streamed
and not, n > 1, and with n-gram speculation); a bad schema is a 400; the engine is idle afterwards."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from server_helpers import serving

from minivllm import LLMEngine
from minivllm.config import EngineConfig
from minivllm.default_model import default_model_dir
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.server import build_app

pytestmark = pytest.mark.slow
MODEL = "smol"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "London", "Rome"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]


@pytest.fixture(scope="module")
def served(request):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3} if request.param == "ngram" else None
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(default_model_dir()), max_model_len=512,
                                                   speculative_config=spec)))
    with serving(build_app(engine, MODEL)) as url:
        yield url, engine, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    engine.shutdown()


def assert_idle(engine: AsyncLLMEngine) -> None:
    inner = engine.engine
    deadline = time.time() + 10
    while inner.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    stats = inner.get_stats()
    assert not inner.has_unfinished_requests() and stats.num_free_blocks == stats.num_total_blocks


def stopped(choices) -> list:
    done = [c for c in choices if c.finish_reason == "stop"]
    assert done, [c.finish_reason for c in choices]  # the grammar does end these outputs
    return done


NESTED_440 = '{"type":"object","properties":{"a":' * 440 + '{"type":"string"}' + "}}" * 440  # 881 JSON levels


BOTH = pytest.mark.parametrize("served", ["plain", "ngram"], indirect=True)  # without and with n-gram drafts


@BOTH
def test_chat_json_schema_gives_valid_json(served):
    url, engine, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in (0, 1):
        r = client.chat.completions.create(model=MODEL, messages=ASK, n=2, seed=seed, temperature=0.8,
                                           max_tokens=60, response_format=fmt)
        for c in stopped(r.choices):
            jsonschema.validate(json.loads(c.message.content), PERSON)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, seed=3, temperature=0.8, max_tokens=60,
                                            response_format=fmt, stream=True)
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    if finish == "stop":
        jsonschema.validate(json.loads(text), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=ASK, seed=4, max_tokens=80,
                                       response_format={"type": "json_object"})
    for c in stopped(r.choices):
        assert isinstance(json.loads(c.message.content), dict)
    assert_idle(engine)


@BOTH
def test_completions_take_structured_outputs_in_extra_body(served):
    url, engine, client = served
    r = client.completions.create(model=MODEL, prompt="Is Paris in France? Answer:", max_tokens=5, n=3, seed=1,
                                  temperature=1.0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(c.text in ("yes", "no") for c in stopped(r.choices)) and len(stopped(r.choices)) == 3
    date = r"[12][0-9]{3}-[01][0-9]-[0-3][0-9]"
    stream = client.completions.create(model=MODEL, prompt="The date today is", max_tokens=16, seed=2, stream=True,
                                       extra_body={"structured_outputs": {"regex": date}})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(date, text), text
    grammar = 'root ::= "(" [0-9] ("+" [0-9])* ")"'
    r = client.completions.create(model=MODEL, prompt="A sum:", max_tokens=30, seed=3,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    for c in stopped(r.choices):
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", c.text), c.text
    r = client.completions.create(model=MODEL, prompt="A person:", max_tokens=60, seed=4,
                                  extra_body={"structured_outputs": {"json": PERSON}})
    for c in stopped(r.choices):
        jsonschema.validate(json.loads(c.text), PERSON)
    assert_idle(engine)


@pytest.mark.parametrize("served", ["plain"], indirect=True)
@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_schema": {}}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    # grammars llguidance compiles but cannot run, or that can only end at once: 400s in a few words
    ({"structured_outputs": {"grammar": 'start: "a" start'}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs"),
    # nested past MAX_SCHEMA_DEPTH: a RecursionError (500) before the depth check
    ({"structured_outputs": {"json": '{"type":"object","properties":{"a":' * 600 + "{}" + "}}" * 600}},
     "structured_outputs"),
    ('"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ' + NESTED_440 + "}}",
     "response_format.json_schema.schema"),  # its text: json.dumps would recurse too deeply in the client
])
def test_bad_structured_requests_are_400s(served, body, param):
    url, engine, _ = served
    if isinstance(body, str):  # the fields as JSON text
        r = httpx.post(f"{url}/v1/chat/completions", headers={"content-type": "application/json"},
                       content=f'{{"messages": {json.dumps(ASK)}, "max_tokens": 4, {body}}}')
    else:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text[:300]
    assert len(r.json()["error"]["message"]) < 500, r.text  # never llguidance's state or the grammar
    if param == "guided_json":
        assert "structured_outputs" in r.json()["error"]["message"]
    if param.startswith("response_format"):  # the field the client sent, never one it did not
        assert "structured_outputs" not in r.json()["error"]["message"] and param in r.json()["error"]["message"]
    assert_idle(engine)


@pytest.mark.parametrize("served", ["plain"], indirect=True)
def test_a_json_schema_allows_no_unnamed_property_by_default(served):
    """vLLM's default backend compiles schemas strictly: without `additionalProperties`, an object has only the
    properties its schema names (the default model, free to add keys, copies `maxLength` and runs out of tokens)."""
    url, engine, client = served
    schema = {k: v for k, v in PERSON.items() if k != "additionalProperties"}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=5, temperature=1.0, max_tokens=60,
                                       response_format=fmt)
    for c in stopped(r.choices):
        assert set(json.loads(c.message.content)) <= set(PERSON["properties"]), c.message.content
    assert_idle(engine)
