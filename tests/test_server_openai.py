"""The OpenAI API surface, checked the way vLLM's tests/entrypoints/openai check vLLM: the official
`openai` client against a real server (uvicorn on a loopback socket, in this process), and every
sampling field against the offline engine given the same `SamplingParams`."""

from __future__ import annotations

import logging
from collections import defaultdict

import httpx
import openai
import pytest
from server_helpers import events, serving

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.field_policy import NO_EFFECT, REFUSED
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from minivllm.entrypoints.openai.server import build_app

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=128, max_model_len=256)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with serving(build_app(engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(qwen3_dir):
    return LLM(qwen3_dir, num_kv_blocks=128, max_model_len=256)


def ids(client, text: str) -> list[int]:
    """The prompt's token ids, as the server sees them (return_token_ids)."""
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"return_token_ids": True})
    return r.choices[0].prompt_token_ids


# --- sampling fields: the server's answer is the offline engine's -----------------------------------

@pytest.mark.parametrize("fields", [
    dict(temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
    dict(temperature=0, repetition_penalty=1.3),
    dict(temperature=0, logit_bias={"65": 5.0, "66": -100}),
    dict(temperature=0, allowed_token_ids=[65, 66, 67]),
    dict(temperature=0, bad_words=["the"], min_tokens=4),
    dict(temperature=0.8, seed=11, top_k=20, top_p=0.9, min_p=0.01),
    dict(temperature=1.0, seed=5, n=3),
    dict(temperature=0, truncate_prompt_tokens=3),
])
def test_sampling_fields_reach_the_engine(client, offline, fields):
    prompt, fields = "The capital of France is", dict(fields)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, extra_body=fields)
    logit_bias = {int(k): v for k, v in fields.pop("logit_bias", {}).items()} or None
    expected = offline.generate(prompt, SamplingParams(max_tokens=8, logit_bias=logit_bias, **fields),
                                use_tqdm=False)[0]
    assert [c.text for c in r.choices] == [c.text for c in expected.outputs]
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_n_completions_per_prompt_in_vllm_order(client):
    prompts = ["Hello, my name is", "Paged attention"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=1,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt index * n + completion index
    assert len({c.text for c in r.choices}) == 4
    one = client.completions.create(model=MODEL, prompt=prompts[1], n=2, max_tokens=6, temperature=1.0, seed=1)
    assert [c.text for c in r.choices[2:]] == [c.text for c in one.choices]
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == sum(len(ids(client, p)) for p in prompts)


def test_n_streams_each_choice_with_its_own_finish(client):
    stream = client.completions.create(model=MODEL, prompt="What is an LLM?", n=3, max_tokens=12, temperature=1.0,
                                       seed=42, stream=True)
    texts, finishes = defaultdict(str), defaultdict(int)
    for chunk in stream:
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        finishes[choice.index] += choice.finish_reason is not None
    assert dict(finishes) == {0: 1, 1: 1, 2: 1}
    whole = client.completions.create(model=MODEL, prompt="What is an LLM?", n=3, max_tokens=12, temperature=1.0,
                                      seed=42)
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]


def test_best_of_equal_to_n_is_accepted(client):
    r = client.completions.create(model=MODEL, prompt="Hi", n=2, best_of=2, max_tokens=2)
    assert len(r.choices) == 2


# --- logprobs -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 5])
def test_completion_logprobs(client, n):
    # Tokens as "token_id:<id>": several byte tokens of this tokenizer decode to the same "\ufffd".
    r = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0, logprobs=n,
                                  extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(n, 1) <= len(top) <= n + 1 and top[token] == logprob  # the top-N and the token itself
        assert logprob <= 0 and (n == 0 or logprob == max(top.values()))  # greedy: the most likely
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
    text = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0, logprobs=n,
                                     extra_body={"ignore_eos": True}).choices[0]
    assert "".join(text.logprobs.tokens) == text.text  # each token's own text
    none = client.completions.create(model=MODEL, prompt=[0, 0, 0], max_tokens=2, logprobs=None)
    assert none.choices[0].logprobs is None


