"""Circuit discovery: edges between components, scored all at once and patched exactly.

    from hooked_models import circuits
    graph = circuits.edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=5)
    circuit = graph.top(20)
    circuit.faithfulness(model, clean, corrupted, metric)    # the fraction of the clean-corrupted gap it keeps
    circuit.plot("out/circuit.png")

A circuit is a set of edges (writer, reader). Its nodes are named over the standard vocabulary:

    input                                writer: the stream entering the first block (layers.0.layer_input)
    layers.{i}.self_attn.head.{h}        writer: head h's result (attention_head_results[..., h, :])
    layers.{i}.self_attn.head.{h}.q      reader: head h's query input (attention_query_inputs[..., h, :])
    layers.{i}.self_attn.kv_head.{j}.k   reader: key/value head j's key input (attention_key_inputs); `.v` its values'
    layers.{i}.mlp                       writer: mlp_output; reader: the MLP branch's input (mlp_residual_input)
    layers.{i}.mlp.expert.{g}            the same for positional expert g, at the positions it owns (alpha-er)
    logits                               reader: the stream entering the final norm (layers.{L-1}.layer_output)

Under multi-head attention key/value head j is head j. Every writer feeds every reader after it through the
residual stream; an edge carries every position. An expert writes and reads only at its own positions, so an
expert reader's edges from the MLPs of earlier layers come from the same expert alone. The readers' inputs are the
model's split inputs (hooked_models/vocabulary.py): copies of the stream taken before the norm, one per head, so
a change to one head's copy reaches that head alone.

`edge_patch` is exact: in the clean run, each chosen reader's input gets, for each chosen writer, that writer's
output in the corrupted run in place of its output in this run (input + corrupted - live); every other reader
reads what it would. Edge sets are batched: one copy of the prompts per set, in forwards sized to a memory
budget. `edge_attribution` estimates `edge_patch(..., [[edge]]) - clean metric` for every edge at once:
(corrupted - clean output of the writer) · d metric / d (reader's input), the gradient taken on the clean run
(EAP, Syed et al. 2023: one clean forward, one corrupted forward, one backward) or averaged over inputs whose
embeddings lie between the clean and corrupted ones (EAP-IG, Hanna et al. 2024: `steps` interpolations, batched).
"""

import difflib
import fnmatch
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm import tqdm

from hooked_models.patching.inputs import Metric, _runs, _scalar
from hooked_models.patching.runner import row_bytes

METHODS = ("eap", "eap-ig")
Edge = tuple[str, str]


# ------------------------------------------------------------------------------------------- layout
@dataclass
class _Hook:
    """A hook point that holds some nodes' values: one slot per head along its head axis (one slot for a
    [batch seq hidden_size] value), the node each slot stands for, and when in the forward it fires.

    `nodes[slot]` is a node index, or a list of node indices by expert when the node depends on the
    position (`router(seq)` gives each position's expert).
    """

    name: str
    nodes: list
    step: int
    router: object = None
    head_axis: bool = True

    def nodes_at(self, seq: int, device=None) -> Tensor:
        """[slots seq]: the node each slot stands for at each position."""
        if self.router is None:
            return torch.tensor(self.nodes, device=device)[:, None].expand(len(self.nodes), seq)
        experts = self.router(seq).to(device)
        return torch.tensor(self.nodes, device=device)[:, experts]


