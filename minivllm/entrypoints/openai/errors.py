"""What a client sees when something goes wrong: every failure becomes one OpenAI error object.

    status  when                                                              error.type
    400     a bad value: the wrong type for its field (strict: `"n": true`),  invalid_request_error
            out of range, NaN/inf; an empty prompt, a prompt too long, a
            chat-template error, a field this server does not implement
    401     /v1/* without the right `Authorization: Bearer <key>`             invalid_request_error
    404     an unknown model                                                  not_found_error
    408     the body did not arrive within the body deadline (then closed)    invalid_request_error
    413     a body over --max-request-bytes                                   invalid_request_error
    422     a body that is not JSON, not a JSON object, or lacks a required   invalid_request_error
            field (`prompt`, `messages`, a message's `role`)
    500     this request failed in the engine, or a step it was in failed     server_error
    503     the engine is dead (fatal device error, worker gone)              server_error

A non-streaming request gets the status and `{"error": {...}}`. A stream has already sent 200, so
it gets the same object as a `data:` event, then `data: [DONE]` (vLLM's shape; the openai client
raises `APIError` on it). A connection whose request headers do not arrive within the header deadline
is closed without an answer: there is no request yet to answer (middleware.py).
"""

from __future__ import annotations

import json
import re

from jinja2 import TemplateError

from minivllm.engine.request.errors import EngineDeadError, StepFailedError
from minivllm.entrypoints.openai.field_policy import RequestError


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON; a stream sends the same object as one `data:` event before `[DONE]`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiError(Exception):
    """An error answer: HTTP status, message, and the field (`param`) / machine `code` if any."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        if self.status == 404:
            return "not_found_error"
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)

    def event(self) -> str:
        """The error as one server-sent event's data."""
        return json.dumps(self.body())


class RequestFailed(Exception):
    """The engine finished this request with finish_reason "error" (it failed on its own)."""


def api_error(e: Exception, prompt_param: str = "prompt") -> ApiError:
    """Map what admission or generation raised to the answer the client gets."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestError):
        return ApiError(400, str(e), e.param)
    if isinstance(e, TemplateError):  # the chat template's own raise_exception(...), or a jinja error
        return ApiError(400, f"the chat template refused these messages: {e}", "messages")
    if isinstance(e, EngineDeadError):
        return ApiError(503, f"the engine is not running: {e}", code="engine_dead")
    if isinstance(e, StepFailedError):
        return ApiError(500, str(e), code="step_failed")
    if isinstance(e, RequestFailed):
        return ApiError(500, f"the engine failed this request: {e}", code="request_failed")
    if isinstance(e, (ValueError, TypeError)):  # refused by SamplingParams or the engine
        return ApiError(400, str(e), _field(str(e), prompt_param))
    return ApiError(500, f"internal error ({type(e).__name__}: {e})")


def _field(message: str, prompt_param: str) -> str | None:
    """SamplingParams and BeamSearchParams name their field ("SamplingParams.top_p=0 is invalid: ..."; a
    beam search's width is the request's n), the engine a token-id field out of the vocabulary
    ("request 'x': logit_bias [99999] are outside ..."); the engine's other refusals are about the
    prompt (empty, out of the vocabulary, too long)."""
    if message.startswith("StructuredOutputsParams."):  # a constraint over a cap (a tools schema too long, too
        return "structured_outputs"  # deep): preprocess names the field it came from, as for other grammar errors
    for owner, renamed in (("SamplingParams.", {}), ("BeamSearchParams.", {"beam_width": "n"})):
        if message.startswith(owner):
            field = message.removeprefix(owner).split("=")[0]
            return renamed.get(field, field)
    named = re.match(r"request '[^']*': (logit_bias|allowed_token_ids|stop_token_ids|structured_outputs)[ .]", message)
    return named.group(1) if named else prompt_param
