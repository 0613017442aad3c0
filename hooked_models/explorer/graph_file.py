"""An attribution graph file in circuit-tracer's schema, as the graph view reads it.

Transcribed from circuit-tracer's `circuit_tracer/frontend/graph_models.py` (the pydantic models its
local viewer and Neuronpedia read: metadata, qParams, nodes, links), field for field, so a file either
writes opens in both. `checked()` adds what the models leave unchecked and a viewer needs: node ids are
unique, every link joins two nodes of the file, and weights are finite.

A link is a plain dict in that schema, so it may carry more than source, target and weight; the view shows
a link's per-head loadings (an edge through attention split over the heads that carry it) when it has
`heads`: a mapping from a head's label to its share of the weight. What the view adds to a file it reads
(`attach_head_loadings`, `attach_examples`, `attach_spread`: from the whole graph, a statistics result beside
it, an aggregate's spread) is here too, read from those and computed by nothing here.
"""

import json
import math
from pathlib import Path

from pydantic import BaseModel, model_validator

from hooked_models import features
from hooked_models.attribution import AttributionGraph
from hooked_models.attribution.export import json_node
from hooked_models.attribution.store import graph_file
from hooked_models.features.results import META as STATISTICS


class Metadata(BaseModel):
    slug: str
    scan: str
    transcoder_list: list[str]
    prompt_tokens: list[str]
    prompt: str
    node_threshold: float | None = None
    schema_version: int | None = 1


class QParams(BaseModel):
    pinnedIds: list[str]
    supernodes: list[list[str]]
    linkType: str
    clickedId: str
    sg_pos: str

    @model_validator(mode="before")
    @classmethod
    def _as_the_viewer_saves(cls, data):
        # circuit-tracer's viewer's Save button posts its URL's parameters and /save_graph writes them as they
        # came: pinnedIds comma-joined, supernodes JSON.stringify'd, a key the page never set null.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("pinnedIds"), str):
            data["pinnedIds"] = [node for node in data["pinnedIds"].split(",") if node]
        if isinstance(data.get("supernodes"), str):
            try:
                data["supernodes"] = json.loads(data["supernodes"])
            except json.JSONDecodeError:
                raise ValueError(f"supernodes {data['supernodes'][:60]!r} is not the JSON of a list") from None
        for key, default in (("pinnedIds", []), ("supernodes", []), ("linkType", "both"), ("clickedId", ""),
                             ("sg_pos", "")):
            if data.get(key) is None:
                data[key] = default
        return data


class Node(BaseModel):
    node_id: str
    feature: int
    layer: str
    ctx_idx: int
    feature_type: str
    token_prob: float = 0.0
    is_target_logit: bool = False
    run_idx: int = 0
    reverse_ctx_idx: int = 0
    jsNodeId: str
    clerp: str = ""
    influence: float | None = None
    activation: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _js_node_id(cls, data):
        # circuit-tracer's Node.__init__ defaults jsNodeId to node_id
        if isinstance(data, dict) and "node_id" in data and "jsNodeId" not in data:
            data = {**data, "jsNodeId": data["node_id"]}
        return data


class Link(BaseModel):
    source: str
    target: str
    weight: float


class GraphFile(BaseModel):
    metadata: Metadata
    qParams: QParams
    nodes: list[Node]
    links: list[dict]

    def checked(self) -> "GraphFile":
        """The file, after the checks the schema leaves to the reader (a ValueError names the first failure)."""
        ids = [node.node_id for node in self.nodes]
        if len(set(ids)) != len(ids):
            duplicate = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"node_id {duplicate!r} appears more than once")
        known = set(ids)
        for index, raw in enumerate(self.links):
            link = Link.model_validate(raw)
            for end in (link.source, link.target):
                if end not in known:
                    raise ValueError(f"links[{index}] names node {end!r}, which the file does not have")
            if not math.isfinite(link.weight):
                raise ValueError(f"links[{index}] has weight {link.weight}")
        return self


# Top examples per feature node shown on hover in the graph view.
HOVER_EXAMPLES = 3


def attach_spread(graph: dict, data: dict) -> None:
    """An aggregate's spread over the prompts, carried through: each node's (`spread`: count, mean and sd,
    its value in each prompt), and each prompt's own graph file (`prompt_graphs`, by graph index)."""
    about = data["metadata"]["hooked_models_aggregate"]
    graph["metadata"]["aggregate"] = about
    graph["metadata"]["prompt_graphs"] = [str(Path(about["store"]) / graph_file(i)) for i in range(about["n_graphs"])]
    spreads = {node["node_id"]: node["hooked_models_aggregate"] for node in data["nodes"]
               if "hooked_models_aggregate" in node}
    for node in graph["nodes"]:
        if node["node_id"] in spreads:
            node["spread"] = spreads[node["node_id"]]


def attach_examples(nodes: list[dict], directory: Path) -> None:
    """Each transcoder node's top windows as text ("[peak]" marked), from the first `features.statistics`
    result in the graph's directory (sorted by name; none: no examples); a layer it lacks gets none."""
    found = sorted(p for p in directory.iterdir() if p.is_dir() and (p / STATISTICS).is_file())
    if not found:
        return
    stats = features.FeatureStatistics.load(found[0])
    for node in nodes:
        if "transcoder" not in node.get("feature_type", ""):
            continue
        layer, feature = int(node["layer"]), int(node["node_id"].split("_")[1])
        try:
            windows = stats[layer].top_windows(feature)[:HOVER_EXAMPLES]
        except (KeyError, IndexError):
            continue
        node["examples"] = ["".join(f"[{t}]" if i == w.position - w.start else t for i, t in enumerate(w.tokens))
                            for w in windows]


def attach_head_loadings(links: list[dict], graph: AttributionGraph) -> None:
    """Give each link through attention its per-head split, `heads`: {"layers.L.self_attn.head.h": part, ...,
    "layers.L.self_attn (skipped)": the part that skips L's attention}, for each attention layer L the edge
    crosses (the heads' parts plus the skip are the edge, per layer), nonzero entries only."""
    if graph.loading_edges is None:
        return
    index = {json_node(graph, i)["node_id"]: i for i in range(graph.n_nodes)}
    row = {(t, s): e for e, (t, s) in enumerate(graph.loading_edges.tolist())}
    for link in links:
        e = row.get((index[link["target"]], index[link["source"]]))
        if e is None:
            continue
        loadings, skips = graph.loading_heads[e], graph.loading_skips[e]
        heads = {}
        for layer in range(loadings.shape[0]):
            if bool(loadings[layer].any()):
                for head, part in enumerate(loadings[layer].tolist()):
                    heads[f"layers.{layer}.self_attn.head.{head}"] = part
                heads[f"layers.{layer}.self_attn (skipped)"] = float(skips[layer])
        if heads:
            link["heads"] = heads
