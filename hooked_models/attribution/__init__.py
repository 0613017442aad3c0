"""Attribution graphs: which transcoder features, embeddings and errors drive which, down to the logits.

    graph = attribute(model, prompt, transcoders)        # every active feature, error, embedding, top logits
    graph.adjacency_matrix[target, source]              # direct effects in the linearised replacement model
    graph.head_loadings[target, source, layer, head]    # the part of an edge that passes each attention head
    pruned = graph.prune(node_threshold=0.8, edge_threshold=0.98)
    pruned.scores()                                     # (replacement score, completeness score)
    pruned.to_json("graph.json"); pruned.plot("graph.png"); AttributionGraph.from_json("graph.json")
    feature_intervention(model, prompt, transcoders, [(layer, pos, feature, value)]) -> logits

Laid out as circuit-tracer's `attribution/` and `graph.py`, one concern per module, each importing only
those listed after it (the contract in pyproject.toml): attribute (`attribute`) | intervention
(`feature_intervention`); graph (nodes, pruning, scores) | targets (the rows' input directions);
export (graph files, the drawing) | replacement (the replacement model and its freezing).
"""

from hooked_models.attribution.attribute import attribute
from hooked_models.attribution.export import FEATURE_TYPES
from hooked_models.attribution.graph import AttributionGraph
from hooked_models.attribution.intervention import feature_intervention

__all__ = ["FEATURE_TYPES", "AttributionGraph", "attribute", "feature_intervention"]
