"""The pipeline's fourth stage: what a choice's new text means, in the same four steps for every endpoint.

    Delta (streams.py: what one choice gained)
      ├─ echo         the endpoint's rule, when it has one (completions: the prompt's text, ids and logprobs first)
      ├─ reasoning    <think>...</think> apart from the content (--reasoning-parser; minivllm/reasoning.py)
      ├─ tool calls   taken out of the content (tool_calls.py), when the request has tools
      └─ logprobs     in the shape the endpoint asked for (logprobs.py: chat's or completions')
    ──> Processed(reasoning, content, tool_calls, finish_reason, logprobs)       and, per request, `usage`

A streamed request feeds each delta as it comes: the reasoning and tool-call parsers hold back what may
still be the start of a tag ("</th", "<tool_c") and give it when the choice ends, so nothing is sent twice
or lost, and a call is only ever sent whole. A whole answer is one delta per choice, parsed at once: its
`reasoning` is None when the output did not reason and `content` None when nothing followed the reasoning
(or only calls were written), as OpenAI's message fields are; streamed, both are strings ("" for nothing).

No step knows which endpoint it serves: chat, completions and responses differ only in the `Postprocessor`
they build (which steps apply) and in how they shape a `Processed` (their serving_*.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minivllm.entrypoints.openai.logprobs import LogprobsWriter
from minivllm.entrypoints.openai.streams import Delta
from minivllm.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan
from minivllm.outputs import RequestOutput
from minivllm.reasoning import ReasoningPhase, ReasoningStream, split_reasoning


@dataclass(frozen=True)
class Processed:
    """One choice's delta after post-processing (the whole choice, for an answer that is not streamed)."""

    delta: Delta  # as the engine's output gave it, before echo: index, first, token_ids, stop_reason, output
    reasoning: str | None  # the reasoning part (None: no reasoning parser, or a whole output that did not reason)
    content: str | None  # the rest, with the tool calls taken out (None: nothing, in a whole answer)
    tool_calls: list[dict[str, Any]]  # OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}
    finish_reason: str | None  # the delta's, or "tool_calls" when the choice ended with calls
    logprobs: Any  # in the writer's shape; None when not asked

    @property
    def index(self) -> int:
        return self.delta.index


class Postprocessor:
    """One request's post-processing: the parsers' state for each of its choices.

    `stream`: deltas come as generated (else each choice comes once, whole). `phase`: where the output starts
    with respect to its reasoning (None: no reasoning parser). `plan`: the request's tools (None or a plan
    that parses nothing: no tool calls). `logprobs`: the writer of the endpoint's shape (None: not asked).
    `echo`: the endpoint's own rewrite of a delta before the rest (completions' echo)."""

    def __init__(self, *, stream: bool, phase: ReasoningPhase | None = None, plan: ToolPlan | None = None,
                 logprobs: LogprobsWriter | None = None, echo: Callable[[Delta], Delta] | None = None) -> None:
        self.stream, self.phase, self.logprobs, self.echo = stream, phase, logprobs, echo
        self.plan = plan if plan is not None and plan.parses_calls else None
        self._thoughts: dict[int, ReasoningStream] = {}  # choice index -> its reasoning parser (streamed)
        self._calls: dict[int, ToolCallStream] = {}  # choice index -> its tool-call parser (streamed)

    def process(self, d: Delta) -> Processed:
        shown = self.echo(d) if self.echo is not None else d
        reasoning, content = self._reasoning(shown)
        content, calls, finish = self._tool_calls(shown, content)
        logprobs = None if self.logprobs is None or shown.logprobs is None else \
            self.logprobs(shown.index, shown.token_ids, shown.logprobs)
        return Processed(d, reasoning, content, calls, finish, logprobs)

    def _reasoning(self, d: Delta) -> tuple[str | None, str | None]:
        if self.phase is None:
            return None, d.text
        if not self.stream:
            split = split_reasoning(d.text, self.phase)
            return split.reasoning, split.content
        stream = self._thoughts.setdefault(d.index, ReasoningStream(self.phase))
        reasoning, content = stream.feed(d.text)
        if d.finish_reason:  # what was held back, now that no tag can follow
            more = stream.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        return reasoning, content

    def _tool_calls(self, d: Delta, content: str | None) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """(content, calls, finish_reason): calls are parsed from the content alone, when the choice ends
        with "stop" (an output cut by max_tokens is no call)."""
        if self.plan is None:
            return content, [], d.finish_reason
        if not self.stream:
            if d.finish_reason != "stop":
                return content, [], d.finish_reason
            rest, calls = self.plan.calls(content or "")
            return (rest, calls, "tool_calls") if calls else (content, [], d.finish_reason)
        stream = self._calls.setdefault(d.index, ToolCallStream(self.plan))
        sent, calls, finish = stream.content(content or ""), [], d.finish_reason
        if finish:  # the content held back, then the calls, each whole
            rest, calls, finish = stream.finish(finish)
            sent += rest
        return sent, calls, finish


def usage(outputs: list[RequestOutput], *, generated: bool = True, details: bool = True) -> dict[str, Any]:
    """OpenAI's usage of these requests (one per prompt): each prompt counted once, and every
    completion's tokens, unless nothing generated is shown (`generated=False`: echo with max_tokens=0,
    whose one computed token is dropped). `details`: vLLM's `prompt_tokens_details`, on a request's usage
    (not on the running usage of each stream chunk): {"cached_tokens": n} when the prefix cache served n > 0
    of the prompt's tokens, else null, as vLLM with --enable-prompt-tokens-details (which minivllm always
    behaves as) writes it (`if enable_prompt_tokens_details and num_cached_tokens`, serving_chat.py and
    serving_completion.py)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if generated else 0
    answer: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
    if details:
        cached = sum(o.num_cached_tokens for o in outputs)
        answer["prompt_tokens_details"] = {"cached_tokens": cached} if cached else None
    return answer
