"""N-gram (prompt lookup) proposals: if the last n tokens appeared before, guess what followed.

    tokens  ... A B C D ... X A B C  ?        last n = 3 tokens "A B C" occurred earlier,
                        ^^^^^ ^              followed by "D ...": propose "D ..." (up to k tokens)

Try n from `prompt_lookup_max` down to `prompt_lookup_min`; the most recent earlier occurrence
wins. Free to compute, and very good at copying: code edits, quoting, "repeat this text".
"""

from __future__ import annotations

from minivllm.engine.spec_decode.proposer import Draft, DraftRequest, Proposer


def ngram_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1) -> None:
        self.n_max, self.n_min = prompt_lookup_max, prompt_lookup_min

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(ngram_lookup(r.token_ids.tolist(), r.max_tokens, self.n_max, self.n_min) if r.max_tokens else [])
                for r in requests]
