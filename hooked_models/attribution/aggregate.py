"""`aggregate`: what the graphs of a store have in common, a pure reader of the store.

    agg = aggregate("out/ioi")                         # align="auto": by role if the prompts share a length
    agg.recurring()                                    # features kept in >= min_fraction of the graphs
    node = agg.nodes[("feature", 1, 37, 14)]           # (kind, layer, feature, column)
    node.count, node.frequency, node.mean("influence"), node.sd("effect"), node.absent(), node.reversed()
    agg.edges[(source_key, target_key)].mean()         # mean weight over the graphs that keep the edge
    agg.exceptions()                                   # the prompts where a recurring feature is absent or reversed
    agg.to_json("out/ioi-aggregate.json")              # circuit-tracer's graph file, each node's spread in it

Each graph is pruned (`AttributionGraph.prune`, at the store's thresholds unless given): a node *occurs* in a
graph if pruning keeps it, an edge if pruning keeps it. A node's values in a graph: its `influence` on the
outputs (circuit-tracer's, as pruning ranks nodes: |edges| row-normalised, propagated from the outputs'
weights through every path; an output's own weight for an output), its `effect` (the same series with the
edges' signs kept: positive if the node raises the outputs through the graph, negative if it lowers them),
and a feature's `activation`. Statistics are over the graphs where the node occurs (sd: population, ddof 0),
in float64.

Nodes of different prompts are matched by a key: (kind, layer, feature, column) for features, (kind, layer,
column) for errors, (kind, column) for embeddings, ("logit", rank) for outputs (the k-th output of each
graph: the most probable logit, or the pair's logit difference). The column is where the node sits:
- align="role": its position. For prompts of one template (all one length), a position is a role (the
  indirect object, the second subject, the last token); prompts of different lengths are refused.
- align="token": its token and that token's occurrence (the second " John" of the prompt), for prompts
  of any lengths.
- align="auto" (the default): "role" if every prompt has one length, else "token"; `agg.align` says which.
"""

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hooked_models.attribution import export
from hooked_models.attribution.graph import AttributionGraph, influence_series, normalized_abs
from hooked_models.attribution.store import GraphStore
from hooked_models.progress import ProgressArg, tracker

ALIGNMENTS = ("auto", "role", "token")
VALUES = ("influence", "effect", "activation")


@dataclass
class NodeStats:
    """One matched node across the graphs: the graphs it occurs in and its values there, in order."""

    key: tuple
    n_graphs: int
    graphs: list[int] = field(default_factory=list)
    influence: list[float] = field(default_factory=list)
    effect: list[float] = field(default_factory=list)
    activation: list[float] = field(default_factory=list)

    @property
    def count(self) -> int:
        """The graphs it occurs in."""
        return len(self.graphs)

    @property
    def frequency(self) -> float:
        return self.count / self.n_graphs

    def mean(self, value: str = "influence") -> float:
        values = getattr(self, value)
        return math.fsum(values) / len(values) if values else math.nan

    def sd(self, value: str = "influence") -> float:
        """The population standard deviation (ddof 0) over the graphs it occurs in."""
        values = getattr(self, value)
        if not values:
            return math.nan
        mean = self.mean(value)
        return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))

    def absent(self) -> list[int]:
        """The graphs it does not occur in."""
        present = set(self.graphs)
        return [g for g in range(self.n_graphs) if g not in present]

    def reversed(self) -> list[int]:
        """The graphs where its effect has the sign opposite to its mean effect's."""
        sign = math.copysign(1.0, self.mean("effect"))
        return [g for g, e in zip(self.graphs, self.effect) if e * sign < 0]

    def summary(self) -> dict:
        """Its spread over the prompts, as JSON (carried by its node in the aggregate graph file)."""
        stats = {v: {"mean": self.mean(v), "sd": self.sd(v), "min": min(getattr(self, v)),
                     "max": max(getattr(self, v))} for v in VALUES if getattr(self, v)}
        return {"key": list(self.key), "count": self.count, "n_graphs": self.n_graphs, "frequency": self.frequency,
                **stats, "absent": self.absent(), "reversed": self.reversed(),
                "per_prompt": {"graphs": self.graphs, **{v: getattr(self, v) for v in VALUES if getattr(self, v)}}}


