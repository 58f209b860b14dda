"""Hands-on 4: grading a block allocator: the free list the block manager takes blocks from, whose order
IS the prefix cache's eviction order (engine/core/block_allocator.py).

    check_allocator_trace(MyAllocator)      # call by call, the same answers as the engine's LRU
    check_allocator_machine(MyAllocator)    # the scheduler's state machine: ownership, conservation, rollback
    check_allocator_in_engine(MyAllocator)  # LLM(block_allocator=...): HF-exact tokens, LRU's cache hits

The assignment is LRU: the block freed longest ago is reused first, so a prefix used a moment ago
outlives one unused for long. Three checks, cheapest first:

  1. a random trace of the seam's calls (reset, take, give_back, revive, a rolled-back step's restore),
     made to the student's allocator and to `LRUAllocator` side by side; after each call both must list
     the same free blocks in the same order, and `take` must return the same block. Where the free
     blocks are right and a copy of the student's allocator would take them in LRU's order but iter()
     lists another order, the rule named is iter()'s, not the call's. The allocator is
     wrapped in the engine's `CheckedAllocator`, so a count that drifts (a leak) or a block taken that
     is owned is named by the engine's own contract error. A failure names the call that went wrong;
  2. the scheduler's hypothesis state machine (teaching/scheduler_machine.py) with the allocator in the
     block manager: every block owned or free, ref counts equal to the block tables, a rolled-back step
     leaving no trace, every block back at the end;
  3. the real engine under memory pressure, sequential requests that share prefixes: greedy tokens equal
     HF transformers' and the prefix cache hits exactly as often as with the engine's LRU.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from copy import deepcopy

from minivllm.engine.core.block_allocator import BlockAllocator, CheckedAllocator, LRUAllocator
from minivllm.teaching.hands_on import AssignmentError, check_finished, tiny_model
from minivllm.teaching.submission_rules import RULES
from minivllm.teaching.submission_watch import Watch

CALL_RULES = {
    "reset": "reset(n) makes blocks 0 .. n-1 free, block b freed at time b (so block 0 is taken first)",
    "take": "take() removes and returns the least recently freed block (LRU: the smallest stamp)",
    "give_back": "give_back(block, stamp) frees the block as the most recently freed one (taken last)",
    "revive": "revive(block) removes exactly that block from the free ones: a prefix-cache hit owns it again, and "
              "a block left on the free list would be handed to another request while still referenced",
    "restore": "restore([(block, stamp), ...]) frees a rolled-back step's blocks with their OLD stamps: each goes "
               "back to its place in the LRU order by its stamp, not to the end nor to the head",
    "__iter__": "iter() lists each free block once, in the order take() would hand them out (the next one taken "
                "first): the block manager and the engine's checks read the eviction order from it",
}
MACHINE_RULE = ("every block is owned or free, never both; ref counts equal the block tables holding each block; a "
                "rolled-back step leaves no trace; every block comes back when the requests finish")


def check_allocator_trace(make_allocator: Callable[[], BlockAllocator], num_traces: int = 60, seed: int = 0) -> None:
    """Random call traces against `LRUAllocator`; raise `AssignmentError` naming the first call that differs."""
    for t in range(num_traces):
        rng = random.Random(seed + t)
        student, lru = CheckedAllocator(make_allocator()), LRUAllocator()
        who = type(student.inner).__name__
        log: list[str] = []

        def call(name: str, *args) -> None:
            log.append(f"{name}({', '.join(map(repr, args))})")
            watch = Watch(RULES["allocator"])
            try:
                with watch:
                    got = getattr(student, name)(*args)
                    student.check_invariants()
                    listed = list(student)
            except AssertionError as error:  # AllocatorContractError: the seam's own rules
                watch.check(who)
                raise AssignmentError(f"{who}: {error}\n  in {log[-1]}, whose rule is: {CALL_RULES[name]}\n  calls: "
                                      f"{'; '.join(log[-12:])}") from None
            except NotImplementedError:
                raise
            except Exception as error:  # a crash in this call: named by the call's rule
                watch.check(who)
                raise AssignmentError(f"{who} broke a RULE: {CALL_RULES[name]}.\n  {log[-1]} raised "
                                      f"{type(error).__name__}: {error}\n  calls: {'; '.join(log[-12:])}") from error
            watch.check(who)
            want = getattr(lru, name)(*args)
            if got == want and listed != list(lru) and sorted(listed) == sorted(lru) and \
                    _take_order(student.inner) == list(lru):  # the right blocks, taken in the right order: iter() lies
                raise AssignmentError(f"{who} broke a RULE: {CALL_RULES['__iter__']}.\n  after {log[-1]}: take() "
                                      f"would hand out {list(lru)[:12]}, but iter() lists {listed[:12]}\n  calls: "
                                      f"{'; '.join(log[-12:])}")
            if got != want or listed != list(lru):
                shown = f"returned {got!r}, LRU returns {want!r}; " if name == "take" else ""
                if name == "restore" and args[0]:  # where the restored blocks went, and where they belong
                    blocks = [b for b, _ in args[0]]
                    shown = (f"the restored blocks {blocks} are at places {_places(listed, blocks)} of your free "
                             f"list (0 = taken next), LRU's at {_places(list(lru), blocks)} of {len(listed)}; ")
                raise AssignmentError(f"{who} broke a RULE: {CALL_RULES[name]}.\n  after {log[-1]}: {shown}free "
                                      f"blocks, "
                                      f"next first: {list(student)[:12]}, LRU's: {list(lru)[:12]}\n  calls: "
                                      f"{'; '.join(log[-12:])}")
            free[:] = list(lru)
            if name == "take":
                stamps.pop(want)

        n = rng.randint(3, 10)
        free: list[int] = []
        stamps = {b: b for b in range(n)}  # block -> stamp, for the free blocks
        clock = n
        call("reset", n)
        for _ in range(40):
            owned = [b for b in range(n) if b not in stamps]
            action = rng.choice(["take", "take", "give_back", "give_back", "revive", "rollback"])
            if action == "take" and free:
                call("take")
            elif action == "give_back" and owned:
                block = rng.choice(owned)
                stamps[block] = clock
                call("give_back", block, clock)
                clock += 1
            elif action == "revive" and free:
                block = rng.choice(free)
                stamps.pop(block)
                call("revive", block)
            elif action == "rollback":  # a step that takes, revives and frees, then is undone
                before = dict(stamps)
                for _ in range(rng.randint(1, 3)):
                    owned = [b for b in range(n) if b not in stamps]
                    if free and rng.random() < 0.4:
                        call("take")
                    elif free and rng.random() < 0.5:
                        block = rng.choice(free)
                        stamps.pop(block)
                        call("revive", block)
                    elif owned:
                        block = rng.choice(owned)
                        stamps[block] = clock
                        call("give_back", block, clock)
                        clock += 1
                for block in [b for b in list(stamps) if before.get(b) != stamps[b]]:  # freed during the step
                    stamps.pop(block)
                    call("revive", block)
                back = sorted(((b, s) for b, s in before.items() if b not in stamps), key=lambda item: item[1])
                stamps.update(back)
                call("restore", back)


def _places(free: list[int], blocks: list[int]) -> list[int | None]:
    """Each block's index in the free list (None: not there)."""
    return [free.index(b) if b in free else None for b in blocks]


