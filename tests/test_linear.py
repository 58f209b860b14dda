"""The CPU matmul forms: both compute x W^T, the plan picks one per shape and row bucket by timing,
and the engine's tokens do not depend on which one it picked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import force_cpu_kernels, force_matmul_form, varied_prompts

from minivllm import LLM, SamplingParams
from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.cpu import matmul_plan
from minivllm.cpu.attach import attached_plan
from minivllm.cpu.planned_linear import planned_linear
from minivllm.cpu.tuning_cache import TuningCache
from minivllm.layers.linear import Linear
from minivllm.cpu import matmul_forms
from minivllm.cpu.matmul_forms import (WIDENED_FROM_ROWS, MatmulForm, bound_product, can_pack, default_form, matmul,
                                       widened_linear)
from minivllm.cpu.matmul_plan import MARGIN, PREFILL_BUCKET, ROW_BUCKETS, CpuInfo, MatmulKey, MatmulPlan, row_bucket
from minivllm.teaching.hf_check import assert_hf_greedy

def available_forms(dtype: torch.dtype = torch.float32) -> list[MatmulForm]:
    """Every form this CPU runs for `dtype`: SKINNY only where minivllm's CPU kernels could be built
    (tests/kernels checks that CI can), PACKED only where oneDNN takes the dtype here (bf16: not on an
    AVX2-only CPU, nor under MINIVLLM_CPU_ISA=avx2), WIDENED for 16-bit dtypes (in fp32 it is F.linear)."""
    packs = can_pack(torch.empty(1, 1, dtype=dtype), CpuInfo.read())
    return [f for f in MatmulForm if (f is not MatmulForm.SKINNY or load_cpu_kernels().available)
            and (f is not MatmulForm.PACKED or packs) and (f is not MatmulForm.WIDENED or dtype is not torch.float32)]

AVX2_LAPTOP = CpuInfo("an AVX2 laptop", amx=False, avx512_bf16=False, last_level_cache_bytes=1 << 23, x86_64_v3=True)


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def test_every_row_count_has_one_bucket_and_prefill_sizes_share_the_last():
    for rows in range(1, ROW_BUCKETS[-1].hi + 1):
        bucket = row_bucket(rows)
        assert bucket in ROW_BUCKETS and bucket.lo <= rows <= bucket.hi
        assert sum(b.lo <= rows <= b.hi for b in ROW_BUCKETS) == 1
    assert row_bucket(64).hi == 64 and row_bucket(65) == PREFILL_BUCKET  # decode-sized and prefill-sized apart
    assert row_bucket(4096) == row_bucket(513) == PREFILL_BUCKET


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 65, 600])
def test_both_forms_compute_the_same_product(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(160, 96, generator=g) / 96 ** 0.5).to(dtype)
    bias = torch.randn(160, generator=g).to(dtype)
    reference = F.linear(x.float(), w.float(), bias.float())
    for form in available_forms(dtype):
        y = matmul(x, w, form)
        assert y.shape == (rows, 160) and y.dtype == dtype
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), **TOLERANCE[dtype])
        forced = MatmulPlan(forms={MatmulKey(160, 96, dtype, b): form for b in ROW_BUCKETS})
        torch.testing.assert_close(planned_linear(x, w, bias, forced).float(), reference, **TOLERANCE[dtype])


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


def test_the_widened_form_is_f_linear_in_fp32_on_widened_operands(monkeypatch):
    """WIDENED is the fp32 product of the widened operands, rounded once to bf16: bit for bit where the
    weight is widened in one block; in blocks of output rows (a large weight), within that rounding
    (2^-8 of the value: bf16 keeps 8 bits) plus fp32 summation order (in * 2^-24 of sum |x||w|)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 96, generator=g).bfloat16()  # (rows, in)
    w = (torch.randn(160, 96, generator=g) / 96 ** 0.5).bfloat16()  # (out, in)
    bias = torch.randn(160, generator=g).bfloat16()
    exact = F.linear(x.float(), w.float(), bias.float())  # (rows, out) fp32
    for y in (widened_linear(x, w, bias), bound_product(w, bias, MatmulForm.WIDENED)(x)):
        assert y.dtype is torch.bfloat16 and y.is_contiguous()
        assert torch.equal(y, exact.bfloat16())
    assert torch.equal(matmul(x, w, MatmulForm.WIDENED), F.linear(x.float(), w.float()).bfloat16())
    monkeypatch.setattr(matmul_forms, "WIDEN_BLOCK_BYTES", 11 * 96 * 4)  # blocks of 11 rows, the last of 6
    blocked = widened_linear(x, w, bias)
    bound = 2 ** -8 * exact.abs() + 96 * 2 ** -24 * (x.float().abs() @ w.float().abs().t() + bias.float().abs())
    assert blocked.shape == (7, 160) and ((blocked.float() - exact).abs() <= bound).all()


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


needs_kernels = pytest.mark.skipif(not load_cpu_kernels().available, reason=load_cpu_kernels().detail)