class _Layout:
    """The graph of a model: writer and reader nodes in forward order, the hooks holding them, its edges."""

    def __init__(self, model):
        cfg = model.cfg
        heads, kv_heads = cfg.n_heads, getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
        self.writers: list[str] = []
        self.readers: list[str] = []
        self.writer_hooks: list[_Hook] = []
        self.reader_hooks: list[_Hook] = []
        self.step: dict[str, int] = {}  # node -> when it writes or reads
        self.expert: dict[str, int | None] = {}
        self.sizes = dict(num_layers=cfg.n_layers, num_heads=heads, num_kv_heads=kv_heads, experts=0)
        missing = [n for n in ("layers.0.self_attn.attention_query_inputs", "layers.0.mlp_residual_input",
                               "layers.0.self_attn.attention_head_results") if n not in model.standard_hook_dict]
        if missing:
            raise ValueError(f"{type(model).__name__} has no {', '.join(missing)}: circuits need per-head results "
                             "and split inputs (hooked_models.components' attention and PreNormBlock)")

        def add(kind: str, hook: str, names: list, step: int, router=None, head_axis=True) -> None:
            nodes, table = (self.writers, self.writer_hooks) if kind == "writer" else (self.readers, self.reader_hooks)
            indices = []
            for name in names:
                group = name if isinstance(name, list) else [name]
                for n in group:
                    self.step[n] = step
                    self.expert[n] = int(n.rpartition(".")[2]) if ".expert." in n else None
                    nodes.append(n)
                ids = list(range(len(nodes) - len(group), len(nodes)))
                indices.append(ids if isinstance(name, list) else ids[0])
            table.append(_Hook(hook, indices, step, router, head_axis))

        add("writer", "layers.0.layer_input", ["input"], 0, head_axis=False)
        for i in range(cfg.n_layers):
            attn, step = f"layers.{i}.self_attn", 1 + 4 * i
            add("reader", f"{attn}.attention_query_inputs", [f"{attn}.head.{h}.q" for h in range(heads)], step)
            for part, value in (("k", "attention_key_inputs"), ("v", "attention_value_inputs")):
                add("reader", f"{attn}.{value}", [f"{attn}.kv_head.{j}.{part}" for j in range(kv_heads)], step)
            add("writer", f"{attn}.attention_head_results", [f"{attn}.head.{h}" for h in range(heads)], step + 1)
            mlp = model.get_submodule(f"layers.{i}.mlp")
            router = getattr(mlp, "expert_index", None)
            if callable(router):  # positional experts: the node depends on the position
                self.sizes["experts"] = mlp.experts
                names = [[f"layers.{i}.mlp.expert.{g}" for g in range(mlp.experts)]]
            else:
                router, names = None, [f"layers.{i}.mlp"]
            add("reader", f"layers.{i}.mlp_residual_input", names, step + 2, router, head_axis=False)
            add("writer", f"layers.{i}.mlp.mlp_output", names, step + 3, router, head_axis=False)
        add("reader", f"layers.{cfg.n_layers - 1}.layer_output", ["logits"], 1 + 4 * cfg.n_layers, head_axis=False)
        self.writer_index = {n: i for i, n in enumerate(self.writers)}
        self.reader_index = {n: i for i, n in enumerate(self.readers)}
        self.edges: list[Edge] = [(w, r) for r in self.readers for w in self.writers if self.connects(w, r)]
        self.edge_index = {e: i for i, e in enumerate(self.edges)}

    def connects(self, writer: str, reader: str) -> bool:
        """Whether the writer's output reaches the reader's input through the residual stream."""
        ew, er = self.expert[writer], self.expert[reader]
        return self.step[writer] < self.step[reader] and (ew is None or er is None or ew == er)

    def check(self, edge, model_name: str) -> Edge:
        """The edge as a (writer, reader) tuple, or a ValueError that says what is wrong with it."""
        if not (isinstance(edge, (tuple, list)) and len(edge) == 2 and all(isinstance(n, str) for n in edge)):
            raise ValueError(f"an edge is a (writer, reader) pair of node names, not {edge!r}")
        writer, reader = edge
        for name, known, role in ((writer, self.writer_index, "writer"), (reader, self.reader_index, "reader")):
            if name not in known:
                close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
                hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
                raise ValueError(f"{name!r} is not a {role} of {model_name}'s graph{hint}")
        if (writer, reader) not in self.edge_index:
            why = ("reads at other positions" if self.step[writer] < self.step[reader] else "reads before it writes")
            raise ValueError(f"({writer!r}, {reader!r}) is not an edge of {model_name}'s graph: the reader {why}")
        return writer, reader


