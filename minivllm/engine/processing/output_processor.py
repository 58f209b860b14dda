"""From committed sequences to `RequestOutput`s: text, logprobs with their text, what is new.

One `RequestState` per request (vLLM's name): its sequences — one, or the n of an `n > 1` request
(engine/processing/parallel_sampling.py), gathered here by their group id into one `RequestOutput`. Each sequence
carries its own incremental detokenizer, created here when the request arrives; the commit
(`Scheduler.update_from_output`) feeds it
the new tokens and searches the stop strings in its text (engine/core/stop_checker.py). Logprobs are turned into vLLM's
`{token_id: Logprob}` dicts once per token and kept, not rebuilt at every step. What a running
request's outputs hold is its `SamplingParams.output_kind` (vLLM's): the whole output so far
(CUMULATIVE, the default), only what is new (DELTA), or nothing until it finishes (FINAL_ONLY, which
`LLM.generate` asks for: it reads only finished outputs, and a RequestOutput a step is work for nothing).

While a request is running, its text holds back the last `len(longest stop) - 1` characters, which
could be the start of a stop string: streamed text therefore never has to shrink.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from transformers import PreTrainedTokenizerBase

from minivllm.engine.processing.detokenizer import IncrementalDetokenizer
from minivllm.engine.request.sequence import FinishReason, Sequence
from minivllm.engine.request.step_types import SampledToken
from minivllm.outputs import (CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput,
                              SampleLogprobs)
from minivllm.sampling_params import RequestOutputKind


@dataclass
class RequestState:
    request_id: str
    seqs: list[Sequence]  # by completion index; [0] is the sequence the request started as
    logprobs: list[SampleLogprobs] = field(default_factory=list)  # converted so far, per sequence
    prompt_logprobs: PromptLogprobs | None = None
    # output_kind=DELTA: per sequence, (tokens, characters of text, logprobs) already in an output
    sent: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # DELTA: the prompt's logprobs went out with the first output

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def metrics(self) -> RequestMetrics:
        return RequestMetrics.of(self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}  # decoded text of single tokens (for logprobs)

    def new_request(self, seqs: list[Sequence]) -> RequestState:
        """A request's state: its sequences (by completion index), each with a detokenizer of its own."""
        for seq in seqs:
            sp = seq.sampling_params
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, sp.skip_special_tokens,
                                                     sp.detokenize)
        state = RequestState(seqs[0].group_id, list(seqs), [[] for _ in seqs], sent=[(0, 0, 0) for _ in seqs])
        if seqs[0].sampling_params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        return state

    def output(self, state: RequestState) -> RequestOutput:
        """The request's output now: everything so far, or with output_kind=DELTA what is new since its
        previous output (the prompt's logprobs only in its first)."""
        seqs = state.seqs
        first = seqs[0]
        delta = first.sampling_params.output_kind is RequestOutputKind.DELTA
        prompt_logprobs = state.prompt_logprobs
        if first.sampling_params.prompt_logprobs is not None:
            self._convert_prompt_logprobs(state)
            if delta:  # once, as a list of its own
                prompt_logprobs = None if state.prompt_logprobs_sent else list(prompt_logprobs)
                state.prompt_logprobs_sent = True
        completions = [self._completion(state, s) for s in seqs]
        if delta:
            completions = [self._delta(state, c) for c in completions]
        return RequestOutput(first.group_id, first.prompt, first.prompt_token_ids, completions, state.finished,
                             first.num_cached_tokens, next((s.error for s in seqs if s.error), None),
                             state.metrics(), prompt_logprobs)

    @staticmethod
    def failed_output(state: RequestState, error: str) -> RequestOutput:
        """What a request whose `output` raised reports: its token ids, no text, finish_reason "error" and
        `error`. Reads nothing that can fail (no detokenizer, no logprob conversion)."""
        first = state.seqs[0]
        delta = first.sampling_params.output_kind is RequestOutputKind.DELTA  # only the tokens not yet sent
        completions = [CompletionOutput(s.index, "", s.output_token_ids[state.sent[s.index][0] if delta else 0:],
                                        FinishReason.ERROR.value, None) for s in state.seqs]
        return RequestOutput(first.group_id, first.prompt, first.prompt_token_ids, completions, True,
                             first.num_cached_tokens, error, state.metrics())

    @staticmethod
    def _delta(state: RequestState, c: CompletionOutput) -> CompletionOutput:
        tokens, chars, logprobs = state.sent[c.index]
        state.sent[c.index] = (len(c.token_ids), len(c.text), len(c.logprobs or ()))
        return replace(c, text=c.text[chars:], token_ids=c.token_ids[tokens:],
                       logprobs=c.logprobs[logprobs:] if c.logprobs is not None else None)

    def _completion(self, state: RequestState, seq: Sequence) -> CompletionOutput:
        text = seq.detokenizer.text
        stops = seq.sampling_params.stop_strings
        if stops and not seq.is_finished:
            # Hold back what could be the start of a stop string, so streamed text never shrinks.
            text = text[:max(0, len(text) - seq.sampling_params.longest_stop + 1)]
        logprobs, cumulative = None, None
        if seq.sampling_params.logprobs is not None:
            logprobs = state.logprobs[seq.index]
            decode = seq.sampling_params.detokenize
            logprobs.extend(self._logprob_dict(t, decode) for t in seq.logprobs[len(logprobs):])
            logprobs, cumulative = list(logprobs), seq.cumulative_logprob
        reason = FinishReason(seq.finish_reason).value if seq.finish_reason is not None else None  # vLLM: plain str
        return CompletionOutput(seq.index, text, seq.output_token_ids, reason, seq.stop_reason,
                                cumulative, logprobs)

    def _convert_prompt_logprobs(self, state: RequestState) -> None:
        done = state.prompt_logprobs
        seq = state.seqs[0]
        decode = seq.sampling_params.detokenize
        for p in seq.prompt_logprobs[len(done) - 1:]:
            done.append(self._logprob_dict(p.token, decode))

    def _logprob_dict(self, t: SampledToken, decode: bool) -> dict[int, Logprob]:
        """vLLM's shape: the top-N candidates and the actual token, each with logprob, rank, text (None
        with detokenize=False, as in vLLM)."""
        out = {tok: Logprob(lp, rank, self._text(tok, decode))
               for rank, (tok, lp) in enumerate(t.top_logprobs, start=1)}
        if t.token_id not in out:
            out[t.token_id] = Logprob(t.logprob, t.rank, self._text(t.token_id, decode))
        return out

    def _text(self, token_id: int, decode: bool = True) -> str | None:
        if not decode:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text
