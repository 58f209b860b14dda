"""Two callers streaming from one `AsyncLLMEngine`, the second joining while the first decodes
(notebook 10's demo, kept here so that a test can run it and starve it).

    first   ──token 1──token 2──token 3──token 4── ...             one engine, one worker thread
                                  │ the join: the first has `join_after` tokens (or has ended)
    second                        └─add──prefill──token 1── ...    from here on they share steps

The second caller starts on an *event*, not after a guessed delay, so the demo does not depend on
how fast the machine is. Every wait is bounded:

- the event is set by the first stream's `join_after`-th token, and also when the first stream ends
  for any reason (it finished early, stopped on EOS, failed): an event nobody can set any more is
  never waited on;
- the whole demo runs under `timeout_s`; a stream that stalls raises `TimeoutError` saying how far
  each caller got, and cancelling the callers aborts their requests (`AsyncLLMEngine.generate`).

The result records what happened, not what was meant to: whether the second joined while the first
was still decoding, and how many tokens the first had then. The notebook prints that.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class StreamingEngine(Protocol):
    """What the demo needs of an engine: `AsyncLLMEngine.generate`'s signature."""

    def generate(self, prompt: str, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]: ...


class StreamEvent(NamedTuple):
    """One output as a caller received it: who, and how many tokens it had then."""

    caller: str
    tokens: int


@dataclass(frozen=True)
class TwoStreams:
    """What the demo saw, in the order the outputs arrived."""

    texts: dict[str, str]  # caller -> its final text
    events: list[StreamEvent]
    join_after: int  # the token count the second caller waited for
    first_tokens_at_join: int  # how many tokens the first had when the second was let in
    joined_while_decoding: bool  # False: the first ended before its `join_after`-th token

    def tokens(self, caller: str) -> list[int]:
        """The token counts one caller saw, output by output."""
        return [e.tokens for e in self.events if e.caller == caller]

    def describe(self) -> str:
        """One sentence on how the second caller started."""
        if self.joined_while_decoding:
            return (f"second joined while first was decoding: first had {self.first_tokens_at_join} "
                    f"tokens (it waited for {self.join_after})")
        return (f"first ended after {self.first_tokens_at_join} token(s), before its "
                f"{self.join_after}th: second started after it, so they shared no step")


async def two_streams(engine: StreamingEngine, prompts: tuple[str, str],
                      params: tuple[SamplingParams, SamplingParams], join_after: int = 3,
                      timeout_s: float = 120.0) -> TwoStreams:
    """Stream `prompts[0]` as "first"; start "second" once first has `join_after` tokens or has
    ended. Raises TimeoutError if both are not done within `timeout_s` seconds."""
    events: list[StreamEvent] = []
    let_in = asyncio.Event()
    at_join = StreamEvent("first", 0)  # first's tokens when the door opened
    while_decoding = False

    def open_the_door(tokens: int, decoding: bool) -> None:
        nonlocal at_join, while_decoding
        if not let_in.is_set():
            at_join, while_decoding = StreamEvent("first", tokens), decoding
            let_in.set()

    async def first() -> str:
        tokens, text = 0, ""
        try:
            async for out in engine.generate(prompts[0], params[0], request_id="first"):
                tokens, text = len(out.outputs[0].token_ids), out.outputs[0].text
                events.append(StreamEvent("first", tokens))
                if tokens >= join_after:  # >=, not ==: one output may carry several tokens
                    open_the_door(tokens, decoding=not out.finished)
        finally:  # ended, failed or cancelled: nobody may wait for a token that will never come
            open_the_door(tokens, decoding=False)
        return text

    async def second() -> str:
        await let_in.wait()  # bounded: set by first's join_after-th token or by its end
        text = ""
        async for out in engine.generate(prompts[1], params[1], request_id="second"):
            text = out.outputs[0].text
            events.append(StreamEvent("second", len(out.outputs[0].token_ids)))
        return text

    both = asyncio.gather(first(), second())
    try:
        texts = await asyncio.wait_for(both, timeout_s)  # a timeout cancels both callers: aborts
    except asyncio.TimeoutError:
        got = {name: max((e.tokens for e in events if e.caller == name), default=0)
               for name in ("first", "second")}
        raise TimeoutError(f"the two streams did not finish within {timeout_s:g} s (first had "
                           f"{got['first']} tokens, second {got['second']}): a stalled engine?") from None
    return TwoStreams(dict(zip(("first", "second"), texts)), events, join_after, at_join.tokens,
                      while_decoding)
