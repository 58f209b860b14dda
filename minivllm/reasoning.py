"""Reasoning parsers: a thinking model's `<think>…</think>` block, told apart from its answer.

A thinking model (Qwen3, DeepSeek-R1) first writes its reasoning, then closes it and answers:

    output text   <think>\\nThe user wants a number.\\n</think>\\n\\n{"n":42}
                  └──────── reasoning_content ────────┘└─ content ─┘

`--reasoning-parser qwen3` (or `deepseek_r1`; vLLM's names) makes the server return the two apart
(`message.reasoning_content`, `delta.reasoning_content` when streaming) and makes structured outputs
apply to the answer only. Both parsers use the same two tokens, resolved once from the tokenizer at
start-up (`ReasoningConfig.from_tokenizer`): a tokenizer without them cannot serve the parser.

Where an output starts is read from the prompt (`ReasoningConfig.prompt_phase`), the last think token
in it deciding, as vLLM's `is_reasoning_end` does:

    prompt's last think token   phase at the first output token
    </think>                    ENDED     e.g. Qwen3's template with enable_thinking=False, which writes
                                          an empty "<think>\\n\\n</think>\\n\\n" into the prompt
    <think>                     INSIDE    DeepSeek-R1's template (and Qwen3-Thinking's) open it there
    none                        qwen3: MAY_OPEN (a first output token <think> opens reasoning, any other
                                starts the answer); deepseek_r1: INSIDE (R1 may reason without writing
                                <think>; one it does write is dropped from the reasoning)

The engine and the text parser both start from that phase, so they agree on where the answer begins:
the engine applies a request's grammar from there (engine/structured_output/grammar.py), the parser below splits the
text there. A prompt whose last think token closed an earlier turn's reasoning counts as ENDED (Qwen3's
template keeps earlier reasoning only after the last user message, i.e. in tool-call loops).

Invariant: `ReasoningStream` fed any split of a text gives, joined, exactly what `split_reasoning` gives
for the whole (a piece of "</think>" is held back until it is known not to be one).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParserName(enum.Enum):
    """`EngineConfig.reasoning_parser`'s values (vLLM's parser names)."""

    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"

    @classmethod
    def parse(cls, name: str) -> "ReasoningParserName":
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join(n.value for n in cls)
            raise ValueError(f"reasoning_parser={name!r} is not a reasoning parser; choose one of {choices}, "
                             "or leave it out (None)") from None


class ReasoningPhase(enum.Enum):
    """Where a sequence's output stands with respect to its reasoning."""

    MAY_OPEN = "may_open"  # nothing yet: a first token <think> opens reasoning, any other starts the answer
    INSIDE = "inside"  # reasoning: unconstrained, until </think>
    ENDED = "ended"  # the answer (also: every output when no reasoning parser is configured)


class _Tokenizer(Protocol):
    def get_added_vocab(self) -> dict[str, int]: ...

    @property
    def all_special_tokens(self) -> list[str]: ...


