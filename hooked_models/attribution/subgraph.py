"""A subgraph of an attribution graph: pinned nodes and named supernodes, as circuit-tracer's viewer and
Neuronpedia build them, the graph of its parts, and the graph's linear prediction of an intervention.

    sub = Subgraph(graph, supernodes={"say Mary": ["1_37_15", "1_12_15"], "Mary": ["0_5_3"]},
                   pinned=["E_523_3"], labels={(1, 37): "says a name"})
    sub.parts            # the supernodes, then each pinned node outside them (named by graph.node_name)
    sub.edges()          # [part part]: row target, column source, each the sum of its members' edges
    sub.kept_influence() # InfluenceShare(nodes=..., paths=...): the graph's influence on the targets kept
    sub.predict("Mary", 0.0)   # the graph's linear prediction of each part's change, "Mary" scaled by 0
    sub.save("graph.json"); Subgraph.load("graph.json", graph)    # the graph file's qParams
    sub.plot("subgraph.png")

Nodes are named by their graph-file ids (`export.node_id`: `1_37_15` a feature, `1_-1_15` an error,
`E_523_3` an embedding, `3_523_15` a logit), by their index in the graph, or by their vocabulary name
(`layers.1.mlp.feature.37@15`). A supernode may hold any nodes, of one or several layers and positions.

How parts aggregate (every sum over the members, nothing normalized):
- an edge from part Q to part P is the sum of the edges from Q's members to P's members: the direct
  effect of all of Q's members' writes on the sum of P's members' pre-activations (edges are linear in
  their sources, so scaling each of Q's members by 1 + eps moves that sum by eps x the edge, attention
  frozen). `edges()` keeps the diagonal (the edges inside a part); the plot leaves it out. (circuit-tracer's
  viewer draws each subgraph link as its share of the target's input instead: the raw sums here.)
- a part's influence is the sum of its members' influence, the graph's influence on the targets as
  circuit-tracer's pruning computes it (`graph.prune`): |adjacency| with each row normalized to sum 1,
  propagated from the targets' weights through every path, w (A + A² + ...).
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from hooked_models.attribution import export, subgraph_files, subgraph_plot
from hooked_models.attribution.graph import influence_series, normalized_abs

# The qParams a subgraph written here starts from (the keys and order of `AttributionGraph.to_json`'s).
DEFAULT_VIEW = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}


@dataclass(frozen=True)
class Supernode:
    """A named group of nodes playing one role ("say a name", "Mary at the subject"), by graph-file id."""

    name: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class Part:
    """A node of the subgraph: a supernode, or a pinned node outside every supernode (a singleton, named by
    the node's vocabulary name). `nodes`: its members' indices in the graph."""

    name: str
    nodes: tuple[int, ...]
    supernode: bool


class InfluenceShare(NamedTuple):
    """The share of the graph's influence on the targets a subgraph keeps (w, A: `Subgraph`'s docstring;
    I_s = (w (A + A² + ...))_s, each node's influence; T = the sum of I over every node):
    `nodes`: the sum of I over the subgraph's nodes, over T (the measure `graph.prune(node_threshold=)`
    thresholds; the whole graph's is 1). `paths`: the same sum over paths whose every node but the target
    at their end lies in the subgraph, over T (A with its columns outside the subgraph and its rows
    outside the subgraph and the targets zeroed): the part of the influence the subgraph carries alone."""

    nodes: float
    paths: float


class Subgraph:
    """Pinned nodes and named supernodes of `graph` (an AttributionGraph), checked: every node is one of
    the graph's, no supernode is empty, no node is in two supernodes, no two parts share a name.

    `supernodes`: {name: nodes} or (name, nodes) pairs or `Supernode`s, in order. `pinned`: the nodes
    shown (the viewer's `pinnedIds`, in its order); a supernode's members are pinned too (appended where
    missing: the viewer draws only pinned members). `labels`: {(layer, feature index): label}, the
    features' labels (the viewer's `clerps`). `view`: the file's other qParams (`linkType`, `clickedId`,
    `sg_pos`, and any key a viewer added), kept as they were."""

    def __init__(self, graph, supernodes: Mapping | Iterable = (), pinned: Iterable = (),
                 labels: Mapping | None = None, *, view: Mapping | None = None):
        self.graph = graph
        self._ids = [export.node_id(graph, i) for i in range(graph.n_nodes)]
        self._index = {node: i for i, node in enumerate(self._ids)}
        self._names = {graph.node_name(i): i for i in range(graph.n_nodes)}
        items = supernodes.items() if isinstance(supernodes, Mapping) else supernodes
        groups, owner = [], {}
        for item in items:
            name, members = (item.name, item.members) if isinstance(item, Supernode) else item
            if not isinstance(name, str) or not name:
                raise ValueError(f"supernode name {name!r} must be a non-empty string")
            if isinstance(members, (str, int)):
                raise ValueError(f"supernode {name!r}: members must be a list of nodes, got {members!r}")
            ids = tuple(self._resolve(node, f"supernode {name!r}") for node in members)
            if not ids:
                raise ValueError(f"supernode {name!r} has no members")
            for node in ids:
                if node in owner:
                    where = "twice" if owner[node] == name else f"in {owner[node]!r} too"
                    raise ValueError(f"node {node!r} of supernode {name!r} is {where}: a node belongs to one supernode")
                owner[node] = name
            groups.append(Supernode(name, ids))
        pins = list(dict.fromkeys(self._resolve(node, "pinned") for node in pinned))
        pins += [node for group in groups for node in group.members if node not in pins]
        self.supernodes: tuple[Supernode, ...] = tuple(groups)
        self.pinned: tuple[str, ...] = tuple(pins)
        self.labels: dict[tuple[int, int], str] = self._checked_labels(labels or {})
        self.view: dict = dict(DEFAULT_VIEW if view is None else view)
        singles = [Part(graph.node_name(self._index[node]), (self._index[node],), False)
                   for node in pins if node not in owner]
        self.parts: tuple[Part, ...] = tuple(
            [Part(g.name, tuple(self._index[n] for n in g.members), True) for g in groups] + singles)
        names = [part.name for part in self.parts]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"two parts of the subgraph are named {twice!r}: give each supernode its own name")

    def _resolve(self, node, where: str) -> str:
        """A node's graph-file id, from its id, index or vocabulary name."""
        if isinstance(node, int) and not isinstance(node, bool) and 0 <= node < len(self._ids):
            return self._ids[node]
        if isinstance(node, str) and node in self._index:
            return node
        if isinstance(node, str) and node in self._names:
            return self._ids[self._names[node]]
        raise ValueError(f"{where}: {node!r} is not a node of this graph (a graph-file id such as "
                         f"{self._ids[0]!r}, an index in [0, {len(self._ids)}) or a name such as "
                         f"{self.graph.node_name(0)!r})")

    @staticmethod
    def _checked_labels(labels: Mapping) -> dict[tuple[int, int], str]:
        out = {}
        for key, label in labels.items():
            if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, int) and k >= 0 for k in key)
                    and isinstance(label, str)):
                raise ValueError(f"label {key!r}: {label!r}: labels map (layer, feature index) to a string")
            out[key] = label
        return out

    # ----------------------------------------------------------------------------------- reading
    def part(self, name: str) -> Part:
        for part in self.parts:
            if part.name == name:
                return part
        raise ValueError(f"no part named {name!r}; the parts: {[p.name for p in self.parts]}")

    def membership(self) -> Float[Tensor, "part node"]:
        """1 where a node is a member of a part."""
        m = torch.zeros(len(self.parts), self.graph.n_nodes, dtype=self.graph.adjacency_matrix.dtype)
        for k, part in enumerate(self.parts):
            m[k, list(part.nodes)] = 1
        return m

    def edges(self) -> Float[Tensor, "part part"]:
        """Row target part, column source part: the sum of the members' edges (the module docstring)."""
        m = self.membership()
        return m @ self.graph.adjacency_matrix @ m.T

    def node_influence(self) -> Float[Tensor, " node"]:
        """Each node's influence on the targets, as `graph.prune` computes it."""
        return influence_series(normalized_abs(self.graph.adjacency_matrix), self.graph.logit_weights())

    def influence(self) -> Float[Tensor, " part"]:
        """Each part's influence on the targets: the sum of its members'."""
        return self.membership() @ self.node_influence()

    def kept_influence(self) -> InfluenceShare:
        """The share of the graph's influence on the targets that the subgraph keeps (`InfluenceShare`)."""
        graph = self.graph
        normalized = normalized_abs(graph.adjacency_matrix)
        weights = graph.logit_weights()
        total = influence_series(normalized, weights).sum().clamp(min=1e-30)
        inside = torch.zeros(graph.n_nodes, dtype=torch.bool)
        inside[[i for part in self.parts for i in part.nodes]] = True
        kept = influence_series(normalized, weights)[inside].sum()
        rows = inside.clone()
        rows[graph.logit_start:] = True  # paths end at the targets, pinned or not
        within = normalized * rows[:, None] * inside[None, :]
        paths = influence_series(within, weights)[inside].sum()
        return InfluenceShare(float(kept / total), float(paths / total))

    # -------------------------------------------------------------------------------- prediction
    def predict(self, name: str, scale: float) -> tuple[Float[Tensor, " part"], Float[Tensor, " logit"]]:
        """The graph's linear prediction of scaling part `name`'s members by `scale`: each part's change
        (`linear_response`, summed over its members) and each output node's."""
        change = linear_response(self.graph, {i: scale for i in self.part(name).nodes})
        return self.membership().double() @ change, change[self.graph.logit_start:]

    # ------------------------------------------------------------------------------- files, plot
    def qparams(self) -> dict:
        """The viewer's qParams: `view`'s keys in their order, with `pinnedIds`, `supernodes` ([name,
        *ids] lists) and, where there are labels, `clerps` (circuit-tracer's viewer: a JSON string of
        [feature number, label] pairs, its nodes' `feature`, Cantor's pairing of layer and index)."""
        clerps = [[str(subgraph_files.cantor(*key)), label] for key, label in self.labels.items()]
        return subgraph_files.qparams(self.view, list(self.pinned), [[g.name, *g.members] for g in self.supernodes],
                                      clerps)

    def metadata(self) -> dict:
        """What a graph file's metadata says of its graph, to check a file against (`subgraph_files.check`)."""
        return {"scan": self.graph.model_name or "hooked_models", "prompt": self.graph.prompt,
                "prompt_tokens": self.graph.str_tokens_or_ids()}

    def save(self, path) -> None:
        """Write the subgraph into `path`'s graph file (this graph's, `graph.to_json`, or a viewer's copy)
        as its qParams, as circuit-tracer's viewer saves one (its `/save_graph`); the rest of the file
        is left as it was, its layout (compact, or indented as the viewer writes) kept."""
        subgraph_files.write(path, self.qparams(), self.metadata())

    @classmethod
    def load(cls, path, graph, slug: str | None = None) -> "Subgraph":
        """The subgraph in `path`'s graph file (written here or by circuit-tracer's viewer), over `graph`;
        refused if the file is another graph's (its scan, prompt, tokens or, given, slug differ).
        Supernodes of one name (the viewer allows them) are told apart as circuit-tracer's
        `decode_url_features` does: "name (2)", ..."""
        expected = {"scan": graph.model_name or "hooked_models", "prompt": graph.prompt,
                    "prompt_tokens": graph.str_tokens_or_ids()}
        if slug is not None:
            expected["slug"] = slug
        qparams = subgraph_files.read(path, expected)
        return cls.from_qparams(graph, qparams)

    @classmethod
    def from_qparams(cls, graph, qparams: Mapping) -> "Subgraph":
        """The subgraph a viewer's qParams describe (`qparams()`'s inverse)."""
        pinned, supernodes, clerps = subgraph_files.parse(qparams)
        labels = {subgraph_files.uncantor(int(feature)): label for feature, label in clerps}
        return cls(graph, supernodes, pinned, labels, view=qparams)

    def neuronpedia(self, slug: str, display_name: str = "") -> dict:
        """The body of Neuronpedia's `POST /api/graph/subgraph/save` for this subgraph of the graph
        uploaded as `slug` (its `clerps` keyed per node, `{layer}_{feature number}_{position}`: a label
        goes to each of the graph's nodes of its feature)."""
        clerps = [[f"{layer}_{subgraph_files.cantor(layer, feature)}_{pos}", self.labels[(layer, feature)]]
                  for layer, pos, feature in self.graph.active_features.tolist() if (layer, feature) in self.labels]
        return {"modelId": self.graph.model_name or "hooked_models", "slug": slug, "displayName": display_name,
                "pinnedIds": list(self.pinned), "supernodes": [[g.name, *g.members] for g in self.supernodes],
                "clerps": clerps, "pruningThreshold": self.graph.node_threshold, "densityThreshold": None}

    @classmethod
    def from_neuronpedia(cls, body: Mapping, graph) -> "Subgraph":
        """The subgraph of a Neuronpedia save body (`neuronpedia()`'s inverse), refused if its model differs."""
        model = graph.model_name or "hooked_models"
        if body.get("modelId") != model:
            raise ValueError(f"the subgraph is of model {body.get('modelId')!r}; this graph's is {model!r}")
        labels = {}
        for feature_id, label in body.get("clerps", []):
            layer, number, _ = (int(x) for x in feature_id.split("_"))
            key = (layer, subgraph_files.uncantor(number)[1])
            if labels.setdefault(key, label) != label:
                raise ValueError(f"feature {key} has two labels, {labels[key]!r} and {label!r}")
        return cls(graph, [(s[0], s[1:]) for s in body["supernodes"]], body["pinnedIds"], labels)

    def plot(self, path=None, ax=None, title: str | None = None):
        """The graph of the parts, as the biology paper draws one: each part at its members' mean layer
        (rows, embeddings below, logits above) and mean position (columns), each edge between two parts
        (`edges()`) an arrow as wide as its |weight|, red raising its target, blue lowering it."""
        return subgraph_plot.plot_subgraph(self, path, ax, title)

    def __str__(self) -> str:
        return (f"Subgraph of {len(self.pinned)} pinned nodes: {len(self.supernodes)} supernodes "
                f"({', '.join(repr(g.name) for g in self.supernodes)}), {len(self.parts) - len(self.supernodes)} "
                "nodes on their own")


