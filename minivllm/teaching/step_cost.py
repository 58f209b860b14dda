"""What a decode step costs, measured on a running engine (notebook 15).

    time_decode(llm, batch, steps)     `batch` requests decoding together for `steps` steps: the engine's
                                       own step and forward times (`get_stats()`), the prefill excluded
    profile_decode(llm, batch, steps)  the same steps under torch's profiler: each op's calls and time
    achieved(weights, run)             the weight bytes/s and matmul FLOP/s of a run, counted as
                                       `minivllm bench` counts them (entrypoints/roofline.py)
    intensity(weights, batch)          FLOPs per byte of weights in a decode step: the roofline's x

Nothing here re-times what the engine already times: step and forward time are `EngineStats` fields,
the weights are `roofline.matmul_weights`, the machine's peaks `roofline.measure_peaks`. A shared
machine only ever slows a run down, so `time_decode` keeps the fastest of its `repeats`.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import NamedTuple

import torch

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.roofline import MatmulWeights

# The ops whose self time is a linear layer's matmul kernel, in every form the engine may choose
# (cpu/matmul_plan.py, layers/quantization.py): x W^T and (W x^T)^T, oneDNN's packed weight, minivllm's
# skinny kernel (kernels/skinny_gemm.cpp), fbgemm's int8.
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "minivllm_cpu::skinny_gemm",
                        "quantized::linear_with_input_q_dq_qweight_dq_output_fp32"})
_ids = itertools.count()


class DecodeRun(NamedTuple):
    batch: int  # requests decoding together: rows per step
    steps: int
    wall_s: float  # the decode steps, end to end
    step_s: float  # of which inside LLMEngine.step (EngineStats.step_time_s)
    forward_s: float  # of which in the model forward + LM head (EngineStats.forward_time_s)

    @property
    def tokens(self) -> int:
        return self.batch * self.steps

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.step_s / self.steps


def start_decode(llm: LLM, batch: int, steps: int) -> None:
    """Add `batch` short prompts and run the step that prefills them all (each gets its first token), so
    that every step after it, until they finish, is a decode step of `batch` rows; `steps` of them."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)  # +1: the prefill's
    for i in range(batch):
        engine.add_request(f"decode-{next(_ids)}", f"Story {i}: once upon a time", params)
    engine.step()  # every prompt at once: well under the step's token budget
    stats = engine.get_stats()
    assert stats.num_running == batch and stats.num_waiting == 0, "the prefill did not admit them all"


def finish_decode(llm: LLM) -> None:
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()


def time_decode(llm: LLM, batch: int, steps: int, repeats: int = 2) -> DecodeRun:
    """`steps` decode steps of `batch` rows, timed by the engine's counters; the fastest of `repeats`."""
    runs = []
    for _ in range(repeats):
        start_decode(llm, batch, steps)
        before = llm.get_stats()
        t0 = time.perf_counter()
        finish_decode(llm)
        wall = time.perf_counter() - t0
        after = llm.get_stats()
        assert after.num_steps - before.num_steps == steps
        runs.append(DecodeRun(batch, steps, wall, after.step_time_s - before.step_time_s,
                              after.forward_time_s - before.forward_time_s))
    return min(runs, key=lambda r: r.wall_s)


class OpTime(NamedTuple):
    name: str
    calls: int
    self_s: float  # time inside the op itself, not in the ops it calls

    @property
    def is_matmul(self) -> bool:
        return self.name in MATMUL_OPS


class OpProfile(NamedTuple):
    steps: int
    wall_s: float  # the steps under the profiler (which adds its own cost to every op call)
    ops: list[OpTime]  # slowest first

    def seconds(self, matmul: bool) -> float:
        """Self time of the matmul ops (True) or of every other op (False)."""
        return sum(op.self_s for op in self.ops if op.is_matmul == matmul)

    @property
    def calls(self) -> int:
        return sum(op.calls for op in self.ops)


def profile_decode(llm: LLM, batch: int, steps: int) -> OpProfile:
    """`steps` decode steps of `batch` rows under torch's profiler: every op they ran, with its number
    of calls and its self time (the prefill step before them is not profiled)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's C++ side is chatty on stderr
    start_decode(llm, batch, steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        finish_decode(llm)
        wall = time.perf_counter() - t0
    ops = [OpTime(e.key, e.count, e.self_cpu_time_total / 1e6) for e in prof.key_averages()
           if e.self_cpu_time_total > 0]
    return OpProfile(steps, wall, sorted(ops, key=lambda op: -op.self_s))


def achieved(weights: MatmulWeights, run: DecodeRun) -> tuple[float, float]:
    """(weight GB/s, matmul GFLOP/s) of a decode run: each step streams every matmul weight once and
    multiplies it by each of the `batch` rows (2 FLOPs a weight a row); what roofline.report prints."""
    gb_s = weights.bytes * run.steps / run.wall_s / 1e9
    params = weights.decoder_params + weights.lm_head_params  # every row is sampled: the LM head too
    return gb_s, 2 * params * run.tokens / run.wall_s / 1e9


def intensity(weights: MatmulWeights, batch: int) -> float:
    """FLOPs per byte of weights streamed, in a decode step of `batch` rows (the roofline's x)."""
    return 2 * (weights.decoder_params + weights.lm_head_params) * batch / weights.bytes
