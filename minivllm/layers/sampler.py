"""The sampler: every row of a step sampled with its own parameters in one batched call.

    logits (S, V) ──> /temperature ──> top-k ──> top-p ──> min-p ──> argmax(logits + Gumbel noise)
                   │                   └──── the filter step ─────┘
                   └─ greedy rows (temperature 0) take argmax(logits) directly

The filter step is a seam: a `SamplingFilter` turns the temperature-scaled logits and each row's
parameters into the logits to draw from (removed tokens -inf). `TopKTopPMinP` is the default; pass
your own with `LLM(model, sampling_filter=MyFilter())` (the PyTorch sampler only: the Triton one filters
inside its kernel). It never touches a greedy row: their token is the argmax of the unfiltered logits.

Gumbel-max: argmax_i(l_i + g_i) with g_i = -log(E_i), E_i ~ Exp(1), is an exact draw from
softmax(l); filtered entries are -inf and can never win. Each row's noise comes from its own
generator seeded by (request seed, token position), so a seeded request draws the same tokens
whatever else is in the batch, and a recomputed (preempted) request redraws the same ones.

top-p needs a sort of the row; it runs only when some row asks for top-p < 1.

On a GPU the whole call stays on the device: nothing in it reads a tensor back to the host (top-k's
width is the host's `max_top_k`; the Gumbel streams are seeded from Python ints), so a step's one
device-to-host copy is the sampled ids the engine reads with `.tolist()` (tests/test_sampler_syncs.py;
benchmarks/cuda_check.py checks both samplers under torch's sync debug mode). A `sampling_filter` of
your own is checked by `CheckedFilter`, which does read one flag back a step.

Every argmax here is `argmax_rows`: on CPU, torch's argmax along a row is not vectorised (0.44 ms for
32 x 32000 fp32 on an AMD EPYC core pair, ~3 % of a 32-row bf16 decode step) while its max is (0.05 ms).
So the row is cut into blocks of 128: the max of each block (fast), the first block holding the row's
maximum (a short argmax), then the first maximum inside that block (another) = the first index of the
maximum, exactly `argmax`'s answer, ties and NaN included. 4-6x faster for 1-128 rows.

A step whose rows are all greedy needs nothing but that argmax. On a CPU where warm-up measured it
faster, minivllm's C++ kernel takes it straight from the model's bf16 or fp32 logits
(kernels/greedy_argmax.py): one pass, no float32 copy. The sampler holds the switch (`greedy_kernel`);
warm-up measures and sets it (minivllm/cpu/decode_kernels.py).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minivllm.kernels.greedy_argmax import greedy_argmax
from minivllm.kernels.seeding import noise_seed  # also imported from here by the engine
from minivllm.layers.custom_op import KernelChoice, NotMeasured

GREEDY_CANDIDATES = ("argmax_rows", "kernel")  # the first is the default (tuning off, no kernels built)
# "kernel": all-greedy steps take their argmax from minivllm's CPU kernel (else argmax_rows, float32)
GREEDY_SUBJECT = "greedy sampling"


class SamplingRow(NamedTuple):
    """One sampled row's draw parameters (the typed hand-off from the model runner)."""

    temperature: float  # 0 = greedy
    top_k: int  # 0 or -1 = off
    top_p: float  # 1 = off
    min_p: float  # 0 = off
    seed: int  # the sequence's seed (an n > 1 request's child i: seed + i)
    position: int  # position of the token being drawn: keys the noise


