"""From an OpenAI request to what the engine runs: checks, chat template, tokens, the length check.

    ServingContext.admit(req, render)
      ├─ model name (404), engine alive (503)
      ├─ req.check_fields(): refused and unknown fields (field_policy.py)    400
      └─ worker thread:
           req.sampling_params(): values SamplingParams refuses, logprobs cap   400
           render (chat template + tokenize, once)
           cut to truncate_prompt_tokens (the end truncation_side says);
           every id in the vocabulary?                                          400 "out of vocabulary" (vLLM's)
           request prepared and fits?                                           400 (context_length_exceeded:
                                                   the prompt, or prompt + max_tokens, past max_model_len)
           a grammar that does not compile or cannot run                        400 naming the field sent:
                                                                                structured_outputs, response_format
                                                                                (.json_schema.schema), or tools
                                                                                (under a required/named tool_choice)

Rendering costs time in the prompt's length, and preparing a request's lists (allowed ids, bad
words) in theirs, so both run once per request, in a worker thread (`asyncio.to_thread`), never on
the event loop nor on the engine's thread (which reuses the prepared lists: `InputProcessor.logit_rules`).
The result is a prompt the engine never re-tokenizes: {"prompt": text, "prompt_token_ids": ids}, which
`LLMEngine.tokenize` takes as is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.processing.input_processor import PromptTooLong
from minivllm.entrypoints.openai.errors import ApiError, api_error
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, Limits
from minivllm.entrypoints.openai.tool_prompt import with_tools_in_system
from minivllm.sampling_params import SamplingParams

TokensPrompt = dict[str, Any]  # {"prompt": text | None, "prompt_token_ids": [...]}
Request = CompletionRequest | ChatCompletionRequest


@dataclass(frozen=True)
class ServingContext:
    """What every endpoint needs: the engine, the name clients use, the request defaults."""
    engine: AsyncLLMEngine
    model_name: str
    defaults: dict[str, Any]  # from the model's generation_config.json

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def limits(self) -> Limits:
        engine = self.engine.engine
        return Limits(engine.config.max_logprobs, engine.spec.vocab_size, engine.scheduler.policy.name != "fcfs",
                      engine.config.max_model_len)

    async def admit(self, req: Request, render: Callable[[], list[TokensPrompt]]
                    ) -> tuple[list[TokensPrompt], SamplingParams]:
        """Check the request and tokenize it (once, off the event loop); raises ApiError."""
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"The model `{req.model}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        try:
            self.engine.check_health()
            limits = self.limits
            req.check_fields(limits)
            # SamplingParams checks every list entry and `check_request` prepares its lists for the steps
            # (tokenizing bad words, a mask of allowed ids): work that grows with the request, done here,
            # once, off the event loop and off the engine's thread, which reuses it.
            return await asyncio.to_thread(self._prepare, req, render, limits, param)
        except Exception as e:
            error = api_error(e, param)
            if error.param == "structured_outputs":  # the grammar may come from the tools
                error = _constraint_error(req, error)
            raise error from e

    def _prepare(self, req: Request, render: Callable[[], list[TokensPrompt]], limits: Limits,
                 param: str) -> tuple[list[TokensPrompt], SamplingParams]:
        sp = req.sampling_params(self.defaults, limits)
        return render_and_check(self.engine, render, sp, param, req.truncation_side), sp


def _constraint_error(req: Request, error: ApiError) -> ApiError:
    """The engine names `structured_outputs` when a grammar does not compile or cannot run, whichever field the
    grammar came from: name the one the client sent. Under a required or named tool_choice it is the tools'
    `parameters`; from a `response_format` it is its json_schema's `schema` (json_object has no schema)."""
    why = error.message.split(": ", 1)[1] if error.message.startswith("request '") else error.message
    if why.startswith("StructuredOutputsParams."):  # StructuredOutputsParams' own caps (size, depth)
        why = "structured_outputs." + why.removeprefix("StructuredOutputsParams.")
    if isinstance(req, ChatCompletionRequest) and req.tool_plan().constraint() is not None:
        return ApiError(400, f"tools: the tools' parameters schema {why.removeprefix('structured_outputs.json ')}",
                        "tools", error.code)
    if req.structured_outputs is not None or req.response_format in (None, {"type": "text"}):
        return error
    field = "response_format.json_schema.schema" if req.response_format.get("type") == "json_schema" \
        else "response_format"
    for sent in ("structured_outputs.json_object", "structured_outputs.json"):
        if why.startswith(sent):
            why = field + why.removeprefix(sent)
            break
    return ApiError(400, why, field, error.code)


