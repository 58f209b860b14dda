"""`StopChecker`: when a sequence is done (vLLM v0's name for the same job).

Two kinds of rule, both applied at commit (`Scheduler.update_from_output`), token by token:

    token rules    EOS (unless ignore_eos), a stop token id, a complete grammar (structured outputs:
                   the commit advances the sequence's matcher by the token first, and says whether
                   that completed it), max_tokens, max_model_len — checked as each token is appended
                   (`check_token`)
    stop strings   need text: the sequence's incremental detokenizer decodes the new tokens and the
                   stop strings are searched in the tail the new text could have completed
                   (`check_strings`); the output is cut where the stop string starts (or ends, with
                   include_stop_str_in_output), and tokens after the one that completed it are dropped

EOS and stop tokens are masked by the sampler until `min_tokens` outputs exist, and stop strings are
not searched before then either. A stop string completed by the token that reached max_tokens still
wins over "length". A grammar's end wins over `min_tokens`: an output its grammar completes (or can only
end: the sampler then lifts the min_tokens ban, engine/worker/sampling_metadata.py) ends "stop" with what it
wrote, since min_tokens cannot hold open an output that has nothing more to write.
"""

from __future__ import annotations

from typing import NamedTuple

from minivllm.engine.processing.detokenizer import StopMatch, find_stop_string
from minivllm.engine.request.sequence import FinishReason, Sequence


class StopReason(NamedTuple):
    finish_reason: FinishReason  # STOP or LENGTH
    stop_reason: int | str | None  # the stop token id or stop string (None: EOS, or a length limit)


def advance_grammar(seq: Sequence, token_id: int) -> bool:
    """Advance `seq`'s grammar (structured outputs) by its new token; True when the grammar is complete
    (it can take no further token), even before min_tokens: the grammar's end wins. Raises ValueError if
    the grammar forbids the token (the sampler's mask makes that impossible). False without a grammar."""
    if seq.grammar is None:
        return False
    if not seq.grammar.accept(token_id):
        raise ValueError(f"token {token_id} breaks the request's structured_outputs grammar: {seq.grammar.error}")
    return seq.grammar.is_complete


class StopChecker:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check_token(self, seq: Sequence, token_id: int, grammar_done: bool = False) -> StopReason | None:
        """The token rules, for the token just appended to `seq` (`grammar_done`: it completed the
        request's grammar, `advance_grammar`)."""
        sp = seq.sampling_params
        if seq.num_output_tokens > sp.min_tokens:  # the sampler masked these ids before that
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                return StopReason(FinishReason.STOP, None)
            if token_id in sp.all_stop_token_ids:
                return StopReason(FinishReason.STOP, token_id)
        if grammar_done:
            return StopReason(FinishReason.STOP, None)
        if sp.max_tokens is not None and seq.num_output_tokens >= sp.max_tokens:
            return StopReason(FinishReason.LENGTH, None)
        if seq.num_tokens >= self.max_model_len:
            return StopReason(FinishReason.LENGTH, None)
        return None

    def tokens_left(self, seq: Sequence) -> int:
        """How many more tokens `seq` may get before max_tokens or max_model_len stops it."""
        left = self.max_model_len - seq.num_tokens
        if seq.sampling_params.max_tokens is not None:
            left = min(left, seq.sampling_params.max_tokens - seq.num_output_tokens)
        return left

    def check_strings(self, seq: Sequence, num_new: int) -> tuple[int, StopMatch | None]:
        """Add `seq`'s `num_new` new tokens (several after accepted drafts) to its text, token by token.
        Returns how many of them the output keeps, and the stop string one of them completed, if any
        (the text is then already cut; the caller finishes the sequence and drops the tokens after it)."""
        detok = seq.detokenizer
        if detok is None:
            return num_new, None  # built without a tokenizer (the scheduler's own tests): no text
        new = seq.output_token_ids[detok.num_output_tokens:]
        sp = seq.sampling_params
        for i, token_id in enumerate(new):
            last = i == len(new) - 1
            delta = detok.update(token_id)
            if last and seq.is_finished:
                delta += detok.flush()
            if not delta or not sp.stop_strings or detok.num_output_tokens <= sp.min_tokens:
                continue
            if last and seq.finish_reason not in (None, FinishReason.LENGTH):  # EOS or a stop token came first
                continue
            match = find_stop_string(detok.text, len(delta), sp.stop_strings, sp.include_stop_str_in_output)
            if match is not None:
                detok.text = detok.text[:match.truncate_at]
                return i + 1, match
        return len(new), None
