"""Notebook 10's demo (`minivllm.teaching.two_streams`) cannot hang: the second caller joins while
the first decodes when it can, starts after it when the first ends early (the event starved), and a
stalled stream ends the demo with a TimeoutError instead of waiting for ever."""

from __future__ import annotations

import asyncio
import time

import pytest

from minivllm import LLMEngine, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.teaching.two_streams import two_streams

PROMPTS = ({"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]})


@pytest.fixture()
def async_engine(qwen3_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, block_size=4, num_kv_blocks=64)))
    yield engine
    engine.shutdown()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_the_second_joins_while_the_first_decodes(async_engine):
    result = asyncio.run(two_streams(async_engine, PROMPTS, (greedy(40), greedy(8)), join_after=3))
    assert result.joined_while_decoding and result.first_tokens_at_join >= 3
    assert result.tokens("first")[-1] == 40 and result.tokens("second")[-1] == 8
    first_after_join = [i for i, e in enumerate(result.events) if e.caller == "first" and e.tokens > 3]
    assert any(e.caller == "second" for e in result.events[:first_after_join[-1]])  # interleaved
    assert "joined while first was decoding" in result.describe()


def test_a_starved_event_still_lets_the_second_run(async_engine):
    """The first ends after 1 token, so its 3rd never comes: the old demo waited for ever here."""
    result = asyncio.run(two_streams(async_engine, PROMPTS, (greedy(1), greedy(5)), join_after=3,
                                     timeout_s=60))
    assert not result.joined_while_decoding and result.first_tokens_at_join == 1
    assert result.tokens("first") == [1] and result.tokens("second")[-1] == 5
    assert "first ended after 1 token(s)" in result.describe()


class _StallingEngine:
    """An engine whose first stream yields one token and then never another (a stalled worker)."""

    async def generate(self, prompt, sampling_params=None, request_id=None):
        yield RequestOutput(request_id, None, [1], [CompletionOutput(0, "a", [7], None)], False)
        await asyncio.Event().wait()  # nobody sets it
        yield  # pragma: no cover  (makes this an async generator; never reached)


def test_a_stalled_stream_ends_the_demo_with_a_timeout():
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="first had 1 tokens, second 0"):
        asyncio.run(two_streams(_StallingEngine(), ("x", "y"), (greedy(5), greedy(5)), timeout_s=0.5))
    assert time.perf_counter() - start < 30  # bounded: the timeout, not a hang
