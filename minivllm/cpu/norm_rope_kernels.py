"""Whether a model's RMSNorms, RoPE and MLP activation run as minivllm's C++ CPU kernels: one choice a
model, made at warm-up.

Around its matmuls a decoder layer runs small element-wise work: two RMSNorms (Qwen3: four, with the
per-head q/k norms), the residual adds, RoPE on q and k, and the MLP's silu(gate) * up. In eager mode
torch runs each of those as several kernels, and at decode sizes (a few to a few dozen rows) every one
of them costs more in dispatch and trips through memory than in arithmetic: ~1.3 ms of a ~7 ms bf16
decode step of the `minivllm bench` model on 2 cores. Three C++ kernels do the same work in one pass
each: kernels/rms_norm.py (with vLLM's `fused_add_rms_norm`), kernels/rotary_embedding.py and
kernels/silu_and_mul.py (vLLM's name too).

As for every CPU kernel, a speed-up measured on one CPU is not assumed on another: `choose` asks the
tuner (tuner.py) to time a layer's worth of this work both ways on the machine at hand (PROBE_ROWS
rows, this model's sizes) and keeps the kernels only if they win every probe by its margin; the
answer is cached per machine, dtype and sizes. With tuning='off', torch's ops. Warm-up calls it and
hands the result to the model's layers (cpu/attach.py), logs what it chose; `minivllm bench` prints it.

Inside a compiled forward (models/compiled_forward.py) they never run: Inductor fuses these element-wise
ops into its own generated loops, so `active` is False while Dynamo traces. Steps larger than the
compiled sizes run eagerly, and there they do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.cpu.tuner import Probe, Tuning, choose, untimed
from minivllm.layers.activation import silu_and_mul
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RopeSpec, RotaryEmbedding, rotate

# A decode step of a batch, and a single stream: the kernels must win both (cpu/tuner.py).
PROBE_ROWS = (32, 1)
CANDIDATES = ("torch", "kernels")  # the first is the default (tuning off, no kernels built)


@dataclass
class NormRopeKernels:
    """The `KernelSwitch` (layers/custom_op.py) shared by a model's RMSNorms, MLPs and rotary step; `choose`
    sets it, and warm-up hands it to those layers (cpu/attach.py)."""

    used: bool = False  # RMSNorm, RoPE and silu·mul run minivllm's C++ kernels on CPU (else torch's ops)
    detail: str = "not measured: no CPU warm-up"  # what was measured, or why it was not

    def __str__(self) -> str:
        way = "minivllm CPU kernels" if self.used else "torch ops"
        return f"RMSNorm, RoPE and silu·mul: {way} ({self.detail})"

    def active(self, x: torch.Tensor) -> bool:
        """Whether the kernels run for this tensor now: chosen, on CPU, in their dtypes, not while tracing, and
        without autograd (the engine runs in inference mode; the kernels record no gradients)."""
        # Tracing is asked first, so Dynamo never traces the tensor checks after it: with them traced before the
        # residual add and F.rms_norm, torch 2.13's compiled graph corrupted the heap on 2 threads (AMD EPYC
        # Zen 4; tests/test_cpu_norm_rope.py's compiled-graph test aborted the suite there).
        return (not torch.compiler.is_compiling() and self.used and x.device.type == "cpu"
                and x.dtype in (torch.float32, torch.bfloat16) and not torch.is_grad_enabled())

    @torch.inference_mode()
    def choose(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               tuning: Tuning = "cached", intermediate_size: int = 0) -> NormRopeKernels:
        """Ask the tuner whether the kernels beat torch's ops for a layer of these sizes here (with the MLP's
        activation over `intermediate_size` columns; 0: a model without that MLP). CPU only."""
        build = load_cpu_kernels()
        if not build.available:
            choice = untimed(CANDIDATES[0], f"CPU kernels {build.detail}")
        elif dtype not in (torch.float32, torch.bfloat16):
            choice = untimed(CANDIDATES[0], f"the kernels take float32 or bfloat16, not {dtype}")
        elif head_dim % 2:
            choice = untimed(CANDIDATES[0], f"RoPE needs an even head dim, not {head_dim}")
        else:
            heads = num_heads + num_kv_heads
            entry = (f"norm_rope {str(dtype).removeprefix('torch.')} hidden {hidden_size} heads {heads} "
                     f"dim {head_dim} mlp {intermediate_size} rows {'/'.join(map(str, PROBE_ROWS))}")
            choice = choose(entry, CANDIDATES,
                            lambda: [_layer_probe(rows, hidden_size, heads, head_dim, intermediate_size, dtype)
                                     for rows in PROBE_ROWS],
                            tuning)
        self.used, self.detail = choice.used, choice.detail(", ".join(f"{rows} rows" for rows in PROBE_ROWS))
        return self


def _layer_probe(rows: int, hidden_size: int, heads: int, head_dim: int, intermediate_size: int,
                 dtype: torch.dtype) -> Probe:
    """One layer's element-wise work at `rows` rows, either way: the input norm, RoPE over q's and k's heads
    together, the residual add with the MLP's norm, the MLP's activation."""
    g = torch.Generator().manual_seed(0)
    probe = NormRopeKernels()
    norm = RMSNorm(hidden_size, 1e-6).to(dtype)
    norm.kernels = probe
    rope = RotaryEmbedding(head_dim, 1024, RopeSpec(), torch.device("cpu"))
    x, y = (torch.randn(rows, hidden_size, generator=g).to(dtype) for _ in range(2))
    qk = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 1024, (rows,), generator=g)
    gate_up = torch.randn(rows, 2 * intermediate_size, generator=g).to(dtype)

    def run(candidate: str) -> None:
        probe.used = candidate == "kernels"
        norm(x)
        rotate(qk, rope.lookup(positions, dtype, kernel=probe.active(qk)))
        norm(y, residual=x)
        if intermediate_size:
            silu_and_mul(gate_up, probe)

    return run

