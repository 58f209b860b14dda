"""Wrong (the seam): `min()` over the waiting queue, which is empty in a step with nothing waiting; the
scheduler asks `admission_order` then too (a student's, issue 46's walkthrough). Otherwise correct."""

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class EmptyQueueRaises(SchedulingPolicy):
    name = "empty-queue-raises"
    AGING_STEPS = 4

    def __init__(self):
        self.clock = 0
        self.arrived = {}  # request id -> (sequence, clock when first seen)

    def _urgency(self, seq):
        return seq.priority - (self.clock - self.arrived[seq.request_id][1]) / self.AGING_STEPS

    def _see(self, seqs):
        for s in seqs:
            self.arrived.setdefault(s.request_id, (s, self.clock))

    def admission_order(self, waiting):
        self.clock += 1
        self.arrived = {r: (s, t) for r, (s, t) in self.arrived.items() if not s.is_finished}
        self._see(waiting)
        oldest = min(s.arrival_index for s in waiting)  # ValueError: the queue may be empty
        return sorted(waiting, key=lambda s: (self._urgency(s), s.arrival_index - oldest))

    def choose_victim(self, candidates):
        self._see(candidates)
        return max(candidates, key=lambda s: (self._urgency(s), s.arrival_index))
