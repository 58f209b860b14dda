"""Pictures of what a step costs, from measured numbers (notebook 15; the measuring is step_cost.py).

    plot_step_split(runs)                 ms per decode step: in the forward, in the rest of step()
    plot_top_ops(profile)                 the ops a decode step spends its time in, and the rest
    plot_bandwidth_floor(rows, gb_s)      ms per token measured against weight bytes / bandwidth
    plot_roofline(points, gb_s, peaks)    achieved matmul FLOP/s against FLOPs per byte, under the roofs

The conventions of viz.py: 8 inches wide, text of 9 pt or more, legends outside the data, units on
every axis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from minivllm.teaching.step_cost import DecodeRun, OpProfile
from minivllm.teaching.viz import WIDTH

MATMUL, OTHER, OUTSIDE = "tab:blue", "tab:orange", "0.6"
DTYPE_COLORS = {"float32": "tab:blue", "bfloat16": "tab:orange", "int8": "tab:green"}


def _axes(ax: Any, height: float) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(WIDTH, height), layout="constrained")[1]


def _legend_below(ax: Any, ncol: int) -> None:
    ax.figure.legend(loc="outside lower center", ncol=ncol, fontsize=9, frameon=False)


def _short(op: str) -> str:
    """Inductor names its generated code by a hash: "## Call CompiledFxGraph f256rco2... ##"."""
    if op.startswith("## Call CompiledFxGraph"):
        return f"Inductor's generated code ({op.split()[3][:6]}…)"
    return op if len(op) <= 40 else op[:39] + "…"


def plot_step_split(runs: Mapping[str, DecodeRun], ax: Any = None,
                    title: str = "one decode step: the model forward and everything else") -> Any:
    """One bar per run (label -> DecodeRun), its ms per step split as EngineStats splits it."""
    ax = _axes(ax, 1.4 + 0.45 * len(runs))
    labels = list(runs)
    fwd = [1e3 * r.forward_s / r.steps for r in runs.values()]
    rest = [r.ms_per_step - f for r, f in zip(runs.values(), fwd)]
    ax.barh(labels, fwd, color=MATMUL, label="model forward + LM head (forward_time_s)")
    ax.barh(labels, rest, left=fwd, color=OTHER,
            label="rest of step(): schedule, pack, sample, commit")
    for y, (f, r) in enumerate(zip(fwd, rest)):
        ax.text(f + r, y, f"  {100 * r / (f + r):.0f}% outside", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.25 * max(f + r for f, r in zip(fwd, rest)))
    ax.set_xlabel("ms per decode step", fontsize=10)
    ax.tick_params(labelsize=10)
    ax.set_title(title, fontsize=11)
    _legend_below(ax, 2)
    return ax


def plot_top_ops(profile: OpProfile, n: int = 8, ax: Any = None, title: str | None = None) -> Any:
    """Ms per step of the `n` ops with the most self time, then of all the other ops together, then
    of the time in no op at all (Python between ops, and the profiler's own); calls per step beside."""
    ax = _axes(ax, 1.5 + 0.3 * (n + 2))
    top, rest = profile.ops[:n], profile.ops[n:]
    between = profile.wall_s - sum(op.self_s for op in profile.ops)
    rows = [(_short(op.name), op.self_s, op.calls, MATMUL if op.is_matmul else OTHER) for op in top]
    rows.append((f"the other {len(rest)} kinds of op", sum(op.self_s for op in rest),
                 sum(op.calls for op in rest), OTHER))
    rows.append(("in no op: Python between ops", between, None, OUTSIDE))
    ms = [1e3 * seconds / profile.steps for _, seconds, _, _ in rows]
    ax.barh(range(len(rows)), ms, color=[color for *_, color in rows])
    ax.set_yticks(range(len(rows)), [name for name, *_ in rows], fontsize=9)
    for y, ((_, _, calls, _), t) in enumerate(zip(rows, ms)):
        if calls is not None:
            per_step = round(calls / profile.steps)
            ax.text(t, y, f"  {per_step:,} call{'s' if per_step != 1 else ''}", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.3 * max(ms))
    ax.set_xlabel("ms per decode step (self time, under the profiler)", fontsize=10)
    ax.tick_params(axis="x", labelsize=10)
    for color, label in ((MATMUL, "a matmul kernel"), (OTHER, "any other op"), (OUTSIDE, "no op")):
        ax.barh([0], [0], color=color, label=label)
    ax.set_title(title or f"where a decode step's time goes: the {n} costliest ops, and the rest", fontsize=11)
    _legend_below(ax, 3)
    return ax


class FloorRow(NamedTuple):
    label: str  # e.g. "bfloat16"
    weight_bytes: int  # matmul weights streamed per step
    ms_per_token: float  # measured, single stream


def plot_bandwidth_floor(rows: Sequence[FloorRow], read_gb_s: float, ax: Any = None) -> Any:
    """Per precision: the measured time of a token, and the least it could take (every weight byte
    read once, at the measured read bandwidth)."""
    ax = _axes(ax, 1.4 + 0.7 * len(rows))
    ys = range(len(rows))
    floor = [1e3 * r.weight_bytes / (read_gb_s * 1e9) for r in rows]
    measured = [r.ms_per_token for r in rows]
    ax.barh([y - 0.2 for y in ys], measured, height=0.38, color=OTHER, label="measured, one token")
    ax.barh([y + 0.2 for y in ys], floor, height=0.38, color=MATMUL,
            label=f"floor: weight bytes / {read_gb_s:.0f} GB/s (read)")
    for y, (m, f) in enumerate(zip(measured, floor)):
        ax.text(m, y - 0.2, f"  {m:.1f} ms", va="center", fontsize=9)
        ax.text(f, y + 0.2, f"  {f:.1f} ms", va="center", fontsize=9)
    ax.set_yticks(list(ys), [f"{r.label}\n{r.weight_bytes / 1e6:.0f} MB" for r in rows], fontsize=10)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.2 * max(measured + floor))
    ax.set_xlabel("ms per decode token, batch 1", fontsize=10)
    ax.tick_params(axis="x", labelsize=10)
    ax.set_title("bytes per token: the time the weights alone take to stream, and the time measured",
                 fontsize=11)
    _legend_below(ax, 2)
    return ax


