"""Pictures of real engine state, for the notebooks and the docs (needs matplotlib).

    plot_timeline(trace)        which request ran in which step: prefill chunks, decodes, preemptions
    plot_block_map(step)        the KV pool after a step: who owns each block, free, free-but-cached
    plot_cache_hits(outputs)    per request: prompt tokens computed vs. served from the prefix cache
"""

from __future__ import annotations

from typing import Any

from minivllm.engine.trace import StepTrace
from minivllm.outputs import RequestOutput


def _axes(ax: Any, size: tuple[float, float]) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size)[1]


def plot_timeline(trace: list[StepTrace], ax: Any = None) -> Any:
    """Rows are requests (in arrival order), columns are steps."""
    ax = _axes(ax, (10, 3.5))
    rows: dict[str, int] = {}
    for st in trace:
        for s in st.scheduled:
            rows.setdefault(s.request_id, len(rows))
    for st in trace:
        for s in st.scheduled:
            color = "tab:blue" if s.is_prefill else "tab:green"
            ax.barh(rows[s.request_id], 0.9, left=st.step - 0.45, color=color, height=0.7)
            if s.is_prefill and s.num_new_tokens > 1:
                ax.text(st.step, rows[s.request_id], str(s.num_new_tokens), ha="center", va="center", fontsize=6,
                        color="white")
        for rid in st.preempted:
            ax.plot(st.step, rows.get(rid, 0), "rx", markersize=8)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_xlabel("step")
    ax.set_title("scheduler timeline: blue = prefill chunk (tokens), green = decode, x = preempted")
    return ax


def plot_block_map(step: StepTrace, ax: Any = None, columns: int = 16) -> Any:
    """One cell per physical block, coloured by owner; hatched = findable in the prefix cache."""
    import matplotlib.pyplot as plt

    ax = _axes(ax, (8, 0.5 + 0.5 * -(-step.num_total_blocks // columns)))
    owners: dict[int, list[str]] = {}
    for rid, table in step.block_tables.items():
        for b in table:
            owners.setdefault(b, []).append(rid)
    palette = plt.get_cmap("tab10")
    ids = sorted(step.block_tables)
    for b in range(step.num_total_blocks):
        x, y = b % columns, b // columns
        who = owners.get(b, [])
        face = "white" if not who else ("gold" if len(who) > 1 else palette(ids.index(who[0]) % 10))
        ax.add_patch(plt.Rectangle((x, y), 0.95, 0.95, facecolor=face, edgecolor="grey",
                                   hatch="//" if b in step.cached_blocks else None))
        ax.text(x + 0.47, y + 0.5, str(b), ha="center", va="center", fontsize=6)
    ax.set_xlim(0, columns)
    ax.set_ylim(-(-step.num_total_blocks // columns), 0)
    ax.set_axis_off()
    legend = [plt.Rectangle((0, 0), 1, 1, facecolor=palette(i % 10)) for i in range(len(ids))]
    legend += [plt.Rectangle((0, 0), 1, 1, facecolor="gold"),
               plt.Rectangle((0, 0), 1, 1, facecolor="white", hatch="//")]
    ax.legend(legend, ids + ["shared", "cached"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(f"KV pool after step {step.step}: {len(step.free_blocks)} of {step.num_total_blocks} blocks free")
    return ax


def plot_cache_hits(outputs: list[RequestOutput], ax: Any = None) -> Any:
    ax = _axes(ax, (7, 3))
    names = [o.request_id for o in outputs]
    cached = [o.num_cached_tokens for o in outputs]
    computed = [len(o.prompt_token_ids) - c for o, c in zip(outputs, cached)]
    ax.bar(names, cached, color="tab:orange", label="from the prefix cache")
    ax.bar(names, computed, bottom=cached, color="tab:blue", label="computed")
    ax.set_ylabel("prompt tokens")
    ax.legend()
    ax.set_title("prefix-cache hits per request")
    return ax
