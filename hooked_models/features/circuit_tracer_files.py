"""circuit-tracer's feature files, and where its local viewer looks for them beside a graph.

One JSON file per feature, the `Model` of circuit-tracer's `frontend/feature_models.py`: `transcoder_id`,
`index`, `examples_quantiles` (the top windows, then a sample per activation interval, strongest first),
`top_logits`/`bottom_logits`, `act_min`/`act_max`, `quantile_values` (the 100 percentiles of the active
activations, each the upper edge of the histogram bin it falls in), `histogram` (the counts in equal
bins from 0 up to the bin holding the maximum: the viewer places an activation by
(a - act_min)/(act_max - act_min), so its marker may sit up to one bin off), `activation_frequency`; plus
`label` and `label_source` (circuit-tracer's reader ignores fields it does not know).

The viewer reads a feature at `{scan}/{feature}.json` where a graph's `metadata.scan` starts with "./",
`feature` the node's Cantor-paired (layer, index); its server maps `./data/` to its data directory. So
`write_beside_graph` puts the graph's features in `features/{slug}/` beside the graph, points the scan
there, writes each node's label as its `clerp`, and lists the graph in `graph-metadata.json`.
"""

import json
import os
from pathlib import Path

from hooked_models.features.labels import labels as all_labels
from hooked_models.features.results import FeatureStatistics, LayerStatistics

METADATA = "graph-metadata.json"
# The node kind of a transcoder feature in circuit-tracer's graph files.
FEATURE_NODE = "cross layer transcoder"


def cantor(layer: int, feature: int) -> int:
    """circuit-tracer's feature id: Cantor's pairing of (layer, index)."""
    return (layer + feature) * (layer + feature + 1) // 2 + feature


def _quantile_values(layer: LayerStatistics, feature: int) -> list[float]:
    counts, edges = layer.histogram(feature)
    total, running, out, j = sum(counts), 0, [], 0
    if total == 0:
        return []
    for q in range(1, 101):
        while running + counts[j] < q * total / 100 and j < len(counts) - 1:
            running += counts[j]
            j += 1
        out.append(edges[j + 1])
    return out


def feature_file(layer: LayerStatistics, feature: int, label: str = "", label_source: str = "") -> dict:
    """One feature as circuit-tracer's feature `Model` (see the module docstring)."""
    seen: set[int] = set()

    def example(window) -> dict:
        repeated = window.row in seen
        seen.add(window.row)
        return {"tokens_acts_list": window.activations, "train_token_ind": window.position - window.start,
                "is_repeated_datapoint": repeated, "tokens": window.tokens}

    quantiles = [{"quantile_name": "Top activations", "examples": [example(w) for w in layer.top_windows(feature)]}]
    for i, (low, high, windows) in enumerate(layer.interval_windows(feature)):
        quantiles.append({"quantile_name": f"Subsample interval {i} (activations {low:.3g} to {high:.3g})",
                          "examples": [example(w) for w in windows]})
    counts, _ = layer.histogram(feature)
    act_max = float(layer.partial.act_max[feature])
    shown = 0 if act_max <= 0 else min(len(counts), int(act_max * len(counts) / layer.range_top(feature)) + 1)
    strings = layer.token_strings
    return {"transcoder_id": layer.transcoder_id, "index": feature, "examples_quantiles": quantiles,
            "top_logits": [strings.get(int(t), str(int(t))) for t in layer.top_logits[feature].tolist()],
            "bottom_logits": [strings.get(int(t), str(int(t))) for t in layer.bottom_logits[feature].tolist()],
            "act_min": float(layer.partial.act_min[feature]), "act_max": act_max,
            "quantile_values": _quantile_values(layer, feature), "histogram": [float(c) for c in counts[:shown]],
            "activation_frequency": float(layer.frequency()[feature]), "label": label, "label_source": label_source}


def write_feature_files(stats: FeatureStatistics, directory: str | os.PathLike, which=None, user_labels=None) -> Path:
    """`directory/{cantor(layer, feature)}.json` for each (layer, feature) of `which` (default: all)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    named = all_labels(stats, user_labels)
    if which is None:
        which = [(layer.layer, f) for layer in stats.layers for f in range(layer.d_sae)]
    for layer_index, feature in which:
        label, source = named[(layer_index, feature)]
        data = feature_file(stats[layer_index], feature, label, source)
        (directory / f"{cantor(layer_index, feature)}.json").write_text(json.dumps(data))
    return directory


def write_beside_graph(graph: dict, path: str | os.PathLike, stats: FeatureStatistics, user_labels=None) -> dict:
    """The graph file `graph` (to be written at `path`) with its features' files written beside it, its
    scan pointing at them and each feature node's label as its clerp; `graph-metadata.json` lists it."""
    path = Path(path)
    slug = graph["metadata"]["slug"]
    named = all_labels(stats, user_labels)
    which = []
    for node in graph["nodes"]:
        if node["feature_type"] == FEATURE_NODE:
            layer, feature = int(node["layer"]), int(node["node_id"].split("_")[1])
            which.append((layer, feature))
            node["clerp"] = named[(layer, feature)][0]
    write_feature_files(stats, path.parent / "features" / slug, sorted(set(which)), user_labels)
    graph["metadata"]["scan"] = f"./data/features/{slug}"
    index = path.parent / METADATA
    listed = json.loads(index.read_text()) if index.is_file() else {"graphs": []}
    # as circuit-tracer's `add_graph_metadata` lists a graph: its metadata, one entry per slug
    listed["graphs"] = [g for g in listed["graphs"] if g.get("slug") != slug] + [dict(graph["metadata"])]
    index.write_text(json.dumps(listed, indent=1))
    return graph
