"""Wrong (requests are read-only): ages a waiting request by lowering its `priority` field in place."""

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class WritesPriority(SchedulingPolicy):
    name = "writes-priority"

    def admission_order(self, waiting):
        for s in waiting:
            s.priority -= 0.25
        return sorted(waiting, key=lambda s: (s.priority, s.arrival_index))

    def choose_victim(self, candidates):
        return max(candidates, key=lambda s: (s.priority, s.arrival_index))
