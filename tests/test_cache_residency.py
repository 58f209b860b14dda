"""Whether a model's weights stay in cache: /sys's sizes in the clear cases, a cached measurement between."""

from __future__ import annotations

import pytest
import torch

from minivllm.layers import cache_residency, matmul_plan, tuner
from minivllm.layers.cache_residency import IN_CACHE, RESIDENT_MARGIN, STREAMED, weights_in_cache
from minivllm.layers.cpu_info import CpuInfo
from minivllm.layers.matmul_plan import MatmulPlan

# A made-up CPU: 256 KiB per core, 2 MiB "last level", so the probe's buffers stay a few MiB.
CPU = CpuInfo("a test CPU", amx=False, avx512_bf16=False, last_level_cache_bytes=2 << 20, l2_cache_bytes=256 << 10)



def test_the_clear_cases_are_sized_from_sys_and_time_nothing(timings):
    small = weights_in_cache(128 << 10, CPU, "cached")
    assert (small.chosen, small.speedups) == (IN_CACHE, {}) and "L2" in small.source
    large = weights_in_cache(1 << 20, CPU, "cached")  # half the last level: too close to call, timed as streamed
    assert (large.chosen, large.speedups) == (STREAMED, {}) and "last-level" in large.source
    assert weights_in_cache(512 << 10, CPU, "off").source == "tuning off"
    assert not timings


def test_between_them_it_is_measured_once_and_every_later_process_reads_the_same_answer(timings):
    first = weights_in_cache(512 << 10, CPU, "cached")
    assert first.source == "measured" and first.chosen in (STREAMED, IN_CACHE) and set(first.speedups) == {IN_CACHE}
    again = weights_in_cache(512 << 10, CPU, "cached")
    assert (again.chosen, again.speedups, again.source) == (first.chosen, first.speedups, "cached")
    assert timings == [(STREAMED, IN_CACHE)]
    assert weights_in_cache(512 << 10, CPU, "remeasure").source == "measured" and len(timings) == 2
    assert "matmul weights between steps" in str(first)


@pytest.mark.parametrize("speedup, chosen", [(1 + RESIDENT_MARGIN + 0.5, IN_CACHE), (1 + RESIDENT_MARGIN - 0.2, STREAMED)])
def test_only_rereads_clearly_faster_than_memory_count_as_in_cache(monkeypatch, speedup, chosen):
    monkeypatch.setattr(tuner, "time_candidates", lambda candidates, probes, repeats=5: {IN_CACHE: speedup})
    assert weights_in_cache(512 << 10, CPU, "remeasure").chosen == chosen


@pytest.mark.parametrize("resident, timed", [(IN_CACHE, False), (STREAMED, True)])
def test_the_matmul_plan_times_its_forms_only_for_streamed_weights(monkeypatch, resident, timed):
    monkeypatch.setattr(matmul_plan, "weights_in_cache",
                        lambda nbytes, cpu, tuning: tuner.untimed(resident, "said so").about(cache_residency.SUBJECT))
    monkeypatch.setattr(CpuInfo, "read", classmethod(lambda cls: CPU))
    plan = MatmulPlan()
    plan.measure([torch.randn(64, 32), torch.randn(64, 32)], repeats=1)
    assert bool(plan.forms) is timed and plan.residency.chosen == resident
    assert f"matmul weights between steps: {resident} (said so)" in plan.summary()


def test_cpu_info_reads_a_per_core_cache_no_larger_than_the_last_level():
    info = CpuInfo.read()
    assert 0 < info.l2_cache_bytes <= info.last_level_cache_bytes
