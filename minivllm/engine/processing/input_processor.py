"""`InputProcessor`: a request at the boundary — tokenized, validated, turned into a `Sequence`.

Everything a request carries is checked here, before it can reach a step (see
docs/concepts/failures.md): the prompt (non-empty, token ids inside the vocabulary, numpy integers
accepted), every token-id field of its `SamplingParams`, logprobs within `max_logprobs`, its
structured-outputs grammar (compiled here, off the engine's step, and its first mask computed and timed:
one that cannot run, can write only EOS or costs more than `grammar_mask_budget_ms` a token is refused;
engine/structured_output/grammar.py; with a reasoning parser, it starts where the prompt leaves the reasoning:
minivllm/reasoning.py), and whether
it can ever run at all (`unservable_reason`: more completions than max_num_seqs, longer than
max_model_len, or needing more KV blocks than the whole pool). Messages say which limit to change.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import torch

from transformers import PreTrainedTokenizerBase

from minivllm.config import EngineConfig
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.structured_output.grammar import GrammarCompiler
from minivllm.layers.logits_processors import RequestLogitRules, bad_words_token_ids
from minivllm.models.hf_config import ModelSpec
from minivllm.reasoning import ReasoningConfig, ReasoningPhase
from minivllm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class KVPool(Protocol):
    """What the pool check asks of the scheduler's KV books (core/'s `BlockManager` or `KVCacheCoordinator`),
    named by its one method so that processing/ imports nothing of core/: (blocks needed, blocks the pool
    has) when `num_tokens` can never fit, else None (the books answer a `PoolShortfall`, that tuple)."""

    def pool_shortfall(self, num_tokens: int) -> tuple[int, int] | None: ...


class Unservable(NamedTuple):
    """Why a request can never run: the request field that makes it so (None: the prompt's length) and
    a message that says what to change."""

    field: str | None
    message: str

    def __str__(self) -> str:
        return self.message


class PromptTooLong(ValueError):
    """The prompt cannot fit in max_model_len (known before tokenizing it: from its bytes)."""


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, spec: ModelSpec, config: EngineConfig, device: torch.device,
                 eos_token_ids: frozenset[int] = frozenset(), reasoning: ReasoningConfig | None = None) -> None:
        self.tokenizer, self.spec, self.config, self.device = tokenizer, spec, config, device
        self.reasoning = reasoning  # a grammar applies after the reasoning ends (minivllm/reasoning.py)
        self._max_token_bytes: int | None = None
        # structured outputs: grammars compiled here, at the boundary, once per (kind, spec)
        self.grammars = GrammarCompiler(tokenizer, spec.vocab_size, eos_token_ids,
                                        mask_budget_ms=config.grammar_mask_budget_ms,
                                        strict_json_schema=config.strict_json_schema)

    def tokenize(self, prompt: PromptType, *, may_truncate: bool = False) -> tuple[str | None, list[int]]:
        """(text, token ids). A text that is not valid Unicode, or whose bytes alone prove it longer than
        max_model_len, is refused before the tokenizer spends time on it (`may_truncate`: the request keeps
        only its last tokens anyway, so length proves nothing)."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        self.check_text(text, may_truncate)
        return text, self.tokenizer(text).input_ids

    def check_text(self, text: str, may_truncate: bool = False) -> None:
        """Refuse a text that is not valid Unicode, or whose bytes alone prove it longer than max_model_len
        (the server calls this before its own tokenization too)."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800"): no tokenizer can take it
            raise ValueError(f"the prompt is not valid Unicode: {text[e.start:e.end]!r} at character {e.start} is a "
                             "lone surrogate; send text whose characters all encode to UTF-8") from None
        if not may_truncate and size > self.config.max_model_len * self.max_token_bytes:
            raise PromptTooLong(f"the prompt is {size} bytes; no token of this model is longer than "
                             f"{self.max_token_bytes} bytes, so it has over {size // self.max_token_bytes} tokens, "
                             f"more than max_model_len={self.config.max_model_len}; shorten the prompt")

    @property
    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token stands for: 4 (UTF-8's longest character) times the
        longest entry of the vocabulary, in characters. Computed once."""
        if self._max_token_bytes is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_token_bytes = 4 * max((len(t) for t in vocab), default=256)
        return self._max_token_bytes

    def make_sequence(self, request_id: str, prompt: PromptType,
                      sampling_params: SamplingParams | None = None, priority: int = 0) -> Sequence:
        """Validate a request and build its Sequence (raises ValueError/TypeError saying what to change)."""
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        text, ids = self.tokenize(prompt, may_truncate=sp.truncate_prompt_tokens is not None)
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
        ids = self.check_token_ids(request_id, "prompt_token_ids", ids)
        self.check_token_ids(request_id, "stop_token_ids", sp.all_stop_token_ids)
        rules = self.logit_rules(request_id, sp)
        for field in ("logprobs", "prompt_logprobs"):
            if (getattr(sp, field) or 0) > self.config.max_logprobs:
                raise ValueError(f"request {request_id!r}: {field}={getattr(sp, field)} exceeds max_logprobs="
                                 f"{self.config.max_logprobs}; ask for fewer or raise the engine's max_logprobs")
        if sp.truncate_prompt_tokens is not None:
            ids = ids[-sp.truncate_prompt_tokens:]  # keep the end, as vLLM does
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id!r}: priority={priority!r} must be an integer (lower = sooner)")
        seq = Sequence(request_id, ids, sp, prompt=text, seed=sp.seed or 0, priority=priority)
        seq.logit_rules = rules
        if sp.structured_outputs is not None:  # compiled (or found in the cache) now: invalid -> ValueError
            try:
                phase = self.reasoning.prompt_phase(ids) if self.reasoning is not None else ReasoningPhase.ENDED
                seq.grammar = self.grammars.matcher(sp.structured_outputs, self.reasoning, phase)
            except ValueError as e:
                raise ValueError(f"request {request_id!r}: {e}") from None
        return seq

    def logit_rules(self, request_id: str, sp: SamplingParams) -> RequestLogitRules | None:
        """`sp`'s allowed ids, biases and bad words, checked against the vocabulary and prepared for every
        step (layers/logits_processors.py). Once per `SamplingParams` and engine: kept on `sp`, so the
        server's check before queueing, off the engine's thread, also does the engine's work, and the
        prompts of one `LLM.generate` call share it."""
        cached = sp.__dict__.get("_logit_rules")  # cached_property-style: SamplingParams' fields never change
        if cached is not None and cached[0]() is self:  # a weak reference: a kept params keeps no engine alive
            return cached[1]
        vocab = self.spec.vocab_size
        for field, ids in (("allowed_token_ids", sp.allowed_token_ids), ("logit_bias", list(sp.logit_bias or ()))):
            if ids:
                t = torch.tensor(ids, dtype=torch.int64)
                bad = t[(t < 0) | (t >= vocab)].tolist()
                if bad:
                    raise ValueError(f"request {request_id!r}: {field} {bad[:5]} are outside the vocabulary "
                                     f"[0, {vocab}) of this model; use integer token ids in that range")
        words = bad_words_token_ids(self.tokenizer, sp.bad_words) if sp.bad_words else []
        rules = RequestLogitRules.build(vocab, allowed_token_ids=sp.allowed_token_ids, logit_bias=sp.logit_bias,
                                        bad_words=words, device=self.device)
        sp.__dict__["_logit_rules"] = (weakref.ref(self), rules)
        return rules

    def check_token_ids(self, request_id: str, field: str, ids: Iterable[Any]) -> list[int]:
        """Every token id a request carries must index the model's vocabulary: an id out of range
        would fail the whole step (an embedding lookup, a logits mask) far from its cause."""
        vocab = self.spec.vocab_size
        out, bad = [], []
        for t in ids:
            if isinstance(t, bool) or not hasattr(t, "__index__") or not 0 <= operator.index(t) < vocab:
                bad.append(t)
            else:
                out.append(operator.index(t))  # numpy integers become Python ints here
        if bad:
            raise ValueError(f"request {request_id!r}: {field} {bad[:5]} are outside the vocabulary [0, {vocab}) "
                             "of this model; use integer token ids in that range")
        return out

    def unservable_reason(self, seq: Sequence, block_manager: KVPool) -> Unservable | None:
        """Which limit makes this request impossible to run, and what to change; None if it fits."""
        cfg, n = self.config, seq.num_prompt_tokens
        num_seqs = seq.sampling_params.n
        if num_seqs > cfg.max_num_seqs:  # a bound on what one request may fan out to (parallel_sampling.py)
            return Unservable("n", f"n={num_seqs} completions are {num_seqs} sequences, more than "
                                   f"max_num_seqs={cfg.max_num_seqs} can run at once; lower n or raise max_num_seqs")
        if n >= cfg.max_model_len:
            return Unservable(None, f"the prompt has {n} tokens but max_model_len={cfg.max_model_len} leaves no "
                                    "room to generate; shorten the prompt or raise max_model_len")
        max_tokens = seq.sampling_params.max_tokens
        final_len = cfg.max_model_len if max_tokens is None else min(n + max_tokens, cfg.max_model_len)
        short = block_manager.pool_shortfall(final_len - 1)  # the last token is never computed
        if short is not None:
            needed, available = short
            return Unservable(None, f"the request needs {needed} KV blocks ({final_len} tokens) but the pool "
                                    f"has only {available}; raise num_kv_blocks (or the KV memory "
                                    "budget), or lower max_tokens")
        return None
