"""POST /tokenize and /detokenize (vLLM's): what a prompt costs in tokens before it is sent, and the text
of token ids. Every client that budgets a context (a UI trimming a chat history, a RAG pipeline packing
documents) asks this first.

    POST /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                   or {"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
                       "add_special_tokens": false, "chat_template_kwargs": {...}, "tools": [...],
                       "return_token_strs": false}
                      -> {"count", "max_model_len", "tokens", "token_strs"}   (token_strs: null unless asked)
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}

- A body with `messages` is a chat request, one without a prompt request (vLLM's two request shapes).
  Messages go through the very code /v1/chat/completions runs (preprocess.chat_text: the chat template,
  tools rendered by it or put in the system message), so `count` is that chat request's
  `usage.prompt_tokens`; a prompt is tokenized as /v1/completions tokenizes a text prompt.
- No length check, as in vLLM: a prompt longer than max_model_len gets its count, which is how a client
  learns how much to cut. (The body limit still bounds the work, and it runs in a worker thread.)
- `token_strs` are the vocabulary's pieces (`convert_ids_to_tokens`: "Ġcat", "▁the"), not decoded text.
- Detokenizing decodes as the tokenizer does (special tokens kept); an id outside the vocabulary is a 400
  saying "out of vocabulary" (vLLM's words), naming `tokens`.
- Strict fields: a field these requests do not declare is a 400 naming it (field_policy.refuse_undeclared),
  never ignored; `model`, when sent, must be the served model (404).
- Like /health and /metrics they live at the root, not under /v1, so `--api-key` does not guard them
  (vLLM's rule: its key guards /v1 only).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError

from minivllm.entrypoints.openai.errors import ApiError, api_error
from minivllm.entrypoints.openai.field_policy import refuse_undeclared
from minivllm.entrypoints.openai.preprocess import ServingContext, chat_text, check_in_vocabulary
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, encodable

Parsed = TypeVar("Parsed", bound="_TokenizationRequest")


class _TokenizationRequest(BaseModel):
    # strict: nothing coerced (as protocol.py); extra="allow": undeclared fields are kept, to be refused by name.
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None


class TokenizeCompletionRequest(_TokenizationRequest):
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's BOS etc., as /v1/completions adds them
    return_token_strs: bool | None = False


class TokenizeChatRequest(_TokenizationRequest):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template already wrote them
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False

    def as_chat_request(self) -> ChatCompletionRequest:
        """The chat request these messages would be: its checks and template are the ones that run."""
        return ChatCompletionRequest(messages=self.messages, tools=self.tools,
                                     add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message,
                                     add_special_tokens=self.add_special_tokens,
                                     chat_template_kwargs=self.chat_template_kwargs)


class DetokenizeRequest(_TokenizationRequest):
    tokens: list[int]


async def create_tokenize(ctx: ServingContext, body: dict[str, Any]) -> dict[str, Any]:
    if "messages" in body:
        req: TokenizeChatRequest | TokenizeCompletionRequest = _parse(ctx, TokenizeChatRequest, body,
                                                                      "POST /tokenize (with messages)")
        if getattr(ctx.tokenizer, "chat_template", None) is None:
            raise ApiError(400, "this model has no chat template; tokenize a prompt instead", "messages")
        ids = await _in_thread(_chat_tokens, ctx, req, param="messages")
    else:
        req = _parse(ctx, TokenizeCompletionRequest, body, "POST /tokenize")
        ids = await _in_thread(_prompt_tokens, ctx, req, param="prompt")
    return {"count": len(ids), "max_model_len": ctx.engine.engine.config.max_model_len, "tokens": ids,
            "token_strs": ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}


async def create_detokenize(ctx: ServingContext, body: dict[str, Any]) -> dict[str, Any]:
    req = _parse(ctx, DetokenizeRequest, body, "POST /detokenize")
    check_in_vocabulary(req.tokens, ctx.engine.engine.spec.vocab_size, "tokens")
    return {"prompt": await _in_thread(ctx.tokenizer.decode, req.tokens, param="tokens")}


def _prompt_tokens(ctx: ServingContext, req: TokenizeCompletionRequest) -> list[int]:
    return ctx.tokenizer(encodable(req.prompt, "prompt"), add_special_tokens=req.add_special_tokens).input_ids


def _chat_tokens(ctx: ServingContext, req: TokenizeChatRequest) -> list[int]:
    chat = req.as_chat_request()
    chat.check_fields(ctx.limits)  # as a chat request: messages not empty, tools, template kwargs, prefill
    return ctx.tokenizer(chat_text(ctx, chat), add_special_tokens=chat.add_special_tokens).input_ids


async def _in_thread(fn: Callable[..., Any], *args: Any, param: str) -> Any:
    """`fn(*args)` in a worker thread (its cost grows with the text: never on the event loop); what it
    raises is answered as /v1 answers it (a template's or a field's error: 400, naming `param` if no other)."""
    try:
        return await asyncio.to_thread(fn, *args)
    except Exception as e:
        raise api_error(e, param) from e


def _parse(ctx: ServingContext, model: type[Parsed], body: dict[str, Any], endpoint: str) -> Parsed:
    """The body as `model`: a wrong type is the same 400 as on /v1 (server.py's handler names the field),
    an undeclared field a 400 naming it, another model's name a 404."""
    try:
        req = model.model_validate(body)
    except ValidationError as e:  # located as FastAPI locates a body's errors, for the same handler
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
    try:
        refuse_undeclared(req.model_extra or {}, endpoint, list(model.model_fields))
    except ValueError as e:
        raise api_error(e) from e
    if req.model is not None and req.model != ctx.model_name:
        raise ApiError(404, f"The model `{req.model}` does not exist; this server serves `{ctx.model_name}`.",
                       "model", "model_not_found")
    return req
