"""The engine's failure model, as exception types.

    isolated   a request whose step fails on its own (bad input that slipped past validation, a
               sampler error on its row) finishes with finish_reason "error" and the message; the
               other requests in the step continue as if it had never been there.
    retried    a step that fails is rolled back (see `LLMEngine.step`) and re-run in halves to find
               the culprit; requests that were not to blame are unaffected.
    fatal      `EngineDeadError`: a device error (CUDA) or a failed collective. The device state can
               no longer be trusted, so nothing is retried or bisected; the engine must be rebuilt.
    named      `RequestsFailedError`: the plan found, before any forward, the requests that cannot go on
               (a structured-outputs grammar over its mask budget, or failing:
               engine/structured_output/grammar_fill.py). The step is rolled back and exactly those finish with their
               messages; no bisection.
    raised     `StepFailedError`: a step failed but no single request reproduces the failure (e.g.
               it needs two requests together). The step is rolled back and the error raised; the
               engine is still consistent and the next `step()` may be tried.
"""

from __future__ import annotations

import torch


class EngineDeadError(RuntimeError):
    """The engine hit an unrecoverable (device or communication) error and must be rebuilt."""


class StepFailedError(RuntimeError):
    """A step failed, was rolled back, and no single request could be blamed for it."""


class RequestsFailedError(RuntimeError):
    """Requests a step found to blame before its forward, each with the message it finishes with."""

    def __init__(self, culprits: dict[str, str]) -> None:  # request_id -> message
        super().__init__("; ".join(f"request {rid!r}: {message}" for rid, message in culprits.items()))
        self.culprits = culprits


def is_fatal(error: BaseException) -> bool:
    """Errors after which the device (or the group of devices) cannot be trusted: CUDA errors leave
    the context unusable, and a failed collective leaves the ranks out of step. Never retried."""
    fatal_types = tuple(t for t in (getattr(torch, "AcceleratorError", None),
                                    getattr(torch.distributed, "DistError", None)) if t is not None)
    if isinstance(error, (EngineDeadError, *fatal_types)):
        return True
    return isinstance(error, RuntimeError) and ("CUDA error" in str(error) or "NCCL" in str(error))
