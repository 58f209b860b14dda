"""Wrong (fair share: admissions): counts an n = 2 request's two sibling sequences (one arrival index)
as ONE admission, so a tenant that sends n = 2 requests gets two seats for each one of the other's
(a student's, issue 46's walkthrough). Each sibling takes a seat and blocks: each is an admission."""

from collections import Counter

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class FairPerRequest(SchedulingPolicy):
    name = "fair-per-request"

    def __init__(self):
        self.served = Counter()  # tenant -> requests admitted so far
        self.last_waiting = {}  # request id -> sequence, as of the last call

    def admission_order(self, waiting):
        now = {s.request_id: s for s in waiting}
        counted = set()
        for request_id, s in self.last_waiting.items():
            if request_id not in now and not s.is_finished and s.arrival_index not in counted:
                counted.add(s.arrival_index)  # the siblings of one request: counted once
                self.served[s.priority] += 1
        self.last_waiting = now
        return sorted(waiting, key=lambda s: (self.served[s.priority], s.arrival_index))

    def choose_victim(self, candidates):
        held = Counter(s.priority for s in candidates)
        return max(candidates, key=lambda s: (held[s.priority], s.arrival_index))
