"""Pictures of real engine state, for the notebooks and the docs (needs matplotlib).

    plot_timeline(trace)              which request ran in which step: prefill chunks, decodes, preemptions
    plot_block_map(step)              the KV pool after a step: who owns each block, free, free-but-cached
    plot_cache_hits(outputs)          per request: prompt tokens computed vs. served from the prefix cache
    plot_slot_map(...)                which KV slots one step writes, and for which request
    plot_block_tables(seqs, ...)      block tables side by side, with ref counts (the n sequences of n > 1)
    plot_acceptance(trace)            speculative decoding: drafts accepted and rejected per step
    plot_static_batches(lens, size)   what a static batch would do with the same requests (padding)
    plot_distributions(series, ...)   probability bars side by side (before/after, target/draft)
    plot_weight_shards(shapes, ...)   tensor parallelism: which rank holds which rows or columns of each weight

Every figure follows the same conventions, so that it reads at the docs site's width: 8 inches wide,
text of 9 pt or more, integer step ticks, steps numbered as in the trace (`StepTrace.step`, from 0),
legends outside the data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from minivllm.engine.metrics.trace import StepTrace
from minivllm.models.sharding import WeightSlice
from minivllm.outputs import RequestOutput

WIDTH = 8.0  # inches: about the content width of the docs site, so 10 pt stays 10 pt
PREFILL, DECODE, PREEMPT, PAD = "tab:blue", "tab:green", "tab:red", "0.85"
# matplotlib's ten categorical colours ("tab10") by name, to tell requests or ranks apart: i -> _TAB10[i % 10]
_TAB10 = tuple("tab:" + c for c in "blue orange green red purple brown pink gray olive cyan".split())


def _axes(ax: Any, size: tuple[float, float]) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size, layout="constrained")[1]


def _integer_steps(ax: Any, label: str = "step") -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(label, fontsize=10)
    ax.tick_params(labelsize=10)


def _legend_below(ax: Any, handles: list[Any], labels: list[str]) -> None:
    """Below the whole figure (constrained layout makes room for it), never over the data."""
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    if isinstance(ax.figure.get_layout_engine(), ConstrainedLayoutEngine):
        ax.figure.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=9, frameon=False)
    else:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(labels),
                  fontsize=9, frameon=False)


def _patch(face: Any, xy: tuple[float, float] = (0, 0), width: float = 1, height: float = 1, **style: Any) -> Any:
    """A rectangle: a cell of a picture (for `ax.add_patch`) or, at the defaults, a legend's swatch."""
    import matplotlib.pyplot as plt

    return plt.Rectangle(xy, width, height, facecolor=face, **{"edgecolor": "grey", **style})


def plot_timeline(trace: list[StepTrace], ax: Any = None, title: str = "scheduler timeline") -> Any:
    """Rows are requests (in order of first appearance), columns are steps."""
    rows: dict[str, int] = {}
    for st in trace:
        for s in st.scheduled:
            rows.setdefault(s.request_id, len(rows))
    ax = _axes(ax, (WIDTH, 1.3 + 0.42 * len(rows)))
    count_size = 9 if len(trace) <= 30 else 8
    for st in trace:
        for s in st.scheduled:
            color = PREFILL if s.is_prefill else DECODE
            ax.barh(rows[s.request_id], 0.9, left=st.step - 0.45, color=color, height=0.7)
            if s.is_prefill and s.num_new_tokens > 1 and len(str(s.num_new_tokens)) <= 2:
                ax.text(st.step, rows[s.request_id], str(s.num_new_tokens), ha="center", va="center",
                        fontsize=count_size, color="white", fontweight="bold")
    handles, labels = [_patch(PREFILL), _patch(DECODE)], ["prefill chunk (number = its tokens)", "decode (1 token)"]
    preempted = [(st.step, rows.get(rid, 0)) for st in trace for rid in st.preempted]
    if preempted:  # one marker series for all of them, which is also their legend entry
        handles += ax.plot(*zip(*preempted), "x", color=PREEMPT, markersize=9, markeredgewidth=2)
        labels.append("preempted")
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    _integer_steps(ax)
    ax.set_title(title, fontsize=11)
    _legend_below(ax, handles, labels)
    return ax