def test_top_logprobs_keep_every_candidate_when_their_texts_collide(client, engine):
    """128 byte tokens of this tokenizer decode to the same "\ufffd": a dict keyed by text lost all but
    one of them (positions had 3, 4, 5, 4, ... of 5). Each candidate keeps a key and its own logprob."""
    kw = dict(model=MODEL, prompt=[0] * 9, max_tokens=8, temperature=0, logprobs=5)
    text = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs
    ids = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}
                                    ).choices[0].logprobs
    decode = engine.engine.tokenizer.decode
    assert any(len({decode([int(t.removeprefix("token_id:"))]) for t in by_id}) < len(by_id)
               for by_id in ids.top_logprobs)  # the texts do collide here
    for token, logprob, top, by_id in zip(text.tokens, text.token_logprobs, text.top_logprobs, ids.top_logprobs):
        assert 5 <= len(top) <= 6 and len(top) == len(by_id)  # the top 5, and the chosen token if not among them
        assert sorted(top.values()) == sorted(by_id.values())  # every candidate with its own logprob
        assert top[token] == logprob  # the chosen token keeps its text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=5, extra_body={"ignore_eos": True})
    assert all(len(t.top_logprobs) == 5 for t in chat.choices[0].logprobs.content)  # a list: nothing collides


def test_too_many_logprobs_are_refused_and_the_server_goes_on(client, url):
    with pytest.raises(openai.BadRequestError, match="max_logprobs"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="max_logprobs"):
        list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logprobs=30, stream=True))
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=21)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "logprobs": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"


def test_streamed_logprobs_and_offsets_equal_the_whole_answer(client):
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=10, temperature=0, logprobs=2, stop=["\n\n"])
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, logprobs, offsets = [], [], []
    for chunk in client.completions.create(**kw, stream=True):
        if chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, logprobs, offsets) == (whole.tokens, whole.token_logprobs, whole.text_offset)


@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("prompt", ["Hello, my name is", [5, 6, 7, 8, 9, 10]])
def test_echo_with_logprobs_puts_the_prompt_first(client, offline, n, prompt):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=n,
                                  extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = r.choices[0]
    text = prompt if isinstance(prompt, str) else offline.get_tokenizer().decode(prompt)
    assert choice.text.startswith(text)
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in choice.prompt_token_ids + choice.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first token
    assert all(max(n, 1) <= len(top) <= n + 1 for top in lp.top_logprobs[1:])


def test_echo_with_max_tokens_0_scores_the_prompt(client):
    """lm-eval's loglikelihood request: the prompt's logprobs, nothing generated."""
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == "The capital of France is"
    assert len(choice.logprobs.tokens) == r.usage.prompt_tokens and choice.logprobs.token_logprobs[0] is None
    streamed = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=0,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "The capital of France is"


def test_echo_with_max_tokens_0_counts_no_completion_tokens(client):
    """The one token computed to run the prompt is dropped from the answer, so usage does not count it."""
    kw = dict(model=MODEL, prompt=["The capital of France is", "Hi"], max_tokens=0, echo=True)
    r = client.completions.create(**kw)
    assert r.usage.completion_tokens == 0 and r.usage.total_tokens == r.usage.prompt_tokens
    chunks = list(client.completions.create(**kw, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in chunks] == [0] * len(chunks)
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


@pytest.mark.parametrize("prompt_logprobs", [0, 1, -1, None])
def test_prompt_logprobs(client, url, prompt_logprobs):
    kw = dict(model=MODEL, prompt=["A robot may not injure another robot", "My name is"], max_tokens=2)
    if prompt_logprobs == -1:  # the whole vocabulary: more than this server's max_logprobs
        with pytest.raises(openai.BadRequestError, match="max_logprobs"):
            client.completions.create(**kw, extra_body={"prompt_logprobs": -1})
        return
    r = client.completions.create(**kw, extra_body={"prompt_logprobs": prompt_logprobs})
    for choice in r.choices:
        if prompt_logprobs is None:
            assert choice.prompt_logprobs is None
            continue
        assert choice.prompt_logprobs[0] is None
        for position in choice.prompt_logprobs[1:]:
            assert max(prompt_logprobs, 1) <= len(position) <= prompt_logprobs + 1
            assert all(set(lp) == {"logprob", "rank", "decoded_token"} for lp in position.values())
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("top", [None, 0, 5])
def test_chat_logprobs(client, top):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5, temperature=0,
                                       logprobs=top is not None, top_logprobs=top)
    choice = r.choices[0]
    if top is None:
        assert choice.logprobs is None
        return
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    for token in choice.logprobs.content:
        assert len(token.top_logprobs) == top and token.bytes == list(token.token.encode("utf-8", "replace"))
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert top == 0 or token.logprob == token.top_logprobs[0].logprob  # greedy: the most likely token


