"""Incremental detokenization and stop strings.

Decoding each new token on its own is wrong: tokenizers merge bytes and spaces across tokens
("▁Par" + "is"), and a multi-byte character may span tokens. So, as vLLM does, we decode a short
window twice, `ids[prefix:read]` and `ids[prefix:]`, and emit only what the second adds. The window
starts a few tokens back into the prompt so that the first output token gets its leading space
right. Text ending in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.

Stop strings are searched only in the tail that the new text could have completed.

`SamplingParams(detokenize=False)` (vLLM's option, for callers who only want token ids) keeps the
count of tokens and decodes nothing: the text stays "".
"""

from __future__ import annotations

from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 5  # how far back into the prompt the first window starts


class StopMatch(NamedTuple):
    stop: str
    truncate_at: int  # the output text is cut to this length


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.detokenize = detokenize
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._num_context = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens seen so far."""
        return len(self.ids) - self._num_context

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        if not self.detokenize:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: release text held back waiting for more bytes (as U+FFFD)."""
        if not self.detokenize:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop_string(text: str, new_chars: int, stops: tuple[str, ...], include: bool) -> StopMatch | None:
    """The earliest stop string that the last `new_chars` characters of `text` completed."""
    found = [(idx, stop) for stop in stops
             if (idx := text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))) != -1]
    if not found:
        return None
    idx, stop = min(found)
    return StopMatch(stop, idx + len(stop) if include else idx)
