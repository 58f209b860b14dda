"""The CPU matmul plan: one form per weight shape and row bucket, chosen by timing the forms (where the
weights do not fit one core's L2) against a fixed default (F.linear, or bf16 widened to fp32 from 5 rows where
oneDNN takes no bf16); what the CPU reports; the plan the warm-up attaches. The forms themselves, and the
engine's tokens under each: test_matmul_forms.py."""

from __future__ import annotations

import json

import pytest
import torch

from minivllm import LLM
from minivllm.cpu import matmul_plan
from minivllm.cpu.attach import attached_plan
from minivllm.cpu.matmul_forms import WIDENED_FROM_ROWS, MatmulForm, can_pack, default_form, widened_linear
from minivllm.cpu.matmul_plan import MARGIN, PREFILL_BUCKET, ROW_BUCKETS, CpuInfo, MatmulKey, MatmulPlan, row_bucket
from minivllm.cpu.planned_linear import planned_linear
from minivllm.cpu.tuning_cache import TuningCache
from minivllm.layers.linear import Linear


AVX2_LAPTOP = CpuInfo("an AVX2 laptop", amx=False, avx512_bf16=False, last_level_cache_bytes=1 << 23, x86_64_v3=True)


def test_every_row_count_has_one_bucket_and_prefill_sizes_share_the_last():
    for rows in range(1, ROW_BUCKETS[-1].hi + 1):
        bucket = row_bucket(rows)
        assert bucket in ROW_BUCKETS and bucket.lo <= rows <= bucket.hi
        assert sum(b.lo <= rows <= b.hi for b in ROW_BUCKETS) == 1
    assert row_bucket(64).hi == 64 and row_bucket(65) == PREFILL_BUCKET  # decode-sized and prefill-sized apart
    assert row_bucket(4096) == row_bucket(513) == PREFILL_BUCKET


def test_prefill_bucket_skips_the_lm_head_and_dtypes_onednn_cannot_pack():
    head = torch.randn(384, 64)
    plan = MatmulPlan()
    plan.measure([torch.randn(192, 64), torch.randn(192, 64), head], repeats=1, cache_bytes=0, decode_only=(head,))
    assert MatmulKey(192, 64, torch.float32, PREFILL_BUCKET) in plan.forms
    assert MatmulKey(384, 64, torch.float32, PREFILL_BUCKET) not in plan.forms  # sampled rows only
    assert MatmulKey(384, 64, torch.float32, ROW_BUCKETS[0]) in plan.forms
    assert plan.form_for(head, 600) is MatmulForm.LINEAR and "not timed" in plan.summary()
    half = MatmulPlan()  # fp16: no packed form, so nothing to compare F.linear with at prefill sizes
    half.measure([torch.randn(128, 128).half(), torch.randn(128, 128).half()], repeats=1, cache_bytes=0)
    assert half.forms and not any(k.bucket == PREFILL_BUCKET for k in half.forms)


def test_an_unmeasured_plan_answers_f_linear_everywhere():
    plan, w = MatmulPlan(), torch.randn(8, 4)
    assert all(plan.form_for(w, rows) is MatmulForm.LINEAR for rows in range(1, 200))
    assert "not measured" in plan.summary()


