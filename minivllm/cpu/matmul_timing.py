"""Timing the matmul forms over a model's weights: the row buckets and keys a `MatmulPlan` decides by,
which forms each key is a contest between on this CPU, and the timing pass itself.

`MatmulPlan.measure` (matmul_plan.py, whose docstring gives the policy: which buckets, which weights,
which margin) asks the tuner; the tuner calls `measure_speedups` when the cache has no usable entry.

Invariants:
  * `form_candidates` and `measure_speedups` agree by construction: both ask `can_pack` (with the
    CpuInfo) and `can_pack_skinny` of each shape, and a form is timed on a weight only where its copy
    could be made. The tuner holds a cached entry to the same candidates, so a choice timed where a
    form ran (oneDNN's bf16 path on an AVX-512 CPU) is never replayed where it cannot (an AVX2 one).
  * A form the CPU cannot run is never called, not even once to see whether it raises.
  * Each key's contest has a default (matmul_forms.py `default_form`: LINEAR, or WIDENED for bf16 where
    oneDNN cannot take it from 5 rows), listed first; a speed-up is the default's time over a form's.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from minivllm.kernels.skinny_gemm import can_pack_skinny
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.cpu.matmul_forms import MatmulForm, can_pack, default_form, matmul, pack, pack_skinny, widens


class RowBucket(NamedTuple):
    lo: int
    hi: int

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


# 17-32 and 33-64 apart: a batch of 17-32 decode rows is common (the bench workload spends most steps
# there), and on a Xeon guest fp32 packed/skinny won at 17 rows but not at 64, so one 17-64 bucket kept F.linear.
ROW_BUCKETS = (RowBucket(1, 1), RowBucket(2, 4), RowBucket(5, 16), RowBucket(17, 32), RowBucket(33, 64),
               RowBucket(65, 512))
PREFILL_BUCKET = ROW_BUCKETS[-1]  # prefill-sized products (see matmul_plan.py's docstring)

Shape = tuple[int, int, torch.dtype]  # (out_features, in_features, dtype) of a weight


def row_bucket(rows: int) -> RowBucket:
    """The bucket holding `rows`; above the last one, the last (prefill-sized) bucket."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket.hi:
            return bucket
    return ROW_BUCKETS[-1]


class MatmulKey(NamedTuple):
    out_features: int
    in_features: int
    dtype: torch.dtype
    bucket: RowBucket


def shape_of(w: torch.Tensor) -> Shape:
    return w.shape[0], w.shape[1], w.dtype


def shape_text(shape: Shape) -> str:
    return f"{shape[0]} x {shape[1]} {str(shape[2]).removeprefix('torch.')}"


def key_name(key: MatmulKey) -> str:
    """A key as the tuning cache names it, e.g. "576 x 1536 bfloat16 rows 2-4"."""
    return f"{shape_text((key.out_features, key.in_features, key.dtype))} rows {key.bucket}"


def form_candidates(sample: list[torch.Tensor], decode_only: tuple[torch.Tensor, ...], cpu: CpuInfo,
                    skinny_built: bool) -> dict[str, tuple[str, ...]]:
    """Per key's name, for every shape of `sample` in every bucket: the forms `measure_speedups` times
    there on `cpu`, the default first (alone: the key is not timed). Decode buckets: LINEAR and
    WEIGHT_LEFT, PACKED where oneDNN packs this dtype on this CPU, WIDENED where it cannot take bf16,
    SKINNY where the kernel is built and lays the shape out. The prefill bucket: the default and PACKED,
    for shapes with a packable weight that is not decode-only (bf16 F.linear is not timed where it
    widens: 3-4.5x slower there, it would only lengthen the start)."""
    skip = {id(w) for w in decode_only}
    firsts = {shape_of(w): w for w in reversed(sample)}  # one weight of each shape (all alike in dtype)
    prefill_shapes = {shape_of(w) for w in sample if id(w) not in skip}
    names: dict[str, tuple[str, ...]] = {}
    for shape, w in firsts.items():
        packs, skinny = can_pack(w, cpu), skinny_built and can_pack_skinny(w)
        for bucket in ROW_BUCKETS:
            default = default_form(w.dtype, cpu, bucket.lo)
            if bucket is PREFILL_BUCKET:
                others = [MatmulForm.PACKED] * (packs and shape in prefill_shapes)
            else:
                others = [MatmulForm.LINEAR, MatmulForm.WEIGHT_LEFT] + [MatmulForm.PACKED] * packs + \
                         [MatmulForm.WIDENED] * widens(w.dtype, cpu) + [MatmulForm.SKINNY] * skinny
            forms = [default] + [f for f in others if f is not default]
            names[key_name(MatmulKey(*shape, bucket))] = tuple(f.value for f in forms)
    return names


