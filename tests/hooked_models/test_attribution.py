"""Attribution graphs (hooked_models/attribution/) against oracles that share none of its code: the
linear replacement model run forward (norm scales and attention patterns written as the prompt's
constants, each MLP's output replaced by its transcoder's decoding of fixed activations plus a fixed
error), on tiny random models of both families with random transcoders (skip connections, biases)."""

import json

import pytest
import torch

from hooked_models.attribution import AttributionGraph, attribute, feature_intervention
# circuit-tracer's graph-file schema, its pydantic models transcribed field for field (circuit-tracer itself
# cannot be imported beside this package: it imports TransformerLens's removed HookedTransformer).
from hooked_models.explorer.graph_file import GraphFile, Link
from hooked_models.transcoders import CrossLayerTranscoder, Transcoder, TranscoderSet, init_transcoder_

SEQ = 8  # a multiple of alpha-er's experts


def make_transcoders(model, kind: str = "per_layer", seed: int = 0, d_transcoder: int = 32):
    """Random transcoders with skip connections and non-zero biases, so a dropped bias or skip cannot pass;
    each encoder drawn apart from its decoder (`init_transcoder_` makes it the decoder's transpose), so that
    an encoder read where a decoder belongs, or the reverse, cannot pass."""
    d, n = model.cfg.hidden_size, model.cfg.num_layers
    if kind == "per_layer":
        tcs = TranscoderSet([Transcoder(d, d_transcoder, layer=l, skip=True) for l in range(n)], model=model)
        parts = list(tcs)
    else:
        tcs = CrossLayerTranscoder(n, d, d_transcoder, skip=True, model=model)
        parts = [tcs]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, part in enumerate(parts):  # no two layers' decoders alike either
            init_transcoder_(part, seed=seed + i)
            part.W_enc.copy_(torch.randn(part.W_enc.shape, generator=generator) / part.d_in ** 0.5)
            part.b_enc.add_(0.1)
            for p in (part.b_dec, part.W_skip):
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return tcs


@pytest.fixture(scope="module", params=[("arcee", "per_layer"), ("alpha_er", "per_layer"), ("arcee", "clt")],
                ids=["arcee", "alpha_er", "arcee_clt"])
def setup(request, tl_model_factory):
    family, kind = request.param
    model = tl_model_factory(family)
    tcs = make_transcoders(model, kind)
    tokens = torch.randint(0, model.cfg.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(3))
    graph = attribute(model, tokens, tcs, batch_size=16, head_loadings="all")
    return model, tcs, tokens, graph


# ----------------------------------------------------------------------------------------- oracle


def frozen(name):
    return name.endswith(".norm_scale") or name.endswith(".attention_probabilities")


def clean_state(model, tcs, tokens):
    """The clean run (attention explicit, as every frozen run below): transcoder inputs, activations,
    errors, norm scales and patterns."""
    inputs = [tcs.input_hook(l) for l in range(tcs.n_layers)]
    outputs = [tcs.output_hook(l) for l in range(tcs.n_layers)]
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens[None], names_filter=lambda n: n in inputs or n in outputs or frozen(n))
        xs = [cache[n][0] for n in inputs]
        acts = [tcs.encode(l, x) for l, x in enumerate(xs)]
        errors = [cache[outputs[l]][0] - tcs.decode_to(l, acts, xs[l]) for l in range(tcs.n_layers)]
    constants = {n: v for n, v in cache.items() if frozen(n)}
    return logits[0], xs, acts, errors, constants


