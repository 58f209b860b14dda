"""Does one heavy request stall the others? A light request's latency beside each kind of heavy request,
as a ratio to its latency alone (same process, same server, medians of alternating rounds).

    python benchmarks/heavy_request.py                 # a tiny random model (seconds)
    python benchmarks/heavy_request.py --model default  # SmolLM2-135M (the default model)

The server runs in this process (the app over httpx's ASGI transport, so each request goes through the
same admission as over a socket: validation and preparation in a worker thread, then the engine). Heavy
requests, each at the largest size the server accepts:
    bad_words      4,096 words                  (MAX_BAD_WORDS)
    stop           256 stop strings              (MAX_STOP_STRINGS)
    allowed ids    every id of the vocabulary, 20 times over
    long prompt    a 1,500-token prompt (its prefill is work every step shares), then
    prompt logprobs  the same with prompt_logprobs=20
A ratio near 1 means the heavy request costs the others nothing but its share of the steps; each heavy
request also generates, so some slowdown (it is one more row in every step) is expected.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import httpx

from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.openai.server import build_app
from minivllm.model_source import resolve_model
from minivllm.sampling_params import MAX_BAD_WORDS, MAX_STOP_STRINGS
from minivllm.teaching.checkpoints import make_tiny_model

LIGHT = {"prompt": "The capital of France is", "max_tokens": 100, "temperature": 0, "ignore_eos": True}


def heavy_requests(vocab: int) -> dict[str, dict]:
    base = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    return {
        "bad_words": {**base, "bad_words": [f"word{i}" for i in range(MAX_BAD_WORDS)]},
        "stop": {**base, "stop": [f"stop string {i}" for i in range(MAX_STOP_STRINGS)]},
        "allowed ids": {**base, "allowed_token_ids": list(range(vocab)) * 20},
        # the same long prompt without and with its logprobs: the prefill's own cost, then what logprobs add
        "long prompt": {**base, "prompt": [5 + i % 300 for i in range(1500)], "max_tokens": 2},
        "prompt logprobs": {**base, "prompt": [5 + i % 300 for i in range(1500)], "prompt_logprobs": 20,
                            "max_tokens": 2},
    }


async def latency(client: httpx.AsyncClient, body: dict) -> float:
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


async def beside(client: httpx.AsyncClient, heavy: dict | None) -> float:
    """The light request's latency, alone or sent just after `heavy`."""
    if heavy is None:
        return await latency(client, LIGHT)
    task = asyncio.create_task(latency(client, heavy))
    await asyncio.sleep(0)  # the heavy one is admitted first
    light = await latency(client, LIGHT)
    await task
    return light


async def run(engine: AsyncLLMEngine, rounds: int) -> None:
    app = build_app(engine, "bench")
    vocab = engine.engine.spec.vocab_size
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
        await beside(client, None)  # warm-up
        for name, heavy in heavy_requests(vocab).items():
            alone, with_heavy = [], []
            for _ in range(rounds):  # alternating, so drift in the machine hits both alike
                alone.append(await beside(client, None))
                with_heavy.append(await beside(client, heavy))
            a, h = statistics.median(alone), statistics.median(with_heavy)
            print(f"  {name:16} light request alone {a * 1e3:7.0f} ms, beside it {h * 1e3:7.0f} ms: {h / a:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint, 'default' for SmolLM2-135M; else a tiny random model")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = (resolve_model(None) if args.model == "default" else args.model
             or str(make_tiny_model(tempfile.mkdtemp(), "qwen3", num_layers=4, hidden_size=256, intermediate_size=512,
                                    max_position_embeddings=2048)))
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model)))
    from minivllm.cpu.cpu_info import CpuInfo

    print(f"{CpuInfo.read()}\nmodel {model}; medians of {args.rounds} alternating rounds")
    try:
        asyncio.run(run(engine, args.rounds))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