def measure_speedups(sample: list[torch.Tensor], decode_only: tuple[torch.Tensor, ...], cpu: CpuInfo,
                     skinny_built: bool, repeats: int) -> dict[str, dict[str, float]]:
    """Per key's name, per candidate but the default (`form_candidates`): the default's time / that form's
    time, the worse of the bucket's two ends. Copies are made only where `cpu` runs the form (`can_pack`:
    never oneDNN's bf16 reorder on a CPU whose torch would refuse it), and only forms with a copy are timed."""
    for w in sample:  # a copy for each form this CPU runs on w, and none left by a plan for another CPU
        for attr, make, runs in (("packed", pack, can_pack(w, cpu)),
                                 ("skinny", pack_skinny, skinny_built and can_pack_skinny(w))):
            if runs:
                make(w)
            elif getattr(w, attr, None) is not None:
                delattr(w, attr)
    candidates, skip = form_candidates(sample, decode_only, cpu, skinny_built), {id(w) for w in decode_only}
    speedups: dict[str, dict[str, float]] = {}
    for bucket in ROW_BUCKETS:
        contest = {shape: [MatmulForm(f) for f in candidates[key_name(MatmulKey(*shape, bucket))]]
                   for shape in {shape_of(w) for w in sample}}
        contest = {shape: forms for shape, forms in contest.items() if len(forms) > 1}  # the timed keys
        timed_weights = [w for w in sample if shape_of(w) in contest]
        # Prefill-sized products are compute-bound (65+ FLOPs per weight byte): whether the weight was in
        # cache barely matters, so one weight per shape is timed there (never a decode-only one).
        if bucket is PREFILL_BUCKET:
            timed_weights = list({shape_of(w): w for w in timed_weights if id(w) not in skip}.values())
        if not timed_weights:
            continue
        forms = tuple(f for f in MatmulForm if any(f in fs for fs in contest.values()))
        for rows in sorted({bucket.lo, bucket.hi}):
            for shape, times in time_forms(timed_weights, rows, repeats, forms).items():
                worst = speedups.setdefault(key_name(MatmulKey(*shape, bucket)), {})
                default, *others = contest[shape]
                for form in others:
                    worst[form.value] = min(worst.get(form.value, math.inf), times[default] / times[form])
    return speedups


def cache_flushing_sample(weights: list[torch.Tensor], min_bytes: int) -> list[torch.Tensor]:
    """The weights to time, in forward order: the first ones until they hold `min_bytes`, then the
    first of any shape not met yet (the LM head). A pass reads them all, so between two timings of one
    weight at least `min_bytes` of others go through the cache and it has been evicted, as it is
    when the model runs (a model smaller than that does sit in cache, in its real runs too)."""
    sample, held, shapes = [], 0, set()
    for w in weights:
        if held < min_bytes or shape_of(w) not in shapes:
            sample.append(w)
            held += w.numel() * w.element_size()
            shapes.add(shape_of(w))
    return sample


def time_forms(weights: list[torch.Tensor], rows: int, repeats: int,
               forms: tuple[MatmulForm, ...] = tuple(MatmulForm)) -> dict[Shape, dict[MatmulForm, float]]:
    """Per (out, in, dtype): the best of `repeats` passes of the summed time of its weights, per form
    of `forms` that runs on them (PACKED and SKINNY only on weights with their copy). Passes alternate
    between the forms, so drift in the machine hits them all alike."""
    xs = {(w.shape[1], w.dtype): torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    copies = {MatmulForm.PACKED: "packed", MatmulForm.SKINNY: "skinny"}

    def runs(w: torch.Tensor, form: MatmulForm) -> bool:  # a copied form only where its copy could be made
        return form not in copies or getattr(w, copies[form], None) is not None

    for w in {shape_of(w): w for w in weights}.values():  # first calls: set-up costs
        for form in forms:
            if runs(w, form):
                matmul(xs[w.shape[1], w.dtype], w, form)
    best: dict[Shape, dict[MatmulForm, float]] = {}
    for _ in range(repeats):
        for form in forms:
            pass_time: dict[Shape, float] = {}
            for w in weights:
                if not runs(w, form):
                    continue
                t0 = time.perf_counter()
                matmul(xs[w.shape[1], w.dtype], w, form)
                pass_time[shape_of(w)] = pass_time.get(shape_of(w), 0.0) + time.perf_counter() - t0
            for shape, t in pass_time.items():
                times = best.setdefault(shape, {})
                times[form] = min(times.get(form, math.inf), t)
    return best
