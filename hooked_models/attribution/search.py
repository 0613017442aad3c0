"""Search across the graphs of a store, read from their files alone (no tensors loaded):

    graphs_containing(store, layer=1, feature=37)              # [3, 8, ...]: the graphs whose file keeps it
    graphs_containing(store, 1, 37, position=14, kept=False)   # ... among every active feature, at position 14
    cooccurring(store, 1, 37)                                  # the features kept beside it, most often first

`kept=True` reads the pruned nodes each graph file holds (as `to_json` pruned it, at the store's
thresholds); `kept=False` every feature that is a node of the graph (the active features whose rows were
computed).
"""

import os
from collections import Counter

from hooked_models.attribution.store import GraphStore


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
