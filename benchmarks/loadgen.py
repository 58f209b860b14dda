"""A bounded load generator for the server (used by `serve_load.py` here and by tests/test_server.py).

N concurrent streaming chat clients on loopback; a fraction of them hang up after their first few
chunks. Every loop is bounded in count and time. Reports requests/s and time-to-first-token.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx


@dataclass
class StreamResult:
    index: int
    text: str
    finish_reason: str | None
    done: bool  # saw data: [DONE]
    disconnected: bool
    ttft: float | None
    error: str | None = None  # the message of an in-stream error event


async def one_stream(client: httpx.AsyncClient, index: int, prompt: str, max_tokens: int,
                     hang_up_after: int | None) -> StreamResult:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    text, finish, done, chunks, ttft = "", None, False, 0, None
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            payload = json.loads(data)
            if "error" in payload:  # the server's in-stream error event; [DONE] follows
                return StreamResult(index, text, "error", False, False, ttft, payload["error"]["message"])
            choice = payload["choices"][0]
            content = choice["delta"].get("content")
            if content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text += content
            finish = choice["finish_reason"] or finish
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return StreamResult(index, text, None, False, True, ttft)  # leaving the block closes it
    return StreamResult(index, text, finish, done, False, ttft)


async def run_load(base_url: str, prompts: list[str], max_tokens: int = 24, disconnect_every: int = 4,
                   timeout_s: float = 120.0) -> tuple[list[StreamResult], float]:
    """All prompts at once; every `disconnect_every`-th client hangs up after 2 chunks."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [one_stream(client, i, p, max_tokens, 2 if disconnect_every and i % disconnect_every == 0 else None)
                 for i, p in enumerate(prompts)]
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s)
        return list(results), time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]
