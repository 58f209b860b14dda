"""`LLM`: the offline API, shaped like vLLM's.

    llm = LLM()                      # the default model; or LLM("path/to/checkpoint")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)

`generate` adds every prompt to the engine, then steps until all are done and returns the outputs in
input order. `generate_stream` yields outputs as they grow instead (streaming without a server).
`beam_search` runs vLLM's beam search on top of `generate` (minivllm/beam_search.py).
All prompts are validated before any is added, so a bad one leaves the engine as it was.

`LLM(model, tensor_parallel_size=N)` splits the model over N processes (this one is rank 0; the
workers are started and ended with the LLM: use `with LLM(...) as llm:` or call `shutdown()`).
Scripts that do this need the usual `if __name__ == "__main__":` guard (the workers are spawned).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

from minivllm.beam_search import BeamSearchOutput, BeamSearchParams, new_search, step_sampling_params
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.engine.metrics.stats import EngineStats
from minivllm.engine.metrics.trace import StepTrace
from minivllm.model_source import resolve_model
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, Any]
T = TypeVar("T")


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`model`: a checkpoint folder, a .gguf file, a hub id, or None for the default model
        (see `model_source.resolve_model`); the keyword arguments are `EngineConfig`'s fields."""
        self.llm_engine = LLMEngine(EngineConfig(model=resolve_model(model), **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order. `priority`: one int per prompt,
        used by scheduling_policy="priority" (lower = sooner), as in vLLM. As vLLM's does, it asks the
        engine for final outputs only (`output_kind=FINAL_ONLY`), the one kind it reads."""
        return self._run(self._add(prompts, sampling_params, priority, RequestOutputKind.FINAL_ONLY), use_tqdm)

    def generate_stream(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Streaming, offline: run the prompts as one batch and yield `(prompt index, output)` every
        step a request gains tokens or finishes (interleaved across prompts). Outputs are cumulative,
        or what each SamplingParams' `output_kind` asks (DELTA: only what is new). Stopping the
        iteration early aborts what is still running."""
        order = self._add(prompts, sampling_params)
        remaining = set(order)
        try:
            while remaining:
                for out in self.llm_engine.step():
                    if out.request_id in remaining:
                        if out.finished:
                            remaining.discard(out.request_id)
                        yield order[out.request_id], out
        finally:
            if remaining:
                self.llm_engine.abort_request(list(remaining), report=False)

    def _add(self, prompts: PromptType | list[PromptType],
             sampling_params: SamplingParams | list[SamplingParams] | None,
             priority: list[int] | None = None, output_kind: RequestOutputKind | None = None) -> dict[str, int]:
        """Validate every prompt, then enqueue them all: request id -> prompt index. `output_kind`
        replaces the params' own."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                                 "pass one SamplingParams or one per prompt")
            params = sampling_params
        else:
            params = [sampling_params] * len(prompts)
        if output_kind is not None:  # once per distinct params object (one is often shared by every prompt)
            replaced: dict[int, SamplingParams] = {}
            for sp in params:
                if (sp is None or isinstance(sp, SamplingParams)) and id(sp) not in replaced:
                    replaced[id(sp)] = dataclasses.replace(SamplingParams() if sp is None else sp,
                                                           output_kind=output_kind)
            params = [replaced.get(id(sp), sp) for sp in params]
        engine = self.llm_engine
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; pass one per prompt")
        priorities = priority if priority is not None else [0] * len(prompts)
        seqs = [engine.make_sequence(f"llm-{next(self._ids)}", p, sp, pr)
                for p, sp, pr in zip(prompts, params, priorities)]
        for seq in seqs:
            engine.enqueue(seq)
        return {seq.request_id: i for i, seq in enumerate(seqs)}

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search: each prompt's `params.beam_width` best beams, best first, in input order.
        Every prompt is checked first. Each step runs the live beams of every prompt as one batch of
        one-token requests, whose common prefixes hit the prefix cache (minivllm/beam_search.py)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        searches = [new_search(self.llm_engine, p, params) for p in prompts]
        sp = step_sampling_params(params)
        for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm, dynamic_ncols=True):
            live = [s for s in searches if not s.done]
            if not live:
                break
            outputs = self.generate([p for s in live for p in s.step_prompts()], sp, use_tqdm=False)
            for s in live:  # each search takes its beams' outputs, in order
                mine, outputs = outputs[:len(s.beams)], outputs[len(s.beams):]
                s.advance(mine)
        return [s.output(self.get_tokenizer()) for s in searches]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        if getattr(tok, "chat_template", None) is None:
            raise ValueError("this tokenizer has no chat template; use generate() with a plain prompt")
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, first = time.perf_counter(), engine.get_stats()
        try:
            while any(r is None for r in results):
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
                if use_tqdm:
                    now, elapsed = engine.get_stats(), max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(
                        f"prefill {(now.num_prefill_tokens - first.num_prefill_tokens) / elapsed:.0f} tok/s, "
                        f"decode {(now.num_decode_tokens - first.num_decode_tokens) / elapsed:.0f} tok/s",
                        refresh=False)
        except BaseException:
            engine.abort_request([rid for rid in order if rid in engine.requests], report=False)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def get_stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    def get_trace(self) -> list[StepTrace]:
        """Per-step records (needs `LLM(..., record_trace=True)`); see engine/metrics/trace.py."""
        if not self.llm_engine.config.record_trace:
            raise ValueError("no trace is recorded: create the LLM with record_trace=True")
        return list(self.llm_engine.trace)

    def collective_rpc(self, method: Callable[[int, Any], T]) -> list[T]:
        """`method(rank, model_runner)` on every tensor-parallel rank, results in rank order (see
        `LLMEngine.collective_rpc`)."""
        return self.llm_engine.collective_rpc(method)

    def shutdown(self) -> None:
        """End the engine (and its tensor-parallel workers, if any)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
