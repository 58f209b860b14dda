"""Wrong (requests are read-only): keeps its wait counter on the request (`seq.waited`), not in its own state."""

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class WritesOwnField(SchedulingPolicy):
    name = "writes-own-field"

    def admission_order(self, waiting):
        for s in waiting:
            s.waited = getattr(s, "waited", 0) + 1
        return sorted(waiting, key=lambda s: (s.priority - s.waited / 4, s.arrival_index))

    def choose_victim(self, candidates):
        return max(candidates, key=lambda s: (s.priority, s.arrival_index))