def test_an_unmeasured_bf16_product_widens_from_5_rows_where_onednn_takes_no_bf16():
    """The default form (tuning off, weights within L2, a bucket nothing competes in) on a CPU without oneDNN's
    bf16 path: torch's bf16 GEMM is 3-4.5x slower there than widening to fp32; at 1-4 rows it stays F.linear."""
    bf16, fp32 = torch.randn(160, 96).bfloat16(), torch.randn(160, 96)
    onednn = CpuInfo("a Xeon", amx=True, avx512_bf16=True, last_level_cache_bytes=1 << 25, onednn_bf16=True)
    assert WIDENED_FROM_ROWS in {b.lo for b in ROW_BUCKETS}  # one default per bucket
    plan = MatmulPlan(cpu=AVX2_LAPTOP)
    forms = [plan.form_for(bf16, rows) for rows in (1, 4, 5, 32, 600)]
    assert forms == [MatmulForm.LINEAR] * 2 + [MatmulForm.WIDENED] * 3
    assert {MatmulPlan(cpu=AVX2_LAPTOP).form_for(fp32, rows) for rows in range(1, 600)} == {MatmulForm.LINEAR}
    assert {MatmulPlan(cpu=onednn).form_for(bf16, rows) for rows in range(1, 600)} == {MatmulForm.LINEAR}
    for tuning, cache_bytes in (("off", 0), ("cached", 1 << 30)):  # nothing timed: the fixed rule
        weights = [torch.randn(160, 96).bfloat16() for _ in range(2)]
        plan = MatmulPlan()
        plan.measure(weights, tuning=tuning, cache_bytes=cache_bytes, cpu=AVX2_LAPTOP)
        assert not plan.forms and plan.form_for(weights[0], 8) is MatmulForm.WIDENED
        assert f"{MatmulForm.WIDENED.value} from {WIDENED_FROM_ROWS}" in plan.summary()
        x = torch.randn(8, 96).bfloat16()
        assert torch.equal(planned_linear(x, weights[0], None, plan), widened_linear(x, weights[0]))


def test_a_measured_bf16_plan_times_every_form_against_the_widened_default(plan_timings):
    """Where oneDNN takes no bf16, WIDENED is the baseline the timed forms must beat from 5 rows (and a
    candidate below); the prefill bucket has nothing to compare it with (no packed bf16, bf16 F.linear not
    timed) and keeps it."""
    weights = [torch.randn(192, 64).bfloat16() for _ in range(4)]
    plan = MatmulPlan()
    plan.measure(weights, repeats=1, cache_bytes=0, cpu=AVX2_LAPTOP, tuning="remeasure")
    assert plan.source == "measured" and plan_timings == [4]
    assert MatmulKey(192, 64, torch.bfloat16, PREFILL_BUCKET) not in plan.forms
    assert plan.form_for(weights[0], 600) is MatmulForm.WIDENED and MatmulForm.PACKED not in plan.forms.values()
    entries = json.loads(TuningCache().path.read_text())["entries"]
    [entry] = [e for name, e in entries.items() if name.startswith("matmul")]
    for bucket in ROW_BUCKETS[:-1]:
        key = MatmulKey(192, 64, torch.bfloat16, bucket)
        default, other = MatmulForm.LINEAR, MatmulForm.WIDENED
        if bucket.lo >= WIDENED_FROM_ROWS:
            default, other = other, default
        assert (plan.forms[key] is default) == (plan.speedups[key] <= 1 + MARGIN)
        timed = entry[f"192 x 64 bfloat16 rows {bucket}"]["speedups"]  # over the default, which is not in it
        assert other.value in timed and default.value not in timed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_plan_picks_a_valid_form_for_every_shape_and_bucket(dtype):
    shapes = [(192, 64), (64, 128)] * 4 + [(384, 64)]  # a tiny "model": two layers' shapes, then a head
    weights = [torch.randn(o, i).to(dtype) for o, i in shapes]
    plan = MatmulPlan()
    plan.measure(weights, repeats=1, cache_bytes=0)  # as if they streamed from memory
    assert plan.measured_with_threads == torch.get_num_threads()
    cpu = CpuInfo.read()
    packs = can_pack(weights[0], cpu)  # bf16 on an AVX2-only CPU: no packed form to time
    for out_f, in_f in set(shapes):
        w = torch.empty(out_f, in_f, dtype=dtype)
        for bucket in ROW_BUCKETS:
            key, default = MatmulKey(out_f, in_f, dtype, bucket), default_form(dtype, cpu, bucket.lo)
            if bucket == PREFILL_BUCKET and not packs:  # the default alone there: nothing timed
                assert key not in plan.forms and plan.form_for(w, 600) is default
                continue
            speedup = plan.speedups[key]
            assert 0 < speedup < float("inf")
            assert (plan.forms[key] is default) == (speedup <= 1 + MARGIN)
            assert {plan.form_for(w, rows) for rows in range(bucket.lo, bucket.hi + 1)} == {plan.forms[key]}
            if bucket == PREFILL_BUCKET:  # only F.linear and the packed weight compete
                assert plan.forms[key] not in (MatmulForm.WEIGHT_LEFT, MatmulForm.SKINNY)
        assert plan.form_for(w, 4096) is plan.form_for(w, 512)  # larger prefills follow the last bucket
    assert len(plan.forms) == len(set(shapes)) * (len(ROW_BUCKETS) - (not packs))
    for form, attr in ((MatmulForm.PACKED, "packed"), (MatmulForm.SKINNY, "skinny")):
        chosen = {(k.out_features, k.in_features) for k, f in plan.forms.items() if f is form}
        for w, shape in zip(weights, shapes):  # a packed copy exactly where some bucket runs in that form
            assert (getattr(w, attr, None) is not None) == (shape in chosen)
    summary = plan.summary()
    assert CpuInfo.read().model_name in summary
    assert all(f"{o} x {i} {str(dtype).removeprefix('torch.')}" in summary for o, i in set(shapes))


