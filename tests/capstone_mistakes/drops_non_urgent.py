"""Wrong (the seam's contract): filters instead of sorting, so a request with priority > 0 is never admitted."""

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class DropsNonUrgent(SchedulingPolicy):
    name = "drops-non-urgent"

    def admission_order(self, waiting):
        return [s for s in waiting if s.priority <= 0]

    def choose_victim(self, candidates):
        return candidates[-1]