def frozen_run(model, tcs, tokens, constants, acts, errors, zero_embedding=False, head_hooks=()):
    """The linear replacement model forward: pre-activations [layer seq d_transcoder] of every feature and
    the logits minus their mean [seq vocab]."""
    live = {}

    def read(t, hook, l):
        live[l] = t[0]

    def write(t, hook, l):
        return (tcs.decode_to(l, acts, live[l]) + errors[l])[None].to(t.dtype)

    hooks = [(frozen, lambda t, hook: constants[hook.name].clone()), *head_hooks]
    for l in range(tcs.n_layers):
        hooks += [(tcs.input_hook(l), lambda t, hook, l=l: read(t, hook, l)),
                  (tcs.output_hook(l), lambda t, hook, l=l: write(t, hook, l))]
    if zero_embedding:
        hooks.append(("layers.0.layer_input", lambda t, hook: torch.zeros_like(t)))
    with torch.no_grad():
        logits = model.run_with_hooks(tokens[None], fwd_hooks=hooks)[0]
        pre = torch.stack([tcs.encode(l, live[l], apply_activation=False) for l in range(tcs.n_layers)])
    return pre, logits - logits.mean(-1, keepdim=True)


def node_values(graph, pre, demeaned):
    """Each feature's and logit's pre-activation, in the graph's row order (other rows: nan)."""
    values = torch.full((graph.n_nodes,), float("nan"))
    layer, pos, feature = graph.active_features.T
    values[:graph.n_features] = pre[layer, pos, feature]
    values[graph.logit_start:] = demeaned[-1, graph.logit_tokens]
    return values


def target_rows(graph):
    return torch.cat([torch.arange(graph.n_features), torch.arange(graph.logit_start, graph.n_nodes)])


# ------------------------------------------------------------------------------------------ tests
def assert_same_edges(got, expected):
    """The same edges up to float32 rounding of the largest: another batch's composition rounds the same sums
    otherwise (matrix products of another shape; autograd's batched rows as well as the written-out backward's,
    whose rows computed alone differ from the same rows in a batch in their last bits)."""
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


def but_position_zero(values: list) -> list:
    """Each [seq ...] tensor zero at every position but 0 (where, by default, the features and errors are
    not nodes but constants of the prompt)."""
    return [torch.cat([v[:1], torch.zeros_like(v[1:])]) for v in values]


def test_completeness_every_node_is_the_sum_of_its_edges_and_its_bias(setup):
    """Every feature's pre-activation and every logit (minus the mean logit) equals the sum of its incoming
    edges plus its bias (the frozen model run with every source zero: embeddings, activations, errors; at
    position 0 the activations and errors, which are not nodes, at their values), within 1e-5 of the
    magnitude of the terms; nodes that are not targets have no incoming edge."""
    model, tcs, tokens, graph = setup
    logits, xs, acts, errors, constants = clean_state(model, tcs, tokens)
    clean = node_values(graph, torch.stack([tcs.encode(l, x, apply_activation=False) for l, x in enumerate(xs)]),
                        logits - logits.mean(-1, keepdim=True))
    bias = node_values(graph, *frozen_run(model, tcs, tokens, constants, but_position_zero(acts),
                                          but_position_zero(errors), zero_embedding=True))
    rows = target_rows(graph)
    a = graph.adjacency_matrix[rows]
    gap = (clean[rows] - a.sum(1) - bias[rows]).abs() / (a.abs().sum(1) + bias[rows].abs())
    assert gap.max() < 1e-5, float(gap.max())
    assert graph.adjacency_matrix[graph.error_start:graph.logit_start].abs().sum() == 0
    assert (a.abs().sum(1) > bias[rows].abs()).float().mean() > 0.5  # the edges carry most of it


