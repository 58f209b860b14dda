"""`MatmulPlan`: which of five equal matmul forms each CPU linear layer uses, chosen by timing them.

A decode step multiplies a few rows x (rows, in) by each weight W (out, in); matmul_forms.py holds five
ways to compute the same y: LINEAR (F.linear), WEIGHT_LEFT ((W x^T)^T), PACKED (oneDNN's prepacked
weight), SKINNY (minivllm's own few-row kernel) and WIDENED (bf16 widened to fp32 for MKL's GEMM).

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
  * Unmeasured means the default form (matmul_forms.py `default_form`): LINEAR, except bf16 on a CPU
    where oneDNN cannot take bf16 (AVX2-only), where it is WIDENED from 5 rows (torch's own bf16 GEMM is
    3-4.5x slower there). tuning='off', weights that fit in one core's L2 (microsecond products: timing
    them would measure the other processes more than the forms), or a bucket nothing competes in:
    `form_for` answers the default. (No warm-up, or a GPU: the layers run F.linear, no plan at all.)
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
    dtype oneDNN cannot pack (fp16, and bf16 where torch refuses oneDNN's bf16 path): those keep
    the default (LINEAR; WIDENED for such bf16), shown as "not timed".
  * PACKED is tried only where the CPU runs it, read from its flags (`can_pack` with the `CpuInfo`:
    bf16 needs what torch's guard needs, AVX-512 BW+VL+DQ or AVX-NE-CONVERT; an AVX2-only CPU has
    neither), never by calling it to see whether it raises. A cached entry is held to the same
    candidates (matmul_timing.py `form_candidates`): one that names another form is measured again.
  * Another form must beat the default by `MARGIN` at BOTH ends of a bucket (e.g. 17 and 32 rows), so one
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

from dataclasses import dataclass, field

import torch

from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.cpu.cpu_info import CpuInfo  # also imported from here (layers/quantization.py, engine/worker/loading.py)
from minivllm.cpu.matmul_forms import (WIDENED_FROM_ROWS, MatmulForm, Product, bound_product, default_form, pack,
                                       pack_skinny, widens)
from minivllm.cpu.matmul_timing import (  # noqa: F401 (ROW_BUCKETS, PREFILL_BUCKET, row_bucket: re-exported)
    PREFILL_BUCKET, ROW_BUCKETS, MatmulKey, RowBucket, cache_flushing_sample, form_candidates, key_name,
    measure_speedups, row_bucket, shape_of, shape_text)
from minivllm.cpu.tuner import MARGIN, Tuning, choose_many


@dataclass
class MatmulPlan:
    """The chosen form per `MatmulKey`, filled by `measure`; every `linear` asks `product` for its bound form."""

    forms: dict[MatmulKey, MatmulForm] = field(default_factory=dict)
    speedups: dict[MatmulKey, float] = field(default_factory=dict)  # the default's time / fastest other form's
    measured_with_threads: int | None = None  # None: not measured (yet)
    weight_bytes: int = 0  # of the weights `measure` was given
    source: str = "not measured"  # "measured", "cached" (by an earlier process), "tuning off" or "fits in L2"
    l2_cache_bytes: int = 0  # the per-core cache the weights were held against (below it nothing is timed)
    # What `measure` was told of the CPU (which forms run, the default form); None: read when first needed.
    cpu: CpuInfo | None = None
    dtypes: tuple[torch.dtype, ...] = ()  # of the weights `measure` was given (for `summary`)
    # (id(weight), id(bias), rows) -> (weight, bias, the bound product), for decode-sized row counts
    # (`product`). Valid for the `forms` dict it was bound from: replacing `forms` (measure does; so may a
    # benchmark) rebinds; changing it in place does not.
    _bound: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor | None, Product]] = field(
        default_factory=dict, repr=False, compare=False)
    _bound_from: dict[MatmulKey, MatmulForm] | None = field(default=None, repr=False, compare=False)

    def form_for(self, weight: torch.Tensor, rows: int) -> MatmulForm:
        """The measured form for this weight's shape at `rows`, else the default form on this CPU."""
        key = MatmulKey(weight.shape[0], weight.shape[1], weight.dtype, row_bucket(rows))
        form = self.forms.get(key)
        if form is None:
            if self.cpu is None:  # an unmeasured plan: read once, not on every prefill-sized call
                self.cpu = CpuInfo.read()
            form = default_form(weight.dtype, self.cpu, rows)
        return form

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
                decode_only: tuple[torch.Tensor, ...] = (), tuning: Tuning = "cached",
                cpu: CpuInfo | None = None) -> None:
        """Time the forms over `weights` (the model's, in forward order) for each bucket and keep the
        fastest, through the tuner (tuner.py: with tuning='cached' a plan measured before for these
        weights' shapes on this machine is read back, nothing timed; 'off' keeps LINEAR). CPU weights
        only: on a GPU the plan stays empty (LINEAR). Weights that fit in one core's L2 (`cache_bytes`,
        read from /sys unless given: tests pass 0 to time tiny weights) are not timed and keep LINEAR.
        Weights in `decode_only` (the LM head: it multiplies sampled rows, a few per request) are not
        timed at prefill sizes. `cpu` (default: this one, read now) says which forms can run at all."""
        weights = [w for w in weights if w.device.type == "cpu" and w.dim() == 2]
        if not weights:
            return
        self.weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        self.dtypes = tuple(dict.fromkeys(w.dtype for w in weights))
        self.forms, self.speedups = {}, {}
        self.cpu = cpu = CpuInfo.read() if cpu is None else cpu
        self.l2_cache_bytes = cpu.l2_cache_bytes if cache_bytes is None else cache_bytes
        self.source = "tuning off" if tuning == "off" else "fits in L2"
        if tuning != "off" and self.weight_bytes > self.l2_cache_bytes:
            # Time over at least twice the reported last level (or every weight, if the model is smaller):
            # between two timings of one weight the others pass through the cache, as in a real step.
            sample = cache_flushing_sample(weights, 2 * max(cpu.last_level_cache_bytes, self.l2_cache_bytes))
            skinny_built = load_cpu_kernels().available
            decode_shapes = {shape_of(w) for w in decode_only}
            shapes = list(dict.fromkeys(shape_of(w) for w in sample))
            names = {key_name(MatmulKey(*shape, bucket)): MatmulKey(*shape, bucket)
                     for shape in shapes for bucket in ROW_BUCKETS}
            entry = (f"matmul {len(sample)} of {len(weights)} weights ({self.weight_bytes} bytes), shapes "
                     f"{', '.join(map(shape_text, shapes))}; decode-only {sorted(map(shape_text, decode_shapes))}; "
                     f"skinny {'built' if skinny_built else 'not built'}; repeats {repeats}; "
                     f"row buckets {' '.join(map(str, ROW_BUCKETS))}")  # another bucketing: another entry
            measure = lambda: measure_speedups(sample, decode_only, cpu, skinny_built, repeats)  # noqa: E731
            # The candidates this CPU runs, per name: a cached entry that names others (timed where oneDNN
            # took bf16, now read where it cannot) is measured again, never replayed (tuner.py).
            candidates = form_candidates(sample, decode_only, cpu, skinny_built)
            for name, choice in choose_many(entry, measure, tuning, MARGIN, candidates=candidates).items():
                key = names[name]
                self.forms[key] = MatmulForm(choice.chosen)
                self.speedups[key] = max(choice.speedups.values())
                self.source = choice.source
        for form, attr, make in ((MatmulForm.PACKED, "packed", pack), (MatmulForm.SKINNY, "skinny", pack_skinny)):
            shapes_in_form = {(k.out_features, k.in_features, k.dtype) for k, f in self.forms.items() if f is form}
            for w in weights:  # every weight of a shape that runs in this form somewhere, and no other
                if shape_of(w) in shapes_in_form:
                    if getattr(w, attr, None) is None:
                        make(w)
                elif getattr(w, attr, None) is not None:
                    delattr(w, attr)
        self.measured_with_threads = torch.get_num_threads()

    def summary(self) -> str:
        """The CPU, then one line per weight shape: the form chosen per row bucket and its speed-up."""
        cpu = self.cpu or CpuInfo.read()
        everywhere = f"matmul: {self._defaults(cpu)} everywhere"
        if self.measured_with_threads is None:
            return f"{cpu}\n{everywhere} (not measured: no CPU warm-up)"
        if self.source == "tuning off":
            return f"{cpu}\n{everywhere} (tuning off: the fixed rule, nothing timed)"
        sizes = f"weights {self.weight_bytes / 2**20:.1f} MiB"
        if not self.forms:
            return (f"{cpu}\n{everywhere}: nothing timed ({sizes}, within one core's L2 of "
                    f"{self.l2_cache_bytes >> 10} KiB)")
        widened = f"{MatmulForm.WIDENED.value}, " if any(widens(dtype, cpu) for dtype in self.dtypes) else ""
        lines = [str(cpu), sizes,
                 f"matmul form by measurement ({self.source}, {self.measured_with_threads} threads; above "
                 f"{ROW_BUCKETS[-1].hi} rows as at {ROW_BUCKETS[-1]}); speed-up = time of the default "
                 f"({self._defaults(cpu)}) / time of the fastest other form ({MatmulForm.WEIGHT_LEFT.value}, "
                 f"{MatmulForm.PACKED.value}: oneDNN's prepacked weight, {widened}or "
                 f"{MatmulForm.SKINNY.value}: minivllm's kernel, {load_cpu_kernels().detail})",
                 "  weight (out x in)".ljust(26) + "".join(f"rows {b}".ljust(22) for b in ROW_BUCKETS)]
        for out_f, in_f, dtype in dict.fromkeys((k.out_features, k.in_features, k.dtype) for k in self.forms):
            keys = [MatmulKey(out_f, in_f, dtype, bucket) for bucket in ROW_BUCKETS]
            cells = "".join((f"{self.forms[k].value} {self.speedups[k]:.2f}x" if k in self.forms
                             else "not timed").ljust(22) for k in keys)
            lines.append(f"  {out_f} x {in_f} {str(dtype).removeprefix('torch.')}".ljust(26) + cells)
        return "\n".join(lines)

    def _defaults(self, cpu: CpuInfo) -> str:
        """The default form in words: "x W^T (F.linear)", and where bf16 widens, from which row count."""
        text = f"{MatmulForm.LINEAR.value} (F.linear)"
        if any(widens(dtype, cpu) for dtype in self.dtypes):
            text += (f" at 1-{WIDENED_FROM_ROWS - 1} rows, {MatmulForm.WIDENED.value} from {WIDENED_FROM_ROWS} "
                     "(bf16 widened to fp32 for MKL's GEMM: oneDNN takes no bf16 here)")
        return text
