"""The OpenAI request shapes we accept, and how they become `SamplingParams` and prompts.

Unknown fields are ignored (clients send many), the extras vLLM takes through `extra_body`
(`top_k`, `min_p`, `ignore_eos`) are accepted at the top level, and fields the request leaves out
fall back to the model's `generation_config.json` (temperature, top_p, top_k, min_p), then to
OpenAI's defaults. Numbers must be finite (NaN and ±inf are refused, naming the field). What pydantic
cannot check (an empty prompt list, a content part that is not text, a lone UTF-16 surrogate) raises
`RequestError` naming the field, which the server answers with 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class RequestError(ValueError):
    """A request field is invalid; `param` names it (OpenAI's `error.param`), the message says why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class _Common(BaseModel):
    # Python's json accepts NaN and Infinity; no sampling field means anything with them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None) -> SamplingParams:
        """Raises ValueError naming the bad field (mapped to HTTP 400)."""
        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    max_tokens: int | None = 16

    def prompts(self) -> list[str | dict[str, Any]]:
        """One engine prompt per completion: a str, or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            return [_encodable(p, "prompt")]
        if not p:
            raise RequestError("prompt", "the list is empty; send a string, token ids, or a list of them")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        return [_encodable(x, f"prompt[{i}]") if isinstance(x, str) else {"prompt_token_ids": list(x)}
                for i, x in enumerate(p)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, where: str) -> dict[str, str]:
        """This message for the chat template; `where` ("messages[2]") names it in errors."""
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))
        content = _encodable(content or "", f"{where}.content")
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


def _part_text(part: dict[str, Any], where: str) -> str:
    # A text-only model cannot look at an image: dropping the part would answer another question.
    if part.get("type") != "text":
        raise RequestError(where, f"content parts of type {part.get('type')!r} are not supported; "
                                  "this server takes text parts only ({\"type\": \"text\", \"text\": ...})")
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}.text", f"must be a string, got {type(part.get('text')).__name__}")
    return part["text"]


def _encodable(text: str, where: str) -> str:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"); no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(where, f"contains a lone UTF-16 surrogate ({text[e.start]!r} at character "
                                  f"{e.start}); send valid Unicode text") from None
    return text


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them."""
        if not self.messages:
            raise RequestError("messages", "the list is empty; send at least one message")
        return [m.text(f"messages[{i}]") for i, m in enumerate(self.messages)]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON; a stream sends the same object as one `data:` event before `[DONE]`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
