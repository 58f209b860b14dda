"""An MoE decode step on CPU: minivllm's experts against HF transformers' MoE block, and the read ceiling.

    python benchmarks/moe_decode.py [--rounds 3] [--layers 8] [--tokens 1 4 16] [--dtype bfloat16] [--threads 1]

A decode step of a mixture of experts reads only the experts its tokens route to, so its floor is those
bytes, not the model's. The benchmark builds a small but real-shaped MoE with random weights (hidden 1024,
64 experts, top-8, expert width 256: Qwen3-30B-A3B's routing at a smaller hidden size; `--layers` sparse
blocks, 100 MB of bf16 experts each, so the model is far larger than the last-level cache and a step's
active experts mostly come from memory) and times the MoE blocks alone (router + experts) of one decode
step of T tokens, each layer fed its own random input (the same in every system: the same routes):

    minivllm            FusedMoE with CpuMoeMethod: the packed skinny kernels, active experts only
    minivllm, torch     FusedMoE with its default TorchMoeMethod: F.linear per active expert
    HF eager            transformers' Qwen3MoeSparseMoeBlock, experts_implementation="eager" (a loop of F.linear)
    HF grouped_mm       the same block as from_pretrained sets it up by default ("grouped_mm")
    dense, minivllm     a dense MLP of the same total size (width 64 x 256) through the same kernel
    dense, HF           Qwen3MoeMLP of that width (three F.linear)

Every system is a fresh process that builds the same weights (one seed), warms up, and times --steps steps at
each token count; a round runs each system once, in turn, for --rounds rounds: a busy moment slows one run of
each at most. Figures are the median (best) over the rounds; each ratio is median over median; the share of
the ceiling is the median's (the best run's).

The ceiling: read bandwidth (x.sum() over 256 MiB, minivllm/entrypoints/roofline.py, best of before and after
the rounds) over the bytes a step must read (each layer's active experts, counted from the routes, and its
router), times T: no implementation can decode faster from memory. The dense model reads all of its bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

HIDDEN, EXPERTS, TOP_K, WIDTH = 1024, 64, 8, 256
SYSTEMS = ("minivllm", "minivllm-torch", "hf-eager", "hf-grouped_mm", "dense-minivllm", "dense-hf")
LABELS = {"minivllm": "minivllm (packed skinny kernels)", "minivllm-torch": "minivllm, TorchMoeMethod (F.linear)",
          "hf-eager": "HF Qwen3MoeSparseMoeBlock, eager", "hf-grouped_mm": "HF Qwen3MoeSparseMoeBlock, grouped_mm",
          "dense-minivllm": "dense MLP of the same size, minivllm kernel", "dense-hf": "dense MLP, HF Qwen3MoeMLP"}


@dataclass(frozen=True)
class Spec:
    """What every child builds: the same weights and inputs from one seed."""

    layers: int
    tokens: tuple[int, ...]
    dtype: str
    steps: int
    threads: int


def weights(spec: Spec, layer: int):
    """Layer `layer`'s router (E, H) and experts w13 (E, 2I, H), w2 (E, H, I), as the checkpoint holds them."""
    import torch

    g = torch.Generator().manual_seed(1000 + layer)
    dtype = getattr(torch, spec.dtype)
    gate = torch.randn(EXPERTS, HIDDEN, generator=g) / HIDDEN ** 0.5  # (E, H)
    w13 = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=g).mul_(HIDDEN ** -0.5)  # (E, 2I, H)
    w2 = torch.randn(EXPERTS, HIDDEN, WIDTH, generator=g).mul_(WIDTH ** -0.5)  # (E, H, I)
    return gate.to(dtype), w13.to(dtype), w2.to(dtype)


def build(system: str, spec: Spec):
    """The system's `layers` blocks, each a callable x (T, H) -> (T, H), and a function giving the bytes a step read."""
    import torch

    blocks = []
    for layer in range(spec.layers):
        gate, w13, w2 = weights(spec, layer)
        if system.startswith("dense"):  # the same bytes as one layer's experts, all read every token
            w13 = torch.cat([w13[:, :WIDTH].reshape(-1, HIDDEN), w13[:, WIDTH:].reshape(-1, HIDDEN)])[None]
            w2 = w2.permute(1, 0, 2).reshape(1, HIDDEN, -1)  # (1, H, E * I)
        blocks.append(_block(system, gate, w13, w2))
        del w13, w2
    return blocks


def _block(system: str, gate, w13, w2):
    import torch
    import torch.nn.functional as F

    if system.startswith("hf") or system == "dense-hf":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                moe_intermediate_size=WIDTH, norm_topk_prob=True, dtype=w13.dtype)
        if system == "dense-hf":
            mlp = Qwen3MoeMLP(config, intermediate_size=w2.shape[2]).to(w13.dtype)
            mlp.gate_proj.weight.data, mlp.up_proj.weight.data = w13[0].chunk(2)
            mlp.down_proj.weight.data = w2[0]
            return lambda x: mlp(x[None])[0]
        config._experts_implementation = system.removeprefix("hf-")
        block = Qwen3MoeSparseMoeBlock(config).to(w13.dtype)
        block.gate.weight.data, block.experts.gate_up_proj.data, block.experts.down_proj.data = gate, w13, w2
        return lambda x: block(x[None])[0]
    from minivllm.cpu.moe_method import attach_moe_method
    from minivllm.layers.fused_moe import FusedMoE

    experts = FusedMoE(w13.shape[0], 1 if system.startswith("dense") else TOP_K, HIDDEN, w2.shape[2],
                       renormalize=True)
    experts.w13_weight.data, experts.w2_weight.data = w13, w2
    if system != "minivllm-torch":
        said = attach_moe_method(experts)
        assert "packed skinny kernels" in said, said
    if system.startswith("dense"):
        return lambda x: experts(x, torch.zeros(x.shape[0], 1))
    return lambda x: experts(x, F.linear(x, gate))  # (T, H): the router, then the experts