@pytest.fixture
def plan_timings(monkeypatch) -> list[int]:
    """The number of weights each matmul-plan timing pass was given (the timings themselves still run)."""
    calls, real = [], matmul_plan.measure_speedups

    def counted(sample, *args):
        calls.append(len(sample))
        return real(sample, *args)

    monkeypatch.setattr(matmul_plan, "measure_speedups", counted)
    return calls


def test_weights_within_one_cores_l2_are_not_timed_and_keep_f_linear(plan_timings):
    weights = [torch.randn(64, 32) for _ in range(4)]
    plan = MatmulPlan()
    plan.measure(weights, cache_bytes=1 << 20)
    assert plan.measured_with_threads is not None and plan.forms == {} and plan.weight_bytes == 4 * 64 * 32 * 4
    assert plan.form_for(weights[0], 1) is MatmulForm.LINEAR and not plan_timings
    assert "nothing timed" in plan.summary() and "within one core's L2 of 1024 KiB" in plan.summary()


def test_weights_above_l2_are_timed_even_where_the_last_level_cache_would_hold_them(monkeypatch, plan_timings):
    # Staying in cache does not make the forms equal (bf16 on AMX: F.linear re-lays the weight out every
    # call): a CPU whose last level holds these weights many times over still times them.
    big_l3 = CpuInfo("a CPU with a large L3", amx=True, avx512_bf16=True, last_level_cache_bytes=1 << 30,
                     l2_cache_bytes=16 << 10)
    monkeypatch.setattr(CpuInfo, "read", classmethod(lambda cls: big_l3))
    weights = [torch.randn(64, 32) for _ in range(4)]  # 32 KiB: above this L2, far below the L3
    plan = MatmulPlan()
    plan.measure(weights, repeats=1, tuning="remeasure")
    assert plan.source == "measured" and len(plan.forms) == len(ROW_BUCKETS) and plan_timings == [4]


def test_cpu_info_reads_a_per_core_cache_no_larger_than_the_last_level():
    info = CpuInfo.read()
    assert 0 < info.l2_cache_bytes <= info.last_level_cache_bytes


def test_cpu_info_reads_a_name_and_a_cache_size():
    info = CpuInfo.read()
    assert info.model_name and info.last_level_cache_bytes >= 1 << 20
    assert isinstance(info.amx, bool) and isinstance(info.avx512_bf16, bool)
    assert f"AMX: {'yes' if info.amx else 'no'}" in str(info)


def test_warmup_attaches_one_plan_to_every_linear_and_measures_it_once(qwen3_dir):
    llm = LLM(qwen3_dir, block_size=4, num_kv_blocks=64)
    model = llm.llm_engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    plan = attached_plan(model.lm_head_layer)
    assert plan is not None and plan.measured_with_threads is not None
    assert linears and all(attached_plan(m) is plan for m in linears)
    weights = {w.data_ptr(): w for w in [m.weight for m in linears] + [model.lm_head_weight]}.values()
    assert plan.weight_bytes == sum(w.numel() * w.element_size() for w in weights)  # each weight once
    plan.measured_with_threads = -1
    llm.llm_engine.model_runner.measure_cpu_kernels()
    assert attached_plan(model.lm_head_layer) is plan and plan.measured_with_threads == -1  # measured once
    llm.shutdown()
