"""AttributionGraph.plot: no two node markers overlap however many nodes share a layer and position, every
position and row is labelled, and the legend explains the edge colours. The oracle is the drawing itself:
the markers' centres in display pixels (matplotlib's own transform) against their drawn radius."""

import math

import torch

from hooked_models.attribution import AttributionGraph


def crowded_graph(features_per_cell: int = 20) -> AttributionGraph:
    """2 layers x 3 positions; `features_per_cell` features of layer 0 at position 1 and of layer 1 at
    position 2, each written by the embedding below it and writing the logit; every node kept."""
    features = [[0, 1, f] for f in range(features_per_cell)] + [[1, 2, f] for f in range(features_per_cell)]
    n_features, n_pos, n_layers = len(features), 3, 2
    n = n_features + n_layers * n_pos + n_pos + 1
    adjacency = torch.zeros(n, n)
    embedding, logit = n_features + n_layers * n_pos, n - 1
    for i, (_, pos, _) in enumerate(features):
        adjacency[i, embedding + pos] = 1.0 + i
        adjacency[logit, i] = -0.5 if i % 2 else 0.75
    graph = AttributionGraph(tokens=torch.tensor([4, 5, 6]), active_features=torch.tensor(features),
                             activation_values=torch.ones(n_features), logit_tokens=torch.tensor([9]),
                             logit_probabilities=torch.tensor([1.0]), adjacency_matrix=adjacency, n_layers=n_layers,
                             str_tokens=["When", " Mary", " and"], logit_str_tokens=[" John"])
    graph.node_mask = torch.ones(n, dtype=torch.bool)
    graph.edge_mask = adjacency != 0
    return graph


def test_no_two_nodes_overlap_and_the_edges_are_explained():
    import matplotlib.pyplot as plt

    figure = crowded_graph().plot()
    axes = figure.axes[0]
    figure.canvas.draw()
    centres, radii = [], []
    for collection in axes.collections:  # one scatter per node kind
        size = collection.get_sizes()[0]  # points^2; the marker's radius in pixels
        radius = math.sqrt(size) / 2 * figure.dpi / 72
        for x, y in axes.transData.transform(collection.get_offsets()):
            centres.append((x, y))
            radii.append(radius)
    assert len(centres) == int(crowded_graph().node_mask.sum())
    for i, (a, ra) in enumerate(zip(centres, radii)):
        for b, rb in zip(centres[i + 1:], radii[i + 1:]):
            assert math.dist(a, b) >= ra + rb, f"nodes at {a} and {b} overlap"
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert "positive edge (raises its target)" in legend and "negative edge (lowers it)" in legend
    assert [t.get_text() for t in axes.get_xticklabels()] == ["When", " Mary", " and"]
    assert [t.get_text() for t in axes.get_yticklabels()] == ["emb", "L0", "L1", "logits"]
    plt.close(figure)