def child(spec: Spec, system: str) -> dict:
    """Build `system`, warm it up, time `spec.steps` decode steps at each token count; seconds a step, bytes read."""
    import torch

    torch.set_num_threads(spec.threads)
    blocks = build(system, spec)
    dtype = getattr(torch, spec.dtype)
    elem = torch.finfo(dtype).bits // 8
    expert_bytes, gate_bytes = 3 * WIDTH * HIDDEN * elem, EXPERTS * HIDDEN * elem
    result = {}
    for T in spec.tokens:
        g = torch.Generator().manual_seed(T)
        inputs = torch.randn(spec.steps + 2, spec.layers, T, HIDDEN, generator=g).to(dtype)  # a fresh x a layer
        active = 0  # experts routed to, over the timed steps and layers (from the same routes as every system)
        with torch.inference_mode():
            for s in range(2):  # warm-up steps
                for block, x in zip(blocks, inputs[s]):
                    block(x)
            start = time.perf_counter()
            for s in range(2, spec.steps + 2):
                for block, x in zip(blocks, inputs[s]):
                    block(x)
            seconds = (time.perf_counter() - start) / spec.steps
            if system == "minivllm":  # count the routes outside the timed loop
                for s in range(2, spec.steps + 2):
                    for layer, x in enumerate(inputs[s]):
                        gate = weights_gate(spec, layer, dtype)
                        ids = (x.float() @ gate.float().t()).softmax(-1).topk(TOP_K).indices
                        active += ids.unique().numel()
        step_bytes = (active / spec.steps * expert_bytes + spec.layers * gate_bytes if system == "minivllm"
                      else spec.layers * EXPERTS * expert_bytes if system.startswith("dense") else 0)
        result[str(T)] = {"seconds": seconds, "bytes": step_bytes}
    return result


def weights_gate(spec: Spec, layer: int, dtype):
    """Only the router of `layer` (the first draw of its generator, as `weights` makes it)."""
    import torch

    g = torch.Generator().manual_seed(1000 + layer)
    return (torch.randn(EXPERTS, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dtype)


def run_child(spec: Spec, system: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", system, "--spec", json.dumps(spec.__dict__)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{system} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per system, alternating; median and best")
    p.add_argument("--layers", type=int, default=8, help="sparse blocks (100 MB of bf16 experts each)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16], help="tokens per decode step")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per token count")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)  # internal: one system, in a fresh process
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        raw = json.loads(args.spec)
        print("RESULT " + json.dumps(child(Spec(**{**raw, "tokens": tuple(raw["tokens"])}), args.child)))
        return 0
    if args.rounds < 1:
        p.error("--rounds must be at least 1 (3 or more for medians worth quoting)")
    spec = Spec(args.layers, tuple(args.tokens), args.dtype, args.steps, args.threads)

    import torch

    from minivllm.cpu.cpu_info import CpuInfo
    from minivllm.entrypoints.bench_peers import level_line
    from minivllm.entrypoints.roofline import measure_read_bandwidth

    torch.set_num_threads(args.threads)
    print(f"{CpuInfo.read()}, {os.cpu_count()} cores, {args.threads} thread(s); {level_line()}; {args.dtype}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    read_gb_s = [measure_read_bandwidth()]
    seconds: dict[tuple[str, int], list[float]] = {}
    step_bytes: dict[tuple[str, int], float] = {}
    for i in range(args.rounds):
        for system in args.systems:
            t0 = time.perf_counter()
            for T, r in run_child(spec, system).items():
                seconds.setdefault((system, int(T)), []).append(r["seconds"])
                if r["bytes"]:
                    step_bytes[(system, int(T))] = r["bytes"]
            print(f"round {i + 1}: {system} ({time.perf_counter() - t0:.0f} s with start-up)", flush=True)
        print(f"load average {os.getloadavg()[0]:.2f} after round {i + 1}", flush=True)
    read_gb_s.append(measure_read_bandwidth())
    bandwidth = max(read_gb_s) * 1e9
    print(f"\nread bandwidth {max(read_gb_s):.1f} GB/s (best of {', '.join(f'{b:.1f}' for b in read_gb_s)}); "
          f"load average {os.getloadavg()[0]:.2f}; {level_line()}; median (best) of {args.rounds} rounds, "
          f"{args.layers} MoE blocks a step\n")
    print("| tokens | system | ms a step | tok/s | vs HF eager | vs HF grouped_mm | MB read a step | ceiling tok/s | "
          "share of it |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in args.tokens:
        def median(system: str) -> float | None:
            return statistics.median(seconds[(system, T)]) if (system, T) in seconds else None

        for system in args.systems:
            ms, best = 1e3 * median(system), 1e3 * min(seconds[(system, T)])
            ratios = [f"{median(peer) / median(system):.2f}×" if median(peer) else "—"
                      for peer in ("hf-eager", "hf-grouped_mm")]
            nbytes = step_bytes.get((system, T)) or (step_bytes.get(("minivllm", T))
                                                     if not system.startswith("dense") else None)
            ceiling = T * bandwidth / nbytes if nbytes else None
            cells = [f"{nbytes / 1e6:.0f}", f"{ceiling:.1f}",
                     f"{100 * T / (ms / 1e3) / ceiling:.0f} % ({100 * T / (best / 1e3) / ceiling:.0f} %)"] \
                if ceiling else ["—"] * 3
            print(f"| {T} | {LABELS[system]} | {ms:.2f} ({best:.2f}) | {T / (ms / 1e3):.1f} | {' | '.join(ratios)} | "
                  f"{' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
