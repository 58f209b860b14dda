"""The capstone's grader holds against wrong policies: each planted mistake (tests/capstone_mistakes/, one
policy a file, as a student hands it in) fails with the rule it breaks named, and the reference policies
(reference_aging.py, reference_fair_share.py there) pass. One test per rule, at least one mistake each:
the victim in both arrival orders and by aged urgency, requests read-only (fields and the queue), an
empty waiting queue answered, bounded wait to the start and to the finish under memory pressure, fair
share judged on tenants (shares, siblings, a late tenant, victims), and the submission rule (no engine
policy imported, called or subclassed)."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from minivllm.engine.core.scheduling_policy import FCFSPolicy, PolicyContractError, PriorityPolicy, SchedulingPolicy
from minivllm.teaching.capstone import grade_policy
from minivllm.teaching.capstone_cheats import check_own_policy
from minivllm.teaching.capstone_fair_share import (check_fair_share, check_late_tenant, check_sibling_shares,
                                                    check_tenant_shares)
from minivllm.teaching.capstone_watch import RequestChangedError, WatchedPolicy
from minivllm.teaching.hands_on import AssignmentError
from minivllm.teaching.policy_behaviour import (ARRIVAL_STEPS, MAX_WAIT_STEPS, Assignment, PolicyBehaviourError,
                                                check_bounded_wait, check_open_load, check_policy_behaviour,
                                                check_victim)

MISTAKES = Path(__file__).resolve().parent / "capstone_mistakes"
sys.path.insert(0, str(MISTAKES))  # the mistakes import the references by module name, as a student's file would


def load(name: str) -> type[SchedulingPolicy]:
    """The one policy class defined in tests/capstone_mistakes/<name>.py (as exercises/capstone/grade.py loads it)."""
    spec = importlib.util.spec_from_file_location(f"capstone_mistake_{name}", MISTAKES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    found = [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]
    assert len(found) == 1, f"{name}.py defines {found}"
    return found[0]


VICTIM = "under memory pressure the least urgent running request is preempted"
READ_ONLY = "a policy reads the requests and the queue it is given and never changes them"
STARTS = "a stream of urgent arrivals cannot keep it out"
FINISHES = "bounded wait holds to the finish"
ORDER = "a more urgent request (lower `priority`) is admitted before a less urgent one"
PRUNED = "state kept per request is dropped once the request has finished"
SHARES = "each gets about half of the admissions, whatever their arrival rates"
TENANT_VICTIM = "the victim comes from the tenant holding the most running requests"
VICTIM_AGED = "the victim is chosen by the same aged urgency as the admission order"
SIBLINGS = "each sibling of an n > 1 request is an admission"
LATE = "a tenant's share is counted from when both wait"
EMPTY = "admission_order is asked every step that admits, also with an empty waiting queue"


def test_the_reference_aging_policy_passes_the_whole_grade():
    grade_policy(load("reference_aging"), max_examples=25, hf=False)


def test_the_reference_fair_share_policy_passes_the_whole_grade():
    grade_policy(load("reference_fair_share"), max_examples=25, hf=False, assignment=Assignment.FAIR_SHARE)


@pytest.mark.parametrize("mistake,rule", [("drops_non_urgent", "admission_order must return every waiting request"),
                                          ("stale_victim", "choose_victim must return one of `candidates`")])
def test_a_policy_breaking_the_seam_fails_naming_the_rule(mistake, rule):
    """The contract (CheckedPolicy, under WatchedPolicy) still names the student's class."""
    policy = load(mistake)
    with pytest.raises(PolicyContractError, match=rule) as err:
        grade_policy(policy, max_examples=100, hf=False, shrink=False)
    assert str(err.value).startswith(f"{policy.__name__} broke a RULE"), str(err.value)


