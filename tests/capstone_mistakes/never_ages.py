"""Wrong (bounded wait: the start): priority order without aging, written by hand."""

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class NeverAges(SchedulingPolicy):
    name = "never-ages"

    def admission_order(self, waiting):
        return sorted(waiting, key=lambda s: (s.priority, s.arrival_index))

    def choose_victim(self, candidates):
        return max(candidates, key=lambda s: (s.priority, s.arrival_index))