@dataclass
class SamplingTensors:
    """Per-row parameters of the rows sampled in one step."""

    temperatures: torch.Tensor  # (S,) float32; 0 = greedy
    top_ks: torch.Tensor  # (S,) int64; V = off
    top_ps: torch.Tensor  # (S,) float32; 1 = off
    min_ps: torch.Tensor  # (S,) float32; 0 = off
    seeds: list[int]  # per-row request seed
    positions: list[int]  # per-row position of the token being drawn
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int  # the largest top-k of the rows that set one (0: none), known on the host

    def select(self, rows: list[int]) -> "SamplingTensors":
        """The same parameters for a subset of the rows."""
        idx = torch.tensor(rows, device=self.temperatures.device)
        return SamplingTensors(self.temperatures[idx], self.top_ks[idx], self.top_ps[idx], self.min_ps[idx],
                               [self.seeds[i] for i in rows], [self.positions[i] for i in rows], self.all_greedy,
                               self.any_top_k, self.any_top_p, self.any_min_p, self.max_top_k)

    @classmethod
    def from_params(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingTensors":
        temps = [r.temperature for r in rows]
        top_ks = [r.top_k if 0 < r.top_k < vocab_size else vocab_size for r in rows]
        top_ps = [r.top_p for r in rows]
        min_ps = [r.min_p for r in rows]
        floats = torch.tensor([temps, top_ps, min_ps], dtype=torch.float32, device=device)  # one copy, not three
        return cls(
            temperatures=floats[0], top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=floats[1], min_ps=floats[2],
            seeds=[r.seed for r in rows], positions=[r.position for r in rows],
            all_greedy=all(t == 0.0 for t in temps),
            any_top_k=any(k < vocab_size for k in top_ks),
            any_top_p=any(p < 1.0 for p in top_ps),
            any_min_p=any(p > 0.0 for p in min_ps),
            max_top_k=max((k for k in top_ks if k < vocab_size), default=0),
        )


def argmax_rows(x: torch.Tensor, block: int = 128) -> torch.Tensor:  # (S, V) -> (S,) int64
    """`x.argmax(-1)`, the same indices, computed blockwise on CPU (see the module docstring)."""
    S, V = x.shape
    if x.device.type != "cpu" or V % block:
        return x.argmax(-1)  # a GPU's argmax is one fast kernel; a vocabulary not in blocks: the plain way
    blocks = x.reshape(S, V // block, block)
    first = blocks.amax(-1).argmax(-1)  # (S,) the first block holding the row's maximum (or first NaN)
    inside = blocks[torch.arange(S, device=x.device), first].argmax(-1)  # (S,) its first maximum
    return first * block + inside


def filtered_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """(S, V) -> (S, V): the distribution each row is drawn from (temperature, then the default filters);
    one-hot at the argmax for greedy rows. Speculative verification compares drafts against it (which is
    why `sampling_filter` and `speculative_config` are refused together: config.py)."""
    temps = torch.where(t.temperatures > 0, t.temperatures, torch.ones_like(t.temperatures))
    probs = apply_top_k_top_p_min_p(logits / temps[:, None], t).softmax(-1)
    greedy = torch.nn.functional.one_hot(argmax_rows(logits), logits.shape[1]).to(probs.dtype)
    return torch.where((t.temperatures > 0)[:, None], probs, greedy)


def apply_top_k_top_p_min_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Filter (S, V) temperature-scaled logits: removed entries become -inf."""
    if t.any_top_k:
        # The host's copy of the widest top-k (`int(t.top_ks.max())` would wait for the GPU), over the rows
        # that set one: a row without top-k (V) would make this a sort of the whole vocabulary.
        max_k = t.max_top_k
        top_vals = logits.topk(max_k, dim=-1).values  # (S, max_k), descending
        kth = top_vals.gather(1, (t.top_ks - 1).clamp(max=max_k - 1)[:, None])  # (S, 1)
        kth = torch.where(t.top_ks[:, None] <= max_k, kth, float("-inf"))  # rows without top-k keep everything
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if t.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # probability of the tokens ranked above
        drop_sorted = mass_before >= t.top_ps[:, None]  # the first token is never dropped
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if t.any_min_p:
        probs = logits.softmax(-1)
        threshold = t.min_ps[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


class SamplingFilter(abc.ABC):
    """The sampler's filter step. Called with a step's sampled rows, float32 logits already divided by each
    row's temperature (R, V), and their parameters (`sampling.top_ks`, `.top_ps`, `.min_ps`, ...: yours may
    read any of them, or none); returns (R, V) logits with every removed token set to -inf. RULES: the
    shape stays (R, V), and a row with temperature > 0 keeps at least one token (`CheckedFilter` enforces
    both). Greedy rows pass through too, but their token is the unfiltered argmax, whatever you return."""

    name = "custom"

    @abc.abstractmethod
    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:  # (R, V) -> (R, V)
        ...


class TopKTopPMinP(SamplingFilter):
    """The default filter: vLLM's top-k, then top-p, then min-p (`apply_top_k_top_p_min_p`)."""

    name = "top-k-top-p-min-p"

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        return apply_top_k_top_p_min_p(logits, sampling)


class FilterContractError(AssertionError):
    """A sampling filter returned something the sampler cannot draw from (the rule is in the message)."""


class CheckedFilter(SamplingFilter):
    """Wraps a filter of your own and checks its two RULES on every call, naming the one it breaks: a wrong
    shape would draw tokens for the wrong rows; a sampled row with every token removed would draw token 0
    (argmax of all -inf) without a word. One reduction over the logits a step."""

    def __init__(self, inner: SamplingFilter) -> None:
        self.inner, self.name = inner, inner.name

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        out = self.inner(logits, sampling)
        rule = f"{type(self.inner).__name__} broke a RULE:"
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise FilterContractError(f"{rule} a filter returns logits of the shape it was given, "
                                      f"{tuple(logits.shape)}; got {got}")
        emptied = ~(out > float("-inf")).any(-1) & (sampling.temperatures > 0)  # (R,) rows with nothing left
        if bool(emptied.any()):
            raise FilterContractError(f"{rule} every sampled row keeps at least one token (not all -inf); rows "
                                      f"{emptied.nonzero()[:, 0].tolist()} kept none")
        return out


class Sampler:
    """The PyTorch sampler (torch.Generator noise per row)."""

    def __init__(self) -> None:
        # the C++ argmax or argmax_rows for all-greedy steps: set at warm-up (minivllm/cpu/decode_kernels.py)
        self.greedy_kernel: KernelChoice = NotMeasured(GREEDY_SUBJECT, GREEDY_CANDIDATES[0])
        self.filter: SamplingFilter = TopKTopPMinP()

    def set_filter(self, sampling_filter: SamplingFilter) -> None:
        """The engine's `sampling_filter` (engine/builder.py), checked on every call (`CheckedFilter`)."""
        self.filter = sampling_filter if isinstance(sampling_filter, CheckedFilter) else CheckedFilter(sampling_filter)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:  # (S, V) in the model's dtype -> (S,)
        if self.greedy_kernel.used and logits.dtype in (torch.float32, torch.bfloat16):
            # The kernel reads each row as one run (every matmul form returns contiguous rows; a caller's
            # strided view is copied first).
            return greedy_argmax(logits if logits.stride(1) == 1 else logits.contiguous())
        return argmax_rows(logits.float())

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:  # (S, V) -> (S,)
        if t.all_greedy:
            return self.greedy(logits)
        logits = logits.float()
        greedy = argmax_rows(logits)
        temps = torch.where(t.temperatures > 0, t.temperatures, torch.ones_like(t.temperatures))
        scaled = self.filter(logits / temps[:, None], t)  # (S, V); greedy rows keep `greedy` below
        gumbel = self.gumbel_noise(t.seeds, t.positions, logits.shape[1], logits.device)  # (S, V)
        drawn = argmax_rows(scaled + gumbel)
        return torch.where(t.temperatures > 0, drawn, greedy)

    @staticmethod
    def gumbel_noise(seeds: list[int], positions: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
        noise = torch.empty(len(seeds), vocab_size, device=device)
        gen = torch.Generator(device=device)
        for row, (seed, pos) in enumerate(zip(seeds, positions)):
            gen.manual_seed(noise_seed(seed, pos))
            noise[row].exponential_(generator=gen)
        return -noise.log()


class TritonSampler:
    """The same contract through `kernels/sampling.py` (bisection cut-offs, Philox Gumbel noise)."""

    def set_filter(self, sampling_filter: SamplingFilter) -> None:
        raise ValueError(f"sampling_filter={type(sampling_filter).__name__}(...) runs in the PyTorch sampler, but this "
                         "engine samples with Triton's (attention_backend 'triton', which 'auto' picks on CUDA), "
                         "whose kernel filters by itself (kernels/sampling.py): pass attention_backend='torch'")

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:  # (S, V) -> (S,)
        from minivllm.kernels.sampling import triton_sample

        if t.all_greedy:
            return logits.argmax(dim=-1)
        return triton_sample(logits, t.temperatures, t.top_ks, t.top_ps, t.min_ps, t.seeds, t.positions)
