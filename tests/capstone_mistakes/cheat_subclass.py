"""Cheat: subclasses the engine's PriorityPolicy (the student's part left to the engine)."""

from minivllm.engine.core.scheduling_policy import PriorityPolicy


class CheatSubclass(PriorityPolicy):
    name = "cheat-subclass"
