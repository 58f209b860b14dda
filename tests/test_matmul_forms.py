"""The CPU matmul forms (F.linear, the weight on the left, oneDNN's packed weight, minivllm's skinny kernel,
bf16 widened to fp32) compute the same x W^T, a plan's product bound to its weight stays its own, and the
engine's tokens do not depend on which form it runs. The plan that picks a form: test_linear.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import force_cpu_kernels, force_matmul_form, varied_prompts

from minivllm import LLM, SamplingParams
from minivllm.cpu import matmul_forms, matmul_plan
from minivllm.cpu.matmul_forms import MatmulForm, bound_product, can_pack, matmul, widened_linear
from minivllm.cpu.matmul_plan import ROW_BUCKETS, CpuInfo, MatmulKey, MatmulPlan
from minivllm.cpu.planned_linear import planned_linear
from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.teaching.hf_check import assert_hf_greedy



def available_forms(dtype: torch.dtype = torch.float32) -> list[MatmulForm]:
    """Every form this CPU runs for `dtype`: SKINNY only where minivllm's CPU kernels could be built
    (tests/kernels checks that CI can), PACKED only where oneDNN takes the dtype here (bf16: not on an
    AVX2-only CPU, nor under MINIVLLM_CPU_ISA=avx2), WIDENED for 16-bit dtypes (in fp32 it is F.linear)."""
    packs = can_pack(torch.empty(1, 1, dtype=dtype), CpuInfo.read())
    return [f for f in MatmulForm if (f is not MatmulForm.SKINNY or load_cpu_kernels().available)
            and (f is not MatmulForm.PACKED or packs) and (f is not MatmulForm.WIDENED or dtype is not torch.float32)]


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
needs_kernels = pytest.mark.skipif(not load_cpu_kernels().available, reason=load_cpu_kernels().detail)


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