class RooflinePoint(NamedTuple):
    precision: str  # a key of DTYPE_COLORS
    batch: int  # rows per decode step
    flop_per_byte: float  # step_cost.intensity
    gflop_s: float  # step_cost.achieved


def plot_roofline(points: Sequence[RooflinePoint], read_gb_s: float, gemm_gflop_s: Mapping[str, float],
                  ax: Any = None) -> Any:
    """Log-log: x = FLOPs per byte of weights, y = matmul FLOP/s achieved. A roof per dtype:
    min(bandwidth * x, that dtype's GEMM peak); a point on its roof is as fast as the machine allows.
    Colour = the weights' precision, marker = rows a step."""
    import numpy as np

    ax = _axes(ax, 5.2)
    x_lo, x_hi = 0.25, 400
    xs = np.geomspace(x_lo, x_hi, 200)
    for dtype, peak in gemm_gflop_s.items():
        color = DTYPE_COLORS[dtype]
        ax.plot(xs, np.minimum(read_gb_s * xs, peak), color=color, lw=1.5, alpha=0.6)
        ax.text(x_hi, peak * 1.08, f"{dtype} GEMM peak {peak:.0f} GFLOP/s", ha="right", va="bottom",
                fontsize=9, color=color)
    # Along the slope: its angle on screen is known only when drawn (log axes, final layout).
    ax.text(0.4, read_gb_s * 0.4 * 1.2, f"memory: {read_gb_s:.0f} GB/s (read)", fontsize=9, color="0.3",
            rotation=np.degrees(np.arctan2(read_gb_s, 1)), transform_rotates_text=True,
            rotation_mode="anchor", ha="left", va="bottom")
    markers = dict(zip(sorted({p.batch for p in points}), "osD^v<>"))
    for p in points:
        ax.plot(p.flop_per_byte, p.gflop_s, markers[p.batch], ms=9, color=DTYPE_COLORS[p.precision],
                mec="black")
    for dtype in dict.fromkeys(p.precision for p in points):
        ax.plot([], [], "o", ms=9, color=DTYPE_COLORS[dtype], mec="black", label=f"{dtype} weights")
    for batch, marker in markers.items():
        ax.plot([], [], marker, ms=9, color="white", mec="black",
                label=f"{batch} row{'s' if batch > 1 else ''} a step")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(min(p.gflop_s for p in points) / 4, 3 * max(gemm_gflop_s.values()))
    ax.set_xlabel("arithmetic intensity: FLOPs per byte of weights read", fontsize=10)
    ax.set_ylabel("matmul GFLOP/s achieved", fontsize=10)
    ax.tick_params(labelsize=10)
    ax.grid(True, which="major", color="0.9")
    ax.set_title("the roofline of this machine, and where decode steps land on it", fontsize=11)
    _legend_below(ax, len(ax.get_legend_handles_labels()[0]))
    return ax
