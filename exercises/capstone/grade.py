"""Grade a scheduling policy (the capstone).

    python exercises/capstone/grade.py [exercises/capstone/my_policy.py] [--examples N] [--no-hf] [--fair-share]

The file must define exactly one `SchedulingPolicy` subclass, your own (its `admission_order` is also
asked with an empty queue, and must return [] then): importing, calling or subclassing
the engine's policies (FCFSPolicy, PriorityPolicy) is refused, naming the rule. In every part the policy
may read the requests it is given, never change them (a write into `seq.priority` or any other field, or
into the queue, fails naming the field). Three parts, in order:
  1. the scheduler's hypothesis state machine (the one the project's own tests run) under the policy:
     random arrivals (n > 1 included), steps, aborts, failed steps, drafts; the seam's contract on every call,
     the block manager's invariants after every action, and every request finishing at the end;
  2. behaviour, with new requests arriving while others run (minivllm/teaching/policy_behaviour.py):
     a more urgent request is admitted first; the least urgent is preempted (whichever arrived first);
     a low-priority request beside a stream of urgent arrivals, under memory pressure, starts within
     a bounded number of steps and then finishes within twice the steps it needs alone; the victim is
     chosen by the aged urgency (an old request is not preempted for a fresh one it aged past); state kept
     per request is dropped once the request finished; under random load every request starts in
     bounded time and finishes. `--fair-share` grades the fair-share assignment instead of the three
     priority rules (there `priority` is a tenant): while two tenants both wait each gets about half
     of the admissions, whether they send at 2 : 1, one of them only n = 2 requests (each sibling is
     an admission), or one came after the other had been alone for 40 steps; and the victim comes
     from the tenant holding the most running requests (minivllm/teaching/capstone_fair_share.py);
  3. an engine scheduling with the policy on a tiny random model, under memory pressure (so requests
     are preempted and recomputed) and with mixed priorities: its greedy output must equal HF
     transformers' (teacher-forced).
Exit status: 0 passed, 1 failed (the rule broken is printed, with hypothesis's smallest failing run),
2 not written yet.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path

from minivllm.engine.core.scheduling_policy import SchedulingPolicy
from minivllm.teaching.capstone import grade_policy
from minivllm.teaching.policy_behaviour import Assignment

HERE = Path(__file__).resolve().parent


def load_policy(path: str | Path) -> type[SchedulingPolicy]:
    """The one SchedulingPolicy subclass defined in the file at `path`."""
    spec = importlib.util.spec_from_file_location("student_policy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    found = [c for c in vars(module).values()
             if inspect.isclass(c) and issubclass(c, SchedulingPolicy) and c.__module__ == spec.name]
    if len(found) != 1:
        raise SystemExit(f"{path}: define exactly one SchedulingPolicy subclass (found {[c.__name__ for c in found]})")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default=str(HERE / "my_policy.py"))
    p.add_argument("--examples", type=int, default=100, help="random runs of the state machine")
    p.add_argument("--no-hf", action="store_true", help="skip part 3 (the comparison with HF transformers)")
    p.add_argument("--fair-share", action="store_true", help="grade the fair-share assignment (no priority rules)")
    args = p.parse_args(argv)
    policy = load_policy(args.path)
    try:
        grade_policy(policy, max_examples=args.examples, hf=not args.no_hf,
                     assignment=Assignment.FAIR_SHARE if args.fair_share else Assignment.AGING)
    except NotImplementedError:
        print(f"{policy.__name__} is not written yet: fill in the TODOs in {args.path}")
        return 2
    except AssertionError as error:
        steps = "\n".join(getattr(error, "__notes__", []))  # hypothesis: the smallest failing run
        print(f"✗ {policy.__name__} failed.\n{error}\n{steps}")
        return 1
    print(f"{policy.__name__} passed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
