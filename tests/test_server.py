"""The OpenAI-compatible server, started for real on a free loopback port, driven by the official
`openai` client and by httpx."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from loadgen import percentile, run_load
from server_helpers import free_port, metric, scrape

from minivllm import LLM, SamplingParams

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("server") / "server.log"


@pytest.fixture(scope="module")
def server(qwen3_dir, server_log):
    port = free_port()
    with open(server_log, "w") as log:  # a file, not a pipe: nobody reads a pipe until it fills and blocks
        proc = subprocess.Popen(
            [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--model", qwen3_dir, "--port", str(port),
             "--served-model-name", MODEL, "--num-kv-blocks", "128", "--max-model-len", "256"],
            stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    # Only a hang reaches this bound: a server that fails exits (checked below), and a busy machine's start-up
    # (maybe compiling the C++ kernels) once outlasted a 2-minute one.
    deadline = time.time() + 900
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {server_log.read_text()}")
    else:
        proc.kill()
        raise RuntimeError(f"server did not start: {server_log.read_text()[-3000:]}")
    yield url
    proc.terminate()
    proc.wait(timeout=300)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(qwen3_dir):
    return LLM(qwen3_dir, num_kv_blocks=64, max_model_len=256)


def greedy_text(llm: LLM, prompt, max_tokens: int) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0].outputs[0].text


def chat_prompt(llm: LLM, messages) -> dict:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False).input_ids}


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server}/version").json()["version"]


def test_completion_equals_offline_generate(client, offline):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text == greedy_text(offline, "The capital of France is", 8)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_prompt_forms(client, offline):
    ids = offline.get_tokenizer()("Hello world").input_ids
    r = client.completions.create(model=MODEL, prompt=["Hello world", "Paged attention"], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text


def test_chat_completion_equals_offline_generate(client, offline):
    messages = [{"role": "user", "content": "What is paged attention?"}]
    expected = greedy_text(offline, chat_prompt(offline, messages), 10)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_extras_and_seed(client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.0, seed=7,
              extra_body={"top_k": 20, "min_p": 0.05, "ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "word " * 400}, 400, "max_model_len"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [1, 99999]}, 400, "vocabulary"),
    ({"max_tokens": 3}, 422, "prompt"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": [[]]}, 400, "empty"),
])
def test_bad_requests_get_openai_errors(server, body, status, needle):
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize("path,raw,param,needle", [
    # Python's json reads NaN and Infinity: the numbers must still be refused, naming the field.
    ("completions", b'{"prompt": "hi", "temperature": NaN}', "temperature", "finite"),
    ("completions", b'{"prompt": "hi", "top_p": -Infinity}', "top_p", "finite"),
    ("completions", b'{"prompt": "hi", "max_tokens": Infinity}', "max_tokens", "valid integer"),
    ("completions", b'{"prompt": "hi", "top_p": 0}', "top_p", "(0, 1]"),  # SamplingParams names it
    ("completions", b'{"prompt": [1, 2], "max_tokens": 0}', "max_tokens", ">= 1"),
    ("completions", b'{"prompt": "a\\ud800b"}', "prompt", "surrogate"),
    ("completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt[1]", "surrogate"),
    ("chat/completions", b'{"messages": []}', "messages", "empty"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content",
     "surrogate"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages[0].content[0].text", "must be a string"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     "messages[0].content[0]", "not supported"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "min_p": NaN}', "min_p", "finite"),
])
def test_bad_values_are_400s_naming_the_field(server, path, raw, param, needle):
    r = httpx.post(f"{server}/v1/{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_and_server_keeps_serving(server, client):
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=2).choices[0].text is not None


def test_load_with_disconnects_frees_every_block(server, offline, capsys):
    prompts = [f"Tell me fact number {i} about the sea." for i in range(32)]
    results, elapsed = asyncio.run(run_load(server, prompts, max_tokens=24, disconnect_every=4, timeout_s=240))
    completed = [r for r in results if not r.disconnected]
    assert len(completed) == 24 and len(results) - len(completed) == 8
    for r in completed:  # intact: ended properly and equal to the offline greedy text
        assert r.done and r.finish_reason in ("stop", "length")
        messages = [{"role": "user", "content": prompts[r.index]}]
        assert r.text == greedy_text(offline, chat_prompt(offline, messages), 24)
    deadline = time.time() + 20
    while time.time() < deadline:
        m = scrape(server)
        running, waiting, used = (metric(m, f"vllm:{name}") for name in
                                  ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
        if running == waiting == used == 0:
            break
        time.sleep(0.2)
    assert used == 0.0, "KV blocks leaked after disconnects"
    assert running == 0 and waiting == 0
    assert metric(m, "vllm:time_to_first_token_seconds_count", model_name=MODEL) >= 24
    assert httpx.get(f"{server}/health").status_code == 200
    ttfts = [r.ttft for r in results if r.ttft is not None]
    with capsys.disabled():
        print(f"\n[load] 32 streams (8 hung up) in {elapsed:.2f} s = {len(results) / elapsed:.1f} req/s; "
              f"TTFT p50 {1e3 * percentile(ttfts, 50):.0f} ms, p99 {1e3 * percentile(ttfts, 99):.0f} ms")


def test_request_defaults_come_from_generation_config():
    from minivllm.entrypoints.openai.protocol import CompletionRequest, Limits

    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    limits = Limits(max_logprobs=20, vocab_size=384, priority_scheduling=False, max_model_len=256)
    sp = CompletionRequest(prompt="x").sampling_params(defaults, limits)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    sp = CompletionRequest(prompt="x", temperature=0.0, top_k=5).sampling_params(defaults, limits)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.0, 0.9, 5)  # what the request says wins


async def health_latencies(url: str, busy) -> tuple[object, list[float]]:
    """Run `busy(client)` while timing /health every 50 ms; returns its result and the timings."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        task = asyncio.create_task(busy(client))
        latencies = []
        while not task.done() or not latencies:
            t0 = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)
        return await task, latencies


def test_oversized_body_is_refused_before_it_is_read(server):
    big = {"prompt": "word " * 800_000}  # 4 MB: tokenizing it on the event loop took seconds

    async def send(client):
        return await client.post("/v1/completions", json=big)

    r, latencies = asyncio.run(health_latencies(server, send))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert "--max-request-bytes" in r.json()["error"]["message"]
    assert max(latencies) < 1.0, f"/health stalled for {max(latencies):.2f} s"


def test_oversized_chunked_body_is_counted(server):
    def chunks():  # no Content-Length: the server must count what arrives
        for _ in range(40):
            yield b"x" * 65536

    r = httpx.post(f"{server}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert "at least" in r.json()["error"]["message"]


def test_long_prompt_is_tokenized_off_the_event_loop(server):
    # 1 MB, just under the limit: about 1 s to tokenize, which stalled every client when it ran on
    # the event loop; in a worker thread /health answers in tens of milliseconds. (Its bytes alone now prove
    # it longer than max_model_len: it is refused before the tokenizer sees it.)
    long_prompt = {"prompt": "a." * 500_000}

    async def send(client):
        return await client.post("/v1/completions", json=long_prompt)

    r, latencies = asyncio.run(health_latencies(server, send))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "bytes" in r.json()["error"]["message"]
    assert max(latencies) < 0.5, f"/health stalled for {max(latencies):.2f} s"


def test_server_log_has_no_traceback(server, server_log):
    assert "Traceback" not in server_log.read_text()
