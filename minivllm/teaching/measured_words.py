"""Sentences made from numbers measured in the run, so that a notebook's story is the run's (notebook 15).

A notebook that says "the matmuls take about half of the step" is right on the machine it was
written on and wrong on a busy one (73 % there, once). Here the words come from the figures:

    in_words(0.48)        -> "about half"
    in_words(0.73)        -> "about three quarters"
    MachineLoad.now()     -> the load average against the cores, and whether that is quiet or busy

`MachineLoad.describe()` says how busy the machine was while the notebook measured: on a shared
machine every time below is longer and noisier than on a quiet one, and a reader should know which
one the figures come from.
"""

from __future__ import annotations

import os
from typing import NamedTuple

# (fraction, words): the nearest one names a share
_SHARES = [(0.0, "almost none"), (0.05, "a twentieth"), (0.1, "a tenth"), (0.2, "a fifth"),
           (0.25, "a quarter"), (1 / 3, "a third"), (0.4, "two fifths"), (0.5, "half"),
           (0.6, "three fifths"), (2 / 3, "two thirds"), (0.75, "three quarters"), (0.8, "four fifths"),
           (0.9, "nine tenths"), (1.0, "almost all")]


def in_words(share: float) -> str:
    """A fraction between 0 and 1 in words: the nearest of a few simple fractions, with "about"."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"a share is between 0 and 1, got {share}")
    value, words = min(_SHARES, key=lambda vw: abs(vw[0] - share))
    return words if value in (0.0, 1.0) else f"about {words}"


class MachineLoad(NamedTuple):
    """The 1-minute load average (runnable processes, averaged) against the cores this process may use."""

    load: float
    cores: int

    @classmethod
    def now(cls) -> MachineLoad:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cls(os.getloadavg()[0], cores)

    @property
    def busy(self) -> bool:
        """More runnable processes than cores, on average over the last minute: some of them wait.
        (A notebook's own work counts too, and up to one process a core never makes a machine busy.)"""
        return self.load > self.cores

    def describe(self) -> str:
        head = f"load average {self.load:.1f} on {self.cores} cores"
        if self.busy:
            return (f"{head}: a BUSY machine. Other jobs share the cores, so the times below are "
                    "longer and noisier than on a quiet one, and shares shift towards what waits "
                    "the most; read them as this run's, not the machine's.")
        return f"{head}: a quiet machine; the times below are this machine's own."
