"""`StateTensors`: a hybrid model's linear-attention states on the runner side, beside `kv_cache`.

The scheduler keeps the books (engine/core/state_pool.py, engine/core/state_cache.py: integers only); this holds
the tensors and does the three things the books ask of them, all inside `execute_model`, before the
commit:

    before the forward    a row admitted with a prefix hit: its snapshot copied into its read slot
                          (`StateRow.load_from`); the pair was free, so nothing published is touched
    the forward           each row reads its read slot, writes its staging slot and keeps states where
                          its row says (layers/linear_attn_metadata.py does the writes)
    after verification    a row that accepted a < d drafts: the candidate after 1 + a rows is copied
                          into its staging slot, which the commit then publishes (`keep_accepted`)

A failed step is safe at every point: none of these writes touches a published state or a snapshot slot
that an entry holds (the plan takes free ones).

    state pools       ((2 + d) P, ...)   pairs then candidates (engine/request/state_layout.py)
    snapshot pools    (S, ...)           prefix caching's snapshots (none without prefix caching)
"""

from __future__ import annotations

import torch

from minivllm.engine.request.step_types import RowGroupOutput, ScheduledSequence, StateRow
from minivllm.engine.worker.kv_cache import zeros
from minivllm.models.hf_config import ModelSpec


class StateTensors:
    def __init__(self, spec: ModelSpec, num_pairs: int, num_speculative_tokens: int, num_snapshots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        la = spec.linear_attn
        assert la is not None, "only hybrid models have linear-attention state"
        layers = spec.linear_attention_layers

        def pools(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            # The conv window in the model's dtype; the recurrent state in fp32, like HF's (it accumulates).
            # On CPU the pools are committed page by page as states are written (see engine/worker/kv_cache.py).
            return ([zeros((n, *la.conv_state_shape), dtype, device) for _ in layers],  # (n, conv_dim, K-1)
                    [zeros((n, *la.recurrent_state_shape), torch.float32, device) for _ in layers])  # (n, Hv, Dk, Dv)

        self.conv_pools, self.recurrent_pools = pools((2 + num_speculative_tokens) * num_pairs)
        self.snapshot_conv_pools, self.snapshot_recurrent_pools = pools(num_snapshots) if num_snapshots else ([], [])

    def load(self, rows: list[StateRow]) -> None:
        """Before the forward: each row admitted with a prefix hit starts from its snapshot."""
        for row in rows:
            if row.load_from is not None:
                for pool, snaps in zip((*self.conv_pools, *self.recurrent_pools),
                                       (*self.snapshot_conv_pools, *self.snapshot_recurrent_pools)):
                    pool[row.read_slot] = snaps[row.load_from]

    def keep_accepted(self, scheduled: list[ScheduledSequence], outputs: list[RowGroupOutput]) -> None:
        """After verification: a row that accepted a of its d drafts keeps the state after 1 + a rows (its
        candidate slot `a`) as the state to publish, in its staging slot."""
        for s, out in zip(scheduled, outputs):
            accepted = len(out.tokens) - 1
            if s.state is None or s.state.kept_are_snapshots or not 0 <= accepted < s.num_spec_tokens:
                continue
            src, dst = s.state.kept_slots[accepted], s.state.write_slot
            for pool in (*self.conv_pools, *self.recurrent_pools):
                pool[dst] = pool[src]
