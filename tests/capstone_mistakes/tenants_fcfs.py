"""Wrong (fair share: admissions): first come, first served, so a tenant's share is its share of arrivals."""

from collections import Counter

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class TenantsFCFS(SchedulingPolicy):
    name = "tenants-fcfs"

    def admission_order(self, waiting):
        return sorted(waiting, key=lambda s: s.arrival_index)

    def choose_victim(self, candidates):
        held = Counter(s.priority for s in candidates)
        return max(candidates, key=lambda s: (held[s.priority], s.arrival_index))
