"""Test helpers: prompts of awkward lengths, HF's next-token logits, a plain re-derivation of the
sampler's filters, and a sampler that fails on purpose.

The comparison of generated tokens with HF transformers (teacher-forced) is the notebooks' and the
capstone's too: `minivllm.teaching.hf_check.assert_hf_greedy`.
"""

from __future__ import annotations

import random

import torch


@torch.no_grad()
def prompt_logits(llm, ids: list[int]) -> torch.Tensor:  # (len(ids), V) fp32: teacher-forced
    """Logits at every prompt position, straight through the model runner (no scheduling)."""
    from minivllm import SamplingParams
    from minivllm.engine.request.sequence import Sequence
    from minivllm.engine.request.step_types import ScheduledSequence, SchedulerOutput

    runner = llm.llm_engine.model_runner
    seq = Sequence("probe", ids, SamplingParams())
    seq.block_table = list(range(-(-len(ids) // runner.block_size)))
    inputs = runner.prepare_inputs(SchedulerOutput([ScheduledSequence(seq, 0, len(ids))])).inputs
    runner.backend.prepare(inputs.attn_metadata)
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn_metadata, runner.kv_caches,
                              runner.backend)
        return runner.model.compute_logits(hidden).float()


def force_matmul_form(llm, form) -> None:
    """Every product of the engine's model in `form` (a MatmulForm), for every shape and row bucket, whatever
    this machine would measure: a plan made by hand, attached as warm-up attaches one (cpu/attach.py)."""
    from minivllm.cpu.matmul_plan import ROW_BUCKETS, MatmulKey, MatmulPlan
    from minivllm.cpu.planned_linear import PlannedLinearMethod
    from minivllm.layers.linear import set_linear_method

    model = llm.llm_engine.model
    weights = [m.weight for m in model.modules() if hasattr(m, "quant_method")]
    set_linear_method(model, PlannedLinearMethod(MatmulPlan(
        forms={MatmulKey(*w.shape, w.dtype, b): form for w in weights for b in ROW_BUCKETS})))


def force_cpu_kernels(llm, used: bool) -> None:
    """Every CPU kernel chosen at warm-up on or off, whatever this machine would measure: RMSNorm, RoPE and silu·mul,
    decode attention with the K/V write, and the greedy argmax (another CPU may choose either way)."""
    from minivllm.layers.sampler import GREEDY_CANDIDATES, GREEDY_SUBJECT
    from minivllm.layers.torch_attention import DECODE_CANDIDATES, DECODE_SUBJECT
    from minivllm.cpu.attach import set_norm_rope_kernels
    from minivllm.cpu.norm_rope_kernels import NormRopeKernels
    from minivllm.cpu.tuner import forced

    runner = llm.llm_engine.model_runner
    set_norm_rope_kernels(llm.llm_engine.model, NormRopeKernels(used, "forced by the test"))
    why = "forced by the test"
    runner.backend.decode_kernel = forced(DECODE_CANDIDATES, DECODE_CANDIDATES[used], why).about(DECODE_SUBJECT)
    runner.sampler.greedy_kernel = forced(GREEDY_CANDIDATES, GREEDY_CANDIDATES[used], why).about(GREEDY_SUBJECT)


def hf_next_token_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0, -1].float()


def varied_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Lengths 1, around block boundaries (block_size 4) and longer than the token budget."""
    rng = random.Random(seed)
    lengths = [1, 3, 4, 5, 8, 9, 17, 40, 70][:n]
    return [[rng.randrange(3, vocab) for _ in range(L)] for L in lengths]


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                          min_p: float) -> torch.Tensor:
    """A plain re-derivation, one filter at a time, renormalising after each."""
    p = torch.softmax(logits / temperature, -1)
    if top_k > 0:
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[p.topk(top_k).indices] = True
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    if top_p < 1.0:
        order = p.argsort(descending=True)
        kept, mass = [], 0.0
        for i in order.tolist():
            kept.append(i)
            mass += float(p[i])
            if mass >= top_p:
                break
        mask = torch.zeros_like(p, dtype=torch.bool)
        mask[kept] = True
        p = torch.where(mask, p, 0.0)
        p = p / p.sum()
    if min_p > 0.0:
        p = torch.where(p >= min_p * p.max(), p, 0.0)
        p = p / p.sum()
    return p


def run_with_flaky_sampler(engine, requests, every: int, phase: int, before_step=None, on_failure=None):
    """Drive `engine` over `requests` ({id: (prompt ids, SamplingParams)}) while its sampler raises on
    every `every`-th call (offset `phase`) over two or more rows: a failure no single request
    reproduces, so each one is rolled back and re-raised. `before_step()` runs before each step and
    `on_failure(state)` after each failure, with what `before_step` returned. Returns (finals, failures)."""
    original = engine.model_runner.sampler
    calls = {"n": 0}

    def flaky(logits, t):
        calls["n"] += 1
        if calls["n"] % every == phase and logits.shape[0] >= 2:
            raise RuntimeError("flaky")
        return original(logits, t)

    engine.model_runner.sampler = flaky
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    finals, failures = {}, 0
    while engine.has_unfinished_requests():
        state = before_step() if before_step else None
        try:
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        except RuntimeError:
            failures += 1
            if on_failure:
                on_failure(state)
    engine.model_runner.sampler = original
    return finals, failures
