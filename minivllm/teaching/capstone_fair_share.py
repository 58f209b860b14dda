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
     policy may count either: the candidates are what it is shown, the running ones what it can track).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from minivllm.engine.core.scheduling_policy import SchedulingPolicy
from minivllm.teaching.capstone_run import ScenarioRun, fail

TENANTS = (0, 1)
SHARE_TOLERANCE = 0.1  # each tenant's share of the admissions within 0.5 +- this while both wait
ARRIVAL_STEPS = 60  # steps with arrivals in the shares scenario


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


def check_tenant_shares(make_policy: Callable[[], SchedulingPolicy]) -> dict[int, float]:
    """Rule 2 (module docstring); returns each tenant's share of the admissions while both waited."""
    run = ScenarioRun(make_policy(), max_num_seqs=5, num_blocks=7)  # five running need 10: ~40 victims chosen
    admitted: Counter[int] = Counter()
    for step in range(ARRIVAL_STEPS):
        run.add(prompt_len=3, max_tokens=3, priority=0)
        run.add(prompt_len=3, max_tokens=3, priority=0)
        if step % 2 == 0:
            run.add(prompt_len=3, max_tokens=3, priority=1, n=2)
        both_wait = {s.priority for s in run.sched.waiting} >= set(TENANTS)
        run.step()
        if both_wait:
            admitted.update(s.priority for s in run.admitted[-1])
    run.drain()
    total = sum(admitted.values())
    shares = {t: admitted[t] / max(total, 1) for t in TENANTS}
    if total == 0 or any(abs(share - 0.5) > SHARE_TOLERANCE for share in shares.values()):
        raise fail(run.name, "while two tenants both have requests waiting, each gets about half of the admissions, "
                             "whatever their arrival rates (a tenant cannot take the engine by sending more)",
                   f"tenant 0 sent 2 requests a step, tenant 1 one (an n = 2 request every other step: two "
                   f"sequences, two admissions); of the {total} admissions made while both waited tenant 0 got "
                   f"{admitted[0]} ({shares[0]:.0%}) and tenant 1 {admitted[1]} ({shares[1]:.0%}); allowed: "
                   f"{0.5 - SHARE_TOLERANCE:.0%} to {0.5 + SHARE_TOLERANCE:.0%} each")
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


def check_fair_share(make_policy: Callable[[], SchedulingPolicy]) -> dict[int, float]:
    """The fair-share rules, in order (module docstring); returns the tenants' shares."""
    check_fair_victim(make_policy)
    return check_tenant_shares(make_policy)
