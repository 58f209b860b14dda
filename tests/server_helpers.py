"""Helpers for the server tests: a free port, an app served on a real socket in this process, the
events of an SSE response, and /metrics parsed by name and labels."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import uvicorn

from minivllm.entrypoints.openai.server import DEFAULT_HEADER_TIMEOUT_S, uvicorn_options


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S):
    """Serve `app` with uvicorn in a thread, on a real loopback socket, with `minivllm serve`'s
    connection settings (header deadline, keep-alive); yields its URL."""
    # log_config=None: uvicorn's records reach pytest's caplog (a traceback would be seen there).
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_config=None,
                                           log_level="warning", **uvicorn_options(header_timeout_s)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response, JSON-decoded except `[DONE]`."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{label="value",...}': value}, labels in the order Prometheus prints them."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def metric(scraped: dict[str, float], name: str, **labels: str) -> float:
    """The value of the one series of `name` whose labels include `labels`."""
    found = [v for series, v in scraped.items() if series.split("{")[0] == name
             and all(f'{k}="{v}"' in series for k, v in labels.items())]
    assert len(found) == 1, f"{name} {labels}: {len(found)} series"
    return found[0]
