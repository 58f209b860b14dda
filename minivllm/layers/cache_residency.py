"""Do a model's weights stay in this CPU's cache from one decode step to the next? Measured, not assumed.

The matmul plan (matmul_plan.py) times its forms only for weights that stream from memory: weights that
stay in cache have nothing to stream faster, and timing microsecond products on a shared machine
measures the other processes more than the forms. Which weights stay in cache used to be read from
/sys (the last-level cache's size). On a virtual machine that number can be the host's: a 2-vCPU KVM
guest on a Sapphire Rapids Xeon reports the host's shared 300 MiB L3, so SmolLM2's 257 MiB of bf16
weights "fit", every product stayed F.linear, and minivllm's skinny kernel, which streamed the same
weights 8x faster on that guest, was never tried. So the size is only trusted in the two clear cases:

    weights <= the per-core cache (L2)          in cache: nothing timed
    weights >= half the reported last level     streamed: the forms are timed
    in between                                  the probe below decides, once per machine (the tuner's cache)

Half, because the two mistakes cost differently: timing forms for weights that do stay in cache costs
a few seconds once per machine, while skipping the timing for weights that stream runs every product
through F.linear for good. So the probe only ever looks at weights that leave room for its k >= 5
re-reads to show a cache (with k = 3, one miss in three re-reads capped a true hit near 1.5x, and a
burst of other jobs made 257 MiB read "1.53x faster" once on a loaded 2-vCPU guest).

The probe reads the same bytes in the same number of same-sized `sum()` calls two ways, alternating
(tuner.time_candidates), so only where the bytes come from differs:

    "streamed"  k weight-sized slices of one buffer, each once (k x weights >= 2 x the reported
                last-level cache, so no slice is still cached when it is read again; k >= 5)
    "in cache"  one weight-sized buffer k times, which stays in cache if the weights would

Both on one thread: on a loaded 2-core machine every parallel op waits for its slower thread, and that
wait, not the cache, decided a 2-thread probe (one core's L2 is all a single thread leaves out).

If the weight-sized re-reads are faster by more than `RESIDENT_MARGIN`, the weights count as in cache.
The answer goes through the tuner, so it is cached per machine and a later process reads it back: the
same run then times (or skips) the same forms, and reads the same matmul plan back, in every process.
"""

from __future__ import annotations

import math

import torch

from minivllm.layers.cpu_info import CpuInfo
from minivllm.layers.tuner import Choice, Probe, Tuning, choose, untimed

STREAMED, IN_CACHE = "streamed", "in cache"
SUBJECT = "matmul weights between steps"
RESIDENT_MARGIN = 0.5  # re-reading must be 1.5x faster than memory: a cache hit is, noise is not


def weights_in_cache(weight_bytes: int, cpu: CpuInfo, tuning: Tuning) -> Choice:
    """Whether `weight_bytes` of weights stay in this CPU's cache between passes (`chosen` is IN_CACHE),
    and why: sized by /sys in the clear cases, else measured by the probe (module docstring)."""
    if weight_bytes <= cpu.l2_cache_bytes:
        return untimed(IN_CACHE, f"within one core's L2 ({cpu.l2_cache_bytes >> 10} KiB)").about(SUBJECT)
    if 2 * weight_bytes >= cpu.last_level_cache_bytes:
        llc = f"{cpu.last_level_cache_bytes >> 20} MiB"
        return untimed(STREAMED, f"at least half the last-level cache ({llc})").about(SUBJECT)
    if tuning == "off":
        return untimed(IN_CACHE, "tuning off").about(SUBJECT)
    k = math.ceil(2 * cpu.last_level_cache_bytes / weight_bytes)  # > 4: weights < half the last level
    elements = weight_bytes // 4

    def probes() -> list[Probe]:
        weights_sized = torch.ones(elements)  # (weight_bytes / 4,) float32
        memory_sized = torch.ones(k, elements)  # (k, weight_bytes / 4) float32: first touch here, not timed

        def probe(name: str) -> None:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                for i in range(k):
                    (memory_sized[i] if name == STREAMED else weights_sized).sum()
            finally:
                torch.set_num_threads(threads)
        return [probe]

    entry = f"weights in cache: {weight_bytes} bytes read {k} times vs {k} such slices of {k * elements * 4} bytes"
    choice = choose(entry, (STREAMED, IN_CACHE), probes, tuning, RESIDENT_MARGIN, repeats=5)
    return choice.about(SUBJECT, f"{weight_bytes >> 20} MiB x {k}")
