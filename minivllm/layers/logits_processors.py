"""Logits processing: what a request asks to change in the model's logits before sampling.

    logits (S, V) ─> allowed_token_ids  keep only these ids                    (mask to -inf)
                  ─> banned ids         bad words, and EOS/stop ids held off before min_tokens (-inf)
                  ─> logit_bias         logits[id] += bias
                  ─> repetition         HF: seen (prompt + output) ids: l > 0 ? l / p : l * p
                  ─> frequency          l -= frequency_penalty * count(id in output)
                  ─> presence           l -= presence_penalty * (count(id in output) > 0)
                  ─> grammar bitmask    structured outputs: tokens the grammar forbids (-inf), LAST,
                                        so that no bias or penalty can bring a forbidden token back

A row whose allowed set comes out empty (a grammar against allowed_token_ids or bad words; never against
min_tokens, whose hold yields to a grammar that can only end) is never drawn from as all -inf (that is NaN in a softmax): `rows_without_choice` finds such rows, sets
them to zeros so the draw stays finite, and the model runner fails their requests with a message.

The order and the formulas are vLLM's (the repetition penalty is HF transformers'
`RepetitionPenaltyLogitsProcessor`; presence and frequency are OpenAI's). Both samplers (PyTorch and
Triton) run after this stage, so every request field works the same on either backend.

Only rows that ask for something are touched, and the (rows, V) count tensors are built only when
some row has a penalty: a batch of plain requests pays nothing here.

What a request's lists ask is prepared ONCE, when it is admitted (`RequestLogitRules`): the allowed ids
as a (V,) mask, the biases as two tensors, the bad words as a table keyed by the tokens before their
last. A step then costs the same whether a request allows 3 ids or 100,000, or bans 2 words or 4,000
(rebuilding them every step once let one request with 80,000 bad words hold every other request back
for seconds).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch


class BadWords:
    """A request's bad words as token sequences, in a table built once: the one-token words (always
    banned) and, for longer ones, the tokens before the last -> the last tokens they ban. Which tokens to
    ban after an output costs one lookup per distinct word length, however many words there are.
    `banned_by_bad_words` below is the plain reference (one comparison per word)."""

    def __init__(self, words: list[list[int]]) -> None:
        after: dict[tuple[int, ...], list[int]] = {}
        always: list[int] = []
        for ids in words:
            if len(ids) == 1:
                always.append(ids[0])
            else:
                after.setdefault(tuple(ids[:-1]), []).append(ids[-1])
        self.always = tuple(dict.fromkeys(always))
        self.after = {prefix: tuple(dict.fromkeys(last)) for prefix, last in after.items()}
        self.lengths = tuple(sorted({len(prefix) for prefix in after}))  # how far back a prefix can reach

    def banned(self, output_token_ids: list[int]) -> list[int]:
        """The next tokens that would complete a bad word after `output_token_ids` (the output so far)."""
        banned = list(self.always)
        for n in self.lengths:
            if n > len(output_token_ids):
                break
            banned += self.after.get(tuple(output_token_ids[-n:]), ())
        return banned


@dataclass(frozen=True)
class RequestLogitRules:
    """What a request's allowed ids, biases and bad words ask of every one of its rows, prepared once at
    admission (engine/processing/input_processor.py) on the device the logits are on; an n > 1 request's sequences share
    it."""

    allowed: torch.Tensor | None = None  # (V,) bool: True = may be drawn
    bias_ids: torch.Tensor | None = None  # (B,) int64
    bias_values: torch.Tensor | None = None  # (B,) float32, added to those logits
    bad_words: BadWords | None = None

    @classmethod
    def build(cls, vocab_size: int, *, allowed_token_ids: list[int] | None = None,
              logit_bias: dict[int, float] | None = None, bad_words: list[list[int]] = (),
              device: torch.device = torch.device("cpu")) -> "RequestLogitRules | None":
        """None when the request asks for none of them. Ids must be inside the vocabulary (checked before)."""
        if allowed_token_ids is None and not logit_bias and not bad_words:
            return None
        allowed = None
        if allowed_token_ids is not None:
            allowed = torch.zeros(vocab_size, dtype=torch.bool)
            allowed[torch.tensor(allowed_token_ids, dtype=torch.int64)] = True
            allowed = allowed.to(device)
        bias_ids = bias_values = None
        if logit_bias:
            bias_ids = torch.tensor(list(logit_bias), dtype=torch.int64, device=device)
            bias_values = torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=device)
        return cls(allowed, bias_ids, bias_values, BadWords(bad_words) if bad_words else None)


@dataclass(frozen=True)
class RowProcessing:
    """What one sampled row asks of this stage (defaults: nothing). Frozen: the no-op one is shared by
    every row that asks for nothing (engine/worker/sampling_metadata.py)."""

    banned_token_ids: list[int] = field(default_factory=list)  # bad words
    # EOS and stop ids before min_tokens: kept apart because a grammar that can only end lifts them
    # (engine/worker/sampling_metadata.py: the grammar's end wins over min_tokens)
    held_token_ids: list[int] = field(default_factory=list)
    rules: RequestLogitRules | None = None  # allowed ids and biases, prepared at admission
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_token_ids: array | None = None  # for the repetition penalty
    output_token_ids: list[int] | None = None  # for all three penalties (includes earlier drafts)
    grammar_bitmask: torch.Tensor | None = None  # (ceil(V/32),) int32 on the CPU: bit t of word t//32 = allowed

    @property
    def is_noop(self) -> bool:
        return (not self.banned_token_ids and not self.held_token_ids and (self.rules is None or (self.rules.allowed is None
                                                                      and self.rules.bias_ids is None))
                and self.presence_penalty == 0 and self.frequency_penalty == 0 and self.repetition_penalty == 1
                and self.grammar_bitmask is None)

    @property
    def may_forbid_all(self) -> bool:
        """Can this row's allowed set be empty? Only with a grammar or an allow-list beside other bans."""
        return self.grammar_bitmask is not None or (self.rules is not None and self.rules.allowed is not None)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 -> (R, V) bool, True = allowed (token t is bit t % 32 of word t // 32)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab_size]  # (R, W*32) cut to V


def apply_logits_processing(logits: torch.Tensor, rows: list[RowProcessing]) -> torch.Tensor:
    """logits: (S, V) float32, one row per entry of `rows`. Returns processed logits (may be a copy)."""
    active = [i for i, r in enumerate(rows) if not r.is_noop]
    if not active:
        return logits
    logits = logits.clone()
    S, V = logits.shape
    for i in active:
        r, rules = rows[i], rows[i].rules
        if rules is not None and rules.allowed is not None:
            logits[i].masked_fill_(~rules.allowed, float("-inf"))
        if r.banned_token_ids:
            logits[i, r.banned_token_ids] = float("-inf")
        if r.held_token_ids:
            logits[i, r.held_token_ids] = float("-inf")
        if rules is not None and rules.bias_ids is not None:
            logits[i, rules.bias_ids] += rules.bias_values
    penalized = [i for i in active if rows[i].output_token_ids is not None]
    if penalized:
        apply_penalties(logits, [rows[i] for i in penalized], penalized)
    constrained = [i for i in active if rows[i].grammar_bitmask is not None]
    if constrained:  # last: the grammar's verdict stands whatever came before
        masks = torch.stack([rows[i].grammar_bitmask for i in constrained]).to(logits.device)  # (G, W)
        forbidden = ~unpack_bitmask(masks, V)  # (G, V)
        if len(constrained) == S:  # every row: in place, no gather and scatter of the whole batch
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            idx = torch.tensor(constrained, device=logits.device)
            logits[idx] = logits[idx].masked_fill(forbidden, float("-inf"))
    return logits


def rows_without_choice(logits: torch.Tensor, rows: list[RowProcessing]) -> list[int]:
    """The rows of processed `logits` (S, V) whose every token is forbidden; each is set to zeros, in place,
    so that sampling it stays finite (the caller fails its request instead of trusting the draw)."""
    check = [i for i, r in enumerate(rows) if r.may_forbid_all]
    if not check:
        return []
    idx = torch.tensor(check, device=logits.device)
    empty = idx[logits[idx].amax(-1) == float("-inf")]  # (E,) every entry -inf (one reduction, no (R, V) temporary)
    if len(empty):
        logits[empty] = 0.0
    return empty.tolist()


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
    texts = [w.lstrip() for w in words]
    plains, spaceds = _encode_all(tokenizer, texts), _encode_all(tokenizer, [" " + t for t in texts])
    out: list[list[int]] = []
    for plain, spaced in zip(plains, spaceds):
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [ids for ids in out if ids]


def _encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's token ids, no special tokens: in one call to a fast tokenizer's Rust core when there is one
    (4,096 words: 16 ms, against 90 ms a word at a time, which also held Python's lock all along)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def banned_by_bad_words(bad_words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """Reference for `BadWords.banned` (one comparison per word): the next tokens that would complete a bad
    word: a one-token word is always banned; a longer one is banned when the output so far ends with all
    of its tokens but the last."""
    banned = []
    for ids in bad_words:
        prefix = ids[:-1]
        if not prefix or (len(output_token_ids) >= len(prefix) and output_token_ids[-len(prefix):] == prefix):
            banned.append(ids[-1])
    return banned
