"""Notebook 15's sentences come from its numbers: a share in words is the nearest simple fraction, and
the machine is called busy only when more processes wait to run than it has cores."""

from __future__ import annotations

import pytest

from minivllm.teaching.measured_words import MachineLoad, in_words


@pytest.mark.parametrize("share, words", [(0.48, "about half"), (0.52, "about half"), (0.73, "about three quarters"),
                                          (0.66, "about two thirds"), (0.31, "about a third"), (0.0, "almost none"),
                                          (0.99, "almost all")])
def test_a_share_in_words_is_the_nearest_simple_fraction(share, words):
    assert in_words(share) == words


def test_a_share_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="between 0 and 1"):
        in_words(1.3)


def test_busy_means_more_runnable_processes_than_cores():
    assert not MachineLoad(1.9, 2).busy and MachineLoad(2.1, 2).busy
    assert "BUSY" in MachineLoad(6.8, 2).describe() and "quiet" in MachineLoad(0.4, 2).describe()
