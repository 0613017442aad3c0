"""Circuit discovery: edges between components, scored all at once and patched exactly.

    from hooked_models import circuits
    graph = circuits.edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=5)
    circuit = graph.top(20)
    circuit.faithfulness(model, clean, corrupted, metric)    # the fraction of the clean-corrupted gap it keeps
    circuit.plot("out/circuit.png")

A circuit is a set of edges (writer, reader). Its nodes are named over the standard vocabulary:

    input                                writer: the stream entering the first block (layers.0.layer_input)
    layers.{i}.self_attn.head.{h}        writer: head h's result (attention_head_results[..., h, :])
    layers.{i}.self_attn.head.{h}.q      reader: head h's query input (attention_query_inputs[..., h, :])
    layers.{i}.self_attn.kv_head.{j}.k   reader: key/value head j's key input (attention_key_inputs); `.v` its values'
    layers.{i}.mlp                       writer: mlp_output; reader: the MLP branch's input (mlp_residual_input)
    layers.{i}.mlp.expert.{g}            the same for positional expert g, at the positions it owns (alpha-er)
    logits                               reader: the stream entering the final norm (layers.{L-1}.layer_output)

Under multi-head attention key/value head j is head j. Every writer feeds every reader after it through the
residual stream; an edge carries every position. An expert writes and reads only at its own positions, so an
expert reader's edges from the MLPs of earlier layers come from the same expert alone. The readers' inputs are the
model's split inputs (hooked_models/vocabulary.py): copies of the stream taken before the norm, one per head, so
a change to one head's copy reaches that head alone.

`edge_patch` is exact: in the clean run, each chosen reader's input gets, for each chosen writer, that writer's
output in the corrupted run in place of its output in this run (input + corrupted - live); every other reader
reads what it would. Edge sets are batched: one copy of the prompts per set, in forwards sized to a memory
budget. `edge_attribution` estimates `edge_patch(..., [[edge]]) - clean metric` for every edge at once:
(corrupted - clean output of the writer) · d metric / d (reader's input), the gradient taken on the clean run
(EAP, Syed et al. 2023: one clean forward, one corrupted forward, one backward) or averaged over inputs whose
embeddings lie between the clean and corrupted ones (EAP-IG, Hanna et al. 2024: `steps` interpolations, batched).
"""

# For developers, the package's layout: one module per concern, each importing only those listed before it (the
# contract in pyproject.toml): layout (the nodes, hooks and edges of a model's graph), edge_patching (`edge_patch`,
# `path_patch`), diagram (`Graph.plot`'s drawing), graph (`Graph`, `graph`), eap (`edge_attribution`).

from hooked_models.circuits.eap import METHODS, edge_attribution
from hooked_models.circuits.edge_patching import edge_patch, path_patch
from hooked_models.circuits.graph import Graph, graph
from hooked_models.circuits.layout import Edge, transformer_lens_node

__all__ = ["METHODS", "Edge", "Graph", "edge_attribution", "edge_patch", "graph", "path_patch", "transformer_lens_node"]