def test_position_zero_features_are_nodes_only_when_kept(setup):
    """By default position 0's features are not nodes and its errors write nothing (circuit-tracer's
    `zero_positions`); `keep_position_zero=True` makes them nodes, every other node and edge unchanged, and
    its graph is complete with every source zero, position 0's included."""
    model, tcs, tokens, graph = setup
    kept = attribute(model, tokens, tcs, batch_size=16, head_loadings=False, keep_position_zero=True)
    at_zero = kept.active_features[:, 1] == 0
    assert at_zero.any() and not (graph.active_features[:, 1] == 0).any()
    assert torch.equal(kept.active_features[~at_zero], graph.active_features)
    assert torch.equal(kept.activation_values[~at_zero], graph.activation_values)
    errors_at_zero = torch.arange(0, graph.n_errors, graph.n_pos)  # error nodes layer-major: layer x n_pos + pos
    assert graph.adjacency_matrix[:, graph.error_start + errors_at_zero].abs().sum() == 0
    assert kept.adjacency_matrix[:, kept.error_start + errors_at_zero].abs().sum() > 0
    nodes = torch.cat([(~at_zero).nonzero().flatten(), torch.arange(kept.error_start, kept.n_nodes)])
    same = kept.adjacency_matrix[nodes][:, nodes]
    same[:, graph.error_start + errors_at_zero] = 0
    assert_same_edges(graph.adjacency_matrix, same)

    logits, xs, acts, errors, constants = clean_state(model, tcs, tokens)
    clean = node_values(kept, torch.stack([tcs.encode(l, x, apply_activation=False) for l, x in enumerate(xs)]),
                        logits - logits.mean(-1, keepdim=True))
    bias = node_values(kept, *frozen_run(model, tcs, tokens, constants, [torch.zeros_like(a) for a in acts],
                                         [torch.zeros_like(e) for e in errors], zero_embedding=True))
    rows = target_rows(kept)
    a = kept.adjacency_matrix[rows]
    assert ((clean[rows] - a.sum(1) - bias[rows]).abs() / (a.abs().sum(1) + bias[rows].abs())).max() < 1e-5


def test_linearity_scaling_a_feature_moves_each_node_by_its_edge(setup):
    """With everything frozen (activations too), scaling one feature's activation by 1 + eps moves each
    node's pre-activation by eps x the edge from that feature; nodes it has no edge to do not move."""
    model, tcs, tokens, graph = setup
    logits, xs, acts, errors, constants = clean_state(model, tcs, tokens)
    before = node_values(graph, *frozen_run(model, tcs, tokens, constants, acts, errors))
    clean = node_values(graph, torch.stack([tcs.encode(l, x, apply_activation=False) for l, x in enumerate(xs)]),
                        logits - logits.mean(-1, keepdim=True))
    rows = target_rows(graph)
    torch.testing.assert_close(before[rows], clean[rows], rtol=1e-5, atol=1e-5)  # the frozen model is the model here
    eps = 0.25
    out_weight = graph.adjacency_matrix[:, :graph.n_features].abs().sum(0)
    for source in out_weight.argsort(descending=True)[:3].tolist():
        layer, pos, feature = graph.active_features[source].tolist()
        scaled = [a.clone() for a in acts]
        scaled[layer][pos, feature] *= 1 + eps
        after = node_values(graph, *frozen_run(model, tcs, tokens, constants, scaled, errors))
        expected = eps * graph.adjacency_matrix[rows, source]
        moved = after[rows] - before[rows]
        assert (moved - expected).abs().max() <= 2e-6 * before[rows].abs().max(), float((moved - expected).abs().max())
        assert expected.abs().max() > 1e-2
        assert torch.equal(moved[expected == 0], torch.zeros_like(moved[expected == 0]))


def test_head_loadings_split_each_edge_over_the_heads_of_each_layer(setup):
    """For every edge and attention layer, the heads' loadings plus the part that skips the layer sum to the
    edge (1e-5 relative); and a head's loading is what the frozen model moves with the source scaled and
    every other head of that layer held at its clean output (an oracle by perturbation)."""
    model, tcs, tokens, graph = setup
    a = graph.adjacency_matrix
    for layer in range(graph.n_layers):
        total = graph.head_loadings[:, :, layer].sum(-1) + graph.attention_skips[:, :, layer]
        assert ((total - a).abs() <= 1e-5 * a.abs().max()).all()
    assert (graph.head_loadings.abs().amax((0, 1)) > 1e-3).all()  # every head carries something

    logits, xs, acts, errors, constants = clean_state(model, tcs, tokens)
    z_name = "layers.1.self_attn.attention_head_outputs"
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[None], names_filter=lambda n: n == z_name or frozen(n))
    source = int(graph.adjacency_matrix[:, :graph.n_features].abs().sum(0).argmax())
    layer, pos, feature = graph.active_features[source].tolist()
    scaled = [x.clone() for x in acts]
    scaled[layer][pos, feature] *= 2
    rows = target_rows(graph)

    def hold(keep):
        def hook(t, hook):
            held = cache[z_name].clone()
            held[:, :, keep] = t[:, :, keep]
            return held
        return [(z_name, hook)]

    before = node_values(graph, *frozen_run(model, tcs, tokens, constants, acts, errors))
    for keep, expected in ((0, graph.head_loadings[:, source, 1, 0] + graph.attention_skips[:, source, 1]),
                           (slice(0, 0), graph.attention_skips[:, source, 1])):
        after = node_values(graph, *frozen_run(model, tcs, tokens, constants, scaled, errors, head_hooks=hold(keep)))
        torch.testing.assert_close(after[rows] - before[rows], expected[rows], rtol=1e-4, atol=2e-6 * before[rows].abs().max())


