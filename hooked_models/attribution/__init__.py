"""Attribution graphs: which transcoder features, embeddings and errors drive which, down to the logits.

    graph = attribute(model, prompt, transcoders)        # every active feature, error, embedding, top logits
    graph.adjacency_matrix[target, source]              # direct effects in the linearised replacement model
    graph.edge_loadings(target, source)                 # a kept edge split over each layer's heads
    graph.qk(layer, head, query_pos, key_pos)           # why that head attended there: (query, key) pairs
    attribute(model, prompt, transcoders, targets=[(" Mary", " John")])   # a logit difference
    pruned = graph.prune(node_threshold=0.8, edge_threshold=0.98)
    pruned.scores()                                     # (replacement score, completeness score)
    pruned.to_json("graph.json"); pruned.plot("graph.png"); AttributionGraph.from_json("graph.json")
    feature_intervention(model, prompt, transcoders, [(layer, pos, feature, value)]) -> logits
    feature_steering(model, prompt, transcoders, [(layer, pos, feature, strength)])  # + decoder row; _generate
    sub = Subgraph(graph, supernodes={"say Mary": ["1_37_15", ...]}, pinned=[...])   # parts, edges, influence
    sub.save("graph.json"); Subgraph.load("graph.json", graph)  # the viewer's qParams in the graph file
    intervene_supernodes(model, prompt, transcoders, sub, scales=(-1, 0, 2))  # measured beside predicted
Over a dataset: `attribute_dataset(model, prompts, transcoders, "out/graphs", engine="ray")` writes a graph
per prompt to a `GraphStore`; `aggregate(store)` matches their nodes (how often each feature occurs, its
influence's mean and spread, the edges between recurring features, the exceptions) and writes an aggregate
graph file; `graphs_containing`, `cooccurring`, `supernode_shares` and `graphs_led_by` search the store.
"""

# For developers, the package's layout: as circuit-tracer's `attribution/` and `graph.py`, one concern per
# module, each importing only those listed after it (the contract in pyproject.toml): supernode_intervention
# (`intervene_supernodes`) | dataset (`attribute_dataset`) | aggregate (`aggregate`) | search
# (`graphs_containing`, `cooccurring`, `supernode_shares`, `graphs_led_by`); store (`GraphStore`: a graph store's
# files and index); attribute (`attribute`) | intervention (`feature_intervention`, `feature_intervention_generate`,
# steering, the batched replacement run); attention (per-head loadings and QK, from one decomposition) | subgraph
# (`Subgraph`: pinned nodes, supernodes, their edges, influence and linear prediction); graph (nodes, pruning,
# scores) | heads (the loadings' reader) | decomposition (the forward decomposition of the residual stream) |
# targets (output nodes, the rows' input directions); subgraph_files (a subgraph as a graph file's qParams) |
# subgraph_plot (the subgraph and intervention figures); export (graph files, the drawing); qk (the QK reader and
# its tables) | replacement (the replacement model and its freezing).

from hooked_models.attribution.aggregate import Aggregate, aggregate
from hooked_models.attribution.attribute import attribute
from hooked_models.attribution.dataset import attribute_dataset
from hooked_models.attribution.export import FEATURE_TYPES
from hooked_models.attribution.graph import AttributionGraph
from hooked_models.attribution.intervention import (
    feature_intervention,
    feature_intervention_generate,
    feature_steering,
    feature_steering_generate,
)
from hooked_models.attribution.qk import QKTable
from hooked_models.attribution.search import cooccurring, graphs_containing, graphs_led_by, supernode_shares
from hooked_models.attribution.store import GraphStore
from hooked_models.attribution.subgraph import InfluenceShare, Subgraph, Supernode, linear_response
from hooked_models.attribution.supernode_intervention import MODES, SupernodeInterventions, intervene_supernodes
from hooked_models.attribution.targets import CustomTarget

__all__ = ["FEATURE_TYPES", "MODES", "Aggregate", "AttributionGraph", "CustomTarget", "GraphStore", "InfluenceShare",
           "QKTable", "Subgraph", "SupernodeInterventions", "Supernode", "aggregate", "attribute", "attribute_dataset",
           "cooccurring", "feature_intervention", "feature_intervention_generate", "feature_steering",
           "feature_steering_generate", "graphs_containing", "graphs_led_by", "intervene_supernodes", "linear_response",
           "supernode_shares"]
