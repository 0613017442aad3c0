"""The circuit diagram: where each box and port sits, how an edge is routed around boxes, and the drawing."""

import math
import os
import re

import torch


_NODE = re.compile(r"^layers\.(\d+)\.(?:self_attn\.(head|kv_head)\.(\d+)(?:\.([qkv]))?|mlp(?:\.expert\.(\d+))?)$")


def _sizes_from_names(nodes: list[str]) -> dict:
    """A graph's sizes read off its node names (for a graph built without them)."""
    sizes = dict(num_layers=1, num_heads=1, num_kv_heads=1, experts=0)
    for node in nodes:
        match = _NODE.match(node)
        if match:
            layer, kind, index, _, expert = match.groups()
            sizes["num_layers"] = max(sizes["num_layers"], int(layer) + 1)
            key = {"head": "num_heads", "kv_head": "num_kv_heads"}.get(kind)
            if key:
                sizes[key] = max(sizes[key], int(index) + 1)
            if expert is not None:
                sizes["experts"] = max(sizes["experts"], int(expert) + 1)
    return sizes


class _Placement:
    """Where Graph.plot draws each box (input, heads, key/value heads under GQA, MLPs or experts, logits)
    and each reader's port. Layer i's heads sit at height 2i + 1, its MLP at 2i + 2."""

    def __init__(self, sizes: dict):
        self.layers, self.heads, self.kv_heads = sizes["num_layers"], sizes["num_heads"], sizes["num_kv_heads"]
        self.experts = sizes.get("experts") or 0
        self.groups = max(self.heads // max(self.kv_heads, 1), 1)
        self.width = max(self.heads, self.experts, 1)

    def _x(self, index, count):
        return index + (self.width - count) / 2

    def box_of(self, node: str) -> str:
        """The box a node is drawn in: a head's q/k/v ports are on the head's box, and so are a key/value
        head's under multi-head attention; under GQA a key/value head has a box of its own."""
        match = _NODE.match(node)
        if match and match.group(2) == "kv_head" and self.groups == 1:
            return f"layers.{match.group(1)}.self_attn.head.{match.group(3)}"
        return re.sub(r"\.[qkv]$", "", node)

    def order(self, box: str) -> tuple:
        x, y, _ = self.box(box)
        return y, x

    def box(self, box: str) -> tuple[float, float, float]:
        """(x, y, width) of a box."""
        middle = (self.width - 1) / 2
        if box in ("input", "logits"):
            return middle, (0.0 if box == "input" else 2 * self.layers + 1.0), 0.76
        layer, kind, index, _, expert = _NODE.match(box).groups()
        if kind == "head":
            return self._x(int(index), self.heads), 2 * int(layer) + 1.0, 0.76
        if kind == "kv_head":  # under its group of query heads, below them
            return self._x(int(index) * self.groups + (self.groups - 1) / 2, self.heads), 2 * int(layer) + 0.45, 0.6
        if expert is not None:
            return self._x(int(expert), self.experts), 2 * int(layer) + 2.0, 0.76
        return middle, 2 * int(layer) + 2.0, 0.76

    def label(self, box: str) -> str:
        if box in ("input", "logits"):
            return box
        layer, kind, index, _, expert = _NODE.match(box).groups()
        if kind:
            return f"L{layer} {'H' if kind == 'head' else 'KV'}{index}"
        return f"L{layer} E{expert}" if expert is not None else f"L{layer} MLP"

    def is_kv_box(self, box: str) -> bool:
        match = _NODE.match(box)
        return bool(match) and match.group(2) == "kv_head"

    def group_heads(self, kv_box: str) -> list[str]:
        """The query heads a (GQA) key/value head's box feeds."""
        layer, _, index, _, _ = _NODE.match(kv_box).groups()
        return [f"layers.{layer}.self_attn.head.{h}"
                for h in range(int(index) * self.groups, (int(index) + 1) * self.groups)]

    @staticmethod
    def route(start: tuple[float, float], end: tuple[float, float],
              obstacles: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
        """Points from `start` up to `end` (an edge always runs upwards) that cross each row of boxes
        (x, y, width) lying between them vertically, where the straight way would, or else through the
        nearest gap between the row's boxes."""
        points, (x0, y0) = [start], start
        for y in sorted({by for _, by, _ in obstacles if start[1] < by < end[1]}):
            row = [(bx, w) for bx, by, w in obstacles if by == y]

            def free(x):
                return all(abs(x - bx) >= w / 2 + 0.06 for bx, w in row)

            x = x0 + (end[0] - x0) * (y - 0.26 - y0) / (end[1] - y0)
            if not free(x):
                gaps = [bx + side * (w / 2 + 0.12) for bx, w in row for side in (-1, 1)]
                x = min((g for g in gaps if free(g)), key=lambda g: abs(g - x))
            points += [(x, y - 0.26), (x, y + 0.26)]
            x0, y0 = x, y + 0.26
        return points + [end]

    def source(self, writer: str) -> tuple[float, float]:
        x, y, _ = self.box(writer)
        return x, y + 0.17

    @staticmethod
    def kind(reader: str) -> str:
        return reader[-1] if re.search(r"\.[qkv]$", reader) else ("logits" if reader == "logits" else "mlp")

    def port(self, reader: str) -> tuple[float, float]:
        x, y, _ = self.box(self.box_of(reader))
        part = reader[-1] if re.search(r"\.[qkv]$", reader) else None
        return x + {"q": -0.25, "k": 0.0, "v": 0.25, None: 0.0}[part], y - 0.17


def draw(graph, path: "str | os.PathLike | None" = None, ax=None, title: str | None = None):
    """`Graph.plot`'s figure (see there) for any graph: the boxes its nodes need, its edges routed between."""
    try:
        import matplotlib

        if ax is None and path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
        from matplotlib.path import Path as PlotPath
    except ImportError:
        raise ImportError("Graph.plot needs matplotlib (pip install matplotlib)") from None
    place = _Placement(graph.sizes or _sizes_from_names(graph.nodes))
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * place.width + 2), 1.8 + 1.5 * (2 * place.layers + 1)))
    fig = ax.figure
    signed = graph.scores.float() if graph.scores is not None else torch.ones(len(graph))
    magnitude = signed.abs()
    top = float(magnitude.max()) if len(graph) and float(magnitude.max()) > 0 else 1.0
    if graph.clean_metric is not None and graph.corrupted_metric != graph.clean_metric:
        direction = math.copysign(1.0, graph.corrupted_metric - graph.clean_metric)
    else:
        direction = math.copysign(1.0, float(signed.sum())) if len(graph) else 1.0
    drawn = {place.box_of(n) for n in graph.nodes} | {"input", "logits"}
    feeds = {kv: place.group_heads(kv) for kv in drawn if place.is_kv_box(kv)}  # GQA: a KV box's query heads
    fed = {head for heads in feeds.values() for head in heads} - drawn  # drawn faint: in no edge
    drawn |= fed
    boxes = {box: place.box(box) for box in drawn}
    for box in sorted(drawn, key=place.order):
        x, y, w = boxes[box]
        ax.add_patch(FancyBboxPatch((x - w / 2, y - 0.17), w, 0.34, boxstyle="round,pad=0.02",
                                    facecolor="white" if box in fed else "#f2f2f2",
                                    edgecolor="#bbbbbb" if box in fed else "#555555", linewidth=1, zorder=3))
        ax.text(x, y, place.label(box), ha="center", va="center", fontsize=8, zorder=4,
                color="#999999" if box in fed else "black")
    for kv, heads in feeds.items():
        x, y, _ = boxes[kv]
        for head in heads:
            hx, hy, _ = boxes[head]
            ax.plot([x, hx], [y + 0.17, hy - 0.19], color="#777777", linewidth=0.9, zorder=2.5)
    colours = {"q": "tab:blue", "k": "tab:green", "v": "tab:orange", "mlp": "tab:purple", "logits": "tab:gray"}
    for (writer, reader), size, sign in sorted(zip(graph.edges, magnitude.tolist(), signed.tolist()),
                                               key=lambda item: item[1]):  # the strongest drawn last
        start, end = place.source(writer), place.port(reader)
        strength = (size / top) ** 0.5
        style = dict(arrowstyle="-|>", mutation_scale=8, zorder=2, linewidth=0.9 + 4.5 * strength,
                     color=colours[place.kind(reader)], alpha=0.5 + 0.45 * strength,
                     linestyle="-" if sign * direction >= 0 else "--")
        obstacles = [b for name, b in boxes.items() if name not in (place.box_of(writer), place.box_of(reader))]
        points = place.route(start, end, obstacles)
        if any(start[1] < y < end[1] for _, y, _ in obstacles):  # boxes between: the route, corners rounded
            middles = [((a[0] + b[0]) / 2, (a[1] + b[1]) / 2) for a, b in zip(points, points[1:])]
            vertices = [points[0], middles[0]]
            for corner, middle in zip(points[1:-1], middles[1:]):
                vertices += [corner, middle]
            vertices.append(points[-1])
            codes = [PlotPath.MOVETO, PlotPath.LINETO] + [PlotPath.CURVE3] * (len(vertices) - 3) + [PlotPath.LINETO]
            ax.add_patch(FancyArrowPatch(path=PlotPath(vertices, codes), **style))
        else:
            ax.add_patch(FancyArrowPatch(start, end, connectionstyle=f"arc3,rad={0.15 if start[0] <= end[0] else -0.15}",
                                         **style))
    ax.set_xlim(-1, place.width)
    ax.set_ylim(-0.7, 2 * place.layers + 1.7)
    ax.axis("off")
    handles = [Line2D([], [], color=c, linewidth=2, label=f"into {k}") for k, c in colours.items()]
    handles.append(Line2D([], [], color="black", linestyle="--", label="works against the corruption"))
    if feeds:
        handles.append(Line2D([], [], color="#777777", linewidth=0.9, label="key/value head to its query heads"))
    ax.legend(handles=handles, loc="upper left", fontsize=7, frameon=False, bbox_to_anchor=(0, 0.98))
    ax.set_title(title or f"circuit: {len(graph)} edges" + (f", scored by {graph.method}" if graph.method else ""))
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