def _take_order(allocator: BlockAllocator) -> list[int] | None:
    """The blocks a copy of `allocator` hands out, take() after take() (None if it cannot be copied)."""
    try:
        copy = deepcopy(allocator)
        return [copy.take() for _ in range(len(copy))]
    except Exception:  # a copy that fails says nothing about iter(): the call's own rule is named instead
        return None


def check_allocator_machine(make_allocator: Callable[[], BlockAllocator], max_examples: int = 40) -> None:
    """The scheduler's state machine with the allocator in the block manager (FCFS policy)."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from minivllm.teaching.scheduler_machine import scheduler_machine

    machine = scheduler_machine(make_allocator=make_allocator)
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=max_examples, stateful_step_count=40, deadline=None, database=None, derandomize=True,
            report_multiple_bugs=False, phases=[Phase.explicit, Phase.reuse, Phase.generate],
            suppress_health_check=list(HealthCheck)))
    except AssertionError as error:
        steps = "\n".join(getattr(error, "__notes__", []))
        raise AssignmentError(f"{getattr(make_allocator, '__name__', 'allocator')} broke a RULE: {MACHINE_RULE}.\n  "
                              f"{error}\n{steps}") from None


def check_allocator_in_engine(make_allocator: Callable[[], BlockAllocator], max_tokens: int = 4) -> None:
    """A small pool (16 blocks of 4), prompts that share prefixes, one at a time so that eviction decides
    which prefixes are still cached: the tokens equal HF's and the cache hits equal the engine's LRU's."""
    from minivllm import LLM, SamplingParams
    from minivllm.teaching.checkpoints import load_hf_model
    from minivllm.teaching.hf_check import assert_hf_greedy

    model_dir = tiny_model("qwen3")
    hf = load_hf_model(model_dir)
    rng = random.Random(0)
    stems = [[rng.randrange(3, 300) for _ in range(12)] for _ in range(3)]
    prompts = [stems[i % 3] + [rng.randrange(3, 300) for _ in range(1 + i % 4)] for i in (0, 1, 2, 0, 2, 1)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(allocator: BlockAllocator | None) -> tuple[list[list[int]], int]:
        llm = LLM(model_dir, dtype="float32", block_size=4, num_kv_blocks=16, warmup=False, block_allocator=allocator)
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        check_finished(who, outs)
        return [o.outputs[0].token_ids for o in outs], llm.get_stats().prefix_cache_hits

    student = make_allocator()
    who = f"{type(student).__name__} (in the engine)"
    (got, hits), (_, lru_hits) = run(student), run(None)
    for prompt, tokens in zip(prompts, got):
        try:
            assert_hf_greedy(hf, prompt, tokens)
        except AssertionError as error:
            raise AssignmentError(f"{who} broke a RULE: whichever block holds a token's K/V, the greedy tokens are "
                                  "HF transformers' (a block handed to two requests at once breaks this): "
                                  f"{error}") from None
    if hits != lru_hits:
        raise AssignmentError(f"{who} broke a RULE: {CALL_RULES['take']}; the same requests hit the prefix cache for "
                              f"{hits} tokens, with the engine's LRU {lru_hits}")
