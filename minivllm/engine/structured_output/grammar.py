"""Structured outputs in the engine: a grammar compiled once, a matcher per sequence, a bitmask per row.

    StructuredOutputsParams ──GrammarCompiler.compile──> grammar (cached by (kind, spec))
        at the request's boundary (InputProcessor), before it is queued: compiled within llguidance's
        limits, its first mask computed and timed; invalid, failing, over the mask budget, or able to
        write nothing but EOS -> ValueError (a 400 on the server) with a short message
    grammar ──GrammarCompiler.matcher──> GrammarMatcher, owned by the Sequence
    each step, the scheduler, for its plan:  grammar_fill.py fill_bitmask(matchers) ──> (R, V/32) int32,
        bit t = token t allowed; a request over its mask budget fails alone (finish_reason "error")
        applied as the LAST logits-processing stage (layers/logits_processors.py), so both samplers and
        draft verification draw only allowed tokens; logprobs are taken before, from the raw logits
    at commit (Scheduler.update_from_output): matcher.accept(token) — the only place it advances

The grammar engine is llguidance (a maintained Rust library, one abi3 wheel without dependencies): it parses
the output so far as bytes and answers, for every token of the vocabulary at once, whether the grammar can
still be completed after it; chosen over xgrammar by measurement (benchmarks/grammar_backends.py).

Masks are written through llguidance's array API (`LLMatcher.unsafe_compute_mask_ptr` into a CPU tensor's
memory), never `llguidance.torch`: it torch.compiles a kernel when imported, which froze every stream for
seconds (2.5 s to 61 s on 2 cores) at the first structured request, inside the engine's step.

Errors are short: `verbose_errors=False` (a verbose one carries the parser's state and the grammar, ~100 KB),
and every message is cut to MAX_ERROR_CHARS.

Invariants:
  * A matcher has seen exactly the sequence's committed output tokens. Speculative decoding asks for d + 1
    masks (after 0, 1, ..., d drafts): the matcher consumes the drafts the grammar allows, fills each mask, and
    rolls them back — the step leaves it as it found it. A draft it forbids has probability 0: rejected.
  * EOS is allowed exactly where the grammar is complete (llguidance is given the model's EOS ids); a
    grammar that can take no further token (`is_complete`) ends the request with finish_reason "stop".
  * n > 1: each of the request's sequences gets its own copy of the matcher at its start (`copy`).
  * JSON is compact (`{"a":1,"b":[2]}`): with free whitespace a small model can emit newlines until max_tokens.
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
import time
from collections import OrderedDict

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import any_to_lark
from transformers import PreTrainedTokenizerBase

from minivllm.reasoning import ReasoningConfig, ReasoningPhase
from minivllm.schema_strictness import strict_schema
from minivllm.structured_outputs import StructuredOutputKind, StructuredOutputsParams

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (most recently used), by (kind, spec); lasting refusals too
MAX_ERROR_CHARS = 300  # llguidance's message is cut here: a request's error names the problem, never dumps state
_JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON (see the module docstring)


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's bounds on the work of a compile and of one mask (its defaults; their docs give the speed of
    each: ~50k lexer fuel/ms to build the lexer, 14k/ms and 20k Earley items/ms a mask), without the verbose
    errors that carry the parser's state and the grammar."""
    return llguidance.LLParserLimits(verbose_errors=False)


def short_error(text: str) -> str:
    """llguidance's error text as one short line: its first lines, without the <non-verbose/> marker, capped."""
    text = " ".join(line.strip() for line in text.replace("<non-verbose/>", "").splitlines() if line.strip())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def bitmask_width(vocab_size: int) -> int:
    """int32 words in one row's bitmask: token t is bit t % 32 of word t // 32."""
    return (vocab_size + 31) // 32


class GrammarOverBudget(ValueError):
    """A timed first mask over the budget: never cached (one slow probe on a busy CPU is no permanent 400)."""