@dataclass
class EdgeStats:
    """One matched edge across the graphs: the graphs that keep it and its weight in each."""

    graphs: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.graphs)

    def mean(self) -> float:
        return math.fsum(self.weights) / len(self.weights)

    def sd(self) -> float:
        mean = self.mean()
        return math.sqrt(math.fsum((w - mean) ** 2 for w in self.weights) / len(self.weights))


def node_values(graph: AttributionGraph) -> tuple[torch.Tensor, torch.Tensor]:
    """(influence, effect) [node] of every node of a graph on its outputs, in float64 (see the module
    docstring); an output's are its weight."""
    adjacency = graph.adjacency_matrix.double()
    weights = graph.logit_weights().double()
    influence = influence_series(normalized_abs(adjacency), weights) + weights
    signed = adjacency / adjacency.abs().sum(1, keepdim=True).clamp(min=1e-10)
    return influence, influence_series(signed, weights) + weights


def columns_of(tokens: list[int], align: str) -> list:
    """Each position's column: the position (role), or (token, its occurrence so far) (token)."""
    if align == "role":
        return list(range(len(tokens)))
    seen: Counter = Counter()
    out = []
    for token in tokens:
        seen[token] += 1
        out.append((token, seen[token]))
    return out


def node_key(graph: AttributionGraph, i: int, columns: list) -> tuple:
    kind = graph.node_kind(i)
    layer, pos = graph.node_position(i)
    if kind == "feature":
        return ("feature", layer, int(graph.active_features[i, 2]), columns[pos])
    if kind == "error":
        return ("error", layer, columns[pos])
    if kind == "embedding":
        return ("embedding", columns[pos])
    return ("logit", i - graph.logit_start)


def resolve_alignment(store: GraphStore, align: str) -> str:
    if align not in ALIGNMENTS:
        raise ValueError(f"align={align!r} must be one of {', '.join(ALIGNMENTS)}")
    lengths = Counter(len(e["tokens"]) for e in store.entries)
    if align == "auto":
        return "role" if len(lengths) == 1 else "token"
    if align == "role" and len(lengths) > 1:
        raise ValueError(f"align='role' matches positions, but the prompts have {len(lengths)} lengths "
                         f"({', '.join(f'{n} tokens: {c}' for n, c in sorted(lengths.items()))}); use align='token'")
    return align


