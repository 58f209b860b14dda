"""A chat answer's reasoning, apart from its content (`--reasoning-parser`; the parsing: minivllm/reasoning.py).

    message  {"role": "assistant", "reasoning_content": "...", "reasoning": "...", "content": "..."}
    delta    {"reasoning_content": "...", "reasoning": "..."}  chunks first, then {"content": "..."} chunks

`reasoning_content` is the field the `openai` client and most tools read; vLLM's newer name, `reasoning`,
carries the same text. Both are null when the output did not reason. `content` is what follows </think>
(null when max_tokens cut the output inside its reasoning); tool calls are parsed from it alone.

`include_reasoning: false` (vLLM's) drops the reasoning from the answer: the content is the same. Without
a reasoning parser it is refused (400), since the server cannot tell the reasoning from the content.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from minivllm.entrypoints.openai.field_policy import RequestError
from minivllm.reasoning import ReasoningConfig


class ReasoningFields(BaseModel):
    """The chat request's reasoning field (protocol.py's ChatCompletionRequest takes it from here)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # as the request's own
    include_reasoning: bool = True

    def check_reasoning(self, reasoning: ReasoningConfig | None) -> None:
        if reasoning is None and not self.include_reasoning:
            raise RequestError("include_reasoning", "false needs a reasoning parser to tell the reasoning from "
                                                    "the content; start the server with --reasoning-parser "
                                                    "(qwen3 or deepseek_r1), or leave include_reasoning out")


def reasoning_fields(reasoning: str | None, include: bool) -> dict[str, Any]:
    """The answer's reasoning fields, both names (none when the request asked to leave them out)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} if include else {}
