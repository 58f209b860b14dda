"""The OpenAI-compatible API over an `AsyncLLMEngine`.

    GET  /health                 200 {"status": "ok"}
    GET  /v1/models              the one served model
    GET  /metrics                Prometheus text (see metrics.py)
    POST /v1/completions         prompt: str | [str] | [int] | [[int]]; stream or not
    POST /v1/chat/completions    messages through the tokenizer's chat template; stream or not

Streaming is Server-Sent Events: `data: {chunk}` lines in OpenAI's chunk shapes, an optional usage
chunk (`stream_options.include_usage`), then `data: [DONE]`. A client that disconnects mid-stream
cancels its generator, which aborts the request and frees its KV blocks. Bad requests get OpenAI's
error JSON: 400 (bad values, prompt too long, n > 1), 404 (unknown model), 422 (malformed body).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse

from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
    usage,
)
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

_FINISH = {"stop": "stop", "length": "length"}


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def build_app(engine: AsyncLLMEngine, model_name: str, defaults: dict[str, Any] | None = None) -> FastAPI:
    app = FastAPI(title="minivllm", description="OpenAI-compatible API of a minivllm engine")
    metrics = ServerMetrics(engine)
    defaults = defaults or {}
    tokenizer = engine.engine.tokenizer

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, e: BadRequest) -> JSONResponse:
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return JSONResponse(error_body(e.message, kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the request body is not valid JSON ({first.get('msg')})"),
                                status_code=422)
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return JSONResponse(error_body(f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                                       param=where or None), status_code=422)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": now(), "owned_by": "minivllm",
                "max_model_len": engine.engine.config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def prepare(req: CompletionRequest | ChatCompletionRequest, prompts: list, max_tokens: int | None
                ) -> SamplingParams:
        if req.model is not None and req.model != model_name:
            raise BadRequest(404, f"The model `{req.model}` does not exist; this server serves `{model_name}`.",
                             "model", "model_not_found")
        if req.n != 1:
            raise BadRequest(400, "n > 1 is not supported yet; send n separate requests", "n")
        try:
            sp = req.sampling_params(defaults, max_tokens)
            for p in prompts:
                reason = engine.check_request(p, sp)
                if reason is not None:
                    raise BadRequest(400, reason, "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                                     "context_length_exceeded")
        except (ValueError, TypeError) as e:
            field = str(e).split("=")[0].removeprefix("SamplingParams.") if "SamplingParams." in str(e) else None
            raise BadRequest(400, str(e), field) from e
        return sp

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        prompts = req.prompts()
        sp = prepare(req, prompts, req.max_tokens)
        rid, created = new_id("cmpl"), now()
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        gens = [engine.generate(p, sp, f"{rid}-{i}") for i, p in enumerate(prompts)]
        if not req.stream:
            finals = await _finals(gens, raw)
            return {**head, "choices": [{"index": i, "text": o.outputs[0].text, "logprobs": None,
                                         "finish_reason": _FINISH.get(o.outputs[0].finish_reason, "stop")}
                                        for i, o in enumerate(finals)], "usage": _usage(finals)}

        async def events() -> AsyncIterator[str]:
            sent, finals = [0] * len(gens), {}
            async for i, out in _merge(gens):
                c = out.outputs[0]
                delta, sent[i] = c.text[sent[i]:], len(c.text)
                if delta or out.finished:
                    fr = _FINISH.get(c.finish_reason, "stop") if out.finished else None
                    yield json.dumps({**head, "choices": [{"index": i, "text": delta, "logprobs": None,
                                                           "finish_reason": fr}]})
                if out.finished:
                    finals[i] = out
            if req.stream_options and req.stream_options.include_usage:
                yield json.dumps({**head, "choices": [], "usage": _usage(list(finals.values()))})
            yield "[DONE]"

        return EventSourceResponse(events(), ping=600)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        if getattr(tokenizer, "chat_template", None) is None:
            raise BadRequest(400, "this model has no chat template; use /v1/completions", "messages")
        text = tokenizer.apply_chat_template([m.text() for m in req.messages], tokenize=False,
                                             add_generation_prompt=True)
        prompt = {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}
        sp = prepare(req, [prompt], req.limit())
        rid, created = new_id("chatcmpl"), now()
        gen = engine.generate(prompt, sp, rid)
        if not req.stream:
            [final] = await _finals([gen], raw)
            c = final.outputs[0]
            return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                                 "finish_reason": _FINISH.get(c.finish_reason, "stop")}], "usage": _usage([final])}
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}

        def chunk(delta: dict[str, str], finish: str | None) -> str:
            return json.dumps({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                    "finish_reason": finish}]})

        async def events() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": ""}, None)
            sent, final = 0, None
            async for out in gen:
                c = out.outputs[0]
                if len(c.text) > sent:
                    yield chunk({"content": c.text[sent:]}, None)
                    sent = len(c.text)
                if out.finished:
                    final = out
                    yield chunk({}, _FINISH.get(c.finish_reason, "stop"))
            if req.stream_options and req.stream_options.include_usage:
                yield json.dumps({**head, "choices": [], "usage": _usage([final])})
            yield "[DONE]"

        return EventSourceResponse(events(), ping=600)

    return app


def _usage(finals: list[RequestOutput]) -> dict[str, int]:
    return usage(sum(len(o.prompt_token_ids) for o in finals), sum(len(o.outputs[0].token_ids) for o in finals))


async def _last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async for out in gen:
        pass
    return out


async def _finals(gens: list[AsyncIterator[RequestOutput]], raw: Request) -> list[RequestOutput]:
    """Run the generators to completion; if the client goes away first, cancel them (aborting)."""
    task = asyncio.ensure_future(asyncio.gather(*(_last(g) for g in gens)))
    while not task.done():
        await asyncio.wait([task], timeout=0.5)
        if not task.done() and await raw.is_disconnected():
            task.cancel()
            for g in gens:
                await g.aclose()
            raise asyncio.CancelledError
    return task.result()


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they arrive; closing this closes (aborts) them all."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as e:  # hand the failure to the consumer rather than dying silently
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        done = 0
        while done < len(gens):
            i, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            done += out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def run_server(model: str | None, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
               **engine_kwargs: Any) -> None:
    """Build the engine, then serve until interrupted (`minivllm serve`)."""
    import sys
    from pathlib import Path

    import uvicorn

    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.model_source import resolve_model

    folder = resolve_model(model)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=folder, **engine_kwargs)))
    name = served_model_name or (model if model and not Path(model).exists() else None) or Path(folder).name
    gen_cfg = Path(folder) / "generation_config.json"
    keys = ("temperature", "top_p", "top_k", "min_p")
    defaults = {k: v for k, v in json.loads(gen_cfg.read_text()).items() if k in keys} if gen_cfg.is_file() else {}
    app = build_app(engine, name, defaults)
    print(f"minivllm: serving {name!r} on http://{host}:{port}/v1 (defaults from generation_config: "
          f"{defaults or 'none'})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        engine.shutdown()
