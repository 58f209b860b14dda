"""The CPU's own wing: what this machine can run and which of several equal ways runs fastest on it.

    cpu_info.py           `CpuInfo`: the CPU's name, flags and caches, as minivllm's ISA level lets it see them
    tuner.py              of several equal ways to compute one thing, keep the fastest here, once
    tuning_cache.py       the tuner's choices, one file per machine (CPU, kernels build, threads, torch)
    matmul_forms.py       four ways to compute y = x W^T on a CPU, and the code of each
    matmul_timing.py      timing those forms over a model's weights, by row bucket
    matmul_plan.py        `MatmulPlan`: the form each weight shape and row bucket uses, chosen by timing
    planned_linear.py     `PlannedLinearMethod`: a `Linear`'s product through the plan's form
    norm_rope_kernels.py  whether RMSNorm, RoPE and silu·mul run minivllm's C++ kernels, chosen by timing
    decode_kernels.py     whether decode attention and greedy sampling run minivllm's C++ kernels, likewise
    moe_method.py         `CpuMoeMethod`: a FusedMoE's experts packed once, only the active ones read (skinny kernels)
    attach.py             `attach_cpu_kernels`: warm-up's entry, the choices handed to a built model's layers

None of it is part of a model: model classes build plain layers (minivllm/layers/), and the engine's
warm-up (engine/worker/warmup.py) hands this wing the built model, whose layers then receive what was chosen.
The arrow points one way: this package imports minivllm.kernels and minivllm.layers (to time and set
their switches), never minivllm.models; the layers and models import nothing from it
(tests/test_layering.py).
"""
