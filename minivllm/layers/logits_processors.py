"""Logits processing: what a request asks to change in the model's logits before sampling.

    logits (S, V) ─> allowed_token_ids  keep only these ids                    (mask to -inf)
                  ─> banned ids         bad words, and EOS/stop ids before min_tokens (-inf)
                  ─> logit_bias         logits[id] += bias
                  ─> repetition         HF: seen (prompt + output) ids: l > 0 ? l / p : l * p
                  ─> frequency          l -= frequency_penalty * count(id in output)
                  ─> presence           l -= presence_penalty * (count(id in output) > 0)

The order and the formulas are vLLM's (the repetition penalty is HF transformers'
`RepetitionPenaltyLogitsProcessor`; presence and frequency are OpenAI's). Both samplers (PyTorch and
Triton) run after this stage, so every request field works the same on either backend.

Only rows that ask for something are touched, and the (rows, V) count tensors are built only when
some row has a penalty: a batch of plain requests pays nothing here.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RowProcessing:
    """What one sampled row asks of this stage (defaults: nothing). Frozen: the no-op one is shared by
    every row that asks for nothing (engine/sampling_metadata.py)."""

    banned_token_ids: list[int] = field(default_factory=list)  # bad words, min_tokens bans
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_token_ids: array | None = None  # for the repetition penalty
    output_token_ids: list[int] | None = None  # for all three penalties (includes earlier drafts)

    @property
    def is_noop(self) -> bool:
        return (not self.banned_token_ids and self.allowed_token_ids is None and not self.logit_bias
                and self.presence_penalty == 0 and self.frequency_penalty == 0 and self.repetition_penalty == 1)


def apply_logits_processing(logits: torch.Tensor, rows: list[RowProcessing]) -> torch.Tensor:
    """logits: (S, V) float32, one row per entry of `rows`. Returns processed logits (may be a copy)."""
    active = [i for i, r in enumerate(rows) if not r.is_noop]
    if not active:
        return logits
    logits = logits.clone()
    S, V = logits.shape
    for i in active:
        r = rows[i]
        if r.allowed_token_ids is not None:
            keep = torch.zeros(V, dtype=torch.bool, device=logits.device)
            keep[r.allowed_token_ids] = True
            logits[i].masked_fill_(~keep, float("-inf"))
        if r.banned_token_ids:
            logits[i, r.banned_token_ids] = float("-inf")
        if r.logit_bias:
            ids = torch.tensor(list(r.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(r.logit_bias.values()), device=logits.device)
    penalized = [i for i in active if rows[i].output_token_ids is not None]
    if penalized:
        apply_penalties(logits, [rows[i] for i in penalized], penalized)
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[RowProcessing], row_index: list[int]) -> None:
    """In place, on the listed rows: repetition (prompt + output), then frequency and presence."""
    V, dev = logits.shape[1], logits.device
    idx = torch.tensor(row_index, device=dev)
    counts = torch.zeros(len(rows), V, device=dev)  # (R, V) occurrences in the output
    seen = torch.zeros(len(rows), V, dtype=torch.bool, device=dev)  # (R, V) in prompt or output
    for j, r in enumerate(rows):
        out = torch.tensor(r.output_token_ids or [], dtype=torch.int64, device=dev)
        counts[j].index_add_(0, out, torch.ones(len(out), device=dev))
        seen[j, out] = True
        if r.prompt_token_ids is not None:
            seen[j, torch.frombuffer(r.prompt_token_ids, dtype=torch.int32).long().to(dev)] = True
    x = logits[idx]  # (R, V)
    rep = torch.tensor([r.repetition_penalty for r in rows], device=dev)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([r.frequency_penalty for r in rows], device=dev)[:, None]
    pres = torch.tensor([r.presence_penalty for r in rows], device=dev)[:, None]
    x = x - freq * counts - pres * (counts > 0).float()
    logits[idx] = x


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences a list of bad words can appear as: each word as tokenized at the start of
    a text, and with a leading space (as in the middle of a text) when that gives a different first
    token of the same length — vLLM's rule, so that banning "cat" also bans " cat"."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [ids for ids in out if ids]


def banned_by_bad_words(bad_words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The next tokens that would complete a bad word: a one-token word is always banned; a longer
    one is banned when the output so far ends with all of its tokens but the last."""
    banned = []
    for ids in bad_words:
        prefix = ids[:-1]
        if not prefix or (len(output_token_ids) >= len(prefix) and output_token_ids[-len(prefix):] == prefix):
            banned.append(ids[-1])
    return banned