class Aggregate:
    """The store's graphs matched node by node (see the module docstring): `nodes` {key: NodeStats},
    `edges` {(source key, target key): EdgeStats}, `columns` (each column's tokens, by count)."""

    def __init__(self, store: GraphStore, align: str, node_threshold: float, edge_threshold: float,
                 min_fraction: float):
        self.store, self.align = store, align
        self.node_threshold, self.edge_threshold, self.min_fraction = node_threshold, edge_threshold, min_fraction
        self.n_graphs = len(store)
        self.nodes: dict[tuple, NodeStats] = {}
        self.edges: dict[tuple, EdgeStats] = {}
        self.columns: dict = {}  # column -> Counter of (token id, token string)
        self.positions: dict = {}  # column -> [sum of positions, count], to order token columns
        self.outputs: dict = {}  # rank -> Counters of its tokens, names and columns
        self.n_layers = 0

    def add(self, g: int, graph: AttributionGraph) -> None:
        """Graph g's kept nodes and edges."""
        self.n_layers = graph.n_layers
        columns = columns_of(graph.tokens.tolist(), self.align)
        for pos, (column, token, text) in enumerate(zip(columns, graph.tokens.tolist(), graph.str_tokens_or_ids())):
            self.columns.setdefault(column, Counter())[(token, text)] += 1
            self.positions.setdefault(column, [0, 0])
            self.positions[column][0] += pos
            self.positions[column][1] += 1
        pruned = graph.prune(self.node_threshold, self.edge_threshold)
        influence, effect = node_values(graph)
        keys = {}
        for i in pruned.node_mask.nonzero().flatten().tolist():
            key = keys[i] = node_key(graph, i, columns)
            stats = self.nodes.setdefault(key, NodeStats(key, self.n_graphs))
            stats.graphs.append(g)
            stats.influence.append(float(influence[i]))
            stats.effect.append(float(effect[i]))
            if key[0] == "feature":
                stats.activation.append(float(graph.activation_values[i]))
        for k in range(graph.n_logits):  # what each output is, over the graphs: token, name, column
            tokens, names, where = self.outputs.setdefault(k, (Counter(), Counter(), Counter()))
            tokens[int(graph.logit_tokens[k])] += 1
            names[graph.logit_text(k)] += 1
            where[columns[graph.node_position(graph.logit_start + k)[1]]] += 1
        targets, sources = pruned.edge_mask.nonzero(as_tuple=True)
        for t, s in zip(targets.tolist(), sources.tolist()):
            edge = self.edges.setdefault((keys[s], keys[t]), EdgeStats())
            edge.graphs.append(g)
            edge.weights.append(float(graph.adjacency_matrix[t, s]))

    # ----------------------------------------------------------------------------- reading
    def recurring(self, min_fraction: float | None = None, kind: str = "feature") -> list[NodeStats]:
        """The nodes of `kind` that occur in at least `min_fraction` of the graphs, most frequent first
        (then by mean influence)."""
        fraction = self.min_fraction if min_fraction is None else min_fraction
        found = [n for n in self.nodes.values() if n.key[0] == kind and n.frequency >= fraction]
        return sorted(found, key=lambda n: (-n.count, -n.mean(), _sortable(n.key)))

    def exceptions(self, min_fraction: float | None = None) -> list[dict]:
        """For each recurring feature, the prompts (graph indices) where it is absent and where its effect
        is reversed; only the features with any."""
        out = []
        for node in self.recurring(min_fraction):
            absent, reversed_ = node.absent(), node.reversed()
            if absent or reversed_:
                out.append({"key": node.key, "name": self.name(node.key), "absent": absent, "reversed": reversed_})
        return out

    def column_order(self) -> list:
        """The columns left to right: positions in order (role), or by mean position (token)."""
        return sorted(self.columns, key=lambda c: (self.positions[c][0] / self.positions[c][1], _sortable(c)))

    def column_label(self, column) -> str:
        """A column as text: its token if every prompt has the same there, else its three commonest."""
        common = self.columns[column].most_common()
        texts = [text for (_, text), _ in common[:3]]
        label = texts[0] if len(common) == 1 else "/".join(texts) + ("/…" if len(common) > 3 else "")
        return label if self.align == "role" or column[1] == 1 else f"{label}#{column[1]}"

    def name(self, key: tuple) -> str:
        """A key over the vocabulary: `layers.1.mlp.feature.37@' Mary'`, `embedding@...`, `logit 0`."""
        where = lambda column: self.column_label(column)  # noqa: E731
        if key[0] == "feature":
            return f"layers.{key[1]}.mlp.feature.{key[2]}@{where(key[3])!r}"
        if key[0] == "error":
            return f"layers.{key[1]}.mlp.error@{where(key[2])!r}"
        if key[0] == "embedding":
            return f"embedding@{where(key[1])!r}"
        return f"logit {key[1]}"

    def __str__(self) -> str:
        return (f"Aggregate of {self.n_graphs} graphs in {self.store.path} (align={self.align!r}): "
                f"{sum(k[0] == 'feature' for k in self.nodes)} features occur, {len(self.recurring())} in >= "
                f"{self.min_fraction:.0%} of the graphs; {len(self.edges)} edges")

    # ----------------------------------------------------------------------------- the graph file
    def graph(self, min_fraction: float | None = None) -> tuple[AttributionGraph, dict[int, tuple]]:
        """The aggregate as an AttributionGraph over the columns, pruned to the recurring features and
        errors linked to another kept node (with every embedding and output): each node's activation and influence their means, each
        edge between kept nodes its mean weight; and each node's key by index."""
        fraction = self.min_fraction if min_fraction is None else min_fraction
        order = self.column_order()
        at = {c: i for i, c in enumerate(order)}
        features = sorted((n for n in self.recurring(fraction)), key=lambda n: (n.key[1], at[n.key[3]], n.key[2]))
        ranks = sorted(k[1] for k in self.nodes if k[0] == "logit")
        n_pos, n_layers = len(order), self.n_layers
        keys = {i: n.key for i, n in enumerate(features)}
        keys.update({len(features) + l * n_pos + p: ("error", l, c) for l in range(n_layers) for p, c in enumerate(order)})
        start = len(features) + n_layers * n_pos
        keys.update({start + p: ("embedding", c) for p, c in enumerate(order)})
        keys.update({start + n_pos + k: ("logit", r) for k, r in enumerate(ranks)})
        index = {key: i for i, key in keys.items()}
        n = len(keys)
        adjacency = torch.zeros(n, n, dtype=torch.float64)
        edge_mask = torch.zeros(n, n, dtype=torch.bool)
        for (source, target), edge in self.edges.items():
            if source in index and target in index:
                adjacency[index[target], index[source]] = edge.mean()
                edge_mask[index[target], index[source]] = True
        node_mask = torch.tensor([keys[i] in self.nodes and (keys[i][0] != "error" or self.nodes[keys[i]].frequency
                                                             >= fraction) for i in range(n)])
        node_mask[start:] = True
        # Links between the nodes kept; a feature or error with none is left out, as `to_json` leaves it out.
        edge_mask &= node_mask[:, None] & node_mask[None, :]
        node_mask &= edge_mask.any(0) | edge_mask.any(1)
        node_mask[start:] = True
        # The viewers read a node's `influence` as circuit-tracer's cumulative share (its pruning slider):
        # here of the nodes' mean influences; each node's mean itself is in its spread.
        influence = torch.tensor([self.nodes[keys[i]].mean() if node_mask[i] else 0.0 for i in range(n)],
                                 dtype=torch.float64)
        ranked = influence.argsort(descending=True)
        cumulative = torch.zeros_like(influence)
        cumulative[ranked] = (influence[ranked].cumsum(0) / influence.sum().clamp(min=1e-30)).clamp(max=1.0)
        outputs = [self._output(r, at) for r in ranks]
        tokens = [self.columns[c].most_common(1)[0][0][0] for c in order]
        graph = AttributionGraph(
            tokens=torch.tensor(tokens), active_features=torch.tensor([[k[1], at[k[3]], k[2]] for k in
                                                                       (f.key for f in features)]).reshape(-1, 3),
            activation_values=torch.tensor([f.mean("activation") for f in features]),
            logit_tokens=torch.tensor([o[0] for o in outputs], dtype=torch.long),
            logit_probabilities=torch.tensor([o[1] for o in outputs]), adjacency_matrix=adjacency.float(),
            n_layers=n_layers, prompt=f"aggregate of {self.n_graphs} graphs ({self.align} alignment)",
            str_tokens=[self.column_label(c) for c in order], model_name=self.store.index["model"]["family"],
            transcoder_names=self.store.index["transcoders"]["names"], logit_str_tokens=[o[2] for o in outputs],
            logit_positions=torch.tensor([o[3] for o in outputs], dtype=torch.long),
            node_mask=node_mask, edge_mask=edge_mask, cumulative_influence=cumulative.float(),
            # 1: a viewer shows every node the file holds (one shows a node whose cumulative influence is at
            # most the threshold); the graphs' own thresholds are in the metadata's hooked_models_aggregate.
            node_threshold=1.0)
        return graph, keys

    def _output(self, rank: int, at: dict) -> tuple[int, float, str, int]:
        """Output `rank` over the graphs: (its token if every graph's is the same, else -1 - rank; its mean
        weight; its name(s); its commonest column)."""
        tokens, names, columns = self.outputs[rank]
        token = next(iter(tokens)) if len(tokens) == 1 and next(iter(tokens)) >= 0 else -1 - rank
        label = "/".join(t for t, _ in names.most_common(3)) + ("/…" if len(names) > 3 else "")
        return token, self.nodes[("logit", rank)].mean(), label, at[columns.most_common(1)[0][0]]

    def to_json(self, path: "str | os.PathLike", slug: str | None = None, min_fraction: float | None = None) -> Path:
        """The aggregate graph (`graph()`) in circuit-tracer's graph-file schema, which its viewer, Neuronpedia
        and the explorer open (`AttributionGraph.from_json` reads it back): each node carries its spread over
        the prompts under `hooked_models_aggregate` (`NodeStats.summary`), each link its count and sd, the
        metadata the store, the alignment and the thresholds."""
        graph, keys = self.graph(min_fraction)

        def annotate(data: dict, nodes: dict) -> None:
            ids = {node["node_id"]: keys[i] for i, node in nodes.items()}
            for node in data["nodes"]:
                key = ids[node["node_id"]]
                if key in self.nodes:
                    node["hooked_models_aggregate"] = self.nodes[key].summary()
                    node["clerp"] = node["clerp"] or f"{self.name(key)}: in {self.nodes[key].count}/{self.n_graphs}"
            for link in data["links"]:
                edge = self.edges[(ids[link["source"]], ids[link["target"]])]
                link["hooked_models_aggregate"] = {"count": edge.count, "sd": edge.sd()}
            data["metadata"]["hooked_models_aggregate"] = {
                "store": str(self.store.path), "n_graphs": self.n_graphs, "align": self.align,
                "node_threshold": self.node_threshold, "edge_threshold": self.edge_threshold,
                "min_fraction": self.min_fraction if min_fraction is None else min_fraction}

        return export.write_json(graph, path, slug or Path(path).stem, annotate=annotate)


