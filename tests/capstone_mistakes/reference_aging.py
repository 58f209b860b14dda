"""Correct (the reference the capstone's tests grade): priority with aging, age counted from arrival.

A request's effective priority is `priority - steps since it arrived / AGING_STEPS`: the longer it has
been in the engine, the more urgent it is. The age is kept while the request runs and across a
preemption (it arrived when it arrived), and the victim is chosen by the same effective priority, so a
request that aged past its newcomers is never preempted for them: it finishes, not only starts, in
bounded time. The age is counted in calls of `admission_order` (once a step that admits) and kept per
request until the request finishes, so the state never outgrows the requests in the engine.
"""

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class ReferenceAging(SchedulingPolicy):
    name = "reference-aging"
    AGING_STEPS = 4

    def __init__(self):
        self.clock = 0
        self.arrived = {}  # request id -> (sequence, clock at arrival): live requests only

    def _urgency(self, seq):
        return seq.priority - (self.clock - self.arrived[seq.request_id][1]) / self.AGING_STEPS

    def _see(self, seqs):
        for s in seqs:
            self.arrived.setdefault(s.request_id, (s, self.clock))

    def admission_order(self, waiting):
        self.clock += 1
        self.arrived = {r: (s, t) for r, (s, t) in self.arrived.items() if not s.is_finished}
        self._see(waiting)
        return sorted(waiting, key=lambda s: (self._urgency(s), s.arrival_index))

    def choose_victim(self, candidates):
        self._see(candidates)
        return max(candidates, key=lambda s: (self._urgency(s), s.arrival_index))