def test_frozen_forward_and_the_replacement_with_errors_are_the_model_bit_for_bit(setup):
    """The replacement model with error terms gives the model's logits bit for bit, with attention and norms
    frozen (as the model computes with attention explicit) and without; a frozen feature intervention moves
    them."""
    model, tcs, tokens, graph = setup
    explicit = [(lambda n: n.endswith(".attention_scores"), lambda t, hook: None)]
    with torch.no_grad():
        plain, explicit_logits = model(tokens[None])[0], model.run_with_hooks(tokens[None], fwd_hooks=explicit)[0]
        detached = model.run_with_hooks(tokens[None], fwd_hooks=[(frozen, lambda t, hook: t.detach())])[0]
    assert torch.equal(detached, explicit_logits)
    if isinstance(tcs, TranscoderSet):  # the transcoders spliced (hooked_models/saes.py), frozen and not
        with torch.no_grad(), model.hooks(fwd_hooks=[(frozen, lambda t, hook: t.detach())]):
            spliced_frozen = model.run_with_saes(tokens[None], saes=tcs, use_error_term=True)[0]
        with torch.no_grad():
            spliced = model.run_with_saes(tokens[None], saes=tcs, use_error_term=True)[0]
        assert torch.equal(spliced_frozen, explicit_logits) and torch.equal(spliced, plain)
    assert torch.equal(feature_intervention(model, tokens, tcs, [], freeze_attention=True), explicit_logits)
    assert torch.equal(feature_intervention(model, tokens, tcs, [], freeze_attention=False), plain)
    layer, pos, feature = graph.active_features[0].tolist()
    moved = feature_intervention(model, tokens, tcs, [(layer, pos, feature, 5.0)])
    assert (moved - explicit_logits).abs().max() > 1e-3


def test_intervening_at_the_last_layer_moves_the_logits_by_the_edge(setup):
    """A feature of the last layer reaches the logits only directly: setting its activation to (1 + eps)
    times its value (attention frozen) moves each target logit (minus the mean) by eps x the edge."""
    model, tcs, tokens, graph = setup
    last = (graph.active_features[:, 0] == graph.n_layers - 1).nonzero().flatten()
    source = int(last[graph.adjacency_matrix[graph.logit_start:, last].abs().sum(0).argmax()])
    layer, pos, feature = graph.active_features[source].tolist()
    value = float(graph.activation_values[source])
    base = feature_intervention(model, tokens, tcs, [])
    moved = feature_intervention(model, tokens, tcs, [(layer, pos, feature, 1.5 * value)])
    demean = lambda x: x - x.mean(-1, keepdim=True)  # noqa: E731
    change = (demean(moved) - demean(base))[-1, graph.logit_tokens]
    torch.testing.assert_close(change, 0.5 * graph.adjacency_matrix[graph.logit_start:, source], rtol=1e-4, atol=1e-5)


