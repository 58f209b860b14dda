"""Structured outputs in the engine: a grammar compiled once, a matcher per sequence, a bitmask per row.

    StructuredOutputsParams ──GrammarCompiler.compile──> grammar (cached by (kind, spec))
        at the request's boundary (InputProcessor), before it is queued: invalid -> ValueError
    grammar ──GrammarCompiler.matcher──> GrammarMatcher, owned by the Sequence
    each step, for each sampled row:  matcher ──row_masks──> (V/32,) int32, bit t = token t allowed
        applied as the LAST logits-processing stage (layers/logits_processors.py), so both samplers and
        draft verification draw only allowed tokens; logprobs are taken before, from the raw logits
    at commit (Scheduler.update_from_output): matcher.accept(token) — the only place it advances

The grammar engine is llguidance (a maintained Rust library, one abi3 wheel without dependencies): it
parses the output so far as bytes and answers, for every token of the vocabulary at once, whether the
grammar can still be completed after it. It was chosen over xgrammar by measurement
(benchmarks/grammar_backends.py, written up in docs/concepts/structured_outputs.md).

Invariants:
  * A matcher has seen exactly the sequence's committed output tokens. Speculative decoding asks for
    d + 1 masks (after 0, 1, ..., d drafts): the matcher consumes the drafts the grammar allows,
    fills each mask, and rolls them back before returning — the step leaves it as it found it. A draft
    the grammar forbids has probability 0 in its row, so verification rejects it.
  * EOS is allowed exactly where the grammar is complete (llguidance is given the model's EOS ids); a
    grammar that can take no further token (`is_complete`) ends the request with finish_reason "stop".
  * n > 1: each child gets a copy of its parent's matcher when it forks (`copy`).
  * JSON is compact (no free whitespace between tokens: `{"a":1,"b":[2]}`): with free whitespace a
    small model can emit newlines until max_tokens, and every valid value has a compact spelling.
  * With a reasoning parser (minivllm/reasoning.py) the grammar governs the answer only. The matcher
    carries the sequence's `ReasoningPhase`: INSIDE, its rows are unconstrained (None) and it consumes
    nothing until the </think> token, which it skips; MAY_OPEN, the first row allows the grammar's
    tokens and <think>. A verification step's rows switch where a draft crosses the boundary:

        phase INSIDE, drafts [a, </think>, {, "]  rows: None  None  mask()  mask({)  mask({")
                                                        (a)   (</think>)  ({)      (")
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import any_to_lark
from transformers import PreTrainedTokenizerBase

from minivllm.reasoning import ReasoningConfig, ReasoningPhase
from minivllm.structured_outputs import StructuredOutputKind, StructuredOutputsParams

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (most recently used), by (kind, spec)
_JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON (see the module docstring)


def bitmask_width(vocab_size: int) -> int:
    """int32 words in one row's bitmask: token t is bit t % 32 of word t // 32."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One sequence's position in its grammar (wraps an `llguidance.LLMatcher`), and in its reasoning."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, reasoning: ReasoningConfig | None = None,
                 phase: ReasoningPhase = ReasoningPhase.ENDED) -> None:
        self._m, self.vocab_size = matcher, vocab_size
        self.reasoning, self.phase = reasoning, phase  # ENDED: the grammar applies (always, without a parser)

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """out: (W,) int32 on the CPU, filled with the tokens allowed next."""
        # Imported at first use, not with minivllm: llguidance.torch decorates a kernel with torch.compile when
        # imported, which loads torch's compiler stack (~2.5 s of every start on 2 cores).
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, out[None], 0)

    def row_masks(self, drafts: list[int] = ()) -> list[torch.Tensor | None]:
        """1 + d rows: the allowed set after the output so far and after each prefix of `drafts`, each a (W,)
        int32 mask, or None where the row is inside reasoning (anything allowed). What the sampler applies."""
        rows: list[torch.Tensor | None] = []
        phase = self.phase
        for j in range(len(drafts) + 1):
            if phase is ReasoningPhase.INSIDE:
                rows.append(None)
                if j < len(drafts) and drafts[j] == self.reasoning.end_token_id:
                    phase = ReasoningPhase.ENDED  # the rows after it are the answer's
                continue
            if phase is ReasoningPhase.MAY_OPEN and j < len(drafts) and drafts[j] == self.reasoning.start_token_id:
                rows.append(self.bitmasks([])[0])  # the grammar's first row, which also allows <think>
                _allow(rows[-1], self.reasoning.start_token_id)
                phase = ReasoningPhase.INSIDE
                continue
            masks = self.bitmasks(drafts[j:])  # ENDED, or MAY_OPEN answering at once: the grammar's rows
            if phase is ReasoningPhase.MAY_OPEN:
                _allow(masks[0], self.reasoning.start_token_id)
            rows.extend(masks)
            break
        return rows

    def bitmasks(self, drafts: list[int] = ()) -> torch.Tensor:
        """(1 + d, W) int32: the grammar's allowed set after the output so far and after each prefix of `drafts`
        (the grammar's own rows, whatever the reasoning phase).
        Rows after a draft the grammar forbids repeat the row that forbids it (verification stops there);
        rows after a draft that completes the grammar repeat the last row too (the commit stops there)."""
        masks = torch.zeros(1 + len(drafts), bitmask_width(self.vocab_size), dtype=torch.int32)
        valid = self._m.validate_tokens(list(drafts)) if drafts else 0  # how many drafts the grammar takes
        self.fill_bitmask(masks[0])
        consumed = last = 0
        try:
            for j in range(1, valid + 1):
                if not self._m.consume_token(drafts[j - 1]):
                    raise RuntimeError(f"llguidance refused a draft it had validated: {self._m.get_error()}")
                consumed += 1
                if self._m.is_stopped():
                    break
                self.fill_bitmask(masks[j])
                last = j
        finally:
            self._m.rollback(consumed)  # the step leaves the matcher as it found it
        masks[last + 1:] = masks[last]
        return masks

    def accept(self, token_id: int) -> bool:
        """Advance by a committed token; False if the grammar forbids it (the matcher is then spent). Inside
        reasoning only </think> changes anything: the grammar starts after it."""
        if self.phase is ReasoningPhase.INSIDE:
            if token_id == self.reasoning.end_token_id:
                self.phase = ReasoningPhase.ENDED
            return True
        if self.phase is ReasoningPhase.MAY_OPEN:
            opens = token_id == self.reasoning.start_token_id
            self.phase = ReasoningPhase.INSIDE if opens else ReasoningPhase.ENDED
            if opens:
                return True
        return self._m.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """The grammar can take no further token: the output is done."""
        return self.phase is ReasoningPhase.ENDED and self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def copy(self) -> "GrammarMatcher":
        return GrammarMatcher(self._m.deep_copy(), self.vocab_size, self.reasoning, self.phase)


