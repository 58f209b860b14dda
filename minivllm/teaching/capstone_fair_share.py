"""The fair-share assignment's behaviour checks: judged on tenants, not on priorities.

    check_fair_share(MyPolicy)      # what `grade.py --fair-share` runs (with the open-load and state rules)

In the fair-share assignment `seq.priority` is a tenant id. The point of fair share is that a tenant
cannot take the engine by sending more: when two tenants both have work waiting, each gets about half
of the admissions, whatever their arrival rates; and under memory pressure the victim comes from the
tenant holding the most of the running requests. FCFS serves tenants in proportion to what they send
(2 : 1 below), an inverted fair share (the most served first) starves the quiet one: both keep the
seam's contract and drain every request, so only a check on tenants can tell them from a fair policy.

  1. victim by tenant: three running requests, two of tenant 0 and one of tenant 1, no free block; the
     victim is tenant 0's. Asked in both arrival orders (the lone tenant's request first, then last):
     "always the newest" and "always the one asking" each fail one of them;
  2. shares under unequal arrival rates: tenant 0 sends two requests a step, tenant 1 one request a step
     with n = 2 every other step (its two sibling sequences, fan_out, as the engine queues them: the same
     arrival index and priority, one request id each; each is an admission, as each takes a seat and
     blocks). Five seats and a pool of seven blocks: both tenants stay backlogged, and a victim is
     chosen about every other step, half of the time between tenants holding unequal numbers. Of the
     admissions made while both had work waiting, each tenant's share must lie within
     `SHARE_TOLERANCE` of one half; and every victim the policy chose during the run must belong to a
     tenant holding the most of that call's candidates, or the most of all running requests then (a
     policy may count either: the candidates are what it is shown, the running ones what it can track);
  3. siblings are admissions: tenant 0 sends two requests a step, tenant 1 one n = 2 request a step (the
     same sequences a step); four seats, no memory pressure, so both siblings of a request leave the
     queue in the same step. The shares must again lie within `SHARE_TOLERANCE` of one half: counting
     an n = 2 request as ONE admission gives tenant 1 two seats for each of tenant 0's one (33 %);
  4. a late tenant: tenant 0 alone for `ALONE_STEPS` steps (one request a step), then tenant 1 as well
     (two a step) for `LATE_STEPS` steps. Of the admissions made while both wait, each tenant's share
     lies within `SHARE_TOLERANCE` of one half: what a tenant got while it was alone is no debt. A count
     of admissions "so far" that is never lifted for a tenant that comes (back) makes the newcomer the
     least served for as long as the early one was alone, and starves the early one (0 of 40 admissions);
     lift it to the lowest count of the tenants that had work waiting (as CFS lifts a waking task's
     virtual runtime to the queue's minimum).
Each scenario (`_shares`) counts, per tenant, the sequences admitted in the steps that began with both
tenants waiting.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from minivllm.engine.core.scheduling_policy import SchedulingPolicy
from minivllm.teaching.capstone_run import ScenarioRun, fail

TENANTS = (0, 1)
SHARE_TOLERANCE = 0.1  # each tenant's share of the admissions within 0.5 +- this while both wait
ARRIVAL_STEPS = 60  # steps with arrivals in the shares scenario
SIBLING_STEPS = 40  # steps with arrivals in the siblings scenario
ALONE_STEPS, LATE_STEPS = 40, 30  # the late-tenant scenario: tenant 0 alone, then both
Arrivals = Callable[[int], list[tuple[int, int]]]  # step -> the requests arriving then: (tenant, n)


def check_fair_victim(make_policy: Callable[[], SchedulingPolicy]) -> None:
    """Rule 1 (module docstring): the victim comes from the tenant holding the most running requests."""
    for tenants in ([1, 0, 0], [0, 0, 1]):
        run = ScenarioRun(make_policy(), max_num_seqs=3, num_blocks=3)
        running, victim = run.first_victim(tenants)
        if victim.priority != 0:
            shown = ", ".join(f"{s.request_id} (tenant {s.priority})" for s in running)
            raise fail(run.name, "under memory pressure the victim comes from the tenant holding the most running "
                                 "requests (fair share: the tenant using most gives back first)",
                       f"running {shown} in admission order, no free block: your policy preempted "
                       f"{victim.request_id} of tenant {victim.priority}")


def _shares(run: ScenarioRun, arrivals: Arrivals, steps: int) -> Counter[int]:
    """Run the scenario (arrivals every step for `steps` steps, then the drain); returns, per tenant, the
    sequences admitted in the steps that began with both tenants waiting."""
    admitted: Counter[int] = Counter()
    for step in range(steps):
        for tenant, n in arrivals(step):
            run.add(prompt_len=3, max_tokens=3, priority=tenant, n=n)
        both_wait = {s.priority for s in run.sched.waiting} >= set(TENANTS)
        run.step()
        if both_wait:
            admitted.update(s.priority for s in run.admitted[-1])
    run.drain()
    return admitted


def _check_even(run: ScenarioRun, admitted: Counter[int], scenario: str, rule: str) -> dict[int, float]:
    """Each tenant's share of `admitted` within `SHARE_TOLERANCE` of one half, or the rule named."""
    total = sum(admitted.values())
    shares = {t: admitted[t] / max(total, 1) for t in TENANTS}
    if total == 0 or any(abs(share - 0.5) > SHARE_TOLERANCE for share in shares.values()):
        raise fail(run.name, rule, f"{scenario}; of the {total} admissions made while both waited tenant 0 got "
                                   f"{admitted[0]} ({shares[0]:.0%}) and tenant 1 {admitted[1]} ({shares[1]:.0%}); "
                                   f"allowed: {0.5 - SHARE_TOLERANCE:.0%} to {0.5 + SHARE_TOLERANCE:.0%} each")
    return shares