def test_logits_cover_the_desired_probability(setup):
    model, tcs, tokens, graph = setup
    probs = torch.softmax(model(tokens[None])[0, -1], -1)
    top = probs.sort(descending=True)
    assert torch.equal(graph.logit_tokens, top.indices[:graph.n_logits])
    covered = graph.logit_probabilities.sum()
    assert covered >= 0.95 or graph.n_logits == 10
    assert graph.n_logits == 1 or graph.logit_probabilities[:-1].sum() < 0.95


def test_batch_size_and_head_loadings_change_no_edge(setup):
    model, tcs, tokens, graph = setup
    small = attribute(model, tokens, tcs, batch_size=5, head_loadings=False, progress=True)
    assert small.head_loadings is None
    assert_same_edges(small.adjacency_matrix, graph.adjacency_matrix)


def test_max_feature_nodes_keeps_the_most_influential_features_rows_unchanged(setup):
    model, tcs, tokens, graph = setup
    k = 20
    part = attribute(model, tokens, tcs, max_feature_nodes=k, batch_size=8, head_loadings=False)
    assert part.n_features == k
    # Each selected feature is a feature of the full graph, its row the full row at the kept columns.
    index = {tuple(f): i for i, f in enumerate(graph.active_features.tolist())}
    chosen = torch.tensor([index[tuple(f)] for f in part.active_features.tolist()])
    nodes = torch.cat([chosen, torch.arange(graph.error_start, graph.n_nodes)])
    assert_same_edges(part.adjacency_matrix, graph.adjacency_matrix[nodes][:, nodes])
    # The chosen ones carry more influence on the logits than those left out.
    influence = graph.prune(0.0, 0.0).cumulative_influence  # cumulative: lower is more influential
    left_out = torch.ones(graph.n_features, dtype=torch.bool)
    left_out[chosen] = False
    assert influence[chosen].median() < influence[:graph.n_features][left_out].median()


def test_json_validates_against_circuit_tracers_schema_and_round_trips(setup, tmp_path):
    model, tcs, tokens, graph = setup
    pruned = graph.prune(0.8, 0.98)
    path = pruned.to_json(tmp_path / "graph.json")
    data = json.loads(path.read_text())
    parsed = GraphFile(**data)
    for link in data["links"]:
        Link(**link)
    ids = {n.node_id for n in parsed.nodes}
    assert len(ids) == len(parsed.nodes)
    assert all(link["source"] in ids and link["target"] in ids for link in data["links"])
    kinds = {n.feature_type for n in parsed.nodes}
    assert kinds <= {"cross layer transcoder", "mlp reconstruction error", "embedding", "logit"}
    assert {"cross layer transcoder", "embedding", "logit"} <= kinds
    assert len(data["links"]) == int(pruned.edge_mask.sum()) > 0
    assert parsed.metadata.prompt_tokens == [str(t) for t in tokens.tolist()]
    back = AttributionGraph.from_json(path)
    for name in ("tokens", "active_features", "activation_values", "logit_tokens", "logit_probabilities",
                 "adjacency_matrix", "head_loadings", "attention_skips"):
        assert torch.equal(getattr(back, name), getattr(graph, name)), name
    assert back.prune(0.8, 0.98).to_json(tmp_path / "again.json").read_text() == path.read_text().replace(
        '"slug": "graph"', '"slug": "again"').replace('"graph.tensors.safetensors"', '"again.tensors.safetensors"')


def test_plot_draws_the_pruned_graph(setup, tmp_path):
    model, tcs, tokens, graph = setup
    figure = graph.plot(tmp_path / "graph.png")
    assert (tmp_path / "graph.png").stat().st_size > 10_000
    axes = figure.axes[0]
    assert len(axes.get_xticklabels()) == SEQ and len(axes.get_yticklabels()) == graph.n_layers + 2
    import matplotlib.pyplot as plt
    plt.close(figure)


