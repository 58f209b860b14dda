"""What happens to a request field this server does not implement, and the error that names a field.

The request models (protocol.py) declare every field minivllm honours. Whatever else a client sends
lands in pydantic's `model_extra`, and `check_undeclared` puts each name in one of three groups, so
that nothing a client asks for is silently dropped:

    REFUSED     in OpenAI's or vLLM's API, not implemented: any value but its default is a 400 that
                names the field and says why (answering another request than the one asked is worse
                than refusing)
    NO_EFFECT   OpenAI's bookkeeping (`user`, `metadata`, `store`, ...): accepted, changes nothing
    unknown     in neither API: ignored, as vLLM does, and logged

Unknown fields cost one log line per request, however many there are: the count and the first few
names. The names are the client's own text, so each is escaped and cut short (`log_safe`): a name
holding a newline must not be able to start a forged line in the server's log.

The tokenization endpoints (/tokenize, /detokenize) are stricter: `refuse_undeclared` answers any field
they do not declare with a 400 naming it (their requests are small and new, with no older clients
sending extras to keep working).

Invariant: no name here is declared on a request model (a declared field never reaches
`model_extra`, so a policy for it would never run).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("minivllm.server")

_BEAM = "vLLM's beam search stops at EOS or max_tokens, with no early stop (use_beam_search and length_penalty work)"
_TOOLS = "the deprecated functions API is not implemented; use tools and tool_choice"
_GUIDED = ("vLLM removed the guided_* fields; send structured_outputs: {\"json\" | \"regex\" | \"choice\" | "
           "\"grammar\" | \"json_object\": ...} (or response_format) instead")
_TEXT = "this server takes and produces text only"
# field: (the values that mean "not asked for", why anything else is refused). None always means "not asked for".
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "early_stopping": ((False,), _BEAM),
    "functions": (([],), _TOOLS),
    "function_call": (("none", "auto"), _TOOLS),
    "guided_json": ((), _GUIDED),
    "guided_regex": ((), _GUIDED),
    "guided_choice": ((), _GUIDED),
    "guided_grammar": ((), _GUIDED),
    "guided_decoding_backend": ((), _GUIDED),
    "guided_whitespace_pattern": ((), _GUIDED),
    "prompt_embeds": ((), _TEXT),
    "mm_processor_kwargs": ((), _TEXT),
    "modalities": ((["text"],), _TEXT),
    "audio": ((), _TEXT),
    "suffix": ((), "inserting text before a suffix (fill-in-the-middle) is not implemented"),
    "logits_processors": ((), "custom logits processors cannot be sent to this server"),
    "lora_request": ((), "LoRA adapters are not implemented"),
    "spaces_between_special_tokens": ((True,), "the detokenizer always decodes as the tokenizer does"),
    "cache_salt": ((), "prefix-cache isolation between users is not implemented"),
    "kv_transfer_params": ((), "disaggregated prefill (KV transfer) is not implemented"),
    "vllm_xargs": ((), "this server takes no custom sampling extensions"),
    "chat_template": ((), "a request's own chat template is not accepted (vLLM also refuses it unless "
                          "started with --trust-request-chat-template); the model's template is used"),
    "documents": ((), "retrieval documents for the chat template are not implemented"),
    "prediction": ((), "predicted outputs are not implemented"),
    "reasoning_effort": ((), "reasoning control is not implemented; a template's switch (e.g. Qwen3's "
                             "enable_thinking) can be set through chat_template_kwargs"),
    "web_search_options": ((), "web search is not implemented"),
    "verbosity": ((), "verbosity control is not implemented"),
}
NO_EFFECT = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
_LOGGED_NAMES, _NAME_CHARS = 5, 40  # unknown fields in the log: at most this many names, each this long


class RequestError(ValueError):
    """A request field is invalid; `param` names it (OpenAI's `error.param`), the message says why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def check_undeclared(extra: Mapping[str, Any]) -> None:
    """Refuse a REFUSED field asked for (RequestError); log, in one line, the fields no API has."""
    unknown = []
    for name, value in extra.items():
        if name in REFUSED:
            defaults, why = REFUSED[name]
            if value is not None and value not in defaults:
                raise RequestError(name, f"not supported by this server: {why}; leave it out")
        elif name not in NO_EFFECT:
            unknown.append(name)
    if unknown:
        shown = ", ".join(log_safe(name, _NAME_CHARS) for name in unknown[:_LOGGED_NAMES])
        more = f" and {len(unknown) - _LOGGED_NAMES} more" if len(unknown) > _LOGGED_NAMES else ""
        log.warning("ignored request fields that are not in OpenAI's or vLLM's API (%d): %s%s",
                    len(unknown), shown, more)


def refuse_undeclared(extra: Mapping[str, Any], endpoint: str, declared: list[str]) -> None:
    """Refuse every field `endpoint` does not declare (RequestError naming the first; the message names
    up to five). A REFUSED name keeps its own reason; None stands for "not sent", as above."""
    sent = [name for name, value in extra.items() if not (value is None and name in REFUSED)]
    if not sent:
        return
    first = sent[0]
    if first in REFUSED:
        raise RequestError(first, f"not supported by this server: {REFUSED[first][1]}; leave it out")
    shown = ", ".join(log_safe(name, _NAME_CHARS) for name in sent[:_LOGGED_NAMES])
    more = f" and {len(sent) - _LOGGED_NAMES} more" if len(sent) > _LOGGED_NAMES else ""
    raise RequestError(first[:_NAME_CHARS], f"{endpoint} has no field{'s' if len(sent) > 1 else ''} {shown}{more}; "
                                            f"its fields are {', '.join(declared)}")


def log_safe(text: str, limit: int = 64) -> str:
    """A client's string as one harmless log token: quoted and escaped as `repr` does (a newline cannot
    start a forged log line), cut to `limit` characters."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
