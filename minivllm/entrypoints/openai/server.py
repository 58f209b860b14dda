"""The OpenAI-compatible API over an `AsyncLLMEngine`.

    GET  /health, GET|POST /ping 200 {"status": "ok"}; 503 with an error body once the engine is dead
    GET  /version                {"version": ...}
    GET  /v1/models              the one served model; /v1/models/{id} that model, or 404
    GET  /metrics                Prometheus text, vLLM's metric names (see metrics.py)
    POST /v1/completions         prompt: str | [str] | [int] | [[int]]; stream or not (serving_completion.py)
    POST /v1/chat/completions    messages through the tokenizer's chat template (serving_chat.py)
    POST /v1/responses           OpenAI's Responses API, read as a chat request (serving_responses.py)
    POST /tokenize, /detokenize  vLLM's: a prompt's or messages' token ids; ids' text (serving_tokenization.py)

A request's way in:

    headers within header_timeout_s (else closed) ─> ApiKeyAuth (401) ─> BodyLimits: size (413), body within
    body_timeout_s (408) ─> pydantic: not JSON or a required field missing (422), a field of the wrong type
    or out of range (400) ─> admit: model (404), fields and sampling params (400) ─> [worker thread] chat
    template + tokenize once, length check (400) ─> engine

- Tokenizing and chat templating cost time in the prompt's length, so they run once, in a worker
  thread (`asyncio.to_thread`): the engine gets {"prompt": text, "prompt_token_ids": ids} and never
  re-tokenizes, and a huge prompt cannot stall /health or the other clients' streams.
- Streaming is Server-Sent Events: `data: {chunk}` lines in OpenAI's chunk shapes, an optional usage
  chunk (`stream_options.include_usage`), then `data: [DONE]`. A failure after the 200 was sent comes
  as one `data: {"error": {...}}` event, then `data: [DONE]`.
- No request outlives its client: a stream's disconnect cancels its generator; a non-streaming
  request polls for the disconnect. Either way the engine aborts the request and frees its blocks.
- Every error is OpenAI's JSON; errors.py has the table (400 401 404 408 413 422 500 503).
- The model card is vLLM's ModelCard: `root` is the model as given to `minivllm serve` (a folder or
  hub id), `parent` None (no adapters), `permission` vLLM's one default ModelPermission.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import uuid
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import minivllm
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.request.errors import EngineDeadError
from minivllm.entrypoints.openai.errors import ApiError, api_error, error_body
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.middleware import ApiKeyAuth, BodyLimits, HeaderDeadline
from minivllm.entrypoints.openai.preprocess import ServingContext
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, now
from minivllm.entrypoints.openai.response_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from minivllm.entrypoints.openai.responses_protocol import ResponsesRequest
from minivllm.entrypoints.openai.serving_chat import create_chat_completion
from minivllm.entrypoints.openai.serving_completion import create_completion
from minivllm.entrypoints.openai.serving_responses import create_response
from minivllm.entrypoints.openai.serving_tokenization import create_detokenize, create_tokenize

# A 2048-token prompt is ~8 KB of English, ~15 KB as JSON token ids, and under 100 KB even as
# \u-escaped text of long tokens; 1 MiB leaves room for 32k-token contexts and batched prompts,
# and refuses before reading a body that could never fit in the context.
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
# A request's headers are a few hundred bytes and its body at most max_request_bytes: 10 s and 30 s
# (1 MiB at 35 KB/s) are ample for any honest client, and bound how long a stalled one holds a socket.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's and vLLM's default)
SHUTDOWN_S = 10  # Ctrl-C waits this long for requests in flight, then cuts them
# Keys of the model's generation_config.json that become request defaults (as in vLLM).
GENERATION_CONFIG_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

log = logging.getLogger("minivllm.server")


def build_app(engine: AsyncLLMEngine, model_name: str, defaults: dict[str, Any] | None = None, *,
              api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, root: str | None = None,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> FastAPI:
    """The app; `root` is the model card's (default: the engine's checkpoint); `max_stored_responses`: how many
    /v1/responses answers previous_response_id can name (in memory, the oldest evicted first)."""
    app = FastAPI(title="minivllm", description="OpenAI-compatible API of a minivllm engine")
    app.add_middleware(BodyLimits, max_bytes=max_request_bytes, timeout_s=body_timeout_s)
    if api_key:  # added last = runs first: no body is read for a client without the key
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    metrics = ServerMetrics(engine, model_name)
    ctx = ServingContext(engine, model_name, defaults or {})
    responses = ResponseStore(max_stored_responses)
    _error_handlers(app)

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's: what SageMaker-style load balancers poll
    async def health() -> Any:
        try:
            engine.check_health()
        except EngineDeadError as e:
            return JSONResponse(api_error(e).body(), status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": minivllm.__version__}

    def card() -> dict[str, Any]:
        created = now()
        permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return {"id": model_name, "object": "model", "created": created, "owned_by": "minivllm",
                "root": root or engine.engine.config.model, "parent": None,
                "max_model_len": engine.engine.config.max_model_len, "permission": [permission]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")  # :path: an id such as "Qwen/Qwen3-0.6B" has a slash
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist; this server serves `{model_name}`.",
                           "model", "model_not_found")
        return card()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await create_completion(ctx, req, raw, metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        return await create_chat_completion(ctx, req, raw, metrics)

    @app.post("/v1/responses")
    async def create_responses(req: ResponsesRequest, raw: Request) -> Any:
        return await create_response(ctx, req, raw, metrics, responses)

    @app.post("/tokenize")  # a JSON object, read as one of two requests (serving_tokenization.py)
    async def tokenize(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        return await create_tokenize(ctx, body)

    @app.post("/detokenize")
    async def detokenize(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        return await create_detokenize(ctx, body)

    return app


# pydantic's errors that mean "this body is not a request" (422): not JSON, not an object, a required
# field missing. Any other names a field whose value is bad (400): the wrong type (strict: `"n": true`),
# out of range, not finite.
_MALFORMED = ("json_invalid", "missing")
# Out of range: the message ends with pydantic's type too, which vLLM's answer carries and its clients match
# ("seed: Input should be less than or equal to 9223372036854775807 (less_than_equal)").
_RANGE = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        if e.status >= 500:
            log.warning("%s", e.message)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the request body is not valid JSON ({first.get('msg')})"),
                                status_code=422)
        where = _where(first.get("loc", ()))
        # A union (prompt: str | [str] | [int] | [[int]]) fails once per form: say so, not just the first.
        same = [err.get("msg", "") for err in errors if _where(err.get("loc", ())) == where]
        message = same[0] if len(same) == 1 else "matches none of the accepted forms: " + "; ".join(dict.fromkeys(same))
        if len(same) == 1 and first.get("type") in _RANGE:
            message += f" ({first['type']})"
        status = 422 if not where or first.get("type") in _MALFORMED else 400
        return JSONResponse(error_body(f"{where or 'body'}: {message or 'invalid request'}", param=where or None),
                            status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:  # a body it cannot parse, 404, 405
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:  # a bug: Starlette also logs the traceback
        return JSONResponse(error_body(f"internal server error ({type(e).__name__}: {e})", "server_error"),
                            status_code=500)


def _where(loc: tuple) -> str:
    """'messages[0].content' from pydantic's ('body', 'messages', 0, 'content', 'str'): a union's member
    tags ('str', 'list[int]') are not fields, so the name stops there."""
    where = ""
    for part in loc[1:]:
        if isinstance(part, int):
            where += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "list", "dict") or "[" in part:
            break
        else:
            where += f".{part}" if where else part
    return where


def uvicorn_options(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> dict[str, Any]:
    """uvicorn's settings for the connections (for `uvicorn.run` or `uvicorn.Config`): the header
    deadline's protocol, the keep-alive and shutdown timeouts."""
    if not header_timeout_s > 0:
        raise ValueError(f"header timeout {header_timeout_s}: must be a positive number of seconds")
    return {"http": functools.partial(HeaderDeadline, header_timeout_s=header_timeout_s),
            "timeout_keep_alive": KEEP_ALIVE_S, "timeout_graceful_shutdown": SHUTDOWN_S}


