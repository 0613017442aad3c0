"""Per-head loadings (hooked_models/attribution/heads.py, read from the decomposition) against the
replacement model of conftest.py: with a source's write doubled and, at layer L, every head but h held
at its clean output, the targets move by the edge's part through h plus the part that skips L; with
every head held, by the skip alone. Every head of every layer, so a permutation of heads fails."""

import pytest
import torch

from hooked_models.attribution import attribute


@pytest.fixture(scope="module")
def graph_all(family_setup):
    model, tcs, tokens = family_setup
    return attribute(model, tokens, tcs, batch_size=16, head_loadings="all", qk=0)


def test_every_heads_loading_is_what_letting_that_head_alone_through_moves(family_setup, graph_all, replacement,
                                                                          node_values):
    model, tcs, tokens = family_setup
    graph = graph_all
    oracle = replacement(model, tcs, tokens)
    rows = torch.cat([torch.arange(graph.n_features), torch.arange(graph.logit_start, graph.n_nodes)])
    out_weight = graph.adjacency_matrix[:, :graph.n_features].abs().sum(0)
    heads = graph.head_loadings
    skips = graph.attention_skips
    for source in out_weight.argsort(descending=True)[:2].tolist():
        layer, pos, feature = graph.active_features[source].tolist()
        write = oracle.write(layer, pos, feature)
        doubled = {(t, pos): write[t] for t in range(tcs.n_layers) if bool(write[t].any())}
        for L in range(graph.n_layers):
            name = f"layers.{L}.self_attn.attention_head_outputs"
            clean_z = oracle.cache[name]

            def hold(keep):
                def hook(t, hook):
                    held = clean_z.clone()
                    held[:, :, keep] = t[:, :, keep]
                    return held
                return [(name, hook)]

            base = node_values(graph, oracle.run())
            none = node_values(graph, oracle.run(doubled, hold(slice(0, 0)))) - base
            scale = float(graph.adjacency_matrix[rows, source].abs().max())
            assert (none[rows] - skips[rows, source, L]).abs().max() <= 1e-5 * scale
            for h in range(model.cfg.n_heads):
                moved = node_values(graph, oracle.run(doubled, hold(h))) - base - none
                gap = (moved[rows] - heads[rows, source, L, h]).abs().max()
                assert gap <= 1e-5 * scale, (source, L, h, float(gap), scale)
    # Every head carries something, and the parts sum to each edge.
    assert (heads.abs().amax((0, 1)) > 1e-4).all()
    total = heads.sum(-1) + skips
    a = graph.adjacency_matrix[:, :, None].expand_as(total)
    computed = (graph.adjacency_matrix != 0)[:, :, None].expand_as(total)
    assert ((total - a).abs()[computed] <= 1e-5 * a.abs().max()).all()


def test_the_pruned_graphs_loadings_are_the_same_numbers_for_its_edges(family_setup, graph_all):
    """The default: loadings for the pruned graph's edges only, stored [edge layer head]; the same
    numbers as the loadings of every edge, for those edges."""
    model, tcs, tokens = family_setup
    pruned = attribute(model, tokens, tcs, batch_size=16, qk=0)
    kept = graph_all.prune(0.8, 0.98).edge_mask
    assert pruned.loading_edges.tolist() == kept.nonzero().tolist()
    assert pruned.loading_heads.shape == (int(kept.sum()), graph_all.n_layers, model.cfg.n_heads)
    t, s = pruned.loading_edges.T
    rounding = 1e-6 * float(graph_all.adjacency_matrix.abs().max())  # float32, summed in another order
    torch.testing.assert_close(pruned.loading_heads, graph_all.head_loadings[t, s], rtol=1e-5, atol=rounding)
    torch.testing.assert_close(pruned.loading_skips, graph_all.attention_skips[t, s], rtol=1e-5, atol=rounding)
    edge = pruned.edge_loadings(int(t[0]), int(s[0]))
    assert edge is not None and torch.equal(edge[0], pruned.loading_heads[0])
    assert pruned.edge_loadings(0, 0) is None  # a feature has no edge from itself