@pytest.mark.parametrize("mistake,error,rule,seen", [
    ("victim_newest", PolicyBehaviourError, VICTIM, "(the newest)"),
    ("victim_requester", PolicyBehaviourError, VICTIM, "(the first admitted)"),
    ("writes_priority", RequestChangedError, READ_ONLY, "changed `priority` of request 'r0' from 1 to 0.75"),
    ("writes_own_field", RequestChangedError, READ_ONLY, "changed `waited` of request 'r0' from <not set> to 1"),
    ("sorts_candidates", RequestChangedError, READ_ONLY, "choose_victim changed the candidates"),
    ("never_ages", PolicyBehaviourError, STARTS, "(after the arrivals stopped)"),
    ("ages_the_probe_only", PolicyBehaviourError, STARTS, "(priority 0) beside one arrival of priority -2 per step"),
    ("shortest_first", PolicyBehaviourError, ORDER, "your policy admitted ['r0']"),
    ("never_pruned", PolicyBehaviourError, PRUNED, "entries in self.arrived"),
    ("forgets_age", PolicyBehaviourError, FINISHES, "was preempted 1 time(s) (steps [15]), finished at step 32"),
    ("victim_by_raw_priority", PolicyBehaviourError, VICTIM_AGED, "your policy preempted r0, the old one"),
])
def test_a_wrong_aging_policy_fails_naming_the_rule(mistake, error, rule, seen):
    with pytest.raises(error, match="broke a RULE") as err:
        check_policy_behaviour(load(mistake))
    assert rule in str(err.value) and seen in str(err.value), str(err.value)


@pytest.mark.parametrize("mistake", ["victim_newest", "victim_requester"])
def test_the_victim_is_asked_in_both_arrival_orders(mistake):
    """Each one-sided victim rule passes one order and fails the other: one order alone would pass one of them."""
    from minivllm.teaching.capstone_run import ScenarioRun

    policy = load(mistake)
    victims = [ScenarioRun(policy(), max_num_seqs=2, num_blocks=2).first_victim(priorities)[1].priority
               for priorities in ([-1, 1], [1, -1])]
    assert sorted(victims) == [-1, 1], victims
    with pytest.raises(PolicyBehaviourError, match=VICTIM):
        check_victim(policy)


def test_a_request_changed_is_caught_in_the_state_machine_too():
    """Part 1 of the grade (random runs, failed steps, n > 1) runs the policy watched as well."""
    with pytest.raises(RequestChangedError, match="changed `priority`"):
        grade_policy(load("writes_priority"), max_examples=10, hf=False, shrink=False)


@pytest.mark.parametrize("mistake,rule,seen", [
    ("tenants_fcfs", SHARES, "tenant 0 got"),
    ("inverted_fair_share", SHARES, "tenant 0 got"),
    ("fair_victim_newest", TENANT_VICTIM, "your policy preempted r2 of tenant 1"),
    ("fair_victim_fewest", TENANT_VICTIM, "of tenant 1"),
    ("reference_aging", TENANT_VICTIM, "of tenant 1"),
    ("fair_per_request", SIBLINGS, "tenant 0 got 18 (32%) and tenant 1 38 (68%)"),
    ("fair_never_lifted", LATE, "tenant 0 got 0 (0%)"),
])
def test_a_wrong_fair_share_policy_fails_naming_the_rule(mistake, rule, seen):
    with pytest.raises(PolicyBehaviourError, match="broke a RULE") as err:
        check_policy_behaviour(load(mistake), Assignment.FAIR_SHARE)
    assert rule in str(err.value) and seen in str(err.value), str(err.value)


def test_the_victim_is_probed_among_requests_of_unequal_age():
    """A victim by raw `priority` passes both equal-age orders (the least urgent IS the raw one there); only
    the old-beside-fresh probe tells it from the aged urgency the assignment asks for."""
    check_victim(load("victim_by_raw_priority"))
    with pytest.raises(PolicyBehaviourError, match=VICTIM_AGED):
        check_policy_behaviour(load("victim_by_raw_priority"))


