"""From an OpenAI request to what the engine runs: chat template, tokens, and the length check.

Everything here costs time in the prompt's length, so the server calls it once per request, in a
worker thread (`asyncio.to_thread`), never on the event loop. The result is a prompt the engine
never re-tokenizes: {"prompt": text, "prompt_token_ids": ids}, which `LLMEngine.tokenize` takes as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.errors import ApiError
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from minivllm.sampling_params import SamplingParams

TokensPrompt = dict[str, Any]  # {"prompt": text | None, "prompt_token_ids": [...]}


def completion_prompts(tokenizer: Any, req: CompletionRequest) -> list[TokensPrompt]:
    # A str is tokenized exactly as LLMEngine.tokenize would (special tokens added); ids pass as they are.
    return [{"prompt": p, "prompt_token_ids": tokenizer(p).input_ids} if isinstance(p, str) else p
            for p in req.prompts()]


def chat_prompt(tokenizer: Any, req: ChatCompletionRequest) -> TokensPrompt:
    text = tokenizer.apply_chat_template(req.conversation(), tokenize=False, add_generation_prompt=True)
    # The template already wrote the special tokens (BOS, role markers): add none twice.
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}


def render_and_check(engine: AsyncLLMEngine, render: Callable[[], list[TokensPrompt]], sp: SamplingParams,
                     param: str) -> list[TokensPrompt]:
    """The prompts `render` builds, once each checked to fit (a 400 now, rather than a stream that
    would fail after its 200 was sent)."""
    prompts = render()
    for p in prompts:
        reason = engine.check_request(p, sp)
        if reason is not None:
            raise ApiError(400, reason, param, "context_length_exceeded")
    return prompts
