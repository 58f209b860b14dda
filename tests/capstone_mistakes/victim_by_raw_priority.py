"""Wrong (the victim by age): ages every request from arrival and keeps the age while it runs, but chooses
the victim by the raw `priority`: an old low-priority request that aged past a fresh urgent one is
preempted for it, and 60 steps of its work are thrown away (a student's, issue 46's walkthrough)."""

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class VictimByRawPriority(SchedulingPolicy):
    name = "victim-by-raw-priority"
    AGING_STEPS = 8

    def __init__(self):
        self.clock = 0
        self.arrived = {}  # request id -> (sequence, clock when first seen)

    def _urgency(self, seq):
        return seq.priority - (self.clock - self.arrived[seq.request_id][1]) / self.AGING_STEPS

    def admission_order(self, waiting):
        self.clock += 1
        self.arrived = {r: (s, t) for r, (s, t) in self.arrived.items() if not s.is_finished}
        for s in waiting:
            self.arrived.setdefault(s.request_id, (s, self.clock))
        return sorted(waiting, key=lambda s: (self._urgency(s), s.arrival_index))

    def choose_victim(self, candidates):
        return max(candidates, key=lambda s: (s.priority, s.arrival_index))
