"""The OpenAI request shapes we accept and how they become `SamplingParams`; the answers' ids.

The models below declare every request field minivllm implements: each one reaches SamplingParams,
the prompt or the answer. A field they do not declare is refused, accepted without effect, or
ignored and logged, by field_policy.py. vLLM's extras (`top_k`, `min_p`, `repetition_penalty`,
`prompt_logprobs`, ...) are top-level fields, which is where the openai client's `extra_body` puts them.

Fields left out fall back to the model's `generation_config.json` (temperature, top_p, top_k, min_p,
repetition_penalty), then to OpenAI's defaults. Types are strict (pydantic's strict mode): an integer field refuses
`true` and `2.0`, a boolean refuses `"yes"` and `1`, a number refuses `"0.5"` (an integer is a number); nothing is
coerced, so a client's mistake is a 400 naming the field, not a different request. Numbers must be finite (NaN, ±inf
are refused, naming the field). What pydantic cannot check raises `RequestError` naming the field (400).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from minivllm.beam_search import BeamSearchParams
from minivllm.entrypoints.openai.field_policy import RequestError, check_undeclared
from minivllm.entrypoints.openai.reasoning import ReasoningFields
from minivllm.entrypoints.openai.structured import structured_outputs_params
from minivllm.entrypoints.openai.tool_calls import ToolCallingFields
from minivllm.entrypoints.openai.tool_prompt import check_history_calls
from minivllm.sampling_params import SamplingParams
from minivllm.structured_outputs import StructuredOutputsParams

# chat_template_kwargs may not set what the server decides itself.
_TEMPLATE_ARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                  "chat_template", "tools", "documents", "return_dict"}
_INT64 = 2**63
# use_beam_search ranks beams by the model's own logprobs: these sampling fields would do nothing (field -> not asked)
_NOT_WITH_BEAMS = {"temperature": (None, 0), "top_p": (None, 1), "top_k": (None, 0, -1), "min_p": (None, 0),
                   "seed": (None,), "stop": (None, [], ""), "stop_token_ids": (None, []), "presence_penalty": (0,),
                   "frequency_penalty": (0,), "repetition_penalty": (None, 1), "logit_bias": (None, {}),
                   "allowed_token_ids": (None,), "bad_words": (None, []), "min_tokens": (0,), "logprobs": (None, False),
                   "top_logprobs": (None, 0), "prompt_logprobs": (None,), "echo": (False,),
                   "truncate_prompt_tokens": (None,), "include_stop_str_in_output": (False,),
                   "skip_special_tokens": (True,), "response_format": (None, {"type": "text"}),
                   "structured_outputs": (None,), "tools": (None, []), "tool_choice": (None, "none")}


class Limits(NamedTuple):
    """What this engine allows, for the checks at the door."""
    max_logprobs: int  # EngineConfig.max_logprobs (`--max-logprobs`)
    vocab_size: int  # what -1 ("every token") means for logprobs
    priority_scheduling: bool  # a request's priority matters (not with --scheduling-policy fcfs)
    max_model_len: int  # EngineConfig.max_model_len: bounds beam search's length_penalty


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool | None = False  # a last chunk with the request's usage and no choices
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, usage on every chunk too


class _Common(BaseModel):
    # strict: no coercion (`"n": true` is not n=1; an int passes for a float); no NaN/Infinity (json accepts them).
    # extra="allow": fields we do not declare are kept, to be refused or reported by check_fields().
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None  # accepted when it equals n (no server-side ranking)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-_INT64, le=_INT64 - 1)  # vLLM's bounds (a torch.long)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # JSON keys are strings: token id -> bias
    top_k: int | None = None  # vLLM's extras from here on
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep only k prompt tokens, at the end truncation_side says:
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "left" (None) the last k, "right" the first
    prompt_logprobs: int | None = None
    echo: bool = False
    return_token_ids: bool = False  # add the prompt's and each choice's token ids to the answer
    return_tokens_as_token_ids: bool = False  # write logprobs' tokens as "token_id:<id>"
    request_id: str | None = None  # becomes the answer's id
    priority: int = 0  # lower = sooner, with --scheduling-policy priority
    use_beam_search: bool = False  # vLLM's: the n best beams instead of n samples (minivllm/beam_search.py)
    length_penalty: float = 1.0  # with use_beam_search: beams rank by cum logprob / length ** length_penalty
    response_format: dict[str, Any] | None = None  # OpenAI's JSON modes (structured.py)
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object

    def check_fields(self, limits: Limits) -> None:
        """The checks at the door: undeclared fields (field_policy.py), then combinations and limits."""
        check_undeclared(self.model_extra or {})
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of", f"best_of={self.best_of} != n={self.n} is not supported: ranking "
                                          "completions on the server is not implemented; use n")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options", "only allowed when stream is true")
        if self.stream and self.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs", "not available when stream is true (as in vLLM)")
        self.beam_search_params(limits)  # its fields, checked now
        if self.priority != 0 and not limits.priority_scheduling:
            raise RequestError("priority", "not supported by this server's scheduling policy (fcfs: first come, "
                                           "first served); start it with --scheduling-policy priority")

    def sampling_params(self, defaults: dict[str, Any], limits: Limits) -> SamplingParams:
        """Raises ValueError naming the bad field (answered with 400)."""
        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), repetition_penalty=pick("repetition_penalty", 1.0), seed=self.seed,
            max_tokens=self.max_new_tokens(), min_tokens=self.min_tokens, n=self.n, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens, logprobs=self.num_logprobs(limits),
            prompt_logprobs=_count("prompt_logprobs", self.num_prompt_logprobs(), limits),
            structured_outputs=self.structured_outputs_params())

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        return structured_outputs_params(self.response_format, self.structured_outputs)

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def beam_search_params(self, limits: Limits) -> BeamSearchParams | None:
        """With use_beam_search, n beams of max_tokens tokens (else None); sampling fields refused with it."""
        if not self.use_beam_search:
            if self.length_penalty != 1:
                raise RequestError("length_penalty", "only applies with use_beam_search: true; leave it out")
            return None
        for name, defaults in _NOT_WITH_BEAMS.items():
            value = getattr(self, name, None)
            if not any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults):
                raise RequestError(name, "not supported with use_beam_search: beam search ranks beams by the model's "
                                         "own logprobs and stops at EOS or max_tokens; leave it out")
        if 2 * self.n > limits.max_logprobs:
            raise RequestError("n", f"beam search asks each beam for its 2n = {2 * self.n} best tokens, more than this "
                                    f"server's max_logprobs={limits.max_logprobs}; lower n or raise --max-logprobs")
        if self.max_new_tokens() is None:
            raise RequestError("max_tokens", "use_beam_search needs max_tokens")
        params = BeamSearchParams(self.n, self.max_new_tokens(), self.ignore_eos, 0.0, self.length_penalty)
        params.check_length_penalty(limits.max_model_len)  # a score that stays finite (errors.py names the field)
        return params

    def num_logprobs(self, limits: Limits) -> int | None:
        raise NotImplementedError

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


def _count(param: str, value: int | None, limits: Limits) -> int | None:
    """A number of logprobs: None, 0..max_logprobs, or -1 for the whole vocabulary (vLLM's)."""
    if value is None:
        return None
    n = limits.vocab_size if value == -1 else value
    if n < 0:
        raise RequestError(param, f"{value} is invalid: give a number of logprobs >= 0, or -1 for all")
    if n > limits.max_logprobs:
        raise RequestError(param, f"{value} asks for {n} logprobs, more than this server's max_logprobs="
                                  f"{limits.max_logprobs}; ask for fewer or start it with a larger --max-logprobs")
    return n


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    max_tokens: int | None = 16
    logprobs: int | None = None  # the top-N per token, N in 0..max_logprobs (OpenAI's cap is 5)
    add_special_tokens: bool = True

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: score the prompt, generate nothing (lm-eval's loglikelihood)."""
        return self.echo and self.max_tokens == 0

    def max_new_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens  # the one token is computed, then dropped

    def num_logprobs(self, limits: Limits) -> int | None:
        return _count("logprobs", self.logprobs, limits)

    def num_prompt_logprobs(self) -> int | None:
        # echo with logprobs returns the prompt's tokens first, with their logprobs (vLLM's rule).
        return self.logprobs if self.prompt_logprobs is None and self.echo else self.prompt_logprobs

    def prompts(self) -> list[str | dict[str, Any]]:
        """One engine prompt per completion: a str, or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            return [encodable(p, "prompt")]
        if not p:
            raise RequestError("prompt", "the list is empty; send a string, token ids, or a list of them")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        return [encodable(x, f"prompt[{i}]") if isinstance(x, str) else {"prompt_token_ids": list(x)}
                for i, x in enumerate(p)]


class ChatMessage(BaseModel):
    # Fields besides role and content (name, tool_calls, ...) go to the chat template as they are.
    model_config = ConfigDict(strict=True, extra="allow")
    role: str  # any role: the chat template decides which it accepts
    content: str | list[dict[str, Any]] | None = None

    def for_template(self, where: str) -> dict[str, Any]:
        """This message for the chat template; `where` ("messages[2]") names it in errors."""
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))
        content = encodable(content or "", f"{where}.content")
        role = "system" if self.role == "developer" else self.role  # OpenAI's new name for system
        check_history_calls((self.model_extra or {}).get("tool_calls"), where)  # before any template sees them
        return {**(self.model_extra or {}), "role": role, "content": content}


def _part_text(part: dict[str, Any], where: str) -> str:
    # A text-only model cannot look at an image: dropping the part would answer another question.
    if part.get("type") != "text":
        raise RequestError(where, f"content parts of type {part.get('type')!r} are not supported; "
                                  "this server takes text parts only ({\"type\": \"text\", \"text\": ...})")
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}.text", f"must be a string, got {type(part.get('text')).__name__}")
    return part["text"]


def encodable(text: str, where: str) -> str:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"); no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(where, f"contains a lone UTF-16 surrogate ({text[e.start]!r} at character "
                                  f"{e.start}); send valid Unicode text") from None
    return text


class ChatCompletionRequest(ToolCallingFields, ReasoningFields, _Common):  # tools: tool_calls.py; reasoning.py
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: the N most likely tokens at each position
    # vLLM's chat extras
    add_generation_prompt: bool = True  # end the prompt with the assistant's turn opening
    continue_final_message: bool = False  # leave the last (assistant) message open and continue it
    add_special_tokens: bool = False  # the template already wrote them
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template

    def check_fields(self, limits: Limits) -> None:
        super().check_fields(limits)
        if not self.messages:
            raise RequestError("messages", "the list is empty; send at least one message")
        if self.add_generation_prompt and self.continue_final_message:
            raise RequestError("continue_final_message", "cannot be true together with add_generation_prompt "
                                                         "(which is true unless set to false)")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs", "needs logprobs: true")
        self.tool_plan()  # checks tools and tool_choice
        taken = _TEMPLATE_ARGS & set(self.chat_template_kwargs or {})
        if taken:
            raise RequestError("chat_template_kwargs", f"{sorted(taken)} are set by the server; use the "
                                                       "request's own fields")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self, limits: Limits) -> int | None:
        return _count("top_logprobs", self.top_logprobs or 0, limits) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them."""
        return [m.for_template(f"messages[{i}]") for i, m in enumerate(self.messages)]

    def echoed(self) -> str:
        """With echo, the answer repeats the last message first when it is the assistant's (vLLM's)."""
        if not self.echo or self.messages[-1].role != "assistant":
            return ""
        return self.conversation()[-1]["content"]


def new_id(prefix: str, request_id: str | None = None) -> str:
    return f"{prefix}-{request_id or uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
