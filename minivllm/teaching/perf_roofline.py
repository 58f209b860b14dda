"""The speed assignment's roofline: how close each few-row matmul came to the machine's read bandwidth.

A few-row matmul does 2 x rows FLOPs per weight element and must read every weight byte once, so its
arithmetic intensity is 2 x rows / bytes per element FLOP/byte: 0.5 for one fp32 row, 8 for eight bf16
rows. That is far left of any CPU's ridge point (tens of FLOP/byte), so its roof is the memory roof, and
the figure of merit is bytes read per second against the read bandwidth measured in the same trials.

    intensity (log2) on x, achieved GB/s on y
    ------------------------------------------- read bandwidth (x.sum over the working set): the roof
         o yours        x engine's kernel        one point per case (dtype, rows)

A point halfway up is a kernel that leaves half the machine's memory speed unused: a layout that is not
one stream, a horizontal sum per output, rows that each re-read the weight (skinny_gemm.py says more).
"""

from __future__ import annotations

from pathlib import Path

from minivllm.teaching.perf_measure import PerfResult


def intensity(label: str) -> float:
    """FLOP per weight byte of a speed case, from its label ("bfloat16 8 rows x 3072x576")."""
    dtype, rows = label.split()[:2]
    return 2 * int(rows) / (2 if dtype == "bfloat16" else 4)


def plot_roofline(result: PerfResult, path: str | Path, machine: str) -> Path:
    """Save the roofline of a speed result as a PNG at `path` (its folder must exist); return the path.
    `machine`: the CPU and ISA levels in words, the title's first line."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no window: the track runs in terminals and on CI
    import matplotlib.pyplot as plt

    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"--plot {path}: the folder {path.parent} does not exist; create it or give "
                                "another path")
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.axhline(result.read_gb_s, color="black", lw=1.5, label=f"read bandwidth {result.read_gb_s:.1f} GB/s (the roof)")
    for dtype, color in (("float32", "tab:blue"), ("bfloat16", "tab:orange")):
        cases = [c for c in result.cases if c.label.startswith(dtype)]
        if not cases:
            continue
        xs = [intensity(c.label) for c in cases]
        ax.plot(xs, [c.gb_s(c.student_s) for c in cases], "o-", color=color, label=f"yours, {dtype}")
        ax.plot(xs, [c.gb_s(c.engine_s) for c in cases], "x--", color=color, label=f"engine's kernel, {dtype}")
        for x, c in zip(xs, cases):
            ax.annotate(c.label.split(" x ")[0].split(" ", 1)[1], (x, c.gb_s(c.student_s)), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("arithmetic intensity (FLOP per weight byte)")
    ax.set_ylabel("weight bytes read per second (GB/s)")
    ax.set_ylim(bottom=0, top=1.15 * max([result.read_gb_s] + [c.gb_s(min(c.student_s, c.engine_s))
                                                                for c in result.cases]))
    ax.set_title(f"few-row matmul on {machine}\n{result.student_name} vs {result.engine_name}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: never over a point
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
