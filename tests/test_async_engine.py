"""AsyncLLMEngine: many concurrent callers on one engine, joining the running batch, cancellation,
and how each kind of failure reaches the callers (refused, failed step, dead engine)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from minivllm import LLMEngine, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.request.errors import EngineDeadError, StepFailedError


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


def test_unservable_request_is_refused_before_any_output(async_engine):
    async def main():
        async for _ in async_engine.generate({"prompt_token_ids": [5] * 600}, SamplingParams()):
            pass

    with pytest.raises(ValueError, match="max_model_len"):  # not an "error" output after a step
        asyncio.run(main())


def test_cancel_while_the_add_is_queued_aborts(async_engine, monkeypatch):
    """A caller that leaves while its add waits behind a long step must never run."""
    step, gate, in_step, seen = async_engine.engine.step, threading.Event(), threading.Event(), set()

    def slow_step():
        in_step.set()
        gate.wait(10)  # the first step is slow; commands queue up behind it
        outputs = step()
        seen.update(o.request_id for o in outputs)
        return outputs

    monkeypatch.setattr(async_engine.engine, "step", slow_step)

    async def main():
        first = asyncio.create_task(_collect(async_engine.generate({"prompt_token_ids": [5, 6, 7]},
                                                                   SamplingParams(max_tokens=3), "first")))
        await asyncio.to_thread(in_step.wait, 10)
        sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        queued = asyncio.create_task(_collect(async_engine.generate({"prompt_token_ids": [8, 9]}, sp, "queued")))
        await asyncio.sleep(0.05)  # "queued" now awaits its add
        queued.cancel()  # only asked: the caller leaves (its abort is queued behind its add) when the loop
        with contextlib.suppress(asyncio.CancelledError):  # runs the task, so wait for that before the step
            await queued  # ends, or the worker may take the add alone and step it before the abort arrives
        gate.set()
        await first
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert "first" in seen and "queued" not in seen, "a cancelled caller's request ran"
    assert "queued" not in async_engine.engine.requests


def test_failed_step_fails_its_callers_and_the_engine_goes_on(async_engine, monkeypatch):
    step, failures = async_engine.engine.step, [RuntimeError("no single request to blame")]

    def flaky_step():
        if failures:
            raise failures.pop()
        return step()

    async def main():
        gen = async_engine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, ignore_eos=True))
        await gen.__anext__()
        monkeypatch.setattr(async_engine.engine, "step", flaky_step)
        with pytest.raises(StepFailedError, match="rolled back.*no single request to blame"):
            async for _ in gen:
                pass
        return await _collect(async_engine.generate({"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=4)))

    outs = asyncio.run(main())
    assert outs[-1].finished and async_engine.is_healthy
    assert not async_engine.engine.requests


def test_a_proposer_failure_still_delivers_what_finished_in_its_step(async_engine, monkeypatch):
    """The proposer fails after the commit of the step in which "short" finished: "short"'s caller gets its
    final output (its step stands, it failed nothing); only "long", still running, gets StepFailedError."""
    engine, fired = async_engine.engine, []
    after_commit = engine._after_commit

    def proposer_fails_once(scheduler_output=None, runner_output=None):
        after_commit(scheduler_output, runner_output)
        if scheduler_output is not None and not fired and any(
                s.seq.request_id == "short" and s.seq.is_finished for s in scheduler_output.scheduled):
            fired.append(True)
            raise RuntimeError("injected proposer failure")

    monkeypatch.setattr(engine, "_after_commit", proposer_fails_once)
    sp = SamplingParams(max_tokens=50, ignore_eos=True)

    async def main():
        long = async_engine.generate({"prompt_token_ids": [5, 6, 7]}, sp, "long")
        await long.__anext__()  # decoding: it is in the step where "short" finishes
        short = await _collect(async_engine.generate({"prompt_token_ids": [8, 9]},
                                                     SamplingParams(max_tokens=2, ignore_eos=True), "short"))
        with pytest.raises(StepFailedError, match="proposer failed after it.*injected proposer failure"):
            async for _ in long:
                pass
        return short

    short = asyncio.run(main())
    assert fired and short[-1].finished and short[-1].error is None
    assert short[-1].outputs[0].finish_reason == "length" and len(short[-1].outputs[0].token_ids) == 2
    assert not engine.has_unfinished_requests() and async_engine.is_healthy


def _assert_dead(async_engine, needle: str) -> None:
    assert not async_engine.is_healthy
    with pytest.raises(EngineDeadError, match=needle):
        async_engine.check_health()

    async def new_request():
        async for _ in async_engine.generate({"prompt_token_ids": [8, 9]}, SamplingParams()):
            pass

    with pytest.raises(EngineDeadError, match=needle):  # refused at once, not left waiting
        asyncio.run(asyncio.wait_for(new_request(), timeout=120))  # a bound only a hang reaches


@pytest.mark.parametrize("fault,needle", [
    ("step", "illegal memory access"),  # LLMEngine.step raises EngineDeadError: fatal
    ("get_stats", r"worker thread died \(RuntimeError: bug in the loop\)"),  # escapes the worker loop
])
def test_fatal_error_fails_every_caller_and_health(async_engine, monkeypatch, fault, needle):
    def fatal(*_):
        if fault == "step":
            raise EngineDeadError("CUDA error: an illegal memory access was encountered")
        raise RuntimeError("bug in the loop")

    async def main():
        gens = [async_engine.generate({"prompt_token_ids": [5 + i, 6]}, SamplingParams(max_tokens=50, ignore_eos=True))
                for i in range(2)]
        for gen in gens:
            await gen.__anext__()
        monkeypatch.setattr(async_engine.engine, fault, fatal)
        for gen in gens:
            with pytest.raises(EngineDeadError, match=needle):
                await asyncio.wait_for(_collect(gen), timeout=120)

    asyncio.run(main())
    _assert_dead(async_engine, needle)