def transformer_lens_node(model, node, seq: int) -> str:
    """The node name here of a TransformerLens `attribution_patching.Node` (kind, layer, head, position):
    an MLP node of a positional-expert MLP is the expert that owns its position (`seq` long prompts)."""
    if node.kind in ("embed", "logits"):
        return "input" if node.kind == "embed" else "logits"
    attn = f"layers.{node.layer}.self_attn"
    if node.kind == "attn_head_out":
        return f"{attn}.head.{node.head}"
    if node.kind == "q_input":
        return f"{attn}.head.{node.head}.q"
    if node.kind in ("k_input", "v_input"):
        return f"{attn}.kv_head.{node.head}.{node.kind[0]}"
    mlp = model.get_submodule(f"layers.{node.layer}.mlp")
    if callable(getattr(mlp, "expert_index", None)):
        return f"layers.{node.layer}.mlp.expert.{int(mlp.expert_index(seq)[node.position])}"
    return f"layers.{node.layer}.mlp"


def graph(model) -> "Graph":
    """Every edge of the model's graph (see the module docstring), unscored."""
    layout = _Layout(model)
    return Graph(list(layout.edges), sizes=dict(layout.sizes))


# -------------------------------------------------------------------------------------------- graph
@dataclass(eq=False)
class Graph:
    """Edges (writer, reader) between nodes of the standard vocabulary, with a score per edge when scored.

    `edges[i]` is scored `scores[i]`: for `edge_attribution`, the estimated change of the metric when that
    edge alone carries the corrupted run (`edge_patch(..., [[edge]])` minus the clean metric). `sizes`
    (layers, heads, key/value heads, experts) lay out `plot`.
    """

    edges: list[Edge]
    scores: Tensor | None = None
    method: str | None = None
    clean_metric: float | None = None
    corrupted_metric: float | None = None
    sizes: dict = field(default_factory=dict)

    def __post_init__(self):
        self.edges = [tuple(e) for e in self.edges]
        if self.scores is not None and len(self.scores) != len(self.edges):
            raise ValueError(f"{len(self.scores)} scores for {len(self.edges)} edges")

    def __len__(self) -> int:
        return len(self.edges)

    @property
    def nodes(self) -> list[str]:
        """Every node an edge touches, writers and readers, in the order they first appear."""
        return list(dict.fromkeys(n for edge in self.edges for n in edge))

    def _scored(self) -> Tensor:
        if self.scores is None:
            raise ValueError("this graph has no scores; edge_attribution gives a scored one")
        return self.scores

    def _subset(self, keep: Sequence[int]) -> "Graph":
        scores = self.scores[torch.as_tensor(list(keep), dtype=torch.long)] if self.scores is not None else None
        return replace(self, edges=[self.edges[i] for i in keep], scores=scores)

    def top(self, k: int) -> "Graph":
        """The k edges with the largest |score|, largest first."""
        if k < 0:
            raise ValueError(f"k={k} must be >= 0")
        order = self._scored().abs().argsort(descending=True, stable=True)[:k]
        return self._subset(order.tolist())

    def prune(self, threshold: float) -> "Graph":
        """The edges whose |score| is at least `threshold`, in their order here."""
        keep = (self._scored().abs() >= threshold).nonzero().flatten()
        return self._subset(keep.tolist())

    def faithfulness(self, model, clean, corrupted, metric: Metric, **options) -> float:
        """The fraction of the clean-corrupted gap this circuit keeps: every edge of the model's graph that is
        not in it carries the corrupted run (exactly, `edge_patch`), (metric - corrupted) / (clean - corrupted).
        1 is the clean run, 0 the corrupted one."""
        return float(self.faithfulness_curve(model, clean, corrupted, metric, [len(self)], ranked=False,
                                             **options)[0])

    def faithfulness_curve(self, model, clean, corrupted, metric: Metric, ks: Sequence[int], ranked: bool = True,
                           **options) -> Tensor:
        """`faithfulness` of the circuit of the top k edges, for each k in `ks` (of the first k edges as they
        are ordered here when `ranked` is False), batched through one `edge_patch`. [len(ks)]"""
        layout = _Layout(model)
        order = self._scored().abs().argsort(descending=True, stable=True).tolist() if ranked else range(len(self))
        circuits = []
        for k in ks:
            if not 0 <= k <= len(self):
                raise ValueError(f"k={k} is outside [0, {len(self)}]")
            kept = {layout.check(self.edges[i], type(model).__name__) for i in list(order)[:k]}
            circuits.append([e for e in layout.edges if e not in kept])
        values, clean_metric, corrupted_metric = _edge_patch(model, clean, corrupted, metric, circuits, layout,
                                                             **options)
        gap = clean_metric - corrupted_metric
        if gap == 0:
            raise ValueError("the clean and corrupted metrics are equal; there is no gap to recover")
        return (values - corrupted_metric) / gap

    def to_json(self, **dump_options) -> str:
        """The graph as JSON: method, the clean and corrupted metrics, sizes, and each edge with its score."""
        scores = self.scores.tolist() if self.scores is not None else [None] * len(self.edges)
        return json.dumps({"method": self.method, "clean_metric": self.clean_metric,
                           "corrupted_metric": self.corrupted_metric, "sizes": self.sizes,
                           "edges": [{"writer": w, "reader": r, "score": s} for (w, r), s in zip(self.edges, scores)]},
                          **dump_options)

    @classmethod
    def from_transformer_lens(cls, model, edge_scores: dict, seq: int, method: str = "transformer_lens") -> "Graph":
        """TransformerLens's per-position edge scores (`attribution_patch(...).edge_scores`) summed over
        positions into this model's graph: its edges that TransformerLens scored, in the graph's order."""
        layout = _Layout(model)
        summed: dict[Edge, float] = {}
        for writer, reader in edge_scores:
            edge = layout.check((transformer_lens_node(model, writer, seq), transformer_lens_node(model, reader, seq)),
                                type(model).__name__)
            summed[edge] = summed.get(edge, 0.0) + float(edge_scores[writer, reader])
        edges = [e for e in layout.edges if e in summed]
        return cls(edges, torch.tensor([summed[e] for e in edges]), method, sizes=dict(layout.sizes))

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        data = json.loads(text)
        edges = [(e["writer"], e["reader"]) for e in data["edges"]]
        scored = data["edges"] and all(e["score"] is not None for e in data["edges"])
        scores = torch.tensor([e["score"] for e in data["edges"]], dtype=torch.float64) if scored else None
        return cls(edges, scores, data.get("method"), data.get("clean_metric"), data.get("corrupted_metric"),
                   data.get("sizes") or {})

    def __str__(self) -> str:
        head = f"Graph of {len(self)} edges" + (f" scored by {self.method}" if self.method else "")
        if self.clean_metric is not None:
            head += f" (clean {self.clean_metric:.4g}, corrupted {self.corrupted_metric:.4g})"
        if self.scores is None:
            return head
        lines = [f"  {w} -> {r}  {float(s):+.4g}" for (w, r), s in zip(self.top(10).edges, self.top(10).scores)]
        return "\n".join([head] + lines)

    def plot(self, path: "str | os.PathLike | None" = None, ax=None, title: str | None = None):
        """A circuit diagram: the input at the bottom, each layer's heads then its MLP (or experts) above,
        the logits on top. An edge runs from its writer to its reader's input: a head's q, k and v ports
        along its bottom (under grouped-query attention, a key/value head is a box of its own under its
        group, joined by thin grey lines to the query heads it feeds), an MLP's bottom, the logits';
        coloured by what it enters, wider and darker the larger its |score| (by the square root, so the
        weak edges stay visible beside a strong one), dashed where its score has the opposite sign to the
        whole corruption's effect (it works against it). An edge that would cross a box on its way up
        passes through the gap beside it. Saves to `path` when given; returns the matplotlib Figure."""
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
        place = _Placement(self.sizes or _sizes_from_names(self.nodes))
        if ax is None:
            fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * place.width + 2), 1.8 + 1.5 * (2 * place.layers + 1)))
        fig = ax.figure
        signed = self.scores.float() if self.scores is not None else torch.ones(len(self))
        magnitude = signed.abs()
        top = float(magnitude.max()) if len(self) and float(magnitude.max()) > 0 else 1.0
        if self.clean_metric is not None and self.corrupted_metric != self.clean_metric:
            direction = math.copysign(1.0, self.corrupted_metric - self.clean_metric)
        else:
            direction = math.copysign(1.0, float(signed.sum())) if len(self) else 1.0
        drawn = {place.box_of(n) for n in self.nodes} | {"input", "logits"}
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
        for (writer, reader), size, sign in sorted(zip(self.edges, magnitude.tolist(), signed.tolist()),
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
        ax.set_title(title or f"circuit: {len(self)} edges" + (f", scored by {self.method}" if self.method else ""))
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


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


# ----------------------------------------------------------------------------------------- running
def _check_runs(model, clean, corrupted) -> tuple[Tensor, Tensor]:
    clean, corrupted = _runs(model, clean, corrupted, "noising")  # (base, source): clean is the base run
    if model.training:
        raise ValueError("the model is in training mode; call model.eval() (dropout would make runs disagree)")
    return clean, corrupted


def _writer_outputs(model, tokens: Tensor, layout: _Layout, extra: Sequence[str] = ()) -> tuple[Tensor, dict]:
    """(logits, {hook: value}) of a no-grad run: every writer hook's value, and `extra` values."""
    names = [h.name for h in layout.writer_hooks] + list(extra)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=names, return_cache_object=False)
    return logits, cache