def test_a_decode_product_is_bound_once_and_bound_again_when_the_forms_are_replaced(monkeypatch):
    """`linear` asks the plan for a product bound to its weight; decode-sized row counts keep theirs, so a
    step does not decide the form again on every call. Replacing `forms` (what `measure` does, and what the
    tests above do by hand) must rebind, or a layer would keep running the form it had before."""
    bound_forms = []
    real = matmul_plan.bound_product
    monkeypatch.setattr(matmul_plan, "bound_product", lambda w, b, form: bound_forms.append(form) or real(w, b, form))
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(160, 96, generator=g), torch.randn(3, 96, generator=g)
    plan = MatmulPlan(forms={MatmulKey(160, 96, torch.float32, b): MatmulForm.WEIGHT_LEFT for b in ROW_BUCKETS})
    first = plan.product(w, None, 3)
    assert plan.product(w, None, 3) is first and bound_forms == [MatmulForm.WEIGHT_LEFT]  # bound once
    assert plan.product(w, None, 1) is not first  # each row count its own
    assert plan.product(w, None, 600) is not plan.product(w, None, 600)  # prefill sizes: bound per call
    plan.forms = {MatmulKey(160, 96, torch.float32, b): MatmulForm.LINEAR for b in ROW_BUCKETS}
    bound_forms.clear()
    again = planned_linear(x, w, None, plan)
    assert bound_forms == [MatmulForm.LINEAR] and plan.product(w, None, 3) is not first
    torch.testing.assert_close(again, F.linear(x, w), rtol=0, atol=0)  # F.linear itself, bit for bit


@pytest.mark.parametrize("form", [f for f in available_forms() if f in (MatmulForm.PACKED, MatmulForm.SKINNY)])
def test_a_bound_product_never_runs_another_weights_packed_copy(form):
    """Short-lived weights through one plan (a notebook's loop): a freed weight's id may come back for the
    next one, and its packed copy must not. (A bound product holding only the copy once answered 199 of
    200 such calls with the first weight's product.)"""
    plan = MatmulPlan(forms={MatmulKey(32, 16, torch.float32, b): form for b in ROW_BUCKETS})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, generator=g)
    for _ in range(50):
        w = torch.randn(32, 16, generator=g)
        torch.testing.assert_close(planned_linear(x, w, None, plan), F.linear(x, w), **TOLERANCE[torch.float32])


@needs_kernels
def test_a_skinny_product_builds_the_kernels_it_needs_in_a_fresh_process():
    """In a process that has not loaded minivllm's CPU kernels yet (the tests above have), a plan set to
    SKINNY by hand must load them before it looks their op up."""
    code = ("import torch, torch.nn.functional as F\n"
            "from minivllm.cpu.planned_linear import planned_linear\n"
            "from minivllm.cpu.matmul_forms import MatmulForm\n"
            "from minivllm.cpu.matmul_plan import ROW_BUCKETS, MatmulKey, MatmulPlan\n"
            "plan = MatmulPlan(forms={MatmulKey(32, 16, torch.float32, b): MatmulForm.SKINNY for b in ROW_BUCKETS})\n"
            "x, w = torch.randn(2, 16), torch.randn(32, 16)\n"
            "torch.testing.assert_close(planned_linear(x, w, None, plan), F.linear(x, w), rtol=1e-5, atol=1e-5)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False])
@pytest.mark.parametrize("form", available_forms())
@pytest.mark.parametrize("family", ["qwen3", "llama_mha_tied_llama3"])
def test_engine_tokens_match_hf_whichever_form_is_chosen(family, form, kernels, model_factory, hf_factory):
    """Force one form for every shape and bucket (what measurement might pick on some CPU), with every C++
    kernel the warm-up may choose on or off (each must take what every form hands it: a one-row
    `(W x^T)^T` product once came back strided and the norm, RoPE and K/V-write kernels refused it):
    batches of 1-9 decode rows and prefill chunks still give HF's greedy tokens. qwen3 normalises q and k
    per head (3-D norms); the llama variant ties its LM head to the embedding and rotates q and k together."""
    llm = LLM(model_factory(family), block_size=4, num_kv_blocks=128, max_num_batched_tokens=32, warmup=False)
    model = llm.llm_engine.model
    force_matmul_form(llm, form)
    force_cpu_kernels(llm, kernels)
    prompts = varied_prompts(9, llm.llm_engine.spec.vocab_size, seed=4)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    hf = hf_factory(family)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].finish_reason == "length", out.error
        assert_hf_greedy(hf, p, out.outputs[0].token_ids)
    llm.shutdown()


@needs_kernels
@pytest.mark.parametrize("form", available_forms(torch.bfloat16))
def test_bfloat16_one_row_steps_run_every_form_through_the_kernels(form, model_factory):
    """bf16, where every kernel has its second code path: a single stream (one row a step, the case that
    failed) in each form with the kernels on gives the tokens it gives with F.linear and torch's ops."""
    path = model_factory("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": varied_prompts(7, 384, seed=2)[6]}
    tokens = {}
    for chosen, kernels in ((MatmulForm.LINEAR, False), (form, True)):
        llm = LLM(path, dtype="bfloat16", block_size=4, num_kv_blocks=64, warmup=False)
        model = llm.llm_engine.model
        force_matmul_form(llm, chosen)
        force_cpu_kernels(llm, kernels)
        out = llm.generate(prompt, sp, use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "length", out.error
        tokens[kernels] = out.outputs[0].token_ids
        llm.shutdown()
    # bf16 rounds differently in each form (another summation order), so the texts may part at a near-tie;
    # the first tokens are far from one in this model
    assert tokens[True][:4] == tokens[False][:4]
