"""POST /tokenize, /detokenize and GET|POST /ping, as vLLM serves them: against the tokenizer itself, against
what /v1/chat/completions counts for the same messages, through the official `openai` client, and the
refusals (a field they do not declare, an id out of the vocabulary, another model)."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import serving
from transformers import AutoTokenizer

from minivllm import LLMEngine
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.server import build_app

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Who won the world series in 2020?"},
            {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
            {"role": "user", "content": "Where was it played?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def engine(qwen3_dir):  # room for the tools' system prompt (about 450 tokens)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=128, max_model_len=512)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with serving(build_app(engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    return AutoTokenizer.from_pretrained(qwen3_dir)


def tokenize(url: str, **body) -> dict:
    r = httpx.post(f"{url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_prompt_is_tokenized_as_the_tokenizer_does(url, tokenizer, add_special_tokens):
    prompt = "vllm1 This is a test prompt."
    got = tokenize(url, prompt=prompt, add_special_tokens=add_special_tokens, model=MODEL)
    expected = tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
    assert got == {"count": len(expected), "max_model_len": 512, "tokens": expected, "token_strs": None}


def test_token_strs_are_the_vocabulary_pieces(url, tokenizer):
    got = tokenize(url, prompt="A token_strs test prompt!", return_token_strs=True)
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    assert len(got["token_strs"]) == got["count"]


@pytest.mark.parametrize("options", [
    {}, {"add_generation_prompt": False}, {"add_special_tokens": True},
    {"add_generation_prompt": False, "continue_final_message": True},
])
def test_messages_count_what_a_chat_request_counts(url, tokenizer, options):
    messages = MESSAGES + [{"role": "assistant", "content": "Sure,"}] if options.get("continue_final_message") \
        else MESSAGES
    got = tokenize(url, messages=messages, **options)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=options.get(
        "add_generation_prompt", True), continue_final_message=options.get("continue_final_message", False))
    assert got["tokens"] == tokenizer(text, add_special_tokens=options.get("add_special_tokens", False)).input_ids
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **options})
    assert chat.status_code == 200, chat.text
    assert got["count"] == chat.json()["usage"]["prompt_tokens"]


def test_tools_are_counted_as_the_chat_request_renders_them(url):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = tokenize(url, messages=messages, tools=[WEATHER])
    assert with_tools["count"] > tokenize(url, messages=messages)["count"]  # the tools are in the prompt
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert with_tools["count"] == chat.json()["usage"]["prompt_tokens"]


def test_detokenize_gives_back_the_text(url, tokenizer):
    prompt = "This is a test prompt. vllm1"
    ids = tokenize(url, prompt=prompt, add_special_tokens=False)["tokens"]
    r = httpx.post(f"{url}/detokenize", json={"tokens": ids, "model": MODEL})
    assert r.status_code == 200 and r.json() == {"prompt": prompt}, r.text
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert httpx.post(f"{url}/detokenize", json={"tokens": [special]}).json() == {"prompt": "<|im_start|>"}


def test_a_prompt_longer_than_the_context_is_counted_not_refused(url):
    """vLLM's /tokenize has no length check: the count is how a client learns how much to cut."""
    got = tokenize(url, prompt="many words " * 300)
    assert got["count"] > got["max_model_len"] == 512


@pytest.mark.parametrize("tokens", [[5, 384], [-1], [10**12]])
def test_ids_out_of_the_vocabulary_are_400s_saying_so(url, tokens):
    r = httpx.post(f"{url}/detokenize", json={"tokens": tokens})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "tokens", r.text
    assert "out of vocabulary" in error["message"] and str(tokens[-1]) in error["message"]


@pytest.mark.parametrize("path,body,param", [
    ("tokenize", {"prompt": "Hi", "max_tokens": 3}, "max_tokens"),
    ("tokenize", {"prompt": "Hi", "messages": MESSAGES}, "prompt"),  # a chat request has no prompt
    ("tokenize", {"messages": MESSAGES, "echo": True, "n": 2}, "echo"),
    ("tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
    ("tokenize", {"messages": MESSAGES, "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
    ("tokenize", {"prompt": "Hi", "user": "me"}, "user"),
    ("detokenize", {"tokens": [1, 2], "skip_special_tokens": True}, "skip_special_tokens"),
])
def test_a_field_they_do_not_declare_is_a_400_naming_it(url, path, body, param):
    r = httpx.post(f"{url}/{path}", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and param in error["message"], r.text


@pytest.mark.parametrize("path,body,status,param", [
    ("tokenize", {"prompt": 5}, 400, "prompt"),
    ("tokenize", {"prompt": "Hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("tokenize", {"messages": []}, 400, "messages"),
    ("tokenize", {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]"),
    ("detokenize", {"tokens": [1, True]}, 400, "tokens[1]"),
    ("tokenize", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("tokenize", {"add_special_tokens": True}, 422, "prompt"),  # neither a prompt nor messages
    ("detokenize", [1, 2], 422, None),  # not a JSON object
])
def test_bad_values_are_answered_as_on_v1(url, path, body, status, param):
    r = httpx.post(f"{url}/{path}", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_ping_answers_as_health(url):
    health = httpx.get(f"{url}/health")
    for r in (httpx.get(f"{url}/ping"), httpx.post(f"{url}/ping")):
        assert r.status_code == health.status_code == 200 and r.json() == health.json()


def test_the_openai_client_reaches_them_at_the_root(url, tokenizer):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    root = client.with_options(base_url=url)  # /tokenize is not under /v1, as in vLLM
    got = root.post("/tokenize", body={"model": MODEL, "prompt": "Hello world"}, cast_to=object)
    assert got["tokens"] == tokenizer("Hello world").input_ids
    assert root.post("/detokenize", body={"tokens": got["tokens"]}, cast_to=object) == {"prompt": "Hello world"}
    assert root.get("/ping", cast_to=object) == {"status": "ok"}
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        root.post("/detokenize", body={"tokens": [10**9]}, cast_to=object)


def test_the_api_key_guards_v1_only_as_in_vllm(engine):
    with serving(build_app(engine, MODEL, api_key="s3cret")) as url:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 401
        assert httpx.post(f"{url}/tokenize", json={"prompt": "Hi"}).status_code == 200
        assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}).status_code == 200
        assert httpx.get(f"{url}/ping").status_code == 200