def test_prune_and_scores_on_a_graph_worked_by_hand():
    """One layer, one position: feature f <- embedding (2); logit <- f (3), <- error (1). Influence from the
    logit (p = 1): f 3/4, error 1/4, embedding 3/4 (through f). Replacement score 3/4 / (3/4 + 1/4);
    completeness: every row error-free but the logit's (3/4), weighted by influence + output weight:
    (3/4 + 1/4 + 3/4 + 3/4 * 1) / (3/4 + 1/4 + 3/4 + 1)."""
    a = torch.zeros(4, 4)
    a[0, 2], a[3, 0], a[3, 1] = 2.0, 3.0, 1.0
    graph = AttributionGraph(tokens=torch.tensor([5]), active_features=torch.tensor([[0, 0, 7]]),
                             activation_values=torch.tensor([1.5]), logit_tokens=torch.tensor([9]),
                             logit_probabilities=torch.tensor([1.0]), adjacency_matrix=a, n_layers=1)
    replacement, completeness = graph.scores()
    assert replacement == pytest.approx(0.75)
    assert completeness == pytest.approx(2.5 / 2.75)
    pruned = graph.prune(0.5, 0.9)
    assert pruned.node_mask.tolist() == [True, False, True, True]  # the error's influence is below the cut
    assert pruned.edge_mask.nonzero().tolist() == [[0, 2], [3, 0]]
    # Where a threshold's score is 0 (a fraction of 1 that the running sum misses by its rounding), every
    # node is kept and the edges of nonzero weight, never one of weight zero (circuit-tracer keeps those).
    import hooked_models.attribution.graph as graph_module

    threshold = graph_module.top_threshold
    graph_module.top_threshold = lambda scores, fraction, **kwargs: scores.new_zeros(())
    try:
        everything = graph.prune(1.0, 1.0)
    finally:
        graph_module.top_threshold = threshold
    assert everything.node_mask.all() and everything.edge_mask.nonzero().tolist() == [[0, 2], [3, 0], [3, 1]]


@pytest.mark.parametrize("bad, message", [
    ("width", "hidden_size"), ("model", "trained for"), ("long", "positions"), ("nodes", "max_feature_nodes=0"),
])
def test_bad_input_is_refused_with_the_value(tl_model_factory, bad, message):
    model = tl_model_factory("arcee")
    tcs = make_transcoders(model)
    tokens = torch.zeros(SEQ, dtype=torch.long)
    kwargs = {}
    if bad == "width":
        tcs = TranscoderSet([Transcoder(model.cfg.hidden_size + 1, 8, layer=l) for l in range(2)])
    elif bad == "model":
        tcs = make_transcoders(tl_model_factory("alpha_er"))
        tcs.transcoders = torch.nn.ModuleList([Transcoder(model.cfg.hidden_size, 8, layer=l) for l in range(2)])
    elif bad == "long":
        tokens = torch.zeros(model.max_positions + 1, dtype=torch.long)
    else:
        kwargs["max_feature_nodes"] = 0
    with pytest.raises(ValueError, match=message):
        attribute(model, tokens, tcs, **kwargs)


# ------------------------------------------------------------------------------------------ memory
def test_the_selection_reranks_every_four_batches_as_circuit_tracer_does(setup, monkeypatch):
    """circuit-tracer ranks, computes `update_interval` (4) batches of the top features, and ranks again: 20
    features in batches of 2 are three rankings (8, 8, 4), not ten (the side-env test compares the nodes)."""
    import sys

    module = sys.modules["hooked_models.attribution.attribute"]  # (the package's `attribute` is the function)
    model, tcs, tokens, graph = setup
    ranked = []
    influence = module._influence_of_rows
    monkeypatch.setattr(module, "_influence_of_rows", lambda rows, *args: ranked.append(rows.shape[0]) or influence(rows, *args))
    part = attribute(model, tokens, tcs, max_feature_nodes=20, batch_size=2, head_loadings=False)
    assert part.n_features == 20
    assert ranked == [part.n_logits, part.n_logits + 8, part.n_logits + 16]


