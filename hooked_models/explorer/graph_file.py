"""An attribution graph file in circuit-tracer's schema, as the graph view reads it.

Transcribed from circuit-tracer's `circuit_tracer/frontend/graph_models.py` (the pydantic models its
local viewer and Neuronpedia read: metadata, qParams, nodes, links), field for field, so a file either
writes opens in both. `checked()` adds what the models leave unchecked and a viewer needs: node ids are
unique, every link joins two nodes of the file, and weights are finite.

A link is a plain dict in that schema, so it may carry more than source, target and weight; the view shows
a link's per-head loadings (an edge through attention split over the heads that carry it) when it has
`heads`: a mapping from a head's label to its share of the weight.
"""

import json
import math

from pydantic import BaseModel, model_validator


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
