"""The gates in front of the routes. The first is the connection itself (uvicorn's HTTP protocol);
the others are plain ASGI middleware, which run before FastAPI reads a body.

    client ──> HeaderDeadline ──> ApiKeyAuth ──> BodyLimits ──> FastAPI routes
               closed unless the   401 unless     413 if the body is over max_bytes: by Content-Length
               headers arrive      Bearer <key>   before reading anything, else by counting it;
               within timeout_s                   408 (and closed) unless it arrives within timeout_s

- A client that opens a connection and sends nothing, or a few header bytes, or a body that never
  ends, holds a socket and memory for as long as the server waits (slowloris). uvicorn closes idle
  keep-alive connections (`timeout_keep_alive`) but has no deadline for the request itself, so
  `HeaderDeadline` gives each request's headers one, and `BodyLimits` its body. The deadlines are
  for the whole headers and the whole body, not per read: trickling a byte a second does not
  extend them.
- `ApiKeyAuth` guards /v1/* only: /health, /metrics and /version stay open for load balancers and
  scrapers, as in vLLM's `--api-key`. Keys are compared in constant time (`secrets.compare_digest`
  on SHA-256 digests, so neither the length nor a non-ASCII key leaks through timing or raises).
- `BodyLimits` refuses a body before it is parsed or tokenized: a huge prompt could never fit in the
  context anyway, and parsing it would cost everybody time on the event loop. A body within the
  limits is read here whole (FastAPI would read it whole too) and replayed to the app.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from typing import Any, NamedTuple

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from minivllm.entrypoints.openai.errors import ApiError


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for each request's headers: armed when the connection
    opens and again when a response completes (the next request's headers are awaited), disarmed
    once the headers are in. A connection still waiting at the deadline is closed: there is no
    request yet to answer. (Hooks into uvicorn's H11Protocol: `cycle`, `connection_made`,
    `data_received`, `on_response_complete`, `connection_lost`; pass it as uvicorn's `http`.)"""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._awaiting_headers():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may already start a pipelined request
        if self._awaiting_headers() and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.transport.close()


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


class Body(NamedTuple):
    """What `BodyLimits` read: the ASGI messages to replay, and their bytes (over the limit: stopped there)."""
    messages: list[Message]
    size: int


class BodyLimits:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes, self.timeout_s = max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(int(length), scope, receive, send)
        try:  # wait_for, not asyncio.timeout: Python 3.10
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except asyncio.TimeoutError:
            return await self._too_slow(scope, receive, send)
        if body.size > self.max_bytes:
            return await self._refuse(body.size, scope, receive, send)
        messages = body.messages

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> Body:
        """The body's messages, counting: a chunked body declares no length. Stops past max_bytes."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left mid-body; the app will see the disconnect
            size += len(message.get("body", b""))
            if size > self.max_bytes or not message.get("more_body", False):
                break
        return Body(messages, size)

    async def _refuse(self, size: int, scope: Scope, receive: Receive, send: Send) -> None:
        over = "at least " if Headers(scope=scope).get("content-length") is None else ""
        error = ApiError(413, f"the request body is {over}{size} bytes, over this server's limit of "
                              f"{self.max_bytes} bytes; send a shorter prompt, or start the server with a "
                              "larger --max-request-bytes", code="request_too_large")
        # Not "Connection: close": closing a socket with unread data makes the kernel reset the
        # connection, and the client would see a broken pipe instead of this answer. Kept open,
        # uvicorn discards the rest of the body (no parsing, no buffering) and the client reads the 413.
        await JSONResponse(error.body(), status_code=413)(scope, receive, send)

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = ApiError(408, f"the request body did not arrive within {self.timeout_s:g} s; send it at once "
                              "(its Content-Length must match what is sent)", code="request_timeout")
        # "Connection: close": uvicorn closes the socket after the answer; the client has stalled, so
        # there is (next to) nothing unread to reset the connection.
        await JSONResponse(error.body(), status_code=408, headers={"Connection": "close"})(scope, receive, send)