def test_the_selections_influence_from_the_computed_rows_alone_is_the_dense_graphs():
    """`max_feature_nodes` ranks features by `_influence_of_rows` over the rows computed so far; it must
    equal `_influence` of the dense [node node] matrix those rows make (which it avoids building)."""
    from hooked_models.attribution.attribute import _influence_of_rows
    from hooked_models.attribution.graph import influence_series as _influence
    from hooked_models.attribution.graph import normalized_abs as _normalized

    generator = torch.Generator().manual_seed(0)
    n_sources, done, n_logits = 40, [3, 17, 8, 29, 0], 3
    rows = torch.randn(n_logits + len(done), n_sources, generator=generator)
    rows[:, 35:] = 0.1  # errors and embeddings: every row reads them
    for r, i in enumerate(done):  # acyclic: a feature reads only features before it
        rows[n_logits + r, i:35] = 0
    dense = torch.zeros(n_sources + n_logits, n_sources + n_logits)
    dense[n_sources:, :n_sources] = rows[:n_logits]
    for r, i in enumerate(done):
        dense[i, :n_sources] = rows[n_logits + r]
    weights = torch.zeros(n_sources + n_logits)
    weights[n_sources:] = torch.tensor([0.5, 0.3, 0.2])
    expected = _influence(_normalized(dense), weights)[:n_sources]
    own_column = torch.tensor([-1] * n_logits + done)
    got = _influence_of_rows(rows, rows.abs().sum(1), own_column, torch.cat([weights[n_sources:], torch.zeros(len(done))]),
                             n_sources)
    assert expected[done].abs().min() > 0  # the chosen features' own influence is part of the series
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_no_backward_pass_leaves_a_graph_behind(setup, monkeypatch):
    """The rows of each batch are plain numbers: with the transcoders' weights requiring grad (as after
    training), a row that kept an autograd graph would keep that pass's gradients alive (the memory then
    grew by batch x seq x hidden_size x layers per batch). And no parameter collects a gradient."""
    from hooked_models.attribution import linear_backward, replacement

    model, tcs, tokens, _ = setup
    assert all(p.requires_grad for p in tcs.parameters())
    returned = []
    # autograd's backward (alpha-er, a cross-layer transcoder) and the written-out one (the Arcee's set)
    for owner, name in ((replacement.Replica, "columns"), (linear_backward.LinearBackward, "rows")):
        method = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda self, *a, method=method, **kw: returned.append(method(self, *a, **kw))
                            or returned[-1])
    attribute(model, tokens, tcs, max_feature_nodes=12, batch_size=8)
    assert returned and not any(rows.requires_grad or rows.grad_fn is not None for rows in returned)
    assert all(p.grad is None for module in (model, tcs) for p in module.parameters())
    assert all(p.requires_grad for p in tcs.parameters())  # given back as they were


def test_rows_are_written_in_place_only_where_they_are_computed_and_consecutive():
    """attribute's row store hands a batch its block of the CPU matrix only where the batch's rows are consecutive
    there and the model computes on the CPU: rows computed on another device (a GPU) come back as a copy, never
    into a CPU block the backward pass's device cannot write."""
    from hooked_models.attribution.attribute import _Rows

    appended = _Rows(torch.zeros(5, 3))
    index, block = appended.place([("feature", 7), ("feature", 2)], torch.device("cpu"))
    assert index.tolist() == [0, 1] and block.data_ptr() == appended.out.data_ptr() and block.shape == (2, 3)
    index, block = appended.place([("feature", 4)], torch.device("meta"))  # computed elsewhere: copied
    assert index.tolist() == [2] and block is None
    appended.add(index, torch.ones(1, 3))
    assert appended.out[2].tolist() == [1, 1, 1] and appended.abs_sums[2] == 3
    fixed = _Rows(torch.zeros(6, 6), {("feature", 0): 0, ("feature", 1): 1, ("output", 0): 5})
    assert fixed.place([("feature", 0), ("output", 0)], torch.device("cpu"))[1] is None  # not consecutive
    index, block = fixed.place([("feature", 0), ("feature", 1)], torch.device("cpu"))
    block[:, :4] = 2.0
    fixed.add(index, block[:, :4], written=True)
    assert fixed.out[:2, :4].eq(2).all() and fixed.out[2:].abs().max() == 0
