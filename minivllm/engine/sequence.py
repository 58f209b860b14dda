"""`Sequence`: one request's tokens and scheduling state.

A request's life:  WAITING --admit--> RUNNING --finish--> FINISHED
                      ^                  |
                      +----preempt-------+   (blocks freed; recomputed from scratch later)

The token list is `prompt + generated output`, kept in one `array("i")` (4 bytes a token instead of
a 28-byte Python int and an 8-byte pointer). `num_computed_tokens` counts the tokens whose K/V are in
the paged cache; the tokens in `[num_computed_tokens, num_tokens)` are what the next step must run.
A decode step is just the case where that gap is one token. `block_table[i]` is the physical KV block
holding tokens `[i*block_size, (i+1)*block_size)`.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence as SequenceABC

from minivllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def as_token_array(token_ids: SequenceABC[int]) -> array:
    """The boundary where token ids enter the engine: an `array("i")` or a list of Python ints."""
    if isinstance(token_ids, array):
        assert token_ids.typecode == "i", f"token ids must be array('i'), got array({token_ids.typecode!r})"
        return array("i", token_ids)
    return array("i", token_ids)


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: SequenceABC[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_index: int = 0,
        seed: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: array = as_token_array(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self._prompt_list = self.token_ids.tolist()  # the prompt never changes: convert once
        self.sampling_params = sampling_params
        self.arrival_index = arrival_index  # order of arrival: "newest" means the largest index
        self.seed = seed  # keys the sampling noise with the token position (see layers/sampler.py)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at (first) admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # prefix-cache hashes of full blocks (BlockManager.block_hashes)
        self.num_admission_skips = 0  # times admission passed over this request (anti-starvation)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None

    # --- sizes -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:].tolist()

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_list

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # --- state changes -----------------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        assert isinstance(token_id, int), "append_token takes a Python int (convert tensors first)"
        self.token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