class GrammarMatcher:
    """One sequence's position in its grammar (wraps an `llguidance.LLMatcher`), and in its reasoning."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, reasoning: ReasoningConfig | None = None,
                 phase: ReasoningPhase = ReasoningPhase.ENDED, mask_budget_ms: float = float("inf")) -> None:
        self._m, self.vocab_size = matcher, vocab_size
        self.reasoning, self.phase = reasoning, phase  # ENDED: the grammar applies (always, without a parser)
        self.mask_budget_ms = mask_budget_ms  # CPU time one mask may take (EngineConfig.grammar_mask_budget_ms)

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """out: (W,) int32, contiguous, on the CPU: filled with the tokens allowed next. llguidance writes
        straight into the tensor's memory (its array API), and drops the GIL while it computes."""
        if out.dtype != torch.int32 or out.device.type != "cpu" or not out.is_contiguous() or \
                out.shape != (bitmask_width(self.vocab_size),):
            raise ValueError(f"a grammar mask is a contiguous ({bitmask_width(self.vocab_size)},) int32 CPU tensor, "
                             f"got {tuple(out.shape)} {out.dtype} on {out.device}")
        self._m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())

    def row_masks(self, drafts: list[int] = (), out: torch.Tensor | None = None) -> list[torch.Tensor | None]:
        """1 + d rows: the allowed set after the output so far and after each prefix of `drafts`, each a (W,)
        int32 mask (a row of `out`, (1 + d, W), when given), or None where the row is inside reasoning
        (anything allowed). What the sampler applies."""
        out = torch.zeros(1 + len(drafts), bitmask_width(self.vocab_size), dtype=torch.int32) if out is None else out
        rows: list[torch.Tensor | None] = []
        phase = self.phase
        for j in range(len(drafts) + 1):
            if phase is ReasoningPhase.INSIDE:
                rows.append(None)
                if j < len(drafts) and drafts[j] == self.reasoning.end_token_id:
                    phase = ReasoningPhase.ENDED  # the rows after it are the answer's
                continue
            if phase is ReasoningPhase.MAY_OPEN and j < len(drafts) and drafts[j] == self.reasoning.start_token_id:
                rows.append(self.bitmasks([], out[j:j + 1])[0])  # the grammar's first row, which also allows <think>
                _allow(rows[-1], self.reasoning.start_token_id)
                phase = ReasoningPhase.INSIDE
                continue
            masks = self.bitmasks(drafts[j:], out[j:])  # ENDED, or MAY_OPEN answering at once: the grammar's rows
            if phase is ReasoningPhase.MAY_OPEN:
                _allow(masks[0], self.reasoning.start_token_id)
            rows.extend(masks)
            break
        return rows

    def bitmasks(self, drafts: list[int] = (), out: torch.Tensor | None = None) -> torch.Tensor:
        """(1 + d, W) int32 (`out`, when given): the grammar's allowed set after the output so far and after each
        prefix of `drafts` (the grammar's own rows, whatever the reasoning phase).
        Rows after a draft the grammar forbids repeat the row that forbids it (verification stops there);
        rows after a draft that completes the grammar repeat the last row too (the commit stops there)."""
        masks = torch.zeros(1 + len(drafts), bitmask_width(self.vocab_size), dtype=torch.int32) if out is None else out
        valid = self._m.validate_tokens(list(drafts)) if drafts else 0  # how many drafts the grammar takes
        self.fill_bitmask(masks[0])
        consumed = last = 0
        try:
            for j in range(1, valid + 1):
                if not self._m.consume_token(drafts[j - 1]):
                    raise RuntimeError(f"llguidance refused a draft it had validated: {self.error}")
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
        """Why the grammar failed (short: MAX_ERROR_CHARS at most); "" while it has not."""
        return short_error(self._m.get_error()) if self._m.is_error() else ""

    def copy(self) -> "GrammarMatcher":
        return GrammarMatcher(self._m.deep_copy(), self.vocab_size, self.reasoning, self.phase, self.mask_budget_ms)


