"""`EngineConfig`: every engine option in one frozen, validated dataclass.

`LLM(...)` keyword arguments become an `EngineConfig`; the engine never reads an option from anywhere
else. Validation happens in `__post_init__` and every message says what to change. Values that depend
on the checkpoint (the model's maximum length) are resolved by the engine at start-up, which builds a
new frozen config with `replace(...)` rather than mutating this one.

KV-pool sizing when `num_kv_blocks` is None:
  * CUDA: `gpu_memory_utilization` (default 0.9) of the GPU's *free* memory after the weights are
    loaded, less a 10 % reserve for activations (so 81 % by default), is given to the KV cache.
  * CPU: a fixed byte budget, `cpu_kv_cache_bytes` (default 1 GiB); CPU memory is committed lazily
    (engine/worker/kv_cache.py), so an unused pool costs address space, not RAM.

Four fields are seams that take an object of your own (docs/concepts/seams.md): `attention_backend`
(an `AttentionBackend`), `scheduling_policy` (a `SchedulingPolicy`), `sampling_filter` (a
`SamplingFilter`) and `block_allocator` (a `BlockAllocator`). They are checked here for their type and
for what they cannot be combined with; the engine checks the rest when it builds (a backend's heads
against the model's). On the command line only the names are flags; an object is passed from Python.

The config sits below the engine and imports nothing of it: the engine's modules all read it. So what
it checks against lives below too: the scheduler side's two interfaces and the policy names in
minivllm/seams.py, the layers' two in layers/, the speculative dict's parse in minivllm/speculative_config.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minivllm.layers.attention_interface import AttentionBackend
from minivllm.layers.sampler import SamplingFilter
from minivllm.cpu.tuner import TUNING_MODES, Tuning
from minivllm.reasoning import ReasoningParserName
from minivllm.seams import BlockAllocator, SchedulingPolicy, check_policy
from minivllm.speculative_config import SpeculativeConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_BACKENDS = ("auto", "torch", "triton")
_QUANTIZATIONS = (None, "int8")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Hybrid models' prefix caching (engine/core/state_cache.py): the linear-attention state is kept every
    # `state_cache_stride` prompt tokens (a multiple of block_size; None: the smallest multiple of
    # lcm(block_size, 64) whose snapshots of one max_model_len prompt fit), in at most
    # `state_cache_bytes` (and at most 1024 snapshots).
    state_cache_stride: int | None = None
    state_cache_bytes: int = 1 << 30
    # "auto" (Triton on CUDA, PyTorch elsewhere), "torch", "triton", or an AttentionBackend instance
    # (layers/attention_interface.py), with the model's head counts; one rank only.
    attention_backend: str | AttentionBackend = "auto"
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    # A waiting request passed over this many times for lack of blocks stops admission behind it
    # until it fits (see Scheduler): the anti-starvation rule.
    max_admission_skips: int = 8
    # Speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": k, ...},
    # {"model": draft_dir, "num_speculative_tokens": k}, or {"proposer": Proposer, ...}; None = off.
    speculative_config: dict | None = None
    # Which waiting request to admit first and whom to preempt: "fcfs" (default), "priority" (lower
    # `priority` first; both in engine/core/scheduling_policy.py), or a SchedulingPolicy instance (minivllm/seams.py).
    scheduling_policy: str | SchedulingPolicy = "fcfs"
    # The sampler's filter step (temperature-scaled logits -> logits with removed tokens at -inf): None =
    # top-k, top-p, min-p; or a SamplingFilter instance (layers/sampler.py). The PyTorch sampler only.
    sampling_filter: SamplingFilter | None = None
    # Which free KV block is reused next (so which cached prefix is evicted): None = least recently
    # freed first; or a BlockAllocator instance (minivllm/seams.py), one per engine.
    block_allocator: BlockAllocator | None = None
    # The most logprobs / prompt_logprobs a request may ask for (vLLM's default: 20).
    max_logprobs: int = 20
    # Tokenizer folder if not beside the weights (e.g. for a GGUF file); None = the model folder.
    tokenizer: str | None = None
    # Run one tiny forward at start-up, then gc.freeze() the heap (as ATOM measured).
    warmup: bool = True
    # Keep a per-step StepTrace (engine/metrics/trace.py) for pictures and teaching; costs a copy per step.
    record_trace: bool = False
    # Tensor parallelism: split every layer's weights over this many processes (rank 0 is the engine,
    # the others are workers it starts); see docs/concepts/tensor-parallelism.md.
    tensor_parallel_size: int = 1
    # Seconds a collective may wait for the other ranks before the engine gives up (EngineDeadError): a
    # worker that hangs is found out this late at most (gloo's own default is 30 minutes).
    distributed_timeout_s: float = 60.0
    # "int8": the decoder's linear layers run int8 weights with per-token dynamic int8 activations (CPU
    # only; layers/quantization.py); None: the weights stay in `dtype`. vLLM's name.
    quantization: str | None = None
    # False: the forward runs as one torch.compile graph per token count in compile_sizes, each step
    # padded up to the next size, attention kept opaque (models/compiled_forward.py); on CUDA, decode steps
    # of those sizes also replay CUDA graphs (engine/worker/cuda_graphs.py). True: every step runs eagerly, no
    # graphs (vLLM's name). None (default): compiled on CUDA; eager on CPU, where compiling costs
    # ~20 s a size of start-up on 2 cores (less once cached on disk) for a measured +5-30 % a step
    # on AMD EPYC, even with eager on a Xeon guest whose eager step runs C++ kernels (docs/guides/benchmarks.md).
    enforce_eager: bool | None = None
    compile_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    # The CPU kernels' choices (matmul forms, norm/RoPE, decode attention, greedy argmax; cpu/tuner.py):
    # "cached" measures once per machine, dtype and shapes and reuses the answer from
    # $MINIVLLM_CACHE/tuning; "remeasure" times again and saves; "off" times nothing (the fixed rules).
    tuning: Tuning = "cached"
    # True: a request's tokens do not depend on the other requests in its steps, nor on how its prompt
    # was chunked (vLLM's VLLM_BATCH_INVARIANT): matmuls in fixed 16-row tiles, attention one row at a
    # time, fixed norm/RoPE/argmax paths, eager (docs/concepts/batch-invariance.md). CPU, one rank.
    batch_invariant: bool = False
    # A thinking model's <think>…</think> block (minivllm/reasoning.py): "qwen3" or "deepseek_r1" (vLLM's
    # names). Structured outputs then apply after </think> only, and the server returns the reasoning apart
    # (message.reasoning_content). The tokenizer must have both think tokens. None: no reasoning parser.
    reasoning_parser: str | None = None
    # Structured outputs: the CPU milliseconds one token's grammar mask may take, per request. A grammar over it
    # is refused before queueing (its first mask is timed), or ends with finish_reason "error" when a later mask
    # is: it would slow every request in its steps. Ordinary masks take 0.02-1.3 ms on a 49k vocabulary, costly ones
    # (a 150,000-character choice) 70+ ms (benchmarks/grammar_budget.py, docs/concepts/structured-outputs.md).
    grammar_mask_budget_ms: float = 20.0
    # A JSON schema's objects that name `properties` allow no other property unless they say
    # `additionalProperties` (vLLM's default, xgrammar's strict mode): response_format json_schema,
    # structured_outputs.json and tools' parameters. False: JSON Schema's own rule (any other property).
    strict_json_schema: bool = True

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid: it must be a positive integer")

        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a path to a Hugging Face checkpoint folder")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: choose one of {_DTYPES}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device={self.device!r} is invalid: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if not isinstance(self.attention_backend, AttentionBackend) and self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is invalid: choose one of {_BACKENDS} "
                             "or pass an AttentionBackend instance")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "cpu_kv_cache_bytes",
                     "max_admission_skips", "max_logprobs", "tensor_parallel_size"):
            positive(name)
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks")
        positive("state_cache_bytes")
        if self.state_cache_stride is not None:
            positive("state_cache_stride")
            if self.state_cache_stride % self.block_size:
                raise ValueError(f"state_cache_stride={self.state_cache_stride} must be a multiple of block_size="
                                 f"{self.block_size} (a snapshot is keyed by the block ending at it)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"distributed_timeout_s={t!r} is invalid: it must be a positive number of seconds")
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} with tensor_parallel_size={self.tensor_parallel_size}: rank r "
                             "runs on cuda:r (of the node), so pass device='cuda' (or 'auto')")
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is invalid: choose one of {_QUANTIZATIONS}")
        if self.quantization is not None and (self.device.startswith("cuda") or self.tensor_parallel_size > 1):
            raise ValueError(f"quantization={self.quantization!r} runs on CPU and one rank only (fbgemm's int8 "
                             "kernels); use device='cpu' and tensor_parallel_size=1, or drop quantization")
        sizes = self.compile_sizes
        if (not isinstance(sizes, (tuple, list)) or not sizes
                or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes)):
            raise ValueError(f"compile_sizes={sizes!r} is invalid: give positive token counts, e.g. (1, 2, 4, 8), "
                             "or pass enforce_eager=True to compile nothing")
        if not isinstance(sizes, tuple):  # a list (from JSON or the CLI) is kept as a tuple: the config is frozen
            object.__setattr__(self, "compile_sizes", tuple(sizes))
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager={self.enforce_eager!r} must be True, False or None (auto)")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        if self.tuning not in TUNING_MODES:
            raise ValueError(f"tuning={self.tuning!r} is invalid: choose one of {TUNING_MODES}")
        check_policy(self.scheduling_policy)  # raises, naming the choices
        if self.reasoning_parser is not None:
            ReasoningParserName.parse(self.reasoning_parser)  # raises, naming the choices
        b = self.grammar_mask_budget_ms
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < float("inf"):
            raise ValueError(f"grammar_mask_budget_ms={b!r} is invalid: it must be a positive number of "
                             "milliseconds (the CPU time one token's grammar mask may take)")
        if not isinstance(self.strict_json_schema, bool):
            raise ValueError(f"strict_json_schema={self.strict_json_schema!r} must be True or False")
        self._check_seams()
        self._check_batch_invariant()

    def _check_seams(self) -> None:
        """The instance-valued fields: the right type, and nothing they cannot be combined with."""
        backend = self.attention_backend
        if isinstance(backend, AttentionBackend) and self.tensor_parallel_size > 1:
            raise ValueError(f"attention_backend={type(backend).__name__}(...) with tensor_parallel_size="
                             f"{self.tensor_parallel_size}: each rank needs a backend of its own for its own heads; "
                             f"pass a name {_BACKENDS}, or tensor_parallel_size=1")
        for name, kind, module in (("sampling_filter", SamplingFilter, "layers.sampler"),
                                   ("block_allocator", BlockAllocator, "seams")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"{name}={value!r} is not a {kind.__name__}: subclass minivllm.{module}."
                                 f"{kind.__name__}, or pass None for the default")
        if self.speculative_config is None:
            return
        method = SpeculativeConfig.from_dict(self.speculative_config).method  # raises, naming what to change
        if self.sampling_filter is not None:
            raise ValueError(f"sampling_filter={type(self.sampling_filter).__name__}(...) with speculative_config: "
                             "drafts are verified against the default filter's distribution (layers/sampler.py "
                             "filtered_probs), not yours; drop one of the two")
        if method == "draft_model" and isinstance(backend, AttentionBackend):
            raise ValueError(f"attention_backend={type(backend).__name__}(...) with a draft model "
                             "(speculative_config 'model'): the draft builds a backend for its own heads from a "
                             f"name; pass one of {_BACKENDS}, or speculate with method 'ngram'")

    def _check_batch_invariant(self) -> None:
        """What batch_invariant=True cannot be combined with (yet), each refusal saying what to change."""
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant={self.batch_invariant!r} must be True or False")
        if not self.batch_invariant:
            return
        refusals = (
            (self.device.startswith("cuda"),
             f"device={self.device!r}: on CUDA the split-KV count and CUDA graphs vary with the batch, and the "
             "mode is not yet verified on a GPU; use device='cpu'"),
            (self.tensor_parallel_size > 1,
             f"tensor_parallel_size={self.tensor_parallel_size}: the all-reduce's summation order is not "
             "shown to be batch-independent; use tensor_parallel_size=1"),
            (self.enforce_eager is False,
             "enforce_eager=False: a compiled graph pads each step to a size and Inductor picks kernels per "
             "size; leave enforce_eager as None (the mode runs eagerly) or pass True"),
            (self.attention_backend not in ("auto", "torch"),
             f"attention_backend={self.attention_backend!r}: the mode runs attention through its own per-row "
             "backend (layers/per_row_attention.py); leave attention_backend='auto'"),
            (self.quantization is not None,
             f"quantization={self.quantization!r}: the int8 kernels' blocking is not shown to be "
             "batch-independent; drop quantization"),
            (self.speculative_config is not None,
             "speculative_config: drafts and their verification are not covered by the mode yet; drop "
             "speculative_config"),
        )
        for refused, why in refusals:
            if refused:
                raise ValueError(f"batch_invariant=True with {why}, or pass batch_invariant=False")

    def replace(self, **changes: object) -> "EngineConfig":
        """A validated copy with some fields changed (the config itself is never mutated)."""
        return dataclasses.replace(self, **changes)