def _sortable(value) -> tuple:
    return tuple((0, v) if isinstance(v, int) else (1, str(v)) for v in (value if isinstance(value, tuple) else (value,)))


def aggregate(store: "GraphStore | str | os.PathLike", *, align: str = "auto", node_threshold: float | None = None,
              edge_threshold: float | None = None, min_fraction: float = 0.5, progress: ProgressArg = None) -> Aggregate:
    """The graphs of `store` (a GraphStore or its directory) matched node by node: see the module docstring.
    `node_threshold`, `edge_threshold`: the pruning that decides what occurs in a graph (default: the
    store's, as its files were pruned). `min_fraction`: the share of the graphs a feature must occur in to
    be recurring (`recurring()`, `exceptions()`, the graph file). Reads one graph at a time: memory is one
    graph plus the matched nodes' values. `progress`: graphs read (a callable raising `Cancelled` stops it)."""
    store = store if isinstance(store, GraphStore) else GraphStore(store)
    if not 0.0 < min_fraction <= 1.0:
        raise ValueError(f"min_fraction={min_fraction} must be in (0, 1]")
    settings = store.settings
    node_threshold = settings["node_threshold"] if node_threshold is None else node_threshold
    edge_threshold = settings["edge_threshold"] if edge_threshold is None else edge_threshold
    result = Aggregate(store, resolve_alignment(store, align), node_threshold, edge_threshold, min_fraction)
    with tracker(progress, total=len(store), desc="aggregate", unit="graph") as steps:
        for g in range(len(store)):
            result.add(g, store[g])
            steps.advance(1)
    return result