class GrammarCompiler:
    """Turns `StructuredOutputsParams` into matchers for one tokenizer. The tokenizer's byte table for
    llguidance is built on the first structured request (about a second for a 49k vocabulary), then
    kept; compiled grammars are kept by (kind, spec), each as a matcher at its start that new requests
    copy. Thread-safe: the server compiles off its event loop
    and off the engine's step."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[StructuredOutputKind, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                eos = sorted(self.eos_token_ids) or None
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=eos)
            return self._ll_tokenizer

    def matcher(self, params: StructuredOutputsParams, reasoning: ReasoningConfig | None = None,
                phase: ReasoningPhase = ReasoningPhase.ENDED) -> GrammarMatcher:
        """A fresh matcher for `params`: a copy of the cached one at the start of its grammar, in reasoning
        `phase` (reasoning.py). Compiles the grammar on a cache miss; raises ValueError naming what is wrong
        with an invalid one."""
        key = (params.kind, params.spec)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            template = self._compile(params)
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
        return GrammarMatcher(template.deep_copy(), self.vocab_size, reasoning, phase)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = to_llguidance_grammar(params.kind, params.spec)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if problem:
            raise ValueError(f"structured_outputs.{params.kind.value} is invalid: {problem.strip()}")
        m = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)  # the grammar's lexer is built here
        if m.is_error():
            raise ValueError(f"structured_outputs.{params.kind.value} is invalid: {m.get_error()}")
        return m


def _allow(mask: torch.Tensor, token_id: int) -> None:
    """Set token_id's bit in a (W,) int32 mask (bit 31 is the int32's sign bit)."""
    bit = token_id % 32
    mask[token_id // 32] |= (1 << bit) if bit < 31 else -(1 << 31)


def to_llguidance_grammar(kind: StructuredOutputKind, spec: str) -> str:
    """A request's kind and spec (StructuredOutputsParams.spec) as one llguidance grammar."""
    if kind is StructuredOutputKind.JSON:
        return llguidance.LLMatcher.grammar_from_json_schema(spec, _JSON_OPTIONS)
    if kind is StructuredOutputKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', _JSON_OPTIONS)
    if kind is StructuredOutputKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind is StructuredOutputKind.CHOICE:  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec)))
    try:
        lark = any_to_lark(spec)  # GBNF ("::=") is translated; Lark passes through
    except Exception as e:  # the translator's own parse errors
        raise ValueError(f"structured_outputs.grammar is invalid: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)