def test_an_empty_waiting_queue_is_a_named_rule_not_a_traceback():
    """The scheduler asks admission_order with an empty queue (a step with nothing waiting, the drain): a
    policy that raises there fails naming that rule, before the state machine runs, and in every scenario."""
    policy = load("empty_queue_raises")
    with pytest.raises(PolicyContractError, match=EMPTY) as err:
        grade_policy(policy, max_examples=5, hf=False, shrink=False)
    assert "it raised ValueError: min()" in str(err.value), str(err.value)
    assert str(err.value).startswith("EmptyQueueRaises broke a RULE"), str(err.value)
    with pytest.raises(PolicyContractError, match=EMPTY):
        check_policy_behaviour(policy)
    assert WatchedPolicy(load("reference_aging")()).admission_order([]) == []


@pytest.mark.parametrize("mistake,check", [("fair_per_request", check_sibling_shares),
                                           ("fair_never_lifted", check_late_tenant)])
def test_each_fair_share_probe_catches_what_the_2_to_1_run_misses(mistake, check):
    """Siblings counted as one request, and a count never lifted, both pass the 2 : 1 run (shares within the
    band there); the sibling run and the late-tenant run each fail one of them."""
    check_tenant_shares(load(mistake))
    with pytest.raises(PolicyBehaviourError, match=SIBLINGS if check is check_sibling_shares else LATE):
        check(load(mistake))
    check(load("reference_fair_share"))


def test_the_victims_of_a_whole_run_are_judged_by_tenant():
    """Beyond the probe: every victim chosen in the 2 : 1 run (about 40 of them) is checked, too."""
    with pytest.raises(PolicyBehaviourError, match=TENANT_VICTIM) as err:
        check_tenant_shares(load("fair_victim_fewest"))
    assert "all running by tenant" in str(err.value), str(err.value)


def test_fair_share_shares_are_measured_on_tenants():
    """The reference splits admissions about evenly between a tenant sending 2 a step and one sending 1."""
    shares = check_fair_share(load("reference_fair_share"))
    assert all(abs(s - 0.5) <= 0.1 for s in shares.values()), shares


@pytest.mark.parametrize("mistake,seen", [
    ("cheat_subclass", "it subclasses minivllm.engine.core.scheduling_policy.PriorityPolicy"),
    ("cheat_calls", "line 11: `scheduling_policy.PriorityPolicy`"),
    ("cheat_hidden", "it called minivllm.engine.core.scheduling_policy.PriorityPolicy.admission_order"),
])
def test_a_cheat_is_refused_naming_the_rule(mistake, seen):
    """By the shared submission rule (teaching/submission_rules.py): the MRO, the source, the calls."""
    with pytest.raises(AssignmentError, match="the policy assignment is written by you") as err:
        grade_policy(load(mistake), max_examples=5, hf=False, shrink=False)
    assert seen in str(err.value), str(err.value)


@pytest.mark.parametrize("policy", [PriorityPolicy, FCFSPolicy])
def test_the_engine_policies_handed_in_as_they_are_are_refused(policy):
    with pytest.raises(AssignmentError, match=f"{policy.__name__} is the engine's own policy"):
        grade_policy(policy, max_examples=5, hf=False, shrink=False)


def test_the_reference_policies_keep_the_submission_rule():
    check_own_policy(load("reference_aging"))
    check_own_policy(load("reference_fair_share"))


def test_open_load_starves_a_policy_without_aging():
    """Rule 5 on its own: under the random stream a policy without aging keeps some request out too long."""
    with pytest.raises(PolicyBehaviourError, match="every request starts within 50 steps of arriving"):
        check_open_load(load("never_ages")())
    check_open_load(load("reference_aging")())


def test_bounded_wait_bounds_start_and_finish():
    """The scenario itself: a correct policy starts AND finishes the long request in bounded time; the
    contract on a changed queue is still the engine's (a filtered order is a contract error)."""
    check_bounded_wait(load("reference_aging")())
    assert MAX_WAIT_STEPS < ARRIVAL_STEPS
    assert issubclass(RequestChangedError, AssertionError) and issubclass(PolicyContractError, AssertionError)