def test_chat_prompt_logprobs_and_streamed_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, extra_body={"prompt_logprobs": 2})
    assert r.prompt_logprobs[0] is None and all(2 <= len(p) <= 3 for p in r.prompt_logprobs[1:])
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).prompt_logprobs is None
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    whole = [(t.token, t.logprob) for t in client.chat.completions.create(**kw).choices[0].logprobs.content]
    streamed = [(t.token, t.logprob) for chunk in client.chat.completions.create(**kw, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert streamed == whole


# --- chat ---------------------------------------------------------------------------------------------

def test_chat_n_streams_a_role_then_content_per_choice(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.7, n=3, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.content for c in r.choices}) > 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.7,
                                                 n=3, seed=3, stream=True))
    texts, roles, finishes = defaultdict(str), set(), defaultdict(int)
    for chunk in chunks:
        choice = chunk.choices[0]
        roles |= {choice.index} if choice.delta.role == "assistant" else set()
        texts[choice.index] += choice.delta.content or ""
        finishes[choice.index] += choice.finish_reason is not None
    assert roles == {0, 1, 2} and dict(finishes) == {0: 1, 1: 1, 2: 1}
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]


@pytest.mark.parametrize("echo", [True, False])
def test_continue_final_message_with_echo(client, offline, echo):
    saying = "Here is a common saying about apple. An apple a day, keeps"
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={
        "echo": echo, "continue_final_message": True, "add_generation_prompt": False})
    tok = offline.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith(saying)  # the assistant's turn is left open, to be continued
    expected = offline.generate({"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False).input_ids},
                                SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].text
    assert r.choices[0].message.content == (saying if echo else "") + expected
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(model=MODEL, messages=messages, extra_body={"continue_final_message": True})


def test_custom_roles_and_extra_message_fields_go_to_the_template(client):
    as_text = client.chat.completions.create(model=MODEL, temperature=0, seed=0, max_tokens=5, messages=[
        {"role": "my-custom-role", "content": "what is 1+1?", "extra_field": "0"}])
    as_parts = client.chat.completions.create(model=MODEL, temperature=0, seed=0, max_tokens=5, messages=[
        {"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}])
    assert as_text.choices[0].message.content == as_parts.choices[0].message.content
    assert as_text.usage.prompt_tokens == as_parts.usage.prompt_tokens


def test_chat_template_kwargs_reach_the_template(engine, url):
    tok = engine.engine.tokenizer
    saved = tok.chat_template
    tok.chat_template = saved + "{% if greeting %}{{ greeting }}{% endif %}"
    try:
        body = {"messages": MESSAGES, "max_tokens": 1}
        plain = httpx.post(f"{url}/v1/chat/completions", json=body).json()
        more = httpx.post(f"{url}/v1/chat/completions", json={**body, "chat_template_kwargs": {
            "greeting": "Hello there"}}).json()
        taken = httpx.post(f"{url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": True}})
    finally:
        tok.chat_template = saved
    assert more["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "chat_template_kwargs"


# --- usage and stream options ---------------------------------------------------------------------------

def test_stream_options(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0, stream=True)
    assert all(c.usage is None for c in client.chat.completions.create(**kw, stream_options={"include_usage": False}))
    chunks = list(client.chat.completions.create(**kw, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kw, extra_body={"min_tokens": 10}, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    used = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert used == sorted(used) and used[-1] == 10 and chunks[-1].choices == []
    for options in ({}, {"include_usage": False, "continuous_usage_stats": True}):  # continuous needs include_usage
        assert all(c.usage is None for c in client.completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                                                      stream=True, stream_options=options))
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=MODEL, prompt="Hi", stream=False, stream_options={"include_usage": True})


def test_cached_tokens_are_reported(client):
    prompt = "Paged attention stores keys and values in fixed-size blocks, " * 3  # several 16-token blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details is None  # vLLM's: no details when nothing was cached
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_prompt_tokens_details_come_with_a_requests_usage(client):
    """vLLM's rule: `prompt_tokens_details.cached_tokens` is on a request's usage (the answer's, a
    stream's last chunk), not on the running usage of each chunk (continuous_usage_stats)."""
    prompt = "The prefix cache keeps the KV blocks of a prompt it has seen, " * 2  # 2 full blocks, cached after once
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    for stream in (client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True,
                                             stream_options={"include_usage": True, "continuous_usage_stats": True}),
                   client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True,
                                                                  "continuous_usage_stats": True})):
        chunks = list(stream)
        assert [c.usage.prompt_tokens_details is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16
    for answer in (client.completions.create(model=MODEL, prompt=prompt, max_tokens=2),
                   client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)):
        assert answer.usage.prompt_tokens_details.cached_tokens >= 16