class GrammarCompiler:
    """Turns `StructuredOutputsParams` into matchers for one tokenizer. The tokenizer's byte table for
    llguidance is built on the first structured request (about a second for a 49k vocabulary), then
    kept; compiled grammars are kept by (kind, spec), each as a matcher at its start that new requests copy,
    and so are refusals but the timed one (GrammarOverBudget). Thread-safe: the server compiles off its
    event loop and off the engine's step.
    A grammar is accepted once its first mask is computed and a copy took its first token: llguidance finds
    the grammars it cannot run (a schema that requires itself, `start: "a" start`, `a{1000000}`, 5,000
    alternatives) only there, at a limit; one whose only token is EOS could write nothing; a copy's mask,
    timed, must fit `mask_budget_ms` (the template's first mask also builds what copies share)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: frozenset[int], *,
                 mask_budget_ms: float = float("inf"), strict_json_schema: bool = False) -> None:
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.mask_budget_ms, self.strict_json_schema = mask_budget_ms, strict_json_schema
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[StructuredOutputKind, str], llguidance.LLMatcher | str] = OrderedDict()
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
        """A fresh matcher for `params` (a copy of the cached one at its start) in reasoning `phase` (reasoning.py).
        Compiles on a cache miss; ValueError says what is wrong (invalid, cannot run, over budget, only EOS)."""
        key = (params.kind, params.spec)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            try:
                template = self._compile(params)
            except GrammarOverBudget:
                raise  # a measurement, not a property of the grammar: the next request times it again
            except ValueError as e:  # invalid, cannot run, only EOS: refused alike every time
                template = str(e)
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(template, str):
            raise ValueError(template)
        return GrammarMatcher(template.deep_copy(), self.vocab_size, reasoning, phase, self.mask_budget_ms)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        where = f"structured_outputs.{params.kind.value}"
        grammar = to_llguidance_grammar(params.kind, params.spec, strict=self.strict_json_schema)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer, limits=parser_limits())
        if problem:
            raise ValueError(f"{where} is invalid: {short_error(problem)}")
        # the grammar's lexer is built here (llguidance drops the GIL meanwhile), within parser_limits()
        m = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=parser_limits())
        first = torch.zeros(bitmask_width(self.vocab_size), dtype=torch.int32)
        if not m.is_error():
            GrammarMatcher(m, self.vocab_size).fill_bitmask(first)
        for t in self.eos_token_ids:
            _allow(first, t, allowed=False)
        if not first.any() or m.get_error().startswith("NoExtensionBias"):  # llguidance's word for "only EOS"
            raise ValueError(f"{where} allows no output: it can only end at once (EOS, an empty text); give one "
                             "that matches a non-empty text")
        if m.is_error():
            raise ValueError(f"{where} cannot be used: {short_error(m.get_error())}")
        self._probe(GrammarMatcher(m.deep_copy(), self.vocab_size), first, where)
        return m

    def _probe(self, probe: GrammarMatcher, first: torch.Tensor, where: str) -> None:
        """On a copy: one mask, in CPU time (what every step pays for each of its rows), refused over the budget;
        then its first allowed token taken, where a grammar that explodes hits llguidance's limit at once."""
        out, start = torch.zeros(bitmask_width(self.vocab_size), dtype=torch.int32), time.thread_time()
        probe.fill_bitmask(out)
        took_ms = (time.thread_time() - start) * 1e3
        if took_ms > self.mask_budget_ms:  # GrammarOverBudget: not cached (GrammarCompiler.matcher)
            raise GrammarOverBudget(f"{where} costs {took_ms:.0f} ms of CPU a token, over the budget of "
                             f"{self.mask_budget_ms:g} ms (the engine's grammar_mask_budget_ms); a long literal "
                             "or a huge repetition count is the usual cause: simplify it")
        bits = (first[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (W, 32): bit t % 32 of word t // 32
        token = int(bits.flatten().nonzero()[0])  # the lowest allowed token other than EOS
        if not probe.accept(token) and probe.error:
            raise ValueError(f"{where} cannot be used: {probe.error}")


def _allow(mask: torch.Tensor, token_id: int, allowed: bool = True) -> None:
    """Set (or clear) token_id's bit in a (W,) int32 mask (bit 31 is the int32's sign bit)."""
    bit = token_id % 32
    value = (1 << bit) if bit < 31 else -(1 << 31)
    if allowed:
        mask[token_id // 32] |= value
    else:
        mask[token_id // 32] &= ~value


def to_llguidance_grammar(kind: StructuredOutputKind, spec: str, *, strict: bool = False) -> str:
    """A request's kind and spec (StructuredOutputsParams.spec) as one llguidance grammar; `strict`: a JSON
    schema's objects allow no property they do not name, unless they say otherwise (structured_outputs.py)."""
    if kind is StructuredOutputKind.JSON:
        try:  # StructuredOutputsParams caps a schema's depth: the backstop for every pass that recurses
            schema = json.loads(spec)
            return llguidance.LLMatcher.grammar_from_json_schema(strict_schema(schema) if strict else schema,
                                                                 _JSON_OPTIONS)
        except RecursionError:
            raise ValueError("structured_outputs.json is nested too deeply to compile; flatten it") from None
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
        raise ValueError(f"structured_outputs.grammar is invalid: {short_error(str(e))}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)
