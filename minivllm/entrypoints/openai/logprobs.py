"""The engine's logprobs in OpenAI's two JSON shapes, and vLLM's `prompt_logprobs`.

The engine gives one dict per token, {token_id: Logprob(logprob, rank, decoded_token)}: the top-N
candidates (ranks 1..N) plus the token actually there, whatever its rank.

    completions  {"tokens": ["The", " cat"], "token_logprobs": [-0.3, -1.2],
                  "top_logprobs": [{"The": -0.3, "A": -1.9}, ...],   # the top-N + the token itself
                  "text_offset": [0, 3]}                              # where each token's text starts
    chat         {"content": [{"token": "The", "logprob": -0.3, "bytes": [84, 104, 101],
                               "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}  # exactly N, by rank
    prompt_logprobs (vLLM)  [None, {"1734": {"logprob": -2.1, "rank": 3, "decoded_token": " cat"}}, ...]

- Completions' `top_logprobs` is keyed by text, and distinct tokens can share one: a byte-fallback
  tokenizer decodes every partial UTF-8 byte to "\ufffd", SentencePiece's decode drops the leading
  space of "▁true", which then reads as "true". A plain dict keeps one and loses the rest (vLLM's
  does; its fix for SentencePiece consults the vocabulary piece to restore the space). The rule
  here, the same idea for any collision, keeps every candidate: the chosen token first, under its text (so
  `top_logprobs[i][tokens[i]]` is its logprob), then by rank; a candidate whose text is already a key
  is written as its vocabulary piece ("▁true", "Ġ", "<0xE2>"), else as "token_id:<id>". N candidates
  give N keys (N + 1 with the chosen token outside them).
- The first prompt token has nothing before it: its entry is None (null in JSON), as in vLLM.
- Logprobs are floored at -9999.0, OpenAI's minimum: JSON has no -inf.
- `text_offset` counts the characters of the tokens' texts; a stream carries on from the last
  offset it sent, so streamed and whole answers agree even while the text is held back.
"""

from __future__ import annotations

from typing import Any, Protocol

from minivllm.outputs import Logprob

Position = dict[int, Logprob] | None  # one token's candidates, or None (the first prompt token)
_FLOOR = -9999.0


def floor(logprob: float) -> float:
    return logprob if logprob > _FLOOR else _FLOOR  # NaN compares False: floored too


class TokenText:
    """How logprobs write a token: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids,
    for tokens whose text is not unique, such as partial UTF-8 bytes)."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def __call__(self, token_id: int, logprob: Logprob | None = None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def unique(self, token_id: int, logprob: Logprob, taken: dict[str, float]) -> str:
        """The token's text, or, when another candidate at this position already has it, its
        vocabulary piece, else "token_id:<id>" (see the module's docstring)."""
        for key in (self(token_id, logprob), self.tokenizer.convert_ids_to_tokens(token_id)):
            if isinstance(key, str) and key not in taken:
                return key
        return f"token_id:{token_id}"


def completion_logprobs(token_ids: list[int], positions: list[Position], text: TokenText,
                        offset: int) -> tuple[dict[str, list], int]:
    """The completions shape for these tokens, their text starting at character `offset`; also
    returns the offset after them (where a stream's next chunk starts)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position else None
        token = text(token_id, chosen)
        out["tokens"].append(token)
        out["token_logprobs"].append(None if chosen is None else floor(chosen.logprob))
        out["top_logprobs"].append(None if chosen is None else _top_logprobs(token_id, position, text))
        out["text_offset"].append(offset)
        offset += len(token)
    return out, offset


def _top_logprobs(token_id: int, position: dict[int, Logprob], text: TokenText) -> dict[str, float]:
    """One key per candidate, the chosen token's first: no two tokens collapse into one key."""
    top: dict[str, float] = {}
    for t, lp in sorted(position.items(), key=lambda c: (c[0] != token_id, c[1].rank or float("inf"))):
        top[text.unique(t, lp, top)] = floor(lp.logprob)
    return top


def chat_logprobs(token_ids: list[int], positions: list[Position], top_n: int, text: TokenText) -> dict[str, list]:
    """The chat shape: each token with its logprob and bytes, and the top_n most likely tokens."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position else None
        entry = _chat_token(text(token_id, chosen), chosen.logprob if chosen else _FLOOR)
        ranked = sorted(((lp.rank, t, lp) for t, lp in (position or {}).items() if lp.rank and lp.rank <= top_n))
        entry["top_logprobs"] = [_chat_token(text(t, lp), lp.logprob) for _, t, lp in ranked]
        content.append(entry)
    return {"content": content}


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": floor(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


class LogprobsWriter(Protocol):
    """A choice's new tokens' logprobs in one endpoint's shape (postprocess.py calls it once a delta)."""

    def __call__(self, index: int, token_ids: list[int], positions: list[Position]) -> Any: ...


class ChatLogprobs:
    """Chat's shape ({"content": [...]}), the `top_n` most likely tokens at each position."""

    def __init__(self, top_n: int, text: TokenText) -> None:
        self.top_n, self.text = top_n, text

    def __call__(self, index: int, token_ids: list[int], positions: list[Position]) -> dict[str, list]:
        return chat_logprobs(token_ids, positions, self.top_n, self.text)


class CompletionLogprobs:
    """Completions' shape; remembers each choice's text offset, so a stream's offsets carry on."""

    def __init__(self, text: TokenText) -> None:
        self.text, self._offsets = text, {}  # choice index -> characters of token text written

    def __call__(self, index: int, token_ids: list[int], positions: list[Position]) -> dict[str, list]:
        out, self._offsets[index] = completion_logprobs(token_ids, positions, self.text, self._offsets.get(index, 0))
        return out


def prompt_logprobs(positions: list[Position]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token, None or {token id: {logprob, rank, decoded_token}}."""
    return [None if p is None else {str(t): {"logprob": floor(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in p.items()}
            for p in positions]
