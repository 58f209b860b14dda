"""Wrong (fair share: a late tenant): counts each tenant's admissions so far and admits the least served
first, but never lifts the count of a tenant that arrives late: a tenant alone for 40 steps has banked
dozens of admissions, and when a second tenant comes it is starved until the newcomer catches up (the
natural fair share; a student's, issue 46's walkthrough, and the reference before it)."""

from collections import Counter

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class FairNeverLifted(SchedulingPolicy):
    name = "fair-never-lifted"

    def __init__(self):
        self.served = Counter()  # tenant -> admissions since the policy started
        self.last_waiting = {}  # request id -> tenant, as of the last call

    def admission_order(self, waiting):
        now = {s.request_id: s.priority for s in waiting}
        for request_id, tenant in self.last_waiting.items():
            if request_id not in now:
                self.served[tenant] += 1
        self.last_waiting = now
        return sorted(waiting, key=lambda s: (self.served[s.priority], s.arrival_index))

    def choose_victim(self, candidates):
        held = Counter(s.priority for s in candidates)
        return max(candidates, key=lambda s: (held[s.priority], s.arrival_index))