def run_server(model: str | None, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
               *, api_key: str | None = None, max_request_bytes: int | None = None,
               header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES, **engine_kwargs: Any) -> None:
    """Build the engine, then serve until interrupted (`minivllm serve`). Without `api_key`, the
    MINIVLLM_API_KEY environment variable is used if set (as vLLM's VLLM_API_KEY); an empty key is
    refused (it would leave the server open while looking guarded). Without `max_request_bytes`,
    DEFAULT_MAX_REQUEST_BYTES."""
    import sys
    from pathlib import Path

    import uvicorn

    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.model_source import resolve_model

    max_request_bytes = DEFAULT_MAX_REQUEST_BYTES if max_request_bytes is None else max_request_bytes
    if max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes {max_request_bytes}: must be a positive number of bytes")
    if not body_timeout_s > 0:
        raise ValueError(f"body timeout {body_timeout_s}: must be a positive number of seconds")
    options = uvicorn_options(header_timeout_s)
    api_key = _api_key(api_key)
    folder = resolve_model(model)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=folder, **engine_kwargs)))
    name = served_model_name or (model if model and not Path(model).exists() else None) or Path(folder).name
    gen_cfg = Path(folder) / "generation_config.json"
    defaults = ({k: v for k, v in json.loads(gen_cfg.read_text()).items() if k in GENERATION_CONFIG_DEFAULTS}
                if gen_cfg.is_file() else {})
    app = build_app(engine, name, defaults, api_key=api_key, max_request_bytes=max_request_bytes,
                    body_timeout_s=body_timeout_s, root=model or folder, max_stored_responses=max_stored_responses)
    print(f"minivllm: serving {name!r} on http://{host}:{port}/v1 (defaults from generation_config: "
          f"{defaults or 'none'}; API key {'required' if api_key else 'not required'})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", log_config=_log_config(), **options)
    finally:
        engine.shutdown()


def _api_key(api_key: str | None) -> str | None:
    """The key to require: --api-key, else $MINIVLLM_API_KEY, else None. Set but empty is an error,
    not "no key": whoever set it meant to guard the server. Surrounding spaces are refused too: the
    header's value is trimmed, so such a key could never match."""
    where = "--api-key"
    if api_key is None:
        api_key, where = os.environ.get("MINIVLLM_API_KEY"), "MINIVLLM_API_KEY"
    if api_key is None:
        return None
    if not api_key.strip():
        raise ValueError(f"{where} is empty, which would leave /v1/* open to anyone; give a key, or leave "
                         f"{where} out to serve without one")
    if api_key != api_key.strip():
        raise ValueError(f"{where} starts or ends with whitespace, which an Authorization header cannot "
                         "carry (its value is trimmed); remove it")
    return api_key


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, plus our one-line notes (disconnects, failed requests) at INFO."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"][log.name] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config
