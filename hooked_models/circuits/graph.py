"""A graph of edges with their scores: ranking, pruning, faithfulness by exact edge patching, JSON and plots."""

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from hooked_models.circuits.diagram import draw
from hooked_models.circuits.edge_patching import _edge_patch
from hooked_models.circuits.layout import Edge, _Layout, transformer_lens_node
from hooked_models.patching.inputs import Metric


def graph(model) -> "Graph":
    """Every edge of the model's graph (see the module docstring), unscored."""
    layout = _Layout(model)
    return Graph(list(layout.edges), sizes=dict(layout.sizes))



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
        return draw(self, path, ax, title)
