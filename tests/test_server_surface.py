"""The server's edges, on real sockets: a client that stalls in its headers or its body cannot hold a
connection past the deadlines, and `minivllm serve` refuses an empty API key and hands uvicorn the
connection settings."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn
from server_helpers import serving

from minivllm import LLMEngine
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.server import build_app

HANG = 60  # seconds: a bound only a connection the server never closes reaches


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=16, max_model_len=64)))
    yield engine
    engine.shutdown()


def connect(url: str) -> socket.socket:
    address = urlsplit(url)
    sock = socket.create_connection((address.hostname, address.port))
    sock.settimeout(HANG)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length: TCP may deliver its headers and body in separate reads."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(4096)
    return data


def test_stalled_headers_are_closed_and_the_server_stays_up(engine):
    with serving(build_app(engine, "tiny"), header_timeout_s=1) as url:
        stalled = [connect(url) for _ in range(20)]
        for sock in stalled:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        assert httpx.get(f"{url}/health").status_code == 200
        # Keep-alive: after a whole request, the next one's headers have the same deadline.
        again = connect(url)
        again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(again).startswith(b"HTTP/1.1 200")
        again.sendall(b"GET /health HTTP/1.1\r\nHost")
        for sock in [*stalled, again]:
            assert read_to_close(sock) == b""  # closed, no answer: there is no request yet
            sock.close()
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_stalled_body_gets_408_and_the_connection_closes(engine):
    with serving(build_app(engine, "tiny", body_timeout_s=1)) as url:
        stalled = [connect(url) for _ in range(20)]
        for sock in stalled:  # 11 of the 100 bytes promised
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        assert httpx.get(f"{url}/health").status_code == 200
        for sock in stalled:
            answer = read_to_close(sock)
            sock.close()
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})  # a prompt one is served
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("flags,env,needle", [
    (["--api-key", ""], None, "--api-key is empty"),
    (["--api-key", "  "], None, "--api-key is empty"),
    ([], "", "MINIVLLM_API_KEY is empty"),
    (["--api-key", "s3cret "], None, "whitespace"),
])
def test_an_empty_api_key_is_refused_at_start(qwen3_dir, monkeypatch, capsys, flags, env, needle):
    """An empty key silently served /v1/* to anyone; it is an error naming the flag (or variable)."""
    from minivllm.entrypoints import cli

    started = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_: started.append(app))
    if env is None:
        monkeypatch.delenv("MINIVLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("MINIVLLM_API_KEY", env)
    assert cli.main(["serve", "--model", qwen3_dir, "--num-kv-blocks", "16", *flags]) == 1
    assert not started and needle in capsys.readouterr().err


def test_serve_gives_uvicorn_the_deadlines_and_the_card_its_root(qwen3_dir, monkeypatch):
    from minivllm.entrypoints import cli

    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: runs.append((app, options)))
    monkeypatch.delenv("MINIVLLM_API_KEY", raising=False)
    assert cli.main(["serve", "--model", qwen3_dir, "--num-kv-blocks", "16"]) == 0
    [(app, options)] = runs
    assert options["http"].keywords == {"header_timeout_s": 10.0} and options["timeout_keep_alive"] == 5
    with serving(app) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["root"] == qwen3_dir