def test_token_ids_and_request_id(client, url):
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0, logprobs=0,
                                  extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                                              "request_id": "abc"})
    choice = r.choices[0]
    assert r.id == "cmpl-abc" and choice.prompt_token_ids == [5, 6, 7, 8] and len(choice.token_ids) == 3
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]


# --- what is refused, and what is ignored ------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("suffix", "and so on"), ("early_stopping", True), ("best_of", 3), ("functions", [{"name": "f"}]),
    ("guided_json", {}), ("guided_regex", "a+"), ("chat_template", "{{ messages }}"), ("priority", 1),
    ("spaces_between_special_tokens", False), ("prompt_embeds", "AAAA"), ("cache_salt", "x"),
])
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_unimplemented_fields_are_400s_naming_them(url, field, value, path):
    body = {"prompt": "Hi"} if path == "completions" else {"messages": MESSAGES}
    r = httpx.post(f"{url}/v1/{path}", json={**body, field: value, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and "not supported" in r.json()["error"]["message"]


def test_defaults_of_refused_fields_are_accepted(url):
    defaults = {name: values[0] for name, (values, _) in REFUSED.items() if values}
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "tools": [],
                                                       "tool_choice": "none", "user": "me", **defaults})
    assert r.status_code == 200, r.text


def test_no_field_has_a_policy_and_a_declaration():
    # A declared field never reaches model_extra, so a policy for it would silently never run.
    declared = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert declared.isdisjoint(set(REFUSED) | NO_EFFECT) and set(REFUSED).isdisjoint(NO_EFFECT)


def test_unknown_fields_are_logged_and_ignored(client, caplog):
    caplog.set_level(logging.WARNING, logger="minivllm.server")
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, user="me",
                                  extra_body={"frobnicate": 1, "colour": "blue"})
    assert r.choices[0].finish_reason == "length"
    [line] = [rec.getMessage() for rec in caplog.records if "ignored request fields" in rec.getMessage()]
    assert "frobnicate" in line and "colour" in line and "user" not in line


def test_unknown_field_names_are_logged_escaped_cut_and_counted_in_one_line(url, caplog):
    caplog.set_level(logging.WARNING, logger="minivllm.server")
    forged = "x\nERROR minivllm.server: forged"  # a newline would start a log line of the client's choosing
    fields = {forged: 1, "y" * 5000: 1, **{f"field{i}": i for i in range(2000)}}
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    [line] = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert "\n" not in line and "'x\\nERROR" in line  # escaped as repr does
    assert "2002" in line and "1997 more" in line and len(line) < 500  # counted, a few names, each cut


