"""Search across the graphs of a store, read from their files alone (no tensors loaded):

    graphs_containing(store, layer=1, feature=37)              # [3, 8, ...]: the graphs whose file keeps it
    graphs_containing(store, 1, 37, position=14, kept=False)   # ... among every active feature, at position 14
    cooccurring(store, 1, 37)                                  # the features kept beside it, most often first
    supernode_shares(store, {"say IO": [(1, 37), "1_12_15"], "S": [(0, 5)]})   # per graph: each one's share
    graphs_led_by(store, supernodes, "say IO")                 # the graphs where it carries the most

`kept=True` reads the pruned nodes each graph file holds (as `to_json` pruned it, at the store's
thresholds); `kept=False` every feature that is a node of the graph (the active features whose rows were
computed). The supernode searches read each graph whole (`Subgraph`'s influence).
"""

import os
from collections import Counter
from collections.abc import Iterable, Mapping

from hooked_models.attribution.export import node_id
from hooked_models.attribution.store import GraphStore
from hooked_models.attribution.subgraph import Subgraph


def graph_features(store: GraphStore, i: int, kept: bool = True) -> set[tuple[int, int, int]]:
    """Graph i's features as (layer, feature, position): those its file keeps, or (kept=False) all."""
    data = store.graph_json(i)
    if not kept:
        return {(layer, feature, pos) for layer, pos, feature in data["hooked_models"]["active_features"]}
    # A feature's node id is "{layer}_{feature}_{position}" (export.json_node); errors have feature -1.
    return {tuple(int(x) for x in n["node_id"].split("_")) for n in data["nodes"]
            if n["feature_type"] == "cross layer transcoder"}


def _open(store) -> GraphStore:
    return store if isinstance(store, GraphStore) else GraphStore(store)


def graphs_containing(store: "GraphStore | str | os.PathLike", layer: int, feature: int,
                      position: int | None = None, kept: bool = True) -> list[int]:
    """The graphs (indices into the store) that hold feature `feature` of layer `layer` (at `position`, if
    given; anywhere otherwise), in order."""
    store = _open(store)
    return [i for i in range(len(store))
            if any(l == layer and f == feature and (position is None or p == position)
                   for l, f, p in graph_features(store, i, kept))]


def cooccurring(store: "GraphStore | str | os.PathLike", layer: int, feature: int, kept: bool = True,
                top: int | None = None) -> list[dict]:
    """The features found in the graphs that hold (layer, feature), at any position: each as {"layer",
    "feature", "count" (graphs holding both), "fraction" (of the graphs holding (layer, feature))}, most
    often first (then by layer and feature); at most `top`."""
    store = _open(store)
    counts: Counter = Counter()
    holding = 0
    for i in range(len(store)):
        found = {(l, f) for l, f, _ in graph_features(store, i, kept)}
        if (layer, feature) in found:
            holding += 1
            counts.update(found - {(layer, feature)})
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]
    return [{"layer": l, "feature": f, "count": c, "fraction": c / holding} for (l, f), c in ranked]


def _members(graph, members: Iterable) -> list[str]:
    """A supernode's members present in `graph`, as graph-file ids: a node id ("1_37_15") if the graph has that
    node, a (layer, feature) at every position it is a node of the graph."""
    ids = {node_id(graph, i) for i in range(graph.n_nodes)}
    found = []
    for member in members:
        if isinstance(member, tuple) and len(member) == 2:
            layer, feature = member
            found += [f"{layer}_{feature}_{p}" for l, p, f in graph.active_features.tolist() if (l, f) == (layer, feature)]
        elif isinstance(member, str):
            found += [member] if member in ids else []
        else:
            raise ValueError(f"supernode member {member!r} must be a graph-file node id ('1_37_15') or a "
                             "(layer, feature) pair")
    return list(dict.fromkeys(found))


def supernode_shares(store: "GraphStore | str | os.PathLike", supernodes: Mapping[str, Iterable]) -> list[dict]:
    """For each graph, each supernode's share of the graph's influence on its outputs: the sum of its members'
    influence (`Subgraph.influence`, circuit-tracer's pruning measure) over every node's; 0.0 where none of
    its members is in that graph. Members: graph-file node ids ("1_37_15": one position, for prompts of one
    template) or (layer, feature) pairs (every position the feature is a node at)."""
    store = _open(store)
    if not supernodes:
        raise ValueError("supernodes is empty: name at least one, {name: [members]}")
    out = []
    for graph in store:
        present = {name: _members(graph, members) for name, members in supernodes.items()}
        sub = Subgraph(graph, {name: ids for name, ids in present.items() if ids})
        total = float(sub.node_influence().sum())
        shares = dict(zip((part.name for part in sub.parts), (float(v) / total if total else 0.0
                                                               for v in sub.influence())))
        out.append({name: shares.get(name, 0.0) for name in supernodes})
    return out


def graphs_led_by(store: "GraphStore | str | os.PathLike", supernodes: Mapping[str, Iterable], name: str) -> list[int]:
    """The graphs where supernode `name` carries the largest share of the influence among `supernodes` (and
    more than none), its largest share first."""
    if name not in supernodes:
        raise ValueError(f"{name!r} is not one of the supernodes {list(supernodes)}")
    shares = supernode_shares(store, supernodes)
    led = [g for g, row in enumerate(shares) if row[name] > 0 and row[name] == max(row.values())]
    return sorted(led, key=lambda g: -shares[g][name])