@dataclass(frozen=True)
class ReasoningConfig:
    """The engine's reasoning parser and its think tokens' ids (ResolvedConfig.reasoning)."""

    name: ReasoningParserName
    start_token_id: int  # <think>
    end_token_id: int  # </think>: vLLM's reasoning_end token

    @classmethod
    def from_tokenizer(cls, name: str, tokenizer: _Tokenizer) -> "ReasoningConfig":
        """Resolve `name`'s think tokens once; ValueError if the tokenizer cannot carry them."""
        parser = ReasoningParserName.parse(name)
        added = tokenizer.get_added_vocab()
        missing = [t for t in (THINK_START, THINK_END) if t not in added]
        if missing:
            raise ValueError(f"reasoning_parser={name!r} needs {THINK_START} and {THINK_END} as tokens of the "
                             f"tokenizer; this one lacks {', '.join(missing)} (it is not a thinking model's): "
                             "leave reasoning_parser out")
        special = [t for t in (THINK_START, THINK_END) if t in tokenizer.all_special_tokens]
        if special:  # decoding skips special tokens by default: the parser would never see them
            raise ValueError(f"reasoning_parser={name!r}: the tokenizer marks {', '.join(special)} as special, so "
                             "the text the parser reads would not contain it; mark them `special: false` in "
                             "tokenizer_config.json's added_tokens_decoder (as Qwen3 and DeepSeek-R1 do)")
        return cls(parser, added[THINK_START], added[THINK_END])

    def prompt_phase(self, prompt_token_ids: list[int]) -> ReasoningPhase:
        """The phase at the first output token (the table in the module docstring)."""
        for t in reversed(prompt_token_ids):
            if t == self.end_token_id:
                return ReasoningPhase.ENDED
            if t == self.start_token_id:
                return ReasoningPhase.INSIDE
        return ReasoningPhase.MAY_OPEN if self.name is ReasoningParserName.QWEN3 else ReasoningPhase.INSIDE


@dataclass(frozen=True)
class ReasoningSplit:
    """An output's text, split: `reasoning` is None when the output never reasoned, `content` is None when
    nothing followed the reasoning (cut by max_tokens inside it)."""

    reasoning: str | None
    content: str | None


class ReasoningStream:
    """One output's text as it comes: `feed` returns the (reasoning, content) text that is safe to send now;
    `finish` returns what was held back. `phase` is the engine's phase at the first output token."""

    def __init__(self, phase: ReasoningPhase) -> None:
        # An output may begin by writing <think>: MAY_OPEN then reasons (else answers), INSIDE drops it.
        self.opening = phase is not ReasoningPhase.ENDED
        self.fallback = ReasoningPhase.ENDED if phase is ReasoningPhase.MAY_OPEN else phase
        self.phase = phase
        self.pending = ""  # text received but not yet sent: a possible piece of <think> or </think>
        self.reasoned = phase is ReasoningPhase.INSIDE  # the output has a reasoning part (maybe empty)

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        if self.opening:
            if self.pending.startswith(THINK_START):
                self.pending, self.phase, self.reasoned = self.pending[len(THINK_START):], ReasoningPhase.INSIDE, True
            elif THINK_START.startswith(self.pending):  # "<thi": not known yet
                return "", ""
            else:
                self.phase = self.fallback
            self.opening = False
        if self.phase is ReasoningPhase.ENDED:
            out, self.pending = self.pending, ""
            return "", out
        at = self.pending.find(THINK_END)
        if at >= 0:  # reasoning ends here; the rest is the answer
            reasoning, content = self.pending[:at], self.pending[at + len(THINK_END):]
            self.pending, self.phase = "", ReasoningPhase.ENDED
            return reasoning, content
        keep = _partial_suffix(self.pending, THINK_END)  # "...</th": may be the start of </think>
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """The held-back text, where it belongs, when the output ends (a lone "<thi" or "</th" was text)."""
        if self.opening and self.fallback is ReasoningPhase.ENDED:
            self.phase = ReasoningPhase.ENDED
        rest, self.pending, self.opening = self.pending, "", False
        return ("", rest) if self.phase is ReasoningPhase.ENDED else (rest, "")


def split_reasoning(text: str, phase: ReasoningPhase) -> ReasoningSplit:
    """A whole output's reasoning and content (what a stream of it sends, joined)."""
    stream = ReasoningStream(phase)
    parts = [stream.feed(text), stream.finish()]
    reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
    if not stream.reasoned:
        return ReasoningSplit(None, content)
    return ReasoningSplit(reasoning, content if stream.phase is ReasoningPhase.ENDED and content else None)


def _partial_suffix(text: str, token: str) -> int:
    """How long a tail of `text` is a proper prefix of `token`."""
    return next((k for k in range(min(len(token) - 1, len(text)), 0, -1) if text.endswith(token[:k])), 0)
