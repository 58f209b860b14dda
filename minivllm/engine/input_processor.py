"""`InputProcessor`: a request at the boundary — tokenized, validated, turned into a `Sequence`.

Everything a request carries is checked here, before it can reach a step (see
docs/concepts/failures.md): the prompt (non-empty, token ids inside the vocabulary, numpy integers
accepted), every token-id field of its `SamplingParams`, logprobs within `max_logprobs`, and whether
it can ever run at all (`unservable_reason`: more completions than max_num_seqs, longer than
max_model_len, or needing more KV blocks than the whole pool). Messages say which limit to change.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any, NamedTuple

from minivllm.config import EngineConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence
from minivllm.layers.logits_processors import bad_words_token_ids
from minivllm.models.hf_config import ModelSpec
from minivllm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class Unservable(NamedTuple):
    """Why a request can never run: the request field that makes it so (None: the prompt's length) and
    a message that says what to change."""

    field: str | None
    message: str

    def __str__(self) -> str:
        return self.message


class InputProcessor:
    def __init__(self, tokenizer: Any, spec: ModelSpec, config: EngineConfig) -> None:
        self.tokenizer, self.spec, self.config = tokenizer, spec, config

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self.tokenize(prompt["prompt"])
        raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def make_sequence(self, request_id: str, prompt: PromptType,
                      sampling_params: SamplingParams | None = None, priority: int = 0) -> Sequence:
        """Validate a request and build its Sequence (raises ValueError/TypeError saying what to change)."""
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
        ids = self.check_token_ids(request_id, "prompt_token_ids", ids)
        for field, field_ids in sp.token_id_fields().items():
            self.check_token_ids(request_id, field, field_ids)
        for field in ("logprobs", "prompt_logprobs"):
            if (getattr(sp, field) or 0) > self.config.max_logprobs:
                raise ValueError(f"request {request_id!r}: {field}={getattr(sp, field)} exceeds max_logprobs="
                                 f"{self.config.max_logprobs}; ask for fewer or raise the engine's max_logprobs")
        if sp.truncate_prompt_tokens is not None:
            ids = ids[-sp.truncate_prompt_tokens:]  # keep the end, as vLLM does
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id!r}: priority={priority!r} must be an integer (lower = sooner)")
        seq = Sequence(request_id, ids, sp, prompt=text, seed=sp.seed or 0, priority=priority)
        if sp.bad_words:
            seq.bad_words_token_ids = bad_words_token_ids(self.tokenizer, sp.bad_words)
        return seq

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

    def unservable_reason(self, seq: Sequence, block_manager: BlockManager) -> Unservable | None:
        """Which limit makes this request impossible to run, and what to change; None if it fits."""
        cfg, n = self.config, seq.num_prompt_tokens
        num_seqs = seq.sampling_params.n
        if num_seqs > cfg.max_num_seqs:  # its n sequences run together once forked: they must fit in one step
            return Unservable("n", f"n={num_seqs} completions run as {num_seqs} sequences at once, but "
                                   f"max_num_seqs={cfg.max_num_seqs}; lower n or raise max_num_seqs")
        if n >= cfg.max_model_len:
            return Unservable(None, f"the prompt has {n} tokens but max_model_len={cfg.max_model_len} leaves no "
                                    "room to generate; shorten the prompt or raise max_model_len")
        max_tokens = seq.sampling_params.max_tokens
        final_len = cfg.max_model_len if max_tokens is None else min(n + max_tokens, cfg.max_model_len)
        needed = block_manager.blocks_needed(final_len - 1)  # the last token is never computed
        if needed > block_manager.num_blocks:
            return Unservable(None, f"the request needs {needed} KV blocks ({final_len} tokens) but the pool has "
                                    f"only {block_manager.num_blocks}; raise num_kv_blocks (or the KV memory "
                                    "budget), or lower max_tokens")
        return None
