"""Cheat: reaches the engine's built-in policy by a name built at run time (no forbidden name in the file)."""

import importlib

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


class CheatHidden(SchedulingPolicy):
    name = "cheat-hidden"

    def __init__(self):
        module = importlib.import_module("minivllm.engine.core.scheduling_" + "policy")
        self.inner = getattr(module, "Priority" + "Policy")()

    def admission_order(self, waiting):
        return self.inner.admission_order(waiting)

    def choose_victim(self, candidates):
        return self.inner.choose_victim(candidates)
