"""Wrong (the seam's contract): remembers the first candidates it was offered and keeps preempting from them."""

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class StaleVictim(SchedulingPolicy):
    name = "stale-victim"

    def __init__(self):
        self.first = None

    def admission_order(self, waiting):
        return list(waiting)

    def choose_victim(self, candidates):
        self.first = self.first or list(candidates)
        return self.first[-1]