def plot_block_map(step: StepTrace, ax: Any = None, columns: int = 16) -> Any:
    """One cell per physical block, coloured by owner; hatched = findable in the prefix cache."""
    nrows = -(-step.num_total_blocks // columns)
    ax = _axes(ax, (WIDTH, 1.0 + 0.5 * nrows))
    owners: dict[int, list[str]] = {}
    for rid, table in step.block_tables.items():
        for b in table:
            owners.setdefault(b, []).append(rid)
    ids = sorted(step.block_tables)
    for b in range(step.num_total_blocks):
        x, y = b % columns, b // columns
        who = owners.get(b, [])
        face = "white" if not who else ("gold" if len(who) > 1 else _TAB10[ids.index(who[0]) % 10])
        ax.add_patch(_patch(face, (x, y), 0.95, 0.95, hatch="//" if b in step.cached_blocks else None))
        ax.text(x + 0.47, y + 0.5, str(b), ha="center", va="center", fontsize=9)
    ax.set(xlim=(0, columns), ylim=(nrows, 0), aspect="equal")
    ax.set_axis_off()
    legend = [_patch(_TAB10[i % 10]) for i in range(len(ids))] + [_patch("gold"), _patch("white", hatch="//")]
    ax.legend(legend, ids + ["shared", "prefix-cached"], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=9, frameon=False)
    ax.set_title(f"KV pool after step {step.step}: {len(step.free_blocks)} of {step.num_total_blocks} "
                 "blocks free (number = physical block id)", fontsize=11)
    return ax


def plot_cache_hits(outputs: list[RequestOutput], ax: Any = None) -> Any:
    ax = _axes(ax, (WIDTH * 0.75, 3.2))
    names = [o.request_id for o in outputs]
    cached = [o.num_cached_tokens for o in outputs]
    computed = [len(o.prompt_token_ids) - c for o, c in zip(outputs, cached)]
    ax.bar(names, cached, color="tab:orange", label="from the prefix cache")
    ax.bar(names, computed, bottom=cached, color=PREFILL, label="computed")
    ax.set_ylabel("prompt tokens", fontsize=10)
    ax.tick_params(labelsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    ax.set_title("prefix-cache hits per request", fontsize=11)
    return ax


def plot_slot_map(slot_mapping: Sequence[int], positions: Sequence[int], query_lens: Sequence[int],
                  names: Sequence[str], num_blocks: int, block_size: int, ax: Any = None,
                  blocks_per_row: int = 8) -> Any:
    """The KV pool as blocks of `block_size` slots; a slot written this step is coloured by its
    request and shows the token position whose K/V lands there (rows: `query_lens` per request)."""
    nrows = -(-num_blocks // blocks_per_row)
    ax = _axes(ax, (WIDTH, 0.9 + 0.62 * nrows))
    request_of_row = [r for r, n in enumerate(query_lens) for _ in range(n)]  # rows are packed request by request
    owner = {int(slot): (r, int(pos)) for slot, pos, r in zip(slot_mapping, positions, request_of_row)}
    gap = 0.25  # between blocks
    for b in range(num_blocks):
        x0, y = (b % blocks_per_row) * (block_size + gap), b // blocks_per_row
        for i in range(block_size):
            slot = b * block_size + i
            r, pos = owner.get(slot, (None, None))
            face = "#f2f2f2" if r is None else _TAB10[r % 10]
            ax.add_patch(_patch(face, (x0 + i, y), 1, 0.8, edgecolor="white", linewidth=1.5))
            if r is not None:
                ax.text(x0 + i + 0.5, y + 0.4, f"p{pos}", ha="center", va="center", fontsize=8, color="white",
                        fontweight="bold")
        ax.text(x0 + block_size / 2, y + 0.8, f"block {b}", ha="center", va="top", fontsize=8, color="0.35")
    ax.set(xlim=(-0.1, blocks_per_row * (block_size + gap)), ylim=(nrows + 0.1, -0.1))
    ax.set_axis_off()
    handles = [_patch(_TAB10[r % 10]) for r in range(len(names))] + [_patch("#f2f2f2")]
    ax.legend(handles, [f"request {n}" for n in names] + ["not written this step"], loc="upper center",
              bbox_to_anchor=(0.5, 0.0), ncol=len(names) + 1, fontsize=9, frameon=False)
    ax.set_title(f"KV slots this step writes ({block_size} slots a block; pN = the token at position N)",
                 fontsize=11)
    return ax


def plot_block_tables(seqs: Sequence[Any], ref_counts: Sequence[int], block_size: int, ax: Any = None,
                      title: str | None = None) -> Any:
    """Each sequence's block table as a row of physical blocks. Gold = shared (ref count > 1, shown
    under the block: the prefix cache shares a prompt's full blocks, as between the n sequences of an
    n > 1 request), coloured = the sequence's own. The bar inside a block shows how many of its slots
    hold tokens."""
    width = max(len(s.block_table) for s in seqs)
    ax = _axes(ax, (WIDTH, 0.9 + 0.85 * len(seqs)))
    for r, seq in enumerate(seqs):
        y = r * 1.3
        for j, b in enumerate(seq.block_table):
            shared = ref_counts[b] > 1
            face = "gold" if shared else _TAB10[(r + 1) % 10]
            ax.add_patch(_patch(face, (j * 1.6, y), 1.4, 0.9, edgecolor="0.3", alpha=0.9))
            filled = min(block_size, max(0, seq.num_tokens - j * block_size))
            ax.add_patch(_patch("0.2", (j * 1.6, y + 0.78), 1.4 * filled / block_size, 0.12, edgecolor="none"))
            ax.text(j * 1.6 + 0.7, y + 0.4, str(b), ha="center", va="center", fontsize=12, fontweight="bold")
            note = f"ref {ref_counts[b]}" if shared else "own"
            ax.text(j * 1.6 + 0.7, y + 1.08, f"{note} · {filled}/{block_size}", ha="center", va="center",
                    fontsize=8.5)
        ax.text(-0.2, y + 0.45, seq.request_id, ha="right", va="center", fontsize=10)
    ax.set(xlim=(-2.6, width * 1.6), ylim=(len(seqs) * 1.3, -0.2))
    ax.set_axis_off()
    keys = [(_patch("gold"), "shared block (ref count > 1)"), (_patch("0.2"), "slots holding tokens")]
    ax.legend(*zip(*keys), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=9, frameon=False)
    ax.set_title(title or "block tables (number = physical block id)", fontsize=11)
    return ax


def plot_acceptance(trace: list[StepTrace], ax: Any = None) -> Any:
    """Per decode step, the drafts verified: accepted (green) and rejected (red); a grey tick where
    the proposer had nothing to propose. A row group that verified d drafts and accepted a of them
    emitted a + 1 tokens (the +1 is the target's own)."""
    decodes = [st for st in trace if any(not s.is_prefill for s in st.scheduled)]
    ax = _axes(ax, (WIDTH, 2.8))
    xs = [st.step for st in decodes]
    acc = [sum(s.num_accepted_tokens for s in st.scheduled) for st in decodes]
    rej = [sum(s.num_draft_tokens - s.num_accepted_tokens for s in st.scheduled) for st in decodes]
    ax.bar(xs, acc, color=DECODE, label="accepted drafts")
    ax.bar(xs, rej, bottom=acc, color="tab:red", alpha=0.55, label="rejected drafts")
    none = [x for x, a, r in zip(xs, acc, rej) if a + r == 0]
    if none:
        ax.bar(none, [0.12] * len(none), color="0.55", label="no draft proposed")
    ax.set_ylabel("drafts", fontsize=10)
    _integer_steps(ax)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    ax.set_title("speculative decoding: drafts verified per step", fontsize=11)
    return ax


def plot_static_batches(output_lens: Sequence[int], batch_size: int, names: Sequence[str] | None = None,
                        ax: Any = None) -> Any:
    """A static batch (HF `generate`-style): requests in groups of `batch_size`, in order; a group
    starts when the previous one has ended, takes one prefill step, then runs until its longest
    request is done. Grey = a row computed for a request that already finished (padding)."""
    names = list(names or [f"r{i}" for i in range(len(output_lens))])
    ax = _axes(ax, (WIDTH, 1.3 + 0.42 * len(names)))
    start = 0
    for g in range(0, len(output_lens), batch_size):
        group = list(range(g, min(g + batch_size, len(output_lens))))
        longest = max(output_lens[i] for i in group)
        for i in group:
            ax.barh(i, 0.9, left=start - 0.45, color=PREFILL, height=0.7)  # the first token comes with it
            for t in range(1, longest):
                ax.barh(i, 0.9, left=start + t - 0.45, color=DECODE if t < output_lens[i] else PAD, height=0.7)
        start += longest
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)
    _integer_steps(ax)
    ax.set_title(f"a static batch of {batch_size} on the same requests", fontsize=11)
    _legend_below(ax, [_patch(PREFILL), _patch(DECODE), _patch(PAD)],
                  ["prefill (whole prompt)", "decode", "padding: finished, still in the batch"])
    return ax


def plot_distributions(series: Mapping[str, Sequence[float]], labels: Sequence[str], ax: Any = None,
                       title: str = "", ylabel: str = "probability") -> Any:
    """Grouped bars: one group per label (a token), one bar per series (a distribution)."""
    ax = _axes(ax, (WIDTH, 3.2))
    n = len(series)
    width = 0.8 / n
    for k, (name, values) in enumerate(series.items()):
        ax.bar([i + (k - (n - 1) / 2) * width for i in range(len(labels))], [float(v) for v in values], width,
               label=name)
    ax.set_xticks(range(len(labels)), list(labels), fontsize=10, rotation=30 if max(map(len, labels)) > 6 else 0)
    ax.tick_params(labelsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    _legend_below(ax, *ax.get_legend_handles_labels())
    ax.set_title(title, fontsize=11)
    return ax


def plot_weight_shards(shapes: Mapping[str, tuple[int, int]], slices: Mapping[str, Sequence[WeightSlice | None]],
                       ax: Any = None, title: str = "") -> Any:
    """Weight matrices side by side, drawn to scale (a linear layer's rows are its output features and
    its columns its input features; an embedding's rows are token ids and its columns the hidden
    size: a table looked up, not multiplied), each part coloured by the rank that holds it.
    `slices[name][r]` is rank r's `WeightSlice` (`ShardLayout.checkpoint_slice`); None, or the same
    slice on every rank, is drawn as held by every rank (replicated)."""
    everyone = "0.75"
    gap = 0.6 * max(cols for _, cols in shapes.values())
    width = sum(cols for _, cols in shapes.values()) + gap * (len(shapes) - 1)
    tallest = max(rows for rows, _ in shapes.values())
    head = 0.3 * tallest  # room above the tallest matrix for the labels
    ax = _axes(ax, (WIDTH, 0.9 + WIDTH * (tallest + head) / width))
    x, ranks, replicated = 0.0, 0, False
    for name, (rows, cols) in shapes.items():
        parts = list(slices[name])
        ranks = max(ranks, len(parts))
        if any(s is None for s in parts) or len(set(parts)) == 1:
            ax.add_patch(_patch(everyone, (x, 0), cols, rows, edgecolor="black"))
            replicated, split = True, "whole"
        else:
            split = "by rows" if parts[0].dim == 0 else "by columns"
            for r, s in enumerate(parts):  # dim 0: a band of rows; dim 1: a band of columns
                band = s.stop - s.start
                xy, w, h = ((x, s.start), cols, band) if s.dim == 0 else ((x + s.start, 0), band, rows)
                ax.add_patch(_patch(_TAB10[r % 10], xy, w, h, edgecolor="black"))
        ax.text(x + cols / 2, -0.03 * tallest, f"{name}\n{rows}×{cols}\n{split}", ha="center", va="bottom",
                fontsize=9)
        x += cols + gap
    ax.set(xlim=(-gap / 4, width + gap / 4), ylim=(tallest * 1.02, -head), aspect="equal", xticks=[], yticks=[])
    ax.spines[:].set_visible(False)  # no frame: each matrix has its own edge
    ax.set_xlabel("columns: input features; an embedding's: the hidden size (all to one scale)", fontsize=10)
    ax.set_ylabel("rows: output features;\nan embedding's: token ids", fontsize=10)
    handles = [_patch(_TAB10[r % 10]) for r in range(ranks)] + ([_patch(everyone)] if replicated else [])
    labels = [f"rank {r}" for r in range(ranks)] + (["every rank (replicated)"] if replicated else [])
    _legend_below(ax, handles, labels)
    ax.set_title(title, fontsize=11)
    return ax