def _stream_bytes(model, tokens: Tensor) -> int:
    """The bytes of one [batch seq hidden_size] value for these prompts."""
    itemsize = torch.finfo(next(model.parameters()).dtype).bits // 8
    return tokens.numel() * model.cfg.d_model * itemsize


def _slots(value: Tensor, hook: _Hook) -> Tensor:
    """A hook's value with a slot axis: [..., slots, hidden_size]."""
    return value if hook.head_axis else value.unsqueeze(-2)


def edge_patch(
    model,
    clean,
    corrupted,
    metric: Metric,
    edge_sets: Sequence,
    *,
    batch_size: int | None = None,
    memory_budget: int = 2**30,
    progress: bool | None = None,
) -> Float[Tensor, " sets"]:
    """The metric with the edges of each set patched: the ground truth the estimates are judged against.

    In the clean run, each edge's reader gets its writer's corrupted output in place of the writer's output
    in this run; every other reader reads what it would (module docstring). One value per set, batched:
    `batch_size` sets per forward (default: as many as `memory_budget` bytes allow). `[[e] for e in
    graph(model).edges]` patches every edge alone; `[[]]` is the clean run. [len(edge_sets)]
    """
    layout = _Layout(model)
    values, _, _ = _edge_patch(model, clean, corrupted, metric, edge_sets, layout, batch_size=batch_size,
                               memory_budget=memory_budget, progress=progress)
    return values


