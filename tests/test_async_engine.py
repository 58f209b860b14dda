"""AsyncLLMEngine: many concurrent callers on one engine, joining the running batch, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from minivllm import LLMEngine, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine


@pytest.fixture()
def async_engine(qwen3_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, block_size=4, num_kv_blocks=64)))
    yield engine
    engine.shutdown()


def test_late_request_joins_the_running_batch(async_engine):
    async def main():
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        first = async_engine.generate({"prompt_token_ids": [5, 6, 7]}, sp, "first")
        outs = [await first.__anext__()]  # the first request is decoding
        second = asyncio.create_task(_collect(async_engine.generate({"prompt_token_ids": [8, 9]}, sp, "second")))
        async for out in first:
            outs.append(out)
        return outs, await second

    first_outs, second_outs = asyncio.run(main())
    assert first_outs[-1].finished and second_outs[-1].finished
    stats = async_engine.stats
    assert stats.num_mixed_steps >= 1  # the newcomer's prefill ran beside the first one's decodes
    assert stats.num_steps < 40 + 40  # ... and they shared their decode steps


def test_cancelling_a_consumer_aborts_and_frees_blocks(async_engine):
    async def main():
        sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gen = async_engine.generate({"prompt_token_ids": list(range(5, 30))}, sp, "cancel-me")
        await gen.__anext__()
        await gen.aclose()  # what a disconnecting client does
        for _ in range(100):
            await asyncio.sleep(0.02)
            if async_engine.stats.num_free_blocks == 64 and not async_engine.engine.requests:
                return True
        return False

    assert asyncio.run(main())


def test_bad_request_raises_in_the_caller(async_engine):
    async def main():
        async for _ in async_engine.generate({"prompt_token_ids": []}, SamplingParams()):
            pass

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(main())


async def _collect(gen):
    return [out async for out in gen]
