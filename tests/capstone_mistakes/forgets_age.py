"""Wrong (bounded wait to the finish): ages only while waiting; the age is forgotten once the request runs,
so the victim is chosen by the raw priority and a request that aged its way in is preempted for newcomers
and must age again from nothing (tests/exercise_solutions.py's AgingPolicy before issue 46)."""

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class ForgetsAge(SchedulingPolicy):
    name = "forgets-age"
    AGING_STEPS = 4

    def __init__(self):
        self.waited = {}

    def admission_order(self, waiting):
        self.waited = {s.request_id: self.waited.get(s.request_id, -1) + 1 for s in waiting}
        return sorted(waiting, key=lambda s: (s.priority - self.waited[s.request_id] / self.AGING_STEPS,
                                              s.arrival_index))

    def choose_victim(self, candidates):
        return max(candidates, key=lambda s: (s.priority, s.arrival_index))
