"""Two gates in front of the routes, as plain ASGI middleware (they run before FastAPI reads a body).

    client ──> ApiKeyAuth ──> BodySizeLimit ──> FastAPI routes
               401 unless      413 if the body is over max_bytes: by Content-Length before
               Bearer <key>    reading anything, else by counting the (chunked) body as it arrives

- `ApiKeyAuth` guards /v1/* only: /health, /metrics and /version stay open for load balancers and
  scrapers, as in vLLM's `--api-key`. Keys are compared in constant time (`secrets.compare_digest`
  on SHA-256 digests, so neither the length nor a non-ASCII key leaks through timing or raises).
- `BodySizeLimit` refuses a body before it is parsed or tokenized: a huge prompt could never fit in
  the context anyway, and parsing it would cost everybody time on the event loop. A body within the
  limit is read here whole (FastAPI would read it whole too) and replayed to the app.
"""

from __future__ import annotations

import hashlib
import secrets

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.entrypoints.openai.errors import ApiError


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = _sha256(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _guarded(scope) and not self._authorized(Headers(scope=scope)):
            error = ApiError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>` "
                                  "with the key the server was started with (--api-key / MINIVLLM_API_KEY)",
                             code="invalid_api_key")
            response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(_sha256(token.strip()), self._digest)


def _guarded(scope: Scope) -> bool:
    path = scope["path"]
    # CORS preflights carry no credentials by design.
    return scope["method"] != "OPTIONS" and (path == "/v1" or path.startswith("/v1/"))


def _sha256(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(int(length), scope, receive, send)
        # Read the body here, counting, and replay it to the app: a chunked body declares no length.
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left mid-body; the app will see the disconnect
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(size, scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, size: int, scope: Scope, receive: Receive, send: Send) -> None:
        over = "at least " if Headers(scope=scope).get("content-length") is None else ""
        error = ApiError(413, f"the request body is {over}{size} bytes, over this server's limit of "
                              f"{self.max_bytes} bytes; send a shorter prompt, or start the server with a "
                              "larger --max-request-bytes", code="request_too_large")
        # Not "Connection: close": closing a socket with unread data makes the kernel reset the
        # connection, and the client would see a broken pipe instead of this answer. Kept open,
        # uvicorn discards the rest of the body (no parsing, no buffering) and the client reads the 413.
        await JSONResponse(error.body(), status_code=413)(scope, receive, send)
