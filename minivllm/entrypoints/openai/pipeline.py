"""One request's path through the server, the same under every endpoint.

    POST body ─> the endpoint's request (protocol.py; /v1/responses: responses_protocol.py, as a chat request)
      1 preprocess.py   ServingContext.admit: checks, chat template or prompt, tokens, length   ─> engine prompts
      2 pipeline.py     Run.start: engine.generate, or beam_search.py; metrics.py observes      ─> engine outputs
      3 streams.py      finals (whole) or merge (streamed); ChoiceTracker: each choice's Delta
      4 postprocess.py  Postprocessor: echo, reasoning split, tool-call parse, logprobs; usage  ─> Processed
      5 serving_*.py    the protocol's shape: a chat.completion, a text_completion, a response (or their events)

Each stage is one module, called once, in that order: data never climbs back up. The endpoints differ only
at the two ends: what they render into prompts (stage 1's `render`, and which Postprocessor steps apply)
and how they shape a `Processed` (stage 5). A new endpoint is a new pair of ends, never a copy of the
middle.

`Run` holds what stages 2-4 share for one request: its engine generators (one per prompt), the tracker of
what each choice already sent, the post-processor's state, and the latest output of each prompt (usage).
Its generators are closed (the engine requests aborted) whenever the consumer stops (streams.py's rule).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from starlette.requests import Request

from minivllm.entrypoints.openai import streams
from minivllm.entrypoints.openai.beam_search import beam_search
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.postprocess import Postprocessor, Processed, usage
from minivllm.entrypoints.openai.preprocess import Request as ApiRequest
from minivllm.entrypoints.openai.preprocess import ServingContext, TokensPrompt
from minivllm.entrypoints.openai.protocol import new_id
from minivllm.entrypoints.openai.streams import ChoiceTracker
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

PostprocessorFactory = Callable[[list[TokensPrompt], SamplingParams], Postprocessor]


class Run:
    """One admitted request in the engine, from its prompts to its post-processed choices."""

    def __init__(self, prompts: list[TokensPrompt], sp: SamplingParams,
                 gens: list[AsyncIterator[RequestOutput]], post: Postprocessor) -> None:
        self.prompts, self.sp, self.gens, self.post = prompts, sp, gens, post
        self.tracker = ChoiceTracker(sp.n)
        self.latest: dict[int, RequestOutput] = {}  # prompt index -> its latest output: what usage counts

    @classmethod
    async def start(cls, ctx: ServingContext, req: ApiRequest, render: Callable[[], list[TokensPrompt]],
                    metrics: ServerMetrics, rid: str, postprocessor: PostprocessorFactory) -> Run:
        """Stages 1 and 2: admit the request (raises ApiError) and hand each prompt to the engine.
        `postprocessor` builds stage 4 from the prompts (a reasoning parser reads where they leave off)."""
        prompts, sp = await ctx.admit(req, render)
        beams = req.beam_search_params(ctx.limits)  # use_beam_search: n beams (beam_search.py)
        # Engine ids stay unique even when clients reuse a request_id.
        gens = [metrics.track(beam_search(ctx.engine, p, beams, new_id(f"{rid}-{i}"), req.priority)
                              if beams is not None else
                              ctx.engine.generate(p, sp, new_id(f"{rid}-{i}"), req.priority), sp)
                for i, p in enumerate(prompts)]
        return cls(prompts, sp, gens, postprocessor(prompts, sp))

    async def whole(self, raw: Request) -> list[Processed] | None:
        """Stages 3 and 4 at once: every choice, whole, in index order; None if the client left first."""
        finals = await streams.finals(self.gens, raw)
        if finals is None:
            return None
        self.latest = dict(enumerate(finals))
        return [self.post.process(d) for i, out in enumerate(finals) for d in self.tracker.deltas(i, out)]

    async def stream(self) -> AsyncIterator[tuple[RequestOutput, list[Processed]]]:
        """Stages 3 and 4 as outputs come: each engine output with what its choices gained (maybe nothing)."""
        async with aclosing(streams.merge(self.gens)) as outputs:
            async for i, out in outputs:
                self.latest[i] = out
                yield out, [self.post.process(d) for d in self.tracker.deltas(i, out)]

    def usage(self, *, generated: bool = True) -> dict[str, Any]:
        """The request's usage so far (all of it, once the choices have ended)."""
        return usage(list(self.latest.values()), generated=generated)
