"""How the tests, the notebooks and the capstone compare the engine with HF transformers.

Greedy text of a random model repeats itself, so comparing strings proves little; and a whole
generated string compared with HF's `generate` fails on the first near-tie that rounds the other way,
after which the two texts have nothing in common. Instead: feed prompt + generated tokens to the HF
model ONCE (teacher forcing) and require every generated token to be an argmax of HF's logits at its
position, within `tol`. One forward checks every token, and a near-tie (two logits within `tol`) may
legitimately go either way without failing the rest.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def assert_hf_greedy(hf_model: Any, prompt_ids: list[int], output_ids: list[int], tol: float = 1e-3,
                     allowed: list[torch.Tensor] | None = None) -> None:
    """Teacher-forced check: feed prompt + output to HF once; every output token must be an argmax of
    HF's logits at its position, within `tol` (near-ties may legitimately flip). `allowed`: per output
    token, a (V,) bool mask of the tokens that could be drawn there (structured outputs' grammar)."""
    assert output_ids, "nothing was generated"
    logits = hf_model(torch.tensor([list(prompt_ids) + list(output_ids)])).logits[0].float()  # (L, V)
    for j, tok in enumerate(output_ids):
        row = logits[len(prompt_ids) - 1 + j]
        if allowed is not None:
            row = row.masked_fill(~allowed[j], float("-inf"))
        gap = float(row.max() - row[tok])
        assert gap <= tol, f"output token {j} ({tok}) is {gap:.2e} below HF's argmax {int(row.argmax())}"