def _edge_patch(model, clean, corrupted, metric, edge_sets, layout: _Layout, batch_size=None,
                memory_budget=2**30, progress=None) -> tuple[Tensor, float, float]:
    """`edge_patch`'s values, and the clean and corrupted runs' metrics."""
    clean, corrupted = _check_runs(model, clean, corrupted)
    name = type(model).__name__

    def is_set(s) -> bool:  # an edge itself, ("input", "logits"), is a common slip for [("input", "logits")]
        return isinstance(s, (list, tuple, set, frozenset)) and not any(isinstance(e, str) for e in s)

    if isinstance(edge_sets, (str, tuple)) or not all(is_set(s) for s in edge_sets):
        raise ValueError("edge_sets is a list of edge sets, each a list of (writer, reader) pairs: [[edge], ...]")
    sets = [[layout.check(e, name) for e in s] for s in edge_sets]
    batch, seq = clean.shape
    device = clean.device
    corrupted_logits, corrupted_out = _writer_outputs(model, corrupted, layout)
    with torch.no_grad():
        clean_metric = _scalar(metric(model(clean)))
    endpoints = (float(clean_metric), float(_scalar(metric(corrupted_logits))))
    results = clean_metric.repeat(len(sets))
    # One mask over (writer node, reader node) per set.
    masks = torch.zeros(len(sets), len(layout.writers), len(layout.readers), dtype=torch.bool)
    for n, edges in enumerate(sets):
        for w, r in edges:
            masks[n, layout.writer_index[w], layout.reader_index[r]] = True
    todo = [n for n in range(len(sets)) if masks[n].any()]  # an empty set is the clean run
    writer_nodes = [h.nodes_at(seq) for h in layout.writer_hooks]
    slots = sum(n.shape[0] for n in writer_nodes)
    # A patched copy of the prompts holds a forward's activations, every writer's delta, and the split inputs.
    per_set = row_bytes(model, clean) + _stream_bytes(model, clean) * (slots + 6 * model.cfg.n_heads)
    per_forward = batch_size or max(1, memory_budget // per_set)
    show = sys.stderr.isatty() and len(todo) > per_forward if progress is None else progress
    with torch.no_grad(), tqdm(total=len(todo), disable=not show, desc="edge patching", unit="set") as bar:
        for start in range(0, len(todo), per_forward):
            rows = todo[start:start + per_forward]
            chunk = masks[rows].to(device)
            hooks = _edge_patch_hooks(layout, chunk, corrupted_out, writer_nodes, batch, seq, device)
            with model.hooks(fwd_hooks=hooks):
                logits = model(clean.repeat(len(rows), 1))
            for row, copy in zip(rows, logits.unflatten(0, (len(rows), -1))):
                results[row] = _scalar(metric(copy))
            bar.update(len(rows))
    return (results.cpu(), *endpoints)


def _edge_patch_hooks(layout: _Layout, masks: Tensor, corrupted_out: dict, writer_nodes: list[Tensor],
                      batch: int, seq: int, device) -> list:
    """Hooks for one chunk of sets: writers record (corrupted - live) per slot; each reader whose edges some
    set patches adds the sum over its chosen writers."""
    copies = masks.shape[0]
    deltas: list[Tensor] = []  # per writer hook in forward order: [copies batch seq slots hidden_size]
    last = max((h.step for h in layout.reader_hooks if masks[:, :, _flat(h.nodes)].any()), default=-1)
    hooks = []
    for writer in layout.writer_hooks:
        if writer.step >= last:
            break

        def record(value, hook, h=writer):
            live = _slots(value, h).unflatten(0, (copies, batch))
            deltas.append(_slots(corrupted_out[h.name], h).to(live.dtype) - live)

        hooks.append((writer.name, record))
    for reader in layout.reader_hooks:
        reader_nodes = reader.nodes_at(seq, device)
        available = [i for i, w in enumerate(layout.writer_hooks) if w.step < reader.step]
        w_nodes = torch.cat([writer_nodes[i] for i in available]).to(device)  # [writer_slots seq]
        # [copies writer_slots reader_slots seq]: whether each set patches that slot pair at that position.
        chosen = masks[:, w_nodes[:, None, :], reader_nodes[None, :, :]]
        if not chosen.any():
            continue

        def patch(value, hook, h=reader, chosen=chosen, count=len(available)):
            delta = torch.cat(deltas[:count], dim=-2)  # [copies batch seq writer_slots hidden_size]
            moved = torch.einsum("nbswd,nwrs->nbsrd", delta, chosen.to(delta.dtype))
            shaped = _slots(value, h).unflatten(0, (copies, batch))
            out = (shaped + moved).flatten(0, 1)
            return out if h.head_axis else out.squeeze(-2)

        hooks.append((reader.name, patch))
    return hooks


def _flat(nodes: list) -> list[int]:
    return [i for n in nodes for i in (n if isinstance(n, list) else [n])]


def path_patch(model, clean, corrupted, metric: Metric, senders, receivers, **options) -> Tensor:
    """Path patching as in the IOI paper (Wang et al. 2022): the senders' corrupted outputs reach only the
    receivers' inputs, directly through the residual stream; everything else stays at the clean run (no
    other component sees the senders' change, so no path through another head or an MLP counts).

    `senders`: writer names or glob patterns ("layers.0.self_attn.head.*"); a string is one group patched
    together, a list gives one result per entry (each entry a name, a pattern, or a list of them).
    `receivers`: reader names or patterns ("layers.1.self_attn.head.*.q", "logits"). A pair whose reader
    reads before the sender writes carries nothing. Returns the metric per sender entry (a scalar for a
    string). Options go to `edge_patch`.
    """
    layout = _Layout(model)
    groups = [senders] if isinstance(senders, str) else list(senders)
    readers = _match(receivers, layout.readers, "receiver")
    sets = []
    for group in groups:
        writers = _match(group, layout.writers, "sender")
        sets.append([(w, r) for w in writers for r in readers if (w, r) in layout.edge_index])
    values = edge_patch(model, clean, corrupted, metric, sets, **options)
    return values[0] if isinstance(senders, str) else values


def _match(patterns, names: list[str], role: str) -> list[str]:
    """The names that a name, a glob pattern, or a list of them match, in the model's order."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    chosen = set()
    for pattern in patterns:
        found = fnmatch.filter(names, pattern)
        if not found:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"no {role} node matches {pattern!r}{hint}")
        chosen.update(found)
    return [n for n in names if n in chosen]


# ------------------------------------------------------------------------------------- attribution
def edge_attribution(
    model,
    clean,
    corrupted,
    metric: Metric,
    method: str = "eap-ig",
    steps: int = 5,
    *,
    batch_size: int | None = None,
    memory_budget: int = 2**30,
) -> Graph:
    """A score for every edge of the model's graph: the estimated `edge_patch(..., [[edge]])` minus the clean
    metric, (corrupted - clean output of the writer) · the gradient of the metric at the reader's input.

    method "eap": the gradient on the clean run (one clean forward, one corrupted forward, one backward).
    method "eap-ig": the gradient averaged over `steps` inputs whose token embeddings lie at the midpoints
    (k + 1/2) / steps of the way from the clean embeddings to the corrupted ones (integrated gradients on the
    embeddings); the steps run batched, `batch_size` of them per forward and backward (default: as many as
    `memory_budget` bytes allow). Many prompt pairs are scored at once: the metric averages over them.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive integer")
    layout = _Layout(model)
    clean, corrupted = _check_runs(model, clean, corrupted)
    batch, seq = clean.shape
    corrupted_logits, corrupted_out = _writer_outputs(model, corrupted, layout, ["token_embeddings"])
    corrupted_metric = float(_scalar(metric(corrupted_logits)))
    readers = [h.name for h in layout.reader_hooks]
    if method == "eap":
        grads, clean_out, clean_metric = _reader_gradients(model, clean, metric, readers, layout)
    else:
        clean_logits, clean_out = _writer_outputs(model, clean, layout, ["token_embeddings"])
        clean_metric = float(_scalar(metric(clean_logits)))
        embeddings = (clean_out["token_embeddings"], corrupted_out["token_embeddings"])
        # A step holds a forward's activations and their gradients, with the split inputs (and theirs).
        per_step = 4 * row_bytes(model, clean) + _stream_bytes(model, clean) * 12 * model.cfg.n_heads
        per_forward = batch_size or max(1, memory_budget // per_step)
        alphas = (torch.arange(steps, dtype=torch.float32) + 0.5) / steps
        grads = {}
        for start in range(0, steps, per_forward):
            part, _, _ = _reader_gradients(model, clean, metric, readers, layout, embeddings,
                                           alphas[start:start + per_forward])
            for name, g in part.items():
                grads[name] = g if name not in grads else grads[name] + g
        grads = {name: g / steps for name, g in grads.items()}
    scores = _scores(layout, corrupted_out, clean_out, grads, seq, clean.device)
    return Graph(list(layout.edges), scores, method if method == "eap" else f"eap-ig ({steps} steps)",
                 clean_metric, corrupted_metric, dict(layout.sizes))


def _reader_gradients(model, tokens: Tensor, metric: Metric, readers: list[str], layout: _Layout,
                      embeddings: tuple[Tensor, Tensor] | None = None, alphas: Tensor | None = None):
    """d metric / d (each reader hook's value) [batch seq (slots) hidden_size], summed over the interpolation
    steps `alphas` when given (their embeddings replace the token embeddings); with the writers' outputs and
    the metric of the run (the clean run when no alphas)."""
    seen: dict[str, Tensor] = {}
    copies = 1 if alphas is None else len(alphas)
    batch = tokens.shape[0]

    def keep(value, hook):
        seen[hook.name] = value

    def embed(value, hook):
        if embeddings is None:
            # With frozen parameters nothing would require grad: start the graph at the embeddings.
            return None if value.requires_grad else value.detach().requires_grad_(True)
        clean, corrupted = embeddings
        alpha = alphas.to(device=value.device, dtype=value.dtype)[:, None, None, None]
        mixed = (clean + alpha * (corrupted - clean)).flatten(0, 1)
        return mixed.detach().requires_grad_(True)

    writers = [h.name for h in layout.writer_hooks]
    hooks = [("token_embeddings", embed)] + [(n, keep) for n in readers + writers]
    with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
        logits = model(tokens.repeat(copies, 1))
        total = sum(metric(chunk) for chunk in logits.unflatten(0, (copies, batch)))
        grads = torch.autograd.grad(total, [seen[n] for n in readers], allow_unused=True)
    out = {}
    for name, grad in zip(readers, grads):
        grad = torch.zeros_like(seen[name]) if grad is None else grad
        out[name] = grad.detach().unflatten(0, (copies, batch)).sum(0)
    writer_values = {n: seen[n].detach() for n in writers}
    return out, writer_values, float(_scalar(total / copies))


def _scores(layout: _Layout, corrupted_out: dict, clean_out: dict, grads: dict, seq: int, device) -> Tensor:
    """Σ over prompts and positions of (corrupted - clean writer output) · reader gradient, per edge."""
    deltas = [(_slots(corrupted_out[h.name], h) - _slots(clean_out[h.name], h)).float() for h in layout.writer_hooks]
    writer_nodes = [h.nodes_at(seq, device) for h in layout.writer_hooks]
    matrix = torch.zeros(len(layout.writers) * len(layout.readers), dtype=torch.float64, device=device)
    for hook in layout.reader_hooks:
        available = [i for i, w in enumerate(layout.writer_hooks) if w.step < hook.step]
        delta = torch.cat([deltas[i] for i in available], dim=-2)  # [batch seq writer_slots hidden_size]
        grad = _slots(grads[hook.name], hook).float()                # [batch seq reader_slots hidden_size]
        per_position = torch.einsum("bswd,bsrd->swr", delta, grad)
        w_nodes = torch.cat([writer_nodes[i] for i in available]).T     # [seq writer_slots]
        r_nodes = hook.nodes_at(seq, device).T                          # [seq reader_slots]
        index = w_nodes[:, :, None] * len(layout.readers) + r_nodes[:, None, :]
        matrix.index_add_(0, index.flatten(), per_position.flatten().double())
    matrix = matrix.view(len(layout.writers), len(layout.readers))
    w = torch.tensor([layout.writer_index[e[0]] for e in layout.edges], device=device)
    r = torch.tensor([layout.reader_index[e[1]] for e in layout.edges], device=device)
    return matrix[w, r].float().cpu()
