"""Correct (the reference the capstone's tests grade): fair share between tenants (`priority` is the tenant).

Admission: each tenant's k-th waiting request gets the rank `served[tenant] + k`, where `served` counts
the tenant's admissions (a request that left the waiting queue since the last call was admitted, each
sibling of an n > 1 request one admission); the lowest rank goes first, ties by arrival. So two tenants
that both have work alternate, whatever their arrival rates: the busier one cannot take the engine by
sending more. A tenant that had nothing waiting at the last call starts from the lowest count of those
that had (its count is lifted, never lowered): what a tenant got while it was alone is no debt, so a
late tenant does not starve the early one until it catches up. Victim: from the tenant holding the
most of the candidates, its newest request. State: one counter per tenant, and the ids waiting at the
last call (rebuilt every call).
"""

from collections import Counter

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class ReferenceFairShare(SchedulingPolicy):
    name = "reference-fair-share"

    def __init__(self):
        self.served = Counter()  # tenant -> admissions so far
        self.last_waiting = {}  # request id -> tenant, as of the last call

    def admission_order(self, waiting):
        now = {s.request_id: s.priority for s in waiting}
        for request_id, tenant in self.last_waiting.items():
            if request_id not in now:
                self.served[tenant] += 1
        waited = set(self.last_waiting.values())  # the tenants with work waiting at the last call
        floor = min((self.served[t] for t in waited), default=0)
        for tenant in set(now.values()) - waited:  # a tenant back (or new): no credit for its idle time
            self.served[tenant] = max(self.served[tenant], floor)
        self.last_waiting = now
        rank, seen = {}, Counter()
        for s in sorted(waiting, key=lambda s: s.arrival_index):
            rank[s.request_id] = self.served[s.priority] + seen[s.priority]
            seen[s.priority] += 1
        return sorted(waiting, key=lambda s: (rank[s.request_id], s.arrival_index))

    def choose_victim(self, candidates):
        held = Counter(s.priority for s in candidates)
        return max(candidates, key=lambda s: (held[s.priority], s.arrival_index))
