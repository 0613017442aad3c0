"""Drawings of a subgraph and of its interventions, as the biology paper draws them (Lindsey et al. 2025,
"On the biology of a large language model"): the parts as labelled boxes at their layer and position,
arrows as wide as their weight; and the intervention figure, a panel per intervened part and scale, each
other part's change measured beside the graph's prediction. Functions of the objects they draw
(`Subgraph.plot`, `SupernodeInterventions.plot` call them)."""

import os
from pathlib import Path

from hooked_models.attribution.export import EDGE_COLOURS


def _row(graph, i: int) -> float:
    """Node i's row: 0 for embeddings, layer + 1 for features and errors, n_layers + 1 for the outputs."""
    layer, _ = graph.node_position(i)
    return 0.0 if layer is None else float(layer + 1)


def plot_subgraph(subgraph, path: "str | os.PathLike | None" = None, ax=None, title: str | None = None):
    """See `Subgraph.plot`."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    graph, parts = subgraph.graph, subgraph.parts
    xy = []
    for part in parts:
        rows = [_row(graph, i) for i in part.nodes]
        columns = [graph.node_position(i)[1] for i in part.nodes]
        xy.append([sum(columns) / len(columns), sum(rows) / len(rows)])
    # Parts that would overlap (one row, closer than a box) are pushed apart along the row.
    order = sorted(range(len(parts)), key=lambda k: (round(xy[k][1], 3), xy[k][0]))
    for a, b in zip(order, order[1:]):
        if abs(xy[a][1] - xy[b][1]) < 0.5 and xy[b][0] - xy[a][0] < 1.6:
            xy[b][0] = xy[a][0] + 1.6
    if ax is None:
        width = max(6.0, 1.1 * (max(x for x, _ in xy) - min(x for x, _ in xy)) + 4) if xy else 6.0
        fig, ax = plt.subplots(figsize=(min(width, 18.0), 1.3 * (graph.n_layers + 2) + 1.5))
    else:
        fig = ax.figure
    edges = subgraph.edges()
    off_diagonal = [(t, s, float(edges[t, s])) for t in range(len(parts)) for s in range(len(parts))
                    if t != s and float(edges[t, s]) != 0.0]
    biggest = max((abs(w) for _, _, w in off_diagonal), default=1.0)
    for t, s, w in sorted(off_diagonal, key=lambda e: abs(e[2])):  # the strongest drawn last, on top
        ax.add_patch(FancyArrowPatch(tuple(xy[s]), tuple(xy[t]), arrowstyle="-|>", mutation_scale=12,
                                     color=EDGE_COLOURS["positive" if w > 0 else "negative"],
                                     linewidth=0.5 + 6 * abs(w) / biggest, alpha=0.55, zorder=1,
                                     shrinkA=14, shrinkB=14, connectionstyle="arc3,rad=0.08"))
    for part, (x, y) in zip(parts, xy):
        label = part.name if len(part.name) <= 28 else part.name[:27] + "…"
        if part.supernode:
            label += f"\n({len(part.nodes)} nodes)"
        ax.text(x, y, label, ha="center", va="center", fontsize=8, zorder=2,
                bbox=dict(boxstyle="round,pad=0.4", facecolor="#fde68a" if part.supernode else "#f3f4f6",
                          edgecolor="black", linewidth=0.8))
    ax.set_xticks(range(graph.n_pos), graph.str_tokens_or_ids(), rotation=45, ha="right")
    ax.set_yticks(range(graph.n_layers + 2), ["emb", *[f"L{l}" for l in range(graph.n_layers)], "logits"])
    xs = [x for x, _ in xy] or [0.0]
    ax.set_xlim(min(-0.5, min(xs) - 1), max(graph.n_pos - 0.5, max(xs) + 1))
    ax.set_ylim(-0.6, graph.n_layers + 1.6)
    ax.grid(axis="y", color="#eeeeee", zorder=0)
    share = subgraph.kept_influence()
    ax.set_title(title or f"subgraph: {len(parts)} parts, {len(off_diagonal)} edges; influence kept: "
                          f"nodes {share.nodes:.0%}, paths {share.paths:.0%}", fontsize=9)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def plot_interventions(table, path: "str | os.PathLike | None" = None, mode: str | None = None):
    """See `SupernodeInterventions.plot`: one row of panels per intervened part, one column per scale;
    in each, every other part's and output's change, measured (solid) beside predicted (hatched)."""
    import matplotlib.pyplot as plt

    mode = mode or table.modes[0]
    if mode not in table.modes:
        raise ValueError(f"mode={mode!r}: this table has {table.modes}")
    rows = [r for r in table.rows if r.mode == mode]
    intervened = list(dict.fromkeys(r.intervened for r in rows))
    scales = list(dict.fromkeys(r.scale for r in rows))
    fig, axes = plt.subplots(len(intervened), len(scales), squeeze=False,
                             figsize=(3.6 * len(scales) + 1, 2.6 * len(intervened) + 0.8))
    for i, name in enumerate(intervened):
        for j, scale in enumerate(scales):
            ax = axes[i][j]
            cell = [r for r in rows if r.intervened == name and r.scale == scale]
            xs = range(len(cell))
            ax.bar([x - 0.2 for x in xs], [r.measured for r in cell], width=0.4, color="#2563eb", label="measured")
            ax.bar([x + 0.2 for x in xs], [r.predicted for r in cell], width=0.4, color="white", edgecolor="#2563eb",
                   hatch="///", label="graph's prediction")
            ax.axhline(0, color="black", linewidth=0.6)
            ax.set_xticks(list(xs), [r.outcome if len(r.outcome) <= 18 else r.outcome[:17] + "…" for r in cell],
                          rotation=40, ha="right", fontsize=7)
            ax.set_title(f"{name} x {scale:g}", fontsize=8)
            if j == 0:
                ax.set_ylabel("change", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"interventions ({table.describe(mode)})", fontsize=9)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig
