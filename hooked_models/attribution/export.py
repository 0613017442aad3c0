"""Graph files: circuit-tracer's graph-file schema (its `frontend/graph_models.py`, `utils/create_graph_files.py`),
which its local viewer and Neuronpedia open, and a drawing. Functions of a graph; the graph's methods
(`to_json`, `from_json`, `plot`) call them.
"""

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hooked_models.attribution.qk import QKTable

# The feature_type strings circuit-tracer's viewer knows (frontend/graph_models.py).
FEATURE_TYPES = ("cross layer transcoder", "mlp reconstruction error", "embedding", "logit")


def write_json(graph, path: "str | os.PathLike", slug: str | None = None, features=None, labels=None,
               annotate=None) -> Path:
    """Write a pruned graph (`node_mask` and `edge_mask` set) in circuit-tracer's graph-file schema: the
    kept nodes and edges (what the viewer draws) and the QK tables (`qk_attributions`, a key the viewer
    ignores; the explorer gives each link its per-head split from the side file). What `from_json` needs
    for the rest (the whole adjacency, the loadings, the QK vectors) goes beside it, in
    `<stem>.tensors.safetensors`, its name under `hooked_models`; the JSON itself grows with the kept graph
    only. With `features` (a statistics result), its features' files beside it and its nodes labelled
    (`features.circuit_tracer_files`). `annotate(data, nodes)`: called with the file's dict and the kept
    nodes by index before it is written, to add keys of its own (an aggregate's spread over prompts)."""
    path = Path(path)
    slug = slug or path.stem
    nodes = {i: json_node(graph, i) for i in graph.node_mask.nonzero().flatten().tolist()}
    targets, sources = graph.edge_mask.nonzero(as_tuple=True)
    links = [{"source": nodes[s]["node_id"], "target": nodes[t]["node_id"],
              "weight": float(graph.adjacency_matrix[t, s])}
             for t, s in zip(targets.tolist(), sources.tolist()) if s in nodes and t in nodes]
    linked = {link["source"] for link in links} | {link["target"] for link in links}
    side = path.with_name(f"{path.stem}.tensors.safetensors")
    data = {
        "metadata": {"slug": slug, "scan": graph.model_name or "hooked_models",
                     "transcoder_list": list(graph.transcoder_names), "prompt_tokens": graph.str_tokens_or_ids(),
                     "prompt": graph.prompt, "node_threshold": graph.node_threshold, "schema_version": 1},
        "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
        "nodes": [n for n in nodes.values() if n["node_id"] in linked or n["feature_type"] in ("embedding", "logit")],
        "links": links,
        "qk_attributions": _qk_json(graph, nodes),
        "hooked_models": {**state(graph), "tensors": side.name},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors(graph), str(side))
    if features is not None:
        from hooked_models.features.circuit_tracer_files import write_beside_graph

        data = write_beside_graph(data, path, features, labels)
    if annotate is not None:
        annotate(data, nodes)
    path.write_text(json.dumps(data))
    return path


def _qk_json(graph, nodes: dict) -> list[dict]:
    """The QK tables for the viewer: each entry's score and its 20 strongest pairs, by node id."""
    ids = {graph.node_name(i): node["node_id"] for i, node in nodes.items()}
    out = []
    for (layer, head, q, k), table in sorted((graph.qk_tables or {}).items()):
        pairs = [{"query": ids.get(p["query"], p["query"]), "key": ids.get(p["key"], p["key"]), "weight": p["value"]}
                 for p in table.top(20)]
        out.append({"layer": layer, "head": head, "query_pos": q, "key_pos": k, "score": table.score,
                    "capped_score": table.capped, "flow": table.flow, "pairs": pairs})
    return out


def node_fields(graph, i: int) -> tuple[str, int | None, int, int | None]:
    """(kind, layer, position, index) of node i: index a feature's index, an embedding's or logit's
    token (a target that is not one token: its negative id), None for an error."""
    kind = graph.node_kind(i)
    layer, pos = graph.node_position(i)
    index = {"feature": lambda: int(graph.active_features[i, 2]), "error": lambda: None,
             "embedding": lambda: int(graph.tokens[pos]),
             "logit": lambda: int(graph.logit_tokens[i - graph.logit_start])}[kind]()
    return kind, layer, pos, index


def node_id(graph, i: int) -> str:
    """Node i's id in the graph file (circuit-tracer's, version 1): `{layer}_{index}_{pos}` for a
    feature, `{layer}_-1_{pos}` for an error, `E_{token}_{pos}` for an embedding, `{n_layers + 1}_{token}_{pos}`
    for a logit (a target that is not one token: its negative id). Subgraphs name their nodes by it."""
    kind, layer, pos, index = node_fields(graph, i)
    return {"feature": f"{layer}_{index}_{pos}", "error": f"{layer}_-1_{pos}", "embedding": f"E_{index}_{pos}",
            "logit": f"{graph.n_layers + 1}_{index}_{pos}"}[kind]


def json_node(graph, i: int) -> dict:
    """Node i as the viewer reads it (circuit-tracer's `Node`)."""
    kind = graph.node_kind(i)
    layer, pos = graph.node_position(i)
    influence = None if graph.cumulative_influence is None else float(graph.cumulative_influence[i])
    node = {"ctx_idx": pos, "token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0,
            "clerp": "", "influence": influence, "activation": None}
    if kind == "feature":
        feature = int(graph.active_features[i, 2])
        # The viewer's feature id: Cantor's pairing of (layer, index), one integer per feature.
        paired = (layer + feature) * (layer + feature + 1) // 2 + feature
        node.update(node_id=node_id(graph, i), feature=paired, layer=str(layer),
                    feature_type=FEATURE_TYPES[0], jsNodeId=f"{layer}_{feature}-0",
                    activation=float(graph.activation_values[i]))
    elif kind == "error":
        # Index -1, never a feature's, so that no error id aliases a feature's.
        node.update(node_id=node_id(graph, i), feature=-1, layer=str(layer), feature_type=FEATURE_TYPES[1],
                    jsNodeId=f"{layer}_-1-{pos}")
    elif kind == "embedding":
        token = int(graph.tokens[pos])
        node.update(node_id=node_id(graph, i), feature=pos, layer="E", feature_type=FEATURE_TYPES[2],
                    jsNodeId=f"E_{token}-{pos}")
    else:
        k = i - graph.logit_start
        token, prob = int(graph.logit_tokens[k]), float(graph.logit_probabilities[k])
        layer = str(graph.n_layers + 1)
        node.update(node_id=node_id(graph, i), feature=token, layer=layer, feature_type=FEATURE_TYPES[3],
                    jsNodeId=f"L_{token}-{pos}", token_prob=prob, is_target_logit=k == 0,
                    clerp=f'Output "{graph.logit_text(k)}" (p={prob:.3f})')
    return node


def state(graph) -> dict:
    """Everything but the masks and the tensors `tensors` holds, as lists."""
    fields = {"tokens": graph.tokens.tolist(), "active_features": graph.active_features.tolist(),
              "logit_tokens": graph.logit_tokens.tolist(), "n_layers": graph.n_layers,
              "prompt": graph.prompt, "str_tokens": list(graph.str_tokens), "model_name": graph.model_name,
              "transcoder_names": list(graph.transcoder_names), "logit_str_tokens": list(graph.logit_str_tokens),
              "logit_positions": None if graph.logit_positions is None else graph.logit_positions.tolist()}
    tables = sorted((graph.qk_tables or {}).items())
    fields["qk"] = [{"entry": list(key), "names": t.names, "scale": t.scale, "cap": t.cap,
                     "model_score": t.model_score, "flow": t.flow} for key, t in tables]
    return fields


def tensors(graph) -> dict[str, torch.Tensor]:
    """The graph's numbers, float32 exactly (safetensors)."""
    out = {"activation_values": graph.activation_values, "logit_probabilities": graph.logit_probabilities,
           "adjacency_matrix": graph.adjacency_matrix}
    for name in ("loading_edges", "loading_heads", "loading_skips"):
        if getattr(graph, name) is not None:
            out[name] = getattr(graph, name)
    for i, (_, table) in enumerate(sorted((graph.qk_tables or {}).items())):
        out[f"qk.{i}.queries"], out[f"qk.{i}.keys"] = table.queries, table.keys
    return {name: value.detach().cpu().contiguous() for name, value in out.items()}


def read_state(path: "str | os.PathLike") -> dict:
    """The fields of the graph `write_json` wrote (its JSON and the tensors beside it), unpruned, every
    node and edge as it was."""
    path = Path(path)
    data = json.loads(path.read_text())
    if "hooked_models" not in data:
        raise ValueError(f"{path} is a graph file without the hooked_models section `to_json` writes; "
                         "only graphs written here can be rebuilt")
    fields = data["hooked_models"]
    side = path.with_name(fields["tensors"])
    if not side.is_file():
        raise ValueError(f"{path} keeps the graph's tensors in {side.name}, which is not beside it")
    numbers = load_file(str(side))
    qk = {}
    for i, table in enumerate(fields["qk"]):
        layer, head, q, k = table["entry"]
        qk[(layer, head, q, k)] = QKTable(layer, head, q, k, table["names"], numbers[f"qk.{i}.queries"],
                                          numbers[f"qk.{i}.keys"], table["scale"], table["cap"],
                                          table["model_score"], table["flow"])
    positions = fields.get("logit_positions")
    return dict(tokens=torch.tensor(fields["tokens"], dtype=torch.long),
                active_features=torch.tensor(fields["active_features"], dtype=torch.long).reshape(-1, 3),
                activation_values=numbers["activation_values"],
                logit_tokens=torch.tensor(fields["logit_tokens"], dtype=torch.long),
                logit_probabilities=numbers["logit_probabilities"], adjacency_matrix=numbers["adjacency_matrix"],
                n_layers=fields["n_layers"], prompt=fields["prompt"], str_tokens=fields["str_tokens"],
                model_name=fields["model_name"], transcoder_names=fields["transcoder_names"],
                logit_str_tokens=fields["logit_str_tokens"],
                logit_positions=None if positions is None else torch.tensor(positions, dtype=torch.long),
                loading_edges=numbers.get("loading_edges"), loading_heads=numbers.get("loading_heads"),
                loading_skips=numbers.get("loading_skips"), qk_tables=qk if "loading_edges" in numbers else None)


# Links by sign, in RdBu's ends (ColorBrewer, as matplotlib ships it; the explorer's graph view uses the same).
EDGE_COLOURS = {"positive": "#b2182b", "negative": "#2166ac"}
ACROSS = 3  # nodes side by side in a (layer, position) cell; more stack up


def plot(graph, path: "str | os.PathLike | None" = None, ax=None, title: str | None = None):
    """Draw a pruned graph (see `AttributionGraph.plot`)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    kept = graph.node_mask.nonzero().flatten().tolist()
    cells: dict[tuple, list[int]] = {}
    for i in kept:
        layer, pos = graph.node_position(i)
        cells.setdefault((-1 if layer is None else layer, pos), []).append(i)
    rows = graph.n_layers + 2
    # A cell's nodes: up to ACROSS side by side, the rest stacked; each row as tall as its fullest cell.
    levels = [1] * rows
    for (row, _), members in cells.items():
        levels[row + 1] = max(levels[row + 1], -(-len(members) // ACROSS))
    step = 0.3  # a stacked node's height, in rows
    bottom = [sum(max(1.0, step * (n + 1)) for n in levels[:r]) for r in range(rows + 1)]
    xy = {}
    for (row, pos), members in cells.items():
        r = row + 1
        centre = bottom[r] + (bottom[r + 1] - bottom[r]) / 2
        for k, i in enumerate(members):
            column, level = k % ACROSS, k // ACROSS
            used = min(ACROSS, len(members) - level * ACROSS)
            xy[i] = (pos - 0.5 + (column + 1) / (used + 1), centre + (level - (levels[r] - 1) / 2) * step)
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * graph.n_pos + 1.5), 0.9 * bottom[-1] + 1.8))
    else:
        fig = ax.figure
    targets, sources = graph.edge_mask.nonzero(as_tuple=True)
    weights = graph.adjacency_matrix[targets, sources]
    biggest = float(weights.abs().max()) if weights.numel() else 1.0
    for t, s, w in zip(targets.tolist(), sources.tolist(), weights.tolist()):
        if s in xy and t in xy:
            ax.plot(*zip(xy[s], xy[t]), color=EDGE_COLOURS["positive" if w > 0 else "negative"],
                    linewidth=0.3 + 4 * abs(w) / biggest, alpha=0.6, zorder=1)
    colours = {"feature": "#f59e0b", "error": "#9ca3af", "embedding": "#16a34a", "logit": "#111827"}
    for kind, colour in colours.items():
        points = [xy[i] for i in kept if graph.node_kind(i) == kind]
        if points:
            ax.scatter(*zip(*points), s=60, color=colour, edgecolor="black", zorder=2, label=kind,
                       marker="s" if kind == "error" else "o")
    crowded = {i for members in cells.values() if len(members) > ACROSS for i in members}
    for i in kept:  # each node by what it is, where it fits: F159 (a feature of its row's layer), logit 'Mary'
        kind = graph.node_kind(i)
        if kind == "logit" or (kind == "feature" and i not in crowded):
            label = (f"F{int(graph.active_features[i, 2])}" if kind == "feature"
                     else f"logit {logit_label(graph, i - graph.logit_start)}")
            ax.annotate(label, xy[i], textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.set_xticks(range(graph.n_pos), graph.str_tokens_or_ids(), rotation=45, ha="right")
    centres = [(bottom[r] + bottom[r + 1]) / 2 for r in range(rows)]
    ax.set_yticks(centres, ["emb", *[f"L{l}" for l in range(graph.n_layers)], "logits"])
    ax.set_xlim(-0.7, graph.n_pos - 0.3)
    ax.set_ylim(bottom[0] - 0.1, bottom[-1] + 0.6)
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color=EDGE_COLOURS["positive"], lw=2, label="positive edge (raises its target)"),
                Line2D([], [], color=EDGE_COLOURS["negative"], lw=2, label="negative edge (lowers it)")]
    ax.legend(handles=handles, loc="upper left", fontsize=7, ncol=3)
    ax.set_title(title or f"attribution graph: {len(kept)} nodes, {int(graph.edge_mask.sum())} edges")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def logit_label(graph, k: int) -> str:
    return f"{graph.logit_text(k)!r} ({float(graph.logit_probabilities[k]):.2f})"
