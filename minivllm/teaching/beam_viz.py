"""A beam search drawn as a tree (notebook 12; needs matplotlib).

    plot_beam_tree(search, tokenizer)     every beam kept at every step, its token and score; the
                                          final beams' paths in colour, the best one thickest

Step 0 is the prompt. At step t the beams kept (`BeamSearch.history[t]`) are drawn top to bottom in
their rank, each joined to the beam it extends (the one whose tokens are its tokens but the last). A
beam that no later step extends was pruned there (grey); a beam that ended in EOS is complete (a
square). The conventions are teaching/viz.py's: 8 inches wide, text of 8 pt or more, integer steps.
"""

from __future__ import annotations

from typing import Any

from minivllm.beam_search import BeamSearch, BeamSearchSequence
from minivllm.teaching.viz import WIDTH, _axes, _integer_steps, _legend_below

BEST, FINAL, PRUNED = "tab:green", "tab:blue", "0.6"


def plot_beam_tree(search: BeamSearch, tokenizer: Any, ax: Any = None, title: str = "beam search") -> Any:
    """Draw `search` (finished, or stopped after any step) as a tree; label = token text and cum logprob."""
    import matplotlib.lines as mlines

    final = sorted(search.completed + search.beams, key=search.score, reverse=True)[:search.params.beam_width]
    best_path, final_paths = set(), set()
    for rank, beam in enumerate(final):
        for t in range(len(search.prompt_token_ids), len(beam.tokens) + 1):
            (best_path if rank == 0 else final_paths).add(tuple(beam.tokens[:t]))
    nodes: dict[tuple[int, ...], tuple[int, int]] = {}  # tokens -> (step, row)
    for step, beams in enumerate(search.history):
        for row, beam in enumerate(beams):
            nodes[tuple(beam.tokens)] = (step, row)
    for beam in search.completed:
        nodes[tuple(beam.tokens)] = (len(beam.tokens) - len(search.prompt_token_ids),
                                     search.params.beam_width + search.completed.index(beam))
    rows = max(row for _, row in nodes.values()) + 1
    ax = _axes(ax, (WIDTH, 1.0 + 0.55 * rows))

    def style(tokens: tuple[int, ...]) -> tuple[str, float]:
        if tokens in best_path:
            return BEST, 2.6
        return (FINAL, 1.6) if tokens in final_paths else (PRUNED, 0.9)

    beams_by_tokens: dict[tuple[int, ...], BeamSearchSequence] = {
        tuple(b.tokens): b for beams in search.history for b in beams}
    beams_by_tokens.update({tuple(b.tokens): b for b in search.completed})
    for tokens, (step, row) in nodes.items():
        color, width = style(tokens)
        parent = nodes.get(tokens[:-1])
        if parent is not None and step > 0:
            ax.plot([parent[0], step], [-parent[1], -row], color=color, lw=width, zorder=1)
        beam = beams_by_tokens[tokens]
        complete = any(beam is c for c in search.completed)
        ax.scatter([step], [-row], s=40, color=color, marker="s" if complete else "o", zorder=2)
        text = "prompt" if step == 0 else f"{tokenizer.decode([tokens[-1]])!r}  {beam.cum_logprob:.2f}"
        ax.annotate(text, (step, -row), xytext=(5, 5), textcoords="offset points", fontsize=8,
                    color="0.4" if color == PRUNED else "black")
    ax.set_yticks([])
    ax.set_xlim(-0.3, max(s for s, _ in nodes.values()) + 0.9)
    ax.set_ylim(-rows + 0.4, 0.8)
    _integer_steps(ax)
    ax.set_title(title, fontsize=11)
    handles = [mlines.Line2D([], [], color=c, lw=w) for c, w in ((BEST, 2.6), (FINAL, 1.6), (PRUNED, 0.9))]
    _legend_below(ax, handles, ["the best beam", "the other final beams", "pruned"])
    return ax