def test_allowed_token_ids_constrain_without_stopping(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, extra_body={
        "allowed_token_ids": [65, 66, 67], "ignore_eos": True, "return_token_ids": True})
    assert len(r.choices[0].token_ids) == 5 and set(r.choices[0].token_ids) <= {65, 66, 67}


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"99999": 1.0}), ("allowed_token_ids", [0, 99999]),
    ("stop_token_ids", [-1]), ("logit_bias", {"x": 1.0})])
def test_token_ids_out_of_the_vocabulary_are_400s_naming_the_field(url, field, value):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("seed", [-2**63 - 1, 2**63])
def test_seeds_beyond_64_bits_are_400s(client, seed):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, seed=seed)


@pytest.mark.parametrize("path,field,value,param", [
    ("completions", "n", True, "n"),
    ("completions", "allowed_token_ids", [True], "allowed_token_ids[0]"),
    ("completions", "stream", "yes", "stream"),
    ("completions", "priority", True, "priority"),
    ("completions", "max_tokens", 2.0, "max_tokens"),
    ("completions", "logprobs", True, "logprobs"),
    ("completions", "seed", "7", "seed"),
    ("completions", "echo", 1, "echo"),
    ("completions", "temperature", "0.5", "temperature"),
    ("completions", "top_p", True, "top_p"),
    ("completions", "logit_bias", {"65": True}, "logit_bias.65"),
    ("completions", "prompt", [1, True], "prompt"),
    ("completions", "stop_token_ids", [1.0], "stop_token_ids[0]"),
    ("chat/completions", "logprobs", 1, "logprobs"),
    ("chat/completions", "top_logprobs", False, "top_logprobs"),
    ("chat/completions", "add_generation_prompt", "false", "add_generation_prompt"),
    ("chat/completions", "ignore_eos", 0, "ignore_eos"),
    ("chat/completions", "stream_options", {"include_usage": 1}, "stream_options.include_usage"),
    ("chat/completions", "messages", [{"role": "user", "content": 5}], "messages[0].content"),
])
def test_fields_are_strictly_typed(url, path, field, value, param):
    """Nothing is coerced (`true` is not 1, `"yes"` not true, 2.0 not 2): a 400 naming the field."""
    body = {"prompt": "Hi"} if path == "completions" else {"messages": MESSAGES}
    extra = {"stream": True} if field == "stream_options" else {}
    r = httpx.post(f"{url}/v1/{path}", json={**body, "max_tokens": 2, **extra, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "valid" in error["message"] and error["type"] == "invalid_request_error"


def test_numbers_take_integers_and_malformed_bodies_stay_422(url):
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_p": 1,
                                                    "presence_penalty": 0})
    assert ok.status_code == 200, ok.text
    for body in ([1, 2], {"max_tokens": 2}, {"prompt": "Hi", "messages": [{}]}):
        path = "chat/completions" if "messages" in body else "completions"
        assert httpx.post(f"{url}/v1/{path}", json=body).status_code == 422, body


def test_model_card_is_vllms(client, url, qwen3_dir):
    [card] = httpx.get(f"{url}/v1/models").json()["data"]
    assert card["root"] == qwen3_dir and card["parent"] is None and card["max_model_len"] == 256
    [permission] = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] and permission["allow_logprobs"] and not permission["allow_fine_tuning"]
    assert client.models.retrieve(MODEL).root == qwen3_dir


def test_model_by_id(client, url):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(f"{url}/v1/models/org/gpt-4").json()["error"]["code"] == "model_not_found"


def test_a_stream_with_echo_and_logprobs_starts_with_the_prompt(url):
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "echo": True,
                                                              "logprobs": 1, "stream": True}) as r:
        got = events(r)
    first = got[0]["choices"][0]
    assert first["text"].startswith("Hello") and first["logprobs"]["token_logprobs"][0] is None
    assert got[-1] == "[DONE]"