def linear_response(graph, scales: Mapping[int, float]) -> Float[Tensor, " node"]:
    """The graph's linear prediction of each node's change when nodes `scales` ({node index: s}) are
    scaled by s and held there: a feature's activation (a clamped one's: (s - 1) x its activation),
    an output node's value (a logit minus the mean logit, or its direction's value); errors and
    embeddings are constants of the replacement model (0 unless scaled, and then not measured: 0).

    Every other feature responds with slope 1 (ReLU, JumpReLU and TopK are the identity on an active
    feature's neighbourhood): with r the nodes' relative changes (s - 1 for the scaled), each edge
    carries r_source x its weight to its target's pre-activation, and a free feature's r is that sum
    over its activation, solved layer by layer (the graph is acyclic). Exact for the replacement model
    with attention and norms frozen as long as no feature turns on or off, and where the graph has every
    active feature (`max_feature_nodes=None`)."""
    adjacency = graph.adjacency_matrix.double()
    n, features = graph.n_nodes, graph.n_features
    clamped = torch.zeros(n, dtype=torch.bool)
    r0 = torch.zeros(n, dtype=torch.float64)
    for i, s in scales.items():
        clamped[i], r0[i] = True, float(s) - 1.0
    activation = torch.ones(n, dtype=torch.float64)
    activation[:features] = graph.activation_values.double()
    free = torch.zeros(n, dtype=torch.bool)
    free[:features] = ~clamped[:features]
    r = r0
    for _ in range(n):  # at most as many rounds as the graph is deep
        moved = torch.where(free, adjacency @ r / activation, r0)
        if torch.equal(moved, r):
            break
        r = moved
    change = torch.zeros(n, dtype=torch.float64)
    change[:features] = activation[:features] * r[:features]
    change[graph.logit_start:] = (adjacency @ r)[graph.logit_start:]
    return change
