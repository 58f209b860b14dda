"""`MatmulPlan`: which of four equal matmul forms each CPU linear layer uses, chosen by timing them.

A decode step multiplies a few rows x (rows, in) by each weight W (out, in); matmul_forms.py holds four
ways to compute the same y: LINEAR (F.linear), WEIGHT_LEFT ((W x^T)^T), PACKED (oneDNN's prepacked
weight) and SKINNY (minivllm's own few-row kernel).

Which one is faster is a property of the machine, not of the maths. On 2 AMD EPYC cores WEIGHT_LEFT
streams fp32 weights 1.5-3x faster for 1-4 rows (about even above) and PACKED is 1.2-1.6x faster
than F.linear in bf16 at every row count (plain bf16 F.linear made bf16 decode slower than fp32); on
an Intel Xeon Sapphire Rapids (AMX) WEIGHT_LEFT made single-stream decode 2x slower (10.8 tok/s
against 22.9 with F.linear). SKINNY streamed the weights of a bf16 model 1.85x faster than PACKED
for one row and 1.15x for 16 (fp32: 1.4x and even), on 2 AMD EPYC cores. So nothing is assumed:
`measure` times the forms on the machine at hand and keeps the fastest per `MatmulKey` (out_features,
in_features, dtype, row bucket), through the tuner (tuner.py), which caches the plan per machine and
per set of weight shapes: later starts read it back and time nothing. `summary()` says what was
chosen, why, and whether it was measured now or read from the cache.

Invariants:
  * Unmeasured means LINEAR. No warm-up, tuning='off', a GPU, or weights that fit in one core's L2
    (microsecond products: timing them would measure the other processes more than the forms):
    `form_for` answers LINEAR.
  * Weights larger than that are timed, whether or not they stay in the last-level cache between steps.
    Staying in cache does not make the forms equal: on a Sapphire Rapids guest whose 56 MiB of bf16
    weights did stay in its L3, F.linear still re-laid each plain bf16 weight out for the AMX tiles on
    every call, and PACKED (laid out once) was 1.1-1.7x faster at 5-64 rows, SKINNY 1.8-3.0x at one
    row; a rule that skipped the timing for cached weights left that bf16 throughput on the table.
  * Prefill-sized products (more than 64 rows) are one bucket, timed at 65 and 512 rows and used for
    every larger count too: there the forms compete on compute, not on streaming, and PACKED was
    1.08-1.31x faster than F.linear in fp32 at those two ends, within 5 % in bf16 (2 AMD EPYC cores).
    Only LINEAR and PACKED are timed there (WEIGHT_LEFT and SKINNY are for skinny products), on one weight per
    shape: a product that size is bound by compute, not by streaming the weight. Weights that only
    ever multiply sampled rows (`decode_only`: the LM head) are not timed there, and neither is a
    dtype oneDNN cannot pack (fp16): those keep LINEAR, shown as "not timed".
  * Another form must beat LINEAR by `MARGIN` at BOTH ends of a bucket (e.g. 17 and 32 rows), so one
    lucky row count cannot make a whole bucket slow; ties and noise keep the default.
  * A packed copy is kept (as `weight.packed`, and `weight.skinny` for SKINNY's layout) only for the
    weights of a shape that form won in some bucket; the plain weight stays too (the other buckets,
    the tied embedding), so such a layer holds its weight two or three times in RAM, though a step
    streams only one of them.
  * SKINNY is timed only where its kernel could be built on this machine (`load_cpu_kernels`, said in
    `summary()`), and only for shapes it can lay out (fp32, or bf16 with an even in_features; not
    fp16): without a compiler the plan chooses among the other three.
  * Timing runs over the model's own weights in forward order (the first layers, at least 2x the
    last-level cache, plus one weight of every other shape): a memory-bound matmul timed on one
    weight that sits in cache looks several times faster than it runs in a model, and the
    comparison would be between two wrong numbers.
  * The plan belongs to one model (`LlamaForCausalLM.matmul_plan`, handed to each of its `Linear`
    modules), so what a plan says is what its model does. The tuning cache holds its decisions by
    the timed weights' shapes, so another model of the same shapes on this machine reads the same
    plan: the timing depends on the shapes, not on the values.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.kernels.skinny_gemm import can_pack_skinny
from minivllm.layers.cpu_info import CpuInfo  # also imported from here (quantization.py, engine/loading.py)
from minivllm.layers.matmul_forms import MatmulForm, Product, bound_product, can_pack, matmul, pack, pack_skinny
from minivllm.layers.tuner import MARGIN, Tuning, choose_many


class RowBucket(NamedTuple):
    lo: int
    hi: int

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


# 17-32 and 33-64 apart: a batch of 17-32 decode rows is common (the bench workload spends most steps
# there), and on a Xeon guest fp32 packed/skinny won at 17 rows but not at 64, so one 17-64 bucket kept F.linear.
ROW_BUCKETS = (RowBucket(1, 1), RowBucket(2, 4), RowBucket(5, 16), RowBucket(17, 32), RowBucket(33, 64),
               RowBucket(65, 512))
PREFILL_BUCKET = ROW_BUCKETS[-1]  # prefill-sized products (see the module docstring)


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


@dataclass
class MatmulPlan:
    """The chosen form per `MatmulKey`, filled by `measure`; every `linear` asks `product` for its bound form."""

    forms: dict[MatmulKey, MatmulForm] = field(default_factory=dict)
    speedups: dict[MatmulKey, float] = field(default_factory=dict)  # LINEAR time / fastest other form's
    measured_with_threads: int | None = None  # None: not measured (yet)
    weight_bytes: int = 0  # of the weights `measure` was given
    source: str = "not measured"  # "measured", "cached" (by an earlier process), "tuning off" or "fits in L2"
    l2_cache_bytes: int = 0  # the per-core cache the weights were held against (below it nothing is timed)
    # (id(weight), id(bias), rows) -> (weight, bias, the bound product), for decode-sized row counts
    # (`product`). Valid for the `forms` dict it was bound from: replacing `forms` (measure does; so may a
    # benchmark) rebinds; changing it in place does not.
    _bound: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor | None, Product]] = field(
        default_factory=dict, repr=False, compare=False)
    _bound_from: dict[MatmulKey, MatmulForm] | None = field(default=None, repr=False, compare=False)

    def form_for(self, weight: torch.Tensor, rows: int) -> MatmulForm:
        key = MatmulKey(weight.shape[0], weight.shape[1], weight.dtype, row_bucket(rows))
        return self.forms.get(key, MatmulForm.LINEAR)

    def product(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> Product:
        """The product `linear` runs for `rows` rows of x times this weight, in the chosen form, bound once per
        (weight, rows) up to 64 rows: a single-stream forward ran 3-5 % faster (docs/guides/benchmarks.md).
        Larger products are bound per call (the kernel dominates; a prefill has too many row counts)."""
        if self._bound_from is not self.forms:
            self._bound, self._bound_from = {}, self.forms
        key = (id(weight), id(bias), rows)
        entry = self._bound.get(key)
        if entry is not None:  # it holds its weight and bias alive, so no other tensor can have their ids
            return entry[2]
        form = self.form_for(weight, rows) if weight.device.type == "cpu" else MatmulForm.LINEAR
        bound = bound_product(weight, bias, form)
        if rows <= ROW_BUCKETS[-2].hi:
            self._bound[key] = (weight, bias, bound)
        return bound

    @torch.inference_mode()
    def measure(self, weights: list[torch.Tensor], repeats: int = 5, cache_bytes: int | None = None,
                decode_only: tuple[torch.Tensor, ...] = (), tuning: Tuning = "cached") -> None:
        """Time the forms over `weights` (the model's, in forward order) for each bucket and keep the
        fastest, through the tuner (tuner.py: with tuning='cached' a plan measured before for these
        weights' shapes on this machine is read back, nothing timed; 'off' keeps LINEAR). CPU weights
        only: on a GPU the plan stays empty (LINEAR). Weights that fit in one core's L2 (`cache_bytes`,
        read from /sys unless given: tests pass 0 to time tiny weights) are not timed and keep LINEAR.
        Weights in `decode_only` (the LM head: it multiplies sampled rows, a few per request) are not
        timed at prefill sizes."""
        weights = [w for w in weights if w.device.type == "cpu" and w.dim() == 2]
        if not weights:
            return
        self.weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        self.forms, self.speedups = {}, {}
        cpu = CpuInfo.read()
        self.l2_cache_bytes = cpu.l2_cache_bytes if cache_bytes is None else cache_bytes
        self.source = "tuning off" if tuning == "off" else "fits in L2"
        if tuning != "off" and self.weight_bytes > self.l2_cache_bytes:
            # Time over at least twice the reported last level (or every weight, if the model is smaller):
            # between two timings of one weight the others pass through the cache, as in a real step.
            sample = _cache_flushing_sample(weights, 2 * max(cpu.last_level_cache_bytes, self.l2_cache_bytes))
            skinny_built = load_cpu_kernels().available
            decode_shapes = {_shape(w) for w in decode_only}
            shapes = list(dict.fromkeys(_shape(w) for w in sample))
            names = {_name(MatmulKey(*shape, bucket)): MatmulKey(*shape, bucket)
                     for shape in shapes for bucket in ROW_BUCKETS}
            entry = (f"matmul {len(sample)} of {len(weights)} weights ({self.weight_bytes} bytes), shapes "
                     f"{', '.join(map(_shape_text, shapes))}; decode-only {sorted(map(_shape_text, decode_shapes))}; "
                     f"skinny {'built' if skinny_built else 'not built'}; repeats {repeats}; "
                     f"row buckets {' '.join(map(str, ROW_BUCKETS))}")  # another bucketing: another entry
            measure = lambda: _measure_speedups(sample, decode_only, skinny_built, repeats, names)  # noqa: E731
            for name, choice in choose_many(entry, MatmulForm.LINEAR.value, measure, tuning, MARGIN).items():
                key = names[name]
                self.forms[key] = MatmulForm(choice.chosen)
                self.speedups[key] = max(choice.speedups.values())
                self.source = choice.source
        for form, attr, make in ((MatmulForm.PACKED, "packed", pack), (MatmulForm.SKINNY, "skinny", pack_skinny)):
            shapes_in_form = {(k.out_features, k.in_features, k.dtype) for k, f in self.forms.items() if f is form}
            for w in weights:  # every weight of a shape that runs in this form somewhere, and no other
                if _shape(w) in shapes_in_form:
                    if getattr(w, attr, None) is None:
                        make(w)
                elif getattr(w, attr, None) is not None:
                    delattr(w, attr)
        self.measured_with_threads = torch.get_num_threads()

    def summary(self) -> str:
        """The CPU, then one line per weight shape: the form chosen per row bucket and its speed-up."""
        cpu = CpuInfo.read()
        everywhere = f"matmul: {MatmulForm.LINEAR.value} (F.linear) everywhere"
        if self.measured_with_threads is None:
            return f"{cpu}\n{everywhere} (not measured: no CPU warm-up)"
        if self.source == "tuning off":
            return f"{cpu}\n{everywhere} (tuning off: the fixed rule, nothing timed)"
        sizes = f"weights {self.weight_bytes / 2**20:.1f} MiB"
        if not self.forms:
            return (f"{cpu}\n{everywhere}: nothing timed ({sizes}, within one core's L2 of "
                    f"{self.l2_cache_bytes >> 10} KiB)")
        lines = [str(cpu), sizes,
                 f"matmul form by measurement ({self.source}, {self.measured_with_threads} threads; above "
                 f"{ROW_BUCKETS[-1].hi} rows as at {ROW_BUCKETS[-1]}); speed-up = time of "
                 f"{MatmulForm.LINEAR.value} / time of the fastest other form ({MatmulForm.WEIGHT_LEFT.value}, "
                 f"{MatmulForm.PACKED.value}: oneDNN's prepacked weight, or {MatmulForm.SKINNY.value}: "
                 f"minivllm's kernel, {load_cpu_kernels().detail})",
                 "  weight (out x in)".ljust(26) + "".join(f"rows {b}".ljust(22) for b in ROW_BUCKETS)]
        for out_f, in_f, dtype in dict.fromkeys((k.out_features, k.in_features, k.dtype) for k in self.forms):
            keys = [MatmulKey(out_f, in_f, dtype, bucket) for bucket in ROW_BUCKETS]
            cells = "".join((f"{self.forms[k].value} {self.speedups[k]:.2f}x" if k in self.forms
                             else "not timed").ljust(22) for k in keys)
            lines.append(f"  {out_f} x {in_f} {str(dtype).removeprefix('torch.')}".ljust(26) + cells)
        return "\n".join(lines)


def _shape(w: torch.Tensor) -> tuple[int, int, torch.dtype]:
    return w.shape[0], w.shape[1], w.dtype


def _shape_text(shape: tuple[int, int, torch.dtype]) -> str:
    return f"{shape[0]} x {shape[1]} {str(shape[2]).removeprefix('torch.')}"


def _name(key: MatmulKey) -> str:
    """A key as the tuning cache names it, e.g. "576 x 1536 bfloat16 rows 2-4"."""
    return f"{_shape_text((key.out_features, key.in_features, key.dtype))} rows {key.bucket}"


def _measure_speedups(sample: list[torch.Tensor], decode_only: tuple[torch.Tensor, ...], skinny_built: bool,
                      repeats: int, names: dict[str, MatmulKey]) -> dict[str, dict[str, float]]:
    """Per key's name, per form but LINEAR: LINEAR time / that form's time, the worse of the bucket's two ends."""
    for w in sample:
        if can_pack(w):
            pack(w)
        if skinny_built and can_pack_skinny(w):
            pack_skinny(w)
    # Prefill-sized products are compute-bound (65+ FLOPs per weight byte): whether the weight was
    # in cache barely matters, so one weight per shape is timed there, not the cache-flushing pass.
    skip = {id(w) for w in decode_only}
    one_per_shape = list({_shape(w): w for w in sample
                          if id(w) not in skip and getattr(w, "packed", None) is not None}.values())
    speedups: dict[str, dict[str, float]] = {}
    for bucket in ROW_BUCKETS:
        prefill = bucket is PREFILL_BUCKET
        forms = (MatmulForm.LINEAR, MatmulForm.PACKED) if prefill else tuple(MatmulForm)
        timed_weights = one_per_shape if prefill else sample
        if not timed_weights:
            continue
        for rows in sorted({bucket.lo, bucket.hi}):
            for shape, times in _time_forms(timed_weights, rows, repeats, forms).items():
                worst = speedups.setdefault(_name(MatmulKey(*shape, bucket)), {})
                for form, t in times.items():
                    if form is not MatmulForm.LINEAR:
                        worst[form.value] = min(worst.get(form.value, math.inf), times[MatmulForm.LINEAR] / t)
    assert speedups.keys() <= names.keys(), "a timed key the plan cannot name"
    return speedups


def _cache_flushing_sample(weights: list[torch.Tensor], min_bytes: int) -> list[torch.Tensor]:
    """The weights to time, in forward order: the first ones until they hold `min_bytes`, then the
    first of any shape not met yet (the LM head). A pass reads them all, so between two timings of one
    weight at least `min_bytes` of others go through the cache and it has been evicted, as it is
    when the model runs (a model smaller than that does sit in cache, in its real runs too)."""
    sample, held, shapes = [], 0, set()
    for w in weights:
        shape = (w.shape[0], w.shape[1], w.dtype)
        if held < min_bytes or shape not in shapes:
            sample.append(w)
            held += w.numel() * w.element_size()
            shapes.add(shape)
    return sample


def _time_forms(weights: list[torch.Tensor], rows: int, repeats: int,
                forms: tuple[MatmulForm, ...] = tuple(MatmulForm)) -> dict[tuple, dict[MatmulForm, float]]:
    """Per (out, in, dtype): the best of `repeats` passes of the summed time of its weights, per form
    of `forms` (PACKED only for weights `pack` has packed). Passes alternate between the forms, so
    drift in the machine hits them all alike."""
    xs = {(w.shape[1], w.dtype): torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    packed = all(getattr(w, "packed", None) is not None for w in weights)
    forms = [f for f in forms if packed or f is not MatmulForm.PACKED]

    def runs(w: torch.Tensor, form: MatmulForm) -> bool:  # SKINNY only where its layout could be made
        return form is not MatmulForm.SKINNY or getattr(w, "skinny", None) is not None

    for w in {(w.shape[0], w.shape[1], w.dtype): w for w in weights}.values():  # first calls: set-up costs
        for form in forms:
            if runs(w, form):
                matmul(xs[w.shape[1], w.dtype], w, form)
    best: dict[tuple, dict[MatmulForm, float]] = {}
    for _ in range(repeats):
        for form in forms:
            pass_time: dict[tuple, float] = {}
            for w in weights:
                if not runs(w, form):
                    continue
                shape = (w.shape[0], w.shape[1], w.dtype)
                t0 = time.perf_counter()
                matmul(xs[w.shape[1], w.dtype], w, form)
                pass_time[shape] = pass_time.get(shape, 0.0) + time.perf_counter() - t0
            for shape, t in pass_time.items():
                times = best.setdefault(shape, {})
                times[form] = min(times.get(form, math.inf), t)
    return best
