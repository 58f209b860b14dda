"""The OpenAI-compatible API over an `AsyncLLMEngine`.

    GET  /health                 200 {"status": "ok"}; 503 with an error body once the engine is dead
    GET  /version                {"version": ...}
    GET  /v1/models              the one served model
    GET  /metrics                Prometheus text (see metrics.py)
    POST /v1/completions         prompt: str | [str] | [int] | [[int]]; stream or not
    POST /v1/chat/completions    messages through the tokenizer's chat template; stream or not

A request's way in:

    ApiKeyAuth (401) ─> BodySizeLimit (413) ─> pydantic shape (422) ─> admit: model, n, sampling
    params (400) ─> [worker thread] chat template + tokenize once, length check (400) ─> engine

- Tokenizing and chat templating cost time in the prompt's length, so they run once, in a worker
  thread (`asyncio.to_thread`): the engine gets {"prompt": text, "prompt_token_ids": ids} and never
  re-tokenizes, and a huge prompt cannot stall /health or the other clients' streams.
- Streaming is Server-Sent Events: `data: {chunk}` lines in OpenAI's chunk shapes, an optional usage
  chunk (`stream_options.include_usage`), then `data: [DONE]`. A failure after the 200 was sent comes
  as one `data: {"error": {...}}` event, then `data: [DONE]`.
- No request outlives its client: a stream's disconnect cancels its generator; a non-streaming
  request polls for the disconnect. Either way the engine aborts the request and frees its blocks.
- Every error is OpenAI's JSON; errors.py has the table (400 401 404 413 422 500 503).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse

import minivllm
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.errors import EngineDeadError
from minivllm.entrypoints.openai import streams
from minivllm.entrypoints.openai.errors import ApiError, api_error
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.middleware import ApiKeyAuth, BodySizeLimit
from minivllm.entrypoints.openai.preprocess import TokensPrompt, chat_prompt, completion_prompts, render_and_check
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

# A 2048-token prompt is ~8 KB of English, ~15 KB as JSON token ids, and under 100 KB even as
# \u-escaped text of long tokens; 1 MiB leaves room for 32k-token contexts and batched prompts,
# and refuses before reading a body that could never fit in the context.
DEFAULT_MAX_REQUEST_BYTES = 1 << 20

_FINISH = {"stop": "stop", "length": "length"}

log = logging.getLogger("minivllm.server")


def build_app(engine: AsyncLLMEngine, model_name: str, defaults: dict[str, Any] | None = None, *,
              api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    app = FastAPI(title="minivllm", description="OpenAI-compatible API of a minivllm engine")
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if api_key:  # added last = runs first: no body is read for a client without the key
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    metrics = ServerMetrics(engine)
    defaults = defaults or {}
    tokenizer = engine.engine.tokenizer
    _error_handlers(app)

    @app.get("/health")
    async def health() -> Any:
        try:
            engine.check_health()
        except EngineDeadError as e:
            return JSONResponse(api_error(e).body(), status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": minivllm.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": now(), "owned_by": "minivllm",
                "max_model_len": engine.engine.config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def admit(req: CompletionRequest | ChatCompletionRequest, render: Callable[[], list[TokensPrompt]],
                    max_tokens: int | None) -> tuple[list[TokensPrompt], SamplingParams]:
        """Check the request and tokenize it (once, off the event loop); raises ApiError."""
        if req.model is not None and req.model != model_name:
            raise ApiError(404, f"The model `{req.model}` does not exist; this server serves `{model_name}`.",
                           "model", "model_not_found")
        if req.n != 1:
            raise ApiError(400, "n > 1 is not supported yet; send n separate requests", "n")
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        try:
            engine.check_health()
            sp = req.sampling_params(defaults, max_tokens)
            return await asyncio.to_thread(render_and_check, engine, render, sp, param), sp
        except Exception as e:
            raise api_error(e, param) from e

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        prompts, sp = await admit(req, lambda: completion_prompts(tokenizer, req), req.max_tokens)
        rid, created = new_id("cmpl"), now()
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        gens = [engine.generate(p, sp, f"{rid}-{i}") for i, p in enumerate(prompts)]
        if not req.stream:
            finals = await streams.finals(gens, raw)
            if finals is None:
                return _client_left(rid)
            return {**head, "choices": [{"index": i, "text": o.outputs[0].text, "logprobs": None,
                                         "finish_reason": _FINISH.get(o.outputs[0].finish_reason, "stop")}
                                        for i, o in enumerate(finals)], "usage": _usage(finals)}

        def chunk(i: int, text: str, finish: str | None) -> str:
            return json.dumps({**head, "choices": [{"index": i, "text": text, "logprobs": None,
                                                    "finish_reason": finish}]})

        async def body() -> AsyncIterator[str]:
            sent, finals = [0] * len(gens), {}
            async with aclosing(streams.merge(gens)) as outputs:
                async for i, out in outputs:
                    c = out.outputs[0]
                    delta, sent[i] = c.text[sent[i]:], len(c.text)
                    if delta or out.finished:
                        yield chunk(i, delta, _FINISH.get(c.finish_reason, "stop") if out.finished else None)
                    if out.finished:
                        finals[i] = out
            if req.stream_options and req.stream_options.include_usage:
                yield json.dumps({**head, "choices": [], "usage": _usage(list(finals.values()))})

        return EventSourceResponse(streams.sse(rid, body()), ping=600)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        [prompt], sp = await admit(req, lambda: [chat_prompt(tokenizer, req)], req.limit())
        rid, created = new_id("chatcmpl"), now()
        gen = engine.generate(prompt, sp, rid)
        if not req.stream:
            finals = await streams.finals([gen], raw)
            if finals is None:
                return _client_left(rid)
            c = finals[0].outputs[0]
            return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                                 "finish_reason": _FINISH.get(c.finish_reason, "stop")}], "usage": _usage(finals)}
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}

        def chunk(delta: dict[str, str], finish: str | None) -> str:
            return json.dumps({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                    "finish_reason": finish}]})

        async def body() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": ""}, None)
            sent, final = 0, None
            async with aclosing(streams.merge([gen])) as outputs:
                async for _, out in outputs:
                    c = out.outputs[0]
                    if len(c.text) > sent:
                        yield chunk({"content": c.text[sent:]}, None)
                        sent = len(c.text)
                    if out.finished:
                        final = out
                        yield chunk({}, _FINISH.get(c.finish_reason, "stop"))
            if req.stream_options and req.stream_options.include_usage:
                yield json.dumps({**head, "choices": [], "usage": _usage([final])})

        return EventSourceResponse(streams.sse(rid, body()), ping=600)

    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        if e.status >= 500:
            log.warning("%s", e.message)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the request body is not valid JSON ({first.get('msg')})"),
                                status_code=422)
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        # NaN/inf is a bad value (400, like temperature=-1), not a malformed body (422).
        status = 400 if first.get("type") == "finite_number" else 422
        return JSONResponse(error_body(f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                                       param=where or None), status_code=status)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:  # a bug: Starlette also logs the traceback
        return JSONResponse(error_body(f"internal server error ({type(e).__name__}: {e})", "server_error"),
                            status_code=500)


def _client_left(rid: str) -> Response:
    log.info("%s: the client disconnected; its request was aborted", rid)
    return Response(status_code=499)  # nginx's "client closed request": nobody will read it


def _usage(finals: list[RequestOutput]) -> dict[str, int]:
    return usage(sum(len(o.prompt_token_ids) for o in finals), sum(len(o.outputs[0].token_ids) for o in finals))


def run_server(model: str | None, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
               *, api_key: str | None = None, max_request_bytes: int | None = None,
               **engine_kwargs: Any) -> None:
    """Build the engine, then serve until interrupted (`minivllm serve`). Without `api_key`, the
    MINIVLLM_API_KEY environment variable is used if set (as vLLM's VLLM_API_KEY); without
    `max_request_bytes`, DEFAULT_MAX_REQUEST_BYTES."""
    import sys
    from pathlib import Path

    import uvicorn

    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.model_source import resolve_model

    max_request_bytes = DEFAULT_MAX_REQUEST_BYTES if max_request_bytes is None else max_request_bytes
    if max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes {max_request_bytes}: must be a positive number of bytes")
    api_key = api_key or os.environ.get("MINIVLLM_API_KEY") or None
    folder = resolve_model(model)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=folder, **engine_kwargs)))
    name = served_model_name or (model if model and not Path(model).exists() else None) or Path(folder).name
    gen_cfg = Path(folder) / "generation_config.json"
    keys = ("temperature", "top_p", "top_k", "min_p")
    defaults = {k: v for k, v in json.loads(gen_cfg.read_text()).items() if k in keys} if gen_cfg.is_file() else {}
    app = build_app(engine, name, defaults, api_key=api_key, max_request_bytes=max_request_bytes)
    print(f"minivllm: serving {name!r} on http://{host}:{port}/v1 (defaults from generation_config: "
          f"{defaults or 'none'}; API key {'required' if api_key else 'not required'})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", log_config=_log_config())
    finally:
        engine.shutdown()


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, plus our one-line notes (disconnects, failed requests) at INFO."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"][log.name] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config
