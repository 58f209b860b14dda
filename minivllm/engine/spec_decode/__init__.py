"""Speculative decoding: propose a few tokens cheaply, verify them all in one target forward.

    step t:  schedule   each decoding sequence reserves 1 + k slots (k draft slots, dropped first
                        when the budget or the pool is short)
             propose    a `Proposer` fills `seq.spec_token_ids` (n-gram lookup, a draft model, or
                        the caller's own) — drafts are NOT tokens yet
             verify     one forward over [last token, d1 .. dk]: the target's logits at every draft
                        position; greedy: accept the longest agreeing prefix, plus one target token;
                        sampling: rejection sampling, which keeps the target's distribution exactly
             commit     accepted drafts (+ the target's token) are appended; K/V of rejected
                        positions are forgotten (num_computed_tokens), blocks past the end freed

Modules: `config.py` (vLLM's `speculative_config`), `proposer.py` (the interface), `ngram.py`,
`draft_model.py`, `rejection_sampler.py` (verification; its Triton kernel is in
kernels/rejection_sampling.py).
"""
