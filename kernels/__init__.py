"""Triton kernels for minivllm (and six CPU kernels in C++), each beside the plain-PyTorch `naive_*`
reference it must match.

    kv_cache_write.py     store a step's new K/V into their paged slots
    paged_attention.py    one kernel for mixed batches: decode rows, prefill chunks, cached prefixes
    grouped_decode_attention.py  decode steps: a KV head's G query heads as one tile, split-KV, one read a block
    split_kv_decode.py    flash-decoding one query head a program (the grouped kernel's predecessor; its merge)
    sampling.py           temperature / top-k / top-p / min-p and a seeded Gumbel-max draw
    seeding.py            `noise_seed` (plain Python, no triton): the per-(seed, position) noise stream key
    rejection_sampling.py speculative decoding: accept drafts or draw from the residual distribution
    gated_delta_rule.py   hybrid models: the recurrent (decode) update of a gated-DeltaNet layer's state
    fused_moe.py          mixture of experts: a step's routes sorted by expert (moe_align.py), one grouped
                          matmul for w13 and one for w2, as vLLM's fused_moe
    moe_cpu.py            CPU: a few tokens' experts through skinny_gemm, reading only the active experts
    skinny_gemm.py (.cpp) CPU, C++: x W^T for a few rows, one sequential read of a re-laid-out weight
                          (one of the forms minivllm/cpu/matmul_plan.py times)
    paged_decode_attention.py (.cpp)  CPU, C++: decode attention reading K/V in place in the paged cache
                          (layers/torch_attention.py uses it where warm-up measured it faster: cpu/decode_kernels.py)
    kv_cache_write_cpu.py (kv_cache_write.cpp)  CPU, C++: the K/V write, one memcpy a row
    greedy_argmax.py (.cpp)  CPU, C++: an all-greedy step's tokens straight from bf16 or fp32 logits
    rms_norm.py (.cpp)    CPU, C++: RMSNorm in HF's rounding order, and vLLM's fused_add_rms_norm
    rotary_embedding.py (.cpp)  CPU, C++: RoPE over a step's heads, bit-identical to the torch form
    cpu_build.py          compiles the C++ kernels on first use, for the CPU at hand (or MINIVLLM_CPU_ISA's level)
    compile_check.py      compiles them for levels this CPU may not run (AVX-512, AMX), loading nothing

This folder is installed as `minivllm.kernels` (see pyproject.toml), never as a top-level
`kernels` package: transformers looks for Hugging Face's kernel hub under that name. It also
defines no `__version__` and imports nothing here, so even run from the repository root (where
`kernels/` is on sys.path) transformers sees no usable kernel hub.

On CPU, Triton runs only through its interpreter: set TRITON_INTERPRET=1 before Python imports triton.
"""
