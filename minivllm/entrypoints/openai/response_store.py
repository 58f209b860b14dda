"""The conversations behind `previous_response_id`: kept in this process's memory, a bounded number of them.

    POST /v1/responses {"input": "Hi"}                            -> resp_a   stored: [user Hi, assistant ...]
    POST /v1/responses {"input": "And?", "previous_response_id": "resp_a"}
         the prompt: resp_a's conversation + [user And?]       -> resp_b   stored: resp_a's + [user And?, assistant ...]

- Each stored response holds its whole conversation as chat messages (its input after the earlier ones, then its
  output as one assistant turn: reasoning_content, content, tool_calls), never its `instructions`: OpenAI does
  not carry them to the next response either.
- At most `max_responses` are kept; storing one more evicts the oldest stored first (insertion order, not last
  use: a conversation's next turn is a new response, stored anew). An evicted or unknown id is a 404.
- Nothing is written to disk: a restart forgets them all. A request with `store: false` is not kept.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from minivllm.entrypoints.openai.errors import ApiError

DEFAULT_MAX_STORED_RESPONSES = 256  # conversations of a few thousand tokens each: a few MB at most


class ResponseStore:
    """Response id -> its conversation (chat messages), the oldest evicted first past `max_responses`."""

    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_responses < 0:
            raise ValueError(f"max_responses={max_responses}: must be >= 0 (0 keeps none)")
        self.max_responses = max_responses
        self._conversations: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._conversations)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._conversations

    def conversation(self, response_id: str | None) -> list[dict[str, Any]]:
        """The stored conversation of `response_id` (a copy: the caller may extend it); [] for None."""
        if response_id is None:
            return []
        if response_id not in self._conversations:
            raise ApiError(404, f"Previous response with id '{response_id}' not found: it was never stored "
                                f"(store: false), or was evicted (this server keeps the last {self.max_responses} "
                                "responses, in memory only, lost on restart).", "previous_response_id")
        return copy.deepcopy(self._conversations[response_id])

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        self._conversations.pop(response_id, None)  # a reused request_id: the newest answer wins, as newest
        self._conversations[response_id] = conversation
        while len(self._conversations) > self.max_responses:
            self._conversations.popitem(last=False)
