"""The CPU's own wing: what this machine can run and which of several equal ways runs fastest on it.

    cpu_info.py           `CpuInfo`: the CPU's name, flags and caches, as minivllm's ISA level lets it see them
    tuner.py              of several equal ways to compute one thing, keep the fastest here, once
    tuning_cache.py       the tuner's choices, one file per machine (CPU, kernels build, threads, torch)
    matmul_forms.py       four ways to compute y = x W^T on a CPU, and the code of each
    matmul_timing.py      timing those forms over a model's weights, by row bucket
    matmul_plan.py        `MatmulPlan`: the form each weight shape and row bucket uses, chosen by timing
    norm_rope_kernels.py  whether RMSNorm, RoPE and silu·mul run minivllm's C++ kernels, chosen by timing

None of it is part of a model: model classes build plain layers (minivllm/layers/), and the engine's
warm-up (engine/warmup.py) hands this wing the built model, whose layers then receive what was chosen.
The arrow points one way: this package imports minivllm.kernels, never minivllm.models, and of
minivllm.layers only the small types the layers accept from outside (tests/test_layering.py).
"""