def check_tenant_shares(make_policy: Callable[[], SchedulingPolicy]) -> dict[int, float]:
    """Rule 2 (module docstring); returns each tenant's share of the admissions while both waited."""
    run = ScenarioRun(make_policy(), max_num_seqs=5, num_blocks=7)  # five running need 10: ~40 victims chosen
    admitted = _shares(run, lambda step: [(0, 1), (0, 1)] + ([(1, 2)] if step % 2 == 0 else []), ARRIVAL_STEPS)
    shares = _check_even(run, admitted, "tenant 0 sent 2 requests a step, tenant 1 one (an n = 2 request every "
                                        "other step: two sequences, two admissions)",
                         "while two tenants both have requests waiting, each gets about half of the admissions, "
                         "whatever their arrival rates (a tenant cannot take the engine by sending more)")
    for call in run.watched.victim_calls:
        held = Counter(s.priority for s in call.candidates)
        running = Counter(s.priority for s in call.running)
        tenant = call.victim.priority
        if held[tenant] < max(held.values()) and running[tenant] < max(running.values()):
            raise fail(run.name, "under memory pressure the victim comes from the tenant holding the most running "
                                 "requests (fair share: the tenant using most gives back first)",
                       f"candidates by tenant {dict(held)}, all running by tenant {dict(running)}: your policy "
                       f"preempted {call.victim.request_id} of tenant {tenant}")
    return shares


def check_sibling_shares(make_policy: Callable[[], SchedulingPolicy]) -> dict[int, float]:
    """Rule 3 (module docstring): each sibling of an n = 2 request is an admission."""
    run = ScenarioRun(make_policy(), max_num_seqs=4, num_blocks=8)  # four running need 8: no victims
    admitted = _shares(run, lambda step: [(0, 1), (0, 1), (1, 2)], SIBLING_STEPS)
    return _check_even(run, admitted, "tenant 0 sent two requests a step, tenant 1 one n = 2 request a step",
                       "each sibling of an n > 1 request is an admission (it takes a seat and blocks): while two "
                       "tenants both wait each gets about half of the admitted sequences, counted one per sibling")


def check_late_tenant(make_policy: Callable[[], SchedulingPolicy]) -> dict[int, float]:
    """Rule 4 (module docstring): a tenant that comes late does not starve the one that was alone."""
    run = ScenarioRun(make_policy(), max_num_seqs=4, num_blocks=8)
    admitted = _shares(run, lambda step: [(0, 1)] + ([(1, 1), (1, 1)] if step >= ALONE_STEPS else []),
                       ALONE_STEPS + LATE_STEPS)
    return _check_even(run, admitted, f"tenant 0 sent one request a step, alone for {ALONE_STEPS} steps, then "
                                      f"tenant 1 two a step for {LATE_STEPS} steps",
                       "a tenant's share is counted from when both wait: what a tenant got while it was alone is "
                       "no debt, so a tenant that comes late (or back) does not starve the other until it catches up "
                       "(lift its count to the lowest of the tenants that had work waiting)")


def check_fair_share(make_policy: Callable[[], SchedulingPolicy]) -> dict[int, float]:
    """The fair-share rules, in order (module docstring); returns the tenants' shares."""
    check_fair_victim(make_policy)
    shares = check_tenant_shares(make_policy)
    check_sibling_shares(make_policy)
    check_late_tenant(make_policy)
    return shares