def completion_prompts(ctx: ServingContext, req: CompletionRequest) -> list[TokensPrompt]:
    # A str is tokenized as LLMEngine.tokenize would (special tokens added, unless the request
    # says add_special_tokens: false); token ids pass as they are.
    return [_tokenized(ctx, p, req) if isinstance(p, str) else p for p in req.prompts()]


def chat_prompt(ctx: ServingContext, req: ChatCompletionRequest) -> TokensPrompt:
    # The template already wrote the special tokens (BOS, role markers): add none twice by default.
    return _tokenized(ctx, chat_text(ctx, req), req)


def chat_text(ctx: ServingContext, req: ChatCompletionRequest) -> str:
    """The messages (and tools) through the model's chat template: the prompt's text (/tokenize's too)."""
    conversation, tools = req.conversation(), req.tool_plan().tools
    options = dict(tokenize=False, add_generation_prompt=req.add_generation_prompt,
                   continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}))
    text = ctx.tokenizer.apply_chat_template(conversation, **options)
    if tools:  # the template renders the tools, or (if it ignores them) they go in the system message
        with_tools = ctx.tokenizer.apply_chat_template(conversation, tools=tools, **options)
        text = with_tools if with_tools != text else ctx.tokenizer.apply_chat_template(
            with_tools_in_system(conversation, tools), **options)
    return text


def _tokenized(ctx: ServingContext, text: str, req: Request) -> TokensPrompt:
    """A text and its tokens; one whose bytes alone prove it too long (1 MB took 3.6 s to tokenize) is refused
    before the tokenizer sees it, as is one that is not valid Unicode."""
    try:
        ctx.engine.engine.input_processor.check_text(text, may_truncate=req.truncate_prompt_tokens is not None)
    except PromptTooLong as e:
        raise ApiError(400, str(e), "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                       "context_length_exceeded") from e
    ids = ctx.tokenizer(text, add_special_tokens=req.add_special_tokens).input_ids
    return {"prompt": text, "prompt_token_ids": ids}


def render_and_check(engine: AsyncLLMEngine, render: Callable[[], list[TokensPrompt]], sp: SamplingParams,
                     param: str, truncation_side: str | None = None) -> list[TokensPrompt]:
    """The prompts `render` builds, cut to `sp.truncate_prompt_tokens` here (the engine's own cut, the last
    k, then keeps them all), each checked to fit (a 400 now, rather than a stream that would fail after its
    200 was sent)."""
    prompts = [_truncated(p, sp.truncate_prompt_tokens, truncation_side) for p in render()]
    max_model_len = engine.engine.config.max_model_len
    for p in prompts:
        check_in_vocabulary(p["prompt_token_ids"], engine.engine.spec.vocab_size, param)
        reason = engine.check_request(p, sp)
        if reason is not None:  # a field that can never be served (n), or the prompt's length
            raise ApiError(400, reason.message, reason.field or param,
                           None if reason.field else "context_length_exceeded")
        n = len(p["prompt_token_ids"])
        if sp.max_tokens is not None and sp.truncate_prompt_tokens is None and n + sp.max_tokens > max_model_len:
            # vLLM's answer: asking for more than the context holds is the client's mistake, not a "length" stop
            raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                                f"requested {n + sp.max_tokens} tokens ({n} in the prompt, {sp.max_tokens} in the "
                                "completion). Please reduce the length of the prompt or max_tokens.",
                           "max_tokens", "context_length_exceeded")
    return prompts


def _truncated(prompt: TokensPrompt, k: int | None, side: str | None) -> TokensPrompt:
    """vLLM's truncation_side: "right" keeps the first k tokens, "left" (the default) the last k. The text stays
    whole, as the engine keeps it (an echo decodes the ids kept)."""
    ids = prompt["prompt_token_ids"]
    if k is None or k < 1 or len(ids) <= k:  # k < 1: SamplingParams refuses it, naming the field
        return prompt
    return {**prompt, "prompt_token_ids": ids[:k] if side == "right" else ids[-k:]}


def check_in_vocabulary(ids: list[int], vocab_size: int, param: str) -> None:
    """A 400 in vLLM's words ("Token id N is out of vocabulary") for an id the model has no embedding for;
    the engine would refuse it too, in words a client looking for vLLM's would not find."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"Token id {bad} is out of vocabulary: this model's token ids are 0 to {vocab_size - 1}",
                       param)
