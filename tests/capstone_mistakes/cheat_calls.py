"""Cheat: keeps the engine's PriorityPolicy and forwards both questions to it."""

from minivllm.engine.core import scheduling_policy
from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class CheatCalls(SchedulingPolicy):
    name = "cheat-calls"

    def __init__(self):
        self.inner = scheduling_policy.PriorityPolicy()

    def admission_order(self, waiting):
        return self.inner.admission_order(waiting)

    def choose_victim(self, candidates):
        return self.inner.choose_victim(candidates)
