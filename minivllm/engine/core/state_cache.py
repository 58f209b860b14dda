"""`StateCache`: prefix caching for a hybrid model — snapshots of the linear-attention state, every
`stride` prompt tokens, beside the KV blocks.

Why blocks are not enough. A cached prefix lets a request skip computing it; for attention layers the
prefix's K/V blocks are all it needs. A gated-DeltaNet layer keeps no per-token past: its whole memory
of the prefix is one state (conv window + recurrent matrix) at the prefix's END. So a hit at position p
needs the KV blocks of tokens [0, p) AND the state after token p - 1. Keeping a state for every block
would cost one state (~1 MB a layer on real models) per 16 tokens; here one is kept every `stride`
tokens (a multiple of the block size and of the chunked rule's chunk), in a pool with its own budget:

    prompt       [ .......... system prompt ........... | question ]
    KV blocks    [b0][b1][b2][b3][b4][b5][b6][b7][b8][b9][b10] ...       every full block hashed
    snapshots                    ^ s(64)             ^ s(128)             key = hash of the block ending there
    a new prompt sharing 150 tokens: KV hit 144 tokens, snapshot hit at 128 -> resumes at 128

Entries. A snapshot is keyed by the chained hash of the block that ends at its position (so equal keys
mean equal whole prefixes, as for blocks) and lives in one slot of the cache's pools (`entries`: key ->
slot). Eviction is LRU by `last_used` (key -> clock); a scan of the entries at commit (a few hundred at most).

These are the scheduler's books: keys, slot numbers and LRU marks, never a tensor. The snapshots
themselves live on the runner side (engine/worker/state_tensors.py), which is told what to copy and where to
write by the plan's rows (`StateRow`, engine/request/step_types.py).

Transactions. The books change in three places:
  * admission (inside the step's transaction): a hit marks its entry used and hands its slot to the plan
    (`use`): the runner copies that snapshot into the request's fresh state slot before the forward;
  * planning (inside it too): the slots this step's snapshots will be written to are taken (`reserve`),
    free ones only, so a failed step writes no slot an entry holds;
  * the commit: each written slot becomes the entry of its prefix's key (`register`), then the least
    recently used entries are evicted until a step's worth of slots is free again (`keep_free`).
A failed step is rolled back with the rest (engine/request/journal.py: the lists a step changes are journaled) and
leaves no trace: it wrote only free slots.

Sizing: engine/request/state_layout.py (`resolve_state_cache`).
"""

from __future__ import annotations

from minivllm.engine.request.journal import Journaled, JournaledDict, JournaledList
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.state_layout import StateCacheConfig


class StateCache(Journaled):
    def __init__(self, cfg: StateCacheConfig, block_size: int) -> None:
        self.cfg, self.stride, self.block_size = cfg, cfg.stride, block_size
        self.entries: dict[bytes, int] = {}  # key -> the slot holding its snapshot (changed at commits only)
        self.last_used: dict[bytes, int] = JournaledDict()  # key -> clock at its last hit or registration
        self.free: list[int] = JournaledList(range(cfg.num_snapshots - 1, -1, -1))  # a stack: slot 0 first
        self.clock = 0
        self.num_hits = 0  # requests that resumed from a snapshot
        self.num_evictions = 0
        # Slots taken for the last step's snapshots and not registered yet: a commit whose tail failed
        # never registers them, so the next step takes them back (`reclaim`) instead of losing them.
        self.reserved: list[int] = JournaledList()

    # --- admission and planning (inside the step's transaction) ------------------------------------
    def hit_tokens(self, hashes: list[bytes], num_kv_tokens: int) -> int:
        """The longest cached prefix with both its KV blocks (`num_kv_tokens`) and a snapshot at its end."""
        for p in range(num_kv_tokens // self.stride * self.stride, 0, -self.stride):
            if hashes[p // self.block_size - 1] in self.entries:
                return p
        return 0

    def use(self, seq: Sequence) -> int:
        """`seq` was admitted with a prefix hit: mark the snapshot at its end used; its slot, to load from."""
        key = seq.block_hashes[seq.num_computed_tokens // self.block_size - 1]
        self.clock += 1
        self.last_used[key], self.num_hits = self.clock, self.num_hits + 1
        return self.entries[key]

    def positions(self, start: int, num_new_tokens: int, num_prompt_tokens: int) -> list[int]:
        """The prompt positions, multiples of the stride, that a chunk [start, start + num_new_tokens) reaches."""
        last = min(start + num_new_tokens, num_prompt_tokens)
        return list(range((start // self.stride + 1) * self.stride, last + 1, self.stride))

    def reserve(self, count: int) -> list[int]:
        """Free slots for (at most) `count` snapshots of this step."""
        count = min(count, len(self.free))
        if not count:
            return []
        slots = [self.free.pop() for _ in range(count)]
        self.reserved.extend(slots)
        return slots

    def reclaim(self) -> None:
        """Before a step: slots a step took and never registered (its commit's tail failed) are free again."""
        self.free.extend(self.reserved)
        self.reserved.clear()

    # --- the commit, and after a rollback ------------------------------------------------------------
    def register(self, key: bytes | None, slot: int) -> None:
        """The step committed: `slot` holds the state at the end of the block hashed `key` (None: its blocks
        were never hashed, it finished first). An equal key already cached stays; the slot goes back."""
        self.clock += 1
        self.reserved.remove(slot)
        if key is not None:
            self.last_used[key] = self.clock
            if key not in self.entries:
                self.entries[key] = slot
                return
        self.free.append(slot)

    def keep_free(self) -> None:
        """After the commit registered its snapshots: evict the least recently used entries until the next
        step's snapshots find free slots (a scan of the entries: a few hundred at most)."""
        while len(self.free) < self.cfg.max_per_step and self.entries:
            victim = min(self.entries, key=self.last_used.__getitem__)
            self.free.append(self.entries.pop(victim))
            del self.last_used[victim]
            self.num_evictions += 1

    # --- proof ---------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every slot is free or holds exactly one entry; entries are findable under their own key."""
        held = list(self.entries.values())
        assert len(set(held)) == len(held), "two snapshots share a slot"
        assert not set(held) & set(self.free) and len(set(self.free)) == len(self.free), "a slot is free and held"
        accounted = sorted(held + self.free + self.reserved)
        assert accounted == list(range(self.cfg.num_snapshots)), "a snapshot slot is lost"
        assert self.entries.keys() == self.last_used.keys(), "an entry without its LRU mark, or a mark without one"
