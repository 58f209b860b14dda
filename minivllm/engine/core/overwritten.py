"""What a failed step's forward may have overwritten, which its rollback cannot write back: K/V.

The journal (engine/request/journal.py) undoes every write to the books exactly. K/V is not in the books. Two
cases follow, both found here by comparing the block tables as planned with the tables rolled back:

  * written blocks. The forward (or the recovery's re-runs) wrote the K/V of the plan's new tokens into
    their blocks. A block that is free after the rollback but keeps a hash would serve that half-written
    K/V to the next prompt that hits it: it loses its hash (`KVBlockManager.forget_overwritten`).
  * reused blocks. A preemption frees its victim's blocks so that another sequence can take them in the
    same step, and that step's forward writes the taker's K/V into them. Giving the victim its blocks back
    would hand it (and the prefix cache, through their hashes) someone else's K/V. So such victims are
    preempted again after the rollback (`Scheduler.rollback_step`): they recompute, and their blocks, free
    again, lose their hashes.
"""

from __future__ import annotations

from typing import NamedTuple

from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.step_types import SchedulerOutput

Tables = dict[Sequence, tuple[list[int], list[int]]]  # a sequence's (full, sliding) block tables


class Overwritten(NamedTuple):
    """Per KV-cache group: blocks a failed step may have written; the preemptions whose blocks it reused."""

    blocks: set[int]  # the full-attention group's
    sliding_blocks: set[int]  # a sliding-window group's (empty without one)
    victims: list[Sequence]


def planned_tables(seqs: list[Sequence]) -> Tables:
    """The tables as the step planned them: taken before the rollback (it costs the blocks the live
    sequences hold, and only a failed step pays it)."""
    return {seq: (list(seq.block_table), list(seq.sliding_block_table)) for seq in seqs}


def overwritten(plan: SchedulerOutput, planned: Tables, block_size: int) -> Overwritten:
    """After the rollback: which blocks the failed run of `plan` may have written, per group, and which
    sequences gave up a block in the step that another one took (a block in a planned table that did not
    hold it before the step, gone from a table that did)."""
    written: tuple[set[int], set[int]] = (set(), set())
    for s in plan.scheduled:
        first, last = s.start // block_size, (s.start + s.num_new_tokens - 1) // block_size
        for group, table in enumerate(planned[s.seq]):
            written[group].update(b for b in table[first:last + 1] if b >= 0)  # -1: a sliding group's NULL
    victims: list[Sequence] = []
    reused: tuple[set[int], set[int]] = (set(), set())
    for group in (0, 1):
        then = {seq: (seq.block_table, seq.sliding_block_table)[group] for seq in planned}
        taken = {b for seq, tables in planned.items() for b in set(tables[group]) - set(then[seq]) if b >= 0}
        for seq, tables in planned.items():
            lost = (set(then[seq]) - set(tables[group])) & taken
            if lost:
                reused[group].update(lost)
                if seq not in victims:
                    victims.append(seq)
    return Overwritten(written[0] | reused[0], written[1] | reused[1], victims)
