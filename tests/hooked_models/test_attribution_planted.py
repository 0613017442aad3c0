"""Attribution bugs that test_attribution.py cannot see, each with an oracle and a fixture that tells the
right code from the wrong one: the per-head loadings of every head of every layer (a permutation of heads
keeps every sum), the salient logits of a prompt that does not hit `max_n_logits`, the logits weighted by
their unequal probabilities, circuit-tracer's pruning rules on a hand-built graph big enough to separate
them, and the JSON read back node by node and link by link against the graph object.

The oracles share no attribution code: the linear replacement model is run forward here through the
model's hooks, in float64, from the transcoders' weights; influence is solved as a linear system where the
library sums a series; pruning is circuit-tracer's `prune_graph` (graph.py) written from its definition and,
where the side environment .ci/ct-env exists, circuit-tracer's own `prune_graph` and `compute_graph_scores`."""

import copy
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from hooked_models.attribution import AttributionGraph, attribute

from .test_attribution import SEQ, make_transcoders

SIDE_PYTHON = Path(__file__).resolve().parents[2] / ".ci" / "ct-env" / "bin" / "python"


def frozen(name: str) -> bool:
    return name.endswith(".norm_scale") or name.endswith(".attention_probabilities")


def head_outputs(layer: int) -> str:
    return f"layers.{layer}.self_attn.attention_head_outputs"


# ------------------------------------------------------------------------------------------ oracle
def source_writes(model, tcs, tokens, graph) -> list[tuple[str, int, torch.Tensor]]:
    """Where each of the graph's sources writes, in its column order: (hook, position, vector added there):
    a feature its activation times its decoder row at its layer's MLP output, an error what the transcoder
    misses there (from the weights: relu(x @ W_enc + b_enc) @ W_dec + b_dec + x @ W_skip.T), an
    embedding the stream entering layer 0."""
    names = [tcs.input_hook(l) for l in range(tcs.n_layers)] + [tcs.output_hook(l) for l in range(tcs.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[None], names_filter=names + ["layers.0.layer_input"])
    writes = []
    for (layer, pos, feature), value in zip(graph.active_features.tolist(), graph.activation_values.tolist()):
        writes.append((tcs.output_hook(layer), pos, value * tcs[layer].W_dec[feature].detach()))
    for layer in range(tcs.n_layers):
        tc, x = tcs[layer], cache[tcs.input_hook(layer)][0]
        recons = torch.relu(x @ tc.W_enc + tc.b_enc) @ tc.W_dec + tc.b_dec + x @ tc.W_skip.T
        error = cache[tcs.output_hook(layer)][0] - recons
        writes += [(tcs.output_hook(layer), pos, error[pos].detach()) for pos in range(len(tokens))]
    writes += [("layers.0.layer_input", pos, cache["layers.0.layer_input"][0, pos]) for pos in range(len(tokens))]
    return writes


def frozen_responses(model, tcs, tokens, graph, writes, held):
    """The linear replacement model (norm scales, patterns and every transcoder's features frozen at the
    prompt's; each MLP output its clean value plus its skip connection's response) run on one copy of the
    prompt per row of `held`, copy b with source writes[b] added (None: none) and, at each layer, the heads
    `held[b, layer]` pinned to their clean outputs. Returns each target's value in each copy
    [copy target]: the features' pre-activations, then the logits minus the mean logit."""
    batch, seq = held.shape[0], len(tokens)
    names = [tcs.input_hook(l) for l in range(tcs.n_layers)] + [tcs.output_hook(l) for l in range(tcs.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[None], names_filter=lambda n: frozen(n) or n in names or n in [
            head_outputs(l) for l in range(tcs.n_layers)])
    added = {name: torch.zeros(batch, seq, model.cfg.hidden_size, dtype=torch.float64)
             for name in [*names[tcs.n_layers:], "layers.0.layer_input"]}
    for b, write in enumerate(writes):
        if write is not None:
            name, pos, vector = write
            added[name][b, pos] += vector
    live = {}

    def read(t, hook, layer):
        live[layer] = t

    def write_mlp(t, hook, layer):
        x_clean = cache[tcs.input_hook(layer)]
        return cache[hook.name] + (live[layer] - x_clean) @ tcs[layer].W_skip.T + added[hook.name]

    def pin(t, hook, layer):
        mask = held[:, layer][:, None, :, None]
        return torch.where(mask, cache[hook.name].expand_as(t), t)

    hooks = [(frozen, lambda t, hook: cache[hook.name].expand(batch, *cache[hook.name].shape[1:]).clone()),
             ("layers.0.layer_input", lambda t, hook: t + added[hook.name])]
    for l in range(tcs.n_layers):
        hooks += [(tcs.input_hook(l), lambda t, hook, l=l: read(t, hook, l)),
                  (tcs.output_hook(l), lambda t, hook, l=l: write_mlp(t, hook, l)),
                  (head_outputs(l), lambda t, hook, l=l: pin(t, hook, l))]
    with torch.no_grad():
        logits = model.run_with_hooks(tokens[None].expand(batch, -1), fwd_hooks=hooks)[:, -1]
    layer, pos, feature = graph.active_features.T
    pre = torch.stack([live[l] @ tcs[l].W_enc + tcs[l].b_enc for l in range(tcs.n_layers)], 1)  # [copy layer seq f]
    features = pre[:, layer, pos, feature]
    demeaned = logits - logits.mean(-1, keepdim=True)
    return torch.cat([features, demeaned[:, graph.logit_tokens]], 1)


@pytest.fixture(scope="module", params=["arcee", "alpha_er"])
def head_setup(request, tl_model_factory):
    """A random model (Arcee: 4 query heads over 2 key/value heads), untied ReLU transcoders, its graph in
    float32, and float64 copies of the model and transcoders for the oracle."""
    model = tl_model_factory(request.param)
    tcs = make_transcoders(model, d_transcoder=16)
    tokens = torch.randint(0, model.cfg.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(5))
    # Every edge, position 0's too (kept: its features and errors are nodes): the oracle checks them all.
    graph = attribute(model, tokens, tcs, batch_size=64, head_loadings="all", keep_position_zero=True)
    return graph, copy.deepcopy(model).to(torch.float64), copy.deepcopy(tcs).to(torch.float64), tokens


def test_every_head_loading_of_every_layer_is_its_heads_alone(head_setup):
    """For every source, every target, every attention layer L and head h: the edge with only head h of L
    let through (the others pinned to their clean outputs) minus the edge with none of L's heads let through
    is `head_loadings[target, source, L, h]`; the latter is `attention_skips`, and with every head let through
    the edge is the adjacency. Within 1e-5 of the largest edge; every head carries something."""
    graph, model, tcs, tokens = head_setup
    n_layers, n_heads = graph.n_layers, model.cfg.n_heads
    writes = source_writes(model, tcs, tokens, graph)
    modes = [None, *[(layer, head) for layer in range(n_layers) for head in range(n_heads + 1)]]  # head n_heads: none
    held = torch.zeros(1 + len(writes) * len(modes), n_layers, n_heads, dtype=torch.bool)
    for m, mode in enumerate(modes):
        if mode is not None:
            layer, head = mode
            held[1 + m * len(writes) + torch.arange(len(writes)), layer] = torch.arange(n_heads) != head
    responses = frozen_responses(model, tcs, tokens, graph, [None, *writes * len(modes)], held)
    moved = (responses[1:] - responses[0]).reshape(len(modes), len(writes), -1).transpose(1, 2)  # [mode target source]
    rows = torch.cat([torch.arange(graph.n_features), torch.arange(graph.logit_start, graph.n_nodes)])
    columns = slice(0, graph.logit_start)
    scale = graph.adjacency_matrix.abs().max()

    def close(ours, oracle, what):
        gap = (ours.double() - oracle).abs().max() / scale
        assert gap <= 1e-5, f"{what}: {float(gap):.2e} of the largest edge"

    close(graph.adjacency_matrix[rows][:, columns], moved[0], "edges")
    by_mode = moved[1:].reshape(n_layers, n_heads + 1, len(rows), -1)
    for layer in range(n_layers):
        skip = by_mode[layer, n_heads]
        close(graph.attention_skips[rows][:, columns, layer], skip, f"layer {layer}'s skip")
        for head in range(n_heads):
            oracle = by_mode[layer, head] - skip
            assert oracle.abs().max() > 1e-3 * scale, (layer, head)  # the fixture: every head carries something
            close(graph.head_loadings[rows][:, columns, layer, head], oracle, f"layer {layer} head {head}")


# --------------------------------------------------------------------------- logits and influence
def most_probable(probs: torch.Tensor, desired: float, cap: int) -> torch.Tensor:
    """The most probable tokens, one by one, until their probabilities sum to `desired` (at most `cap`)."""
    order = probs.argsort(descending=True)
    kept, total = [], 0.0
    while total < desired and len(kept) < cap:
        kept.append(int(order[len(kept)]))
        total += float(probs[kept[-1]])
    return torch.tensor(kept)


def between(probs: torch.Tensor, k: int) -> float:
    """A desired probability that the k most probable tokens cover and the k - 1 most probable do not,
    halfway between the two sums (so that rounding cannot decide)."""
    covered = probs.sort(descending=True).values.cumsum(0)
    return float((covered[k - 1] + (covered[k - 2] if k > 1 else 0.0)) / 2)


@pytest.fixture(scope="module", params=["arcee", "alpha_er"])
def logit_setup(request, tl_model_factory):
    """A graph of five logits of unequal probability, well below `max_n_logits` (the vocabulary)."""
    model = tl_model_factory(request.param)
    tcs = make_transcoders(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        probs = torch.softmax(model(tokens[None])[0, -1].double(), -1)
    graph = attribute(model, tokens, tcs, desired_logit_prob=between(probs, 5), max_n_logits=model.cfg.d_vocab,
                      head_loadings=False)
    return model, tcs, tokens, probs, graph


@pytest.mark.parametrize("k, cap", [(1, 50), (3, 50), (6, 50), (6, 4)])
def test_the_logits_are_the_most_probable_until_the_desired_probability(logit_setup, k, cap):
    """The logits kept: the most probable tokens until they cover `desired_logit_prob`, stopped at
    `max_n_logits` only where it binds (cap 4 for six), with their probabilities."""
    model, tcs, tokens, probs, _ = logit_setup
    desired = between(probs, k)
    graph = attribute(model, tokens, tcs, desired_logit_prob=desired, max_n_logits=cap, max_feature_nodes=4,
                      head_loadings=False)
    expected = most_probable(probs, desired, cap)
    assert len(expected) == min(k, cap)
    assert torch.equal(graph.logit_tokens, expected)
    torch.testing.assert_close(graph.logit_probabilities.double(), probs[expected], rtol=1e-5, atol=0)


def influence_of(adjacency: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """weights · (A + A² + ...) for A the row-normalized |adjacency|, solved: x (I - A) = weights · A."""
    a = adjacency.double().abs()
    a = a / a.sum(1, keepdim=True).clamp(min=1e-10)
    return torch.linalg.solve(torch.eye(a.shape[0], dtype=a.dtype) - a.T, a.T @ weights.double())


def output_weights(graph) -> torch.Tensor:
    weights = torch.zeros(graph.n_nodes, dtype=torch.float64)
    weights[graph.logit_start:] = graph.logit_probabilities.double()
    return weights


def test_influence_and_scores_weight_each_logit_by_its_probability(logit_setup):
    """The cumulative influence `prune` reports and both `scores` are circuit-tracer's with each logit
    weighted by its probability: influence solved here, replacement = the embeddings' share of the
    embeddings' plus errors' influence, completeness = the non-error share of each row weighted by
    influence + output weight."""
    *_, graph = logit_setup
    p = graph.logit_probabilities
    assert graph.n_logits == 5 and p.max() > 1.2 * p.min()  # the fixture: unequal weights
    weights = output_weights(graph)
    influence = influence_of(graph.adjacency_matrix, weights)
    order = influence.argsort(descending=True)
    cumulative = torch.zeros_like(influence)
    cumulative[order] = influence[order].cumsum(0) / influence.sum()
    torch.testing.assert_close(graph.prune(0.8, 0.98).cumulative_influence.double(), cumulative, rtol=0, atol=1e-5)

    errors = slice(graph.error_start, graph.embedding_start)
    tokens = influence[graph.embedding_start:graph.logit_start].sum()
    replacement = tokens / (tokens + influence[errors].sum())
    a = graph.adjacency_matrix.double().abs()
    error_share = a[:, errors].sum(1) / a.sum(1).clamp(min=1e-10)
    output = influence + weights
    completeness = ((1 - error_share) * output).sum() / output.sum()
    assert graph.scores() == pytest.approx((float(replacement), float(completeness)), rel=1e-5)


# ------------------------------------------------------------------------------------------ pruning
def share_cut(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The smallest of the highest scores that together make `fraction` of their total."""
    ordered = scores.sort(descending=True).values
    reach = ordered.cumsum(0) / ordered.sum()
    return ordered[min(int((reach < fraction).sum()), len(ordered) - 1)]


def pruned_by_definition(graph, node_threshold: float, edge_threshold: float, features_need_inputs: bool = True,
                         zero_edge_cut: bool = False):
    """circuit-tracer's `prune_graph`: nodes of the top `node_threshold` of influence (embeddings and logits
    always), edges of the top `edge_threshold` of edge influence among them (normalized weight times the
    target's influence plus output weight), then, until nothing changes, edges only between kept nodes,
    features and errors without an outgoing edge dropped, features without an incoming edge dropped (unless
    not `features_need_inputs`: to show that a fixture exercises that rule). `zero_edge_cut`: the edge cut
    is zero (a fraction the running sum misses by rounding), where ours keeps the edges of nonzero weight."""
    weights = output_weights(graph)
    always = graph.embedding_start
    influence = influence_of(graph.adjacency_matrix, weights)
    node_mask = influence >= share_cut(influence, node_threshold)
    node_mask[always:] = True
    kept = graph.adjacency_matrix.double() * node_mask[:, None] * node_mask[None, :]
    normalized = kept.abs() / kept.abs().sum(1, keepdim=True).clamp(min=1e-10)
    edge_scores = normalized * (influence_of(kept, weights) + weights)[:, None]
    if zero_edge_cut:
        edge_mask = kept != 0
    else:
        edge_mask = edge_scores >= share_cut(edge_scores.flatten(), edge_threshold)
    while True:
        edge_mask &= node_mask[:, None] & node_mask[None, :]
        before = node_mask.clone()
        node_mask[:always] &= edge_mask[:, :always].any(0)
        if features_need_inputs:
            node_mask[:graph.n_features] &= edge_mask[:graph.n_features].any(1)
        if torch.equal(before, node_mask):
            return node_mask, edge_mask


@pytest.fixture(scope="module")
def hand_built():
    """A graph of 3 layers x 5 positions with 24 features and 4 logits of unequal probability, edges
    where the model would have them (a feature or logit reads features and errors of earlier layers and
    embeddings, at its own position or before), about half of them present, heavy-tailed in size."""
    generator = torch.Generator().manual_seed(11)
    n_layers, n_pos, per_layer = 3, 5, 8
    features = sorted((l, int(p), int(f)) for l in range(n_layers) for f, p in enumerate(
        torch.randint(0, n_pos, (per_layer,), generator=generator)))
    where = [(l, p) for l, p, _ in features] + [(l, p) for l in range(n_layers) for p in range(n_pos)]
    where += [(-1, p) for p in range(n_pos)] + [(n_layers, n_pos - 1)] * 4
    n = len(where)
    layer, pos = torch.tensor(where).T
    n_sources = n - 4
    readable = (layer[:, None] > layer[None, :]) & (pos[:, None] >= pos[None, :])
    readable[:, n_sources:] = False
    readable[len(features):n_sources] = False  # errors and embeddings read nothing
    present = torch.rand(n, n, generator=generator) < 0.5
    sizes = torch.randn(n, n, generator=generator) * torch.exp(1.5 * torch.randn(n, n, generator=generator))
    return AttributionGraph(tokens=torch.arange(n_pos) + 3, active_features=torch.tensor(features),
                            activation_values=torch.rand(len(features), generator=generator) + 0.5,
                            logit_tokens=torch.tensor([7, 2, 9, 4]),
                            logit_probabilities=torch.tensor([0.45, 0.25, 0.15, 0.1]),
                            adjacency_matrix=torch.where(readable & present, sizes, torch.zeros(n, n)),
                            n_layers=n_layers)


THRESHOLDS = [(0.8, 0.98), (0.6, 0.9), (0.9, 0.6), (0.8, 0.5), (0.95, 0.7)]


@pytest.mark.parametrize("node_threshold", [0.6, 0.95])
def test_prune_at_a_zero_edge_cut_keeps_the_kept_nodes_edges_of_nonzero_weight(hand_built, monkeypatch,
                                                                                 node_threshold):
    """Where the edge cut is zero, every kept node's edge of nonzero weight passes it, and then the rules
    run: the definition's nodes and edges, whether fewer than half the nodes pass the node cut (0.6: prune
    reads their rows only) or more (0.95: every row, in place)."""
    import hooked_models.attribution.graph as graph_module

    threshold = graph_module.top_threshold

    def zero_edge_cut(scores, fraction, **kwargs):
        return scores.new_zeros(()) if "n_scores" in kwargs else threshold(scores, fraction, **kwargs)

    monkeypatch.setattr(graph_module, "top_threshold", zero_edge_cut)
    pruned = hand_built.prune(node_threshold, 0.98)
    node_mask, edge_mask = pruned_by_definition(hand_built, node_threshold, 0.98, zero_edge_cut=True)
    assert torch.equal(pruned.node_mask, node_mask) and torch.equal(pruned.edge_mask, edge_mask)
    assert int(edge_mask.sum()) > int(pruned_by_definition(hand_built, node_threshold, 0.98)[1].sum())


@pytest.mark.parametrize("node_threshold, edge_threshold, inputs_rule_bites",
                         [(*pair, pair in [(0.8, 0.5), (0.95, 0.7)]) for pair in THRESHOLDS])
def test_prune_keeps_what_circuit_tracers_rules_keep(hand_built, node_threshold, edge_threshold, inputs_rule_bites):
    """`prune` on a hand-built graph is `prune_graph` by its definition, node by node and edge by edge;
    and the fixture tells the rules apart: the thresholds swapped keep other nodes, and at two settings
    some kept feature loses every incoming edge."""
    graph = hand_built
    pruned = graph.prune(node_threshold, edge_threshold)
    node_mask, edge_mask = pruned_by_definition(graph, node_threshold, edge_threshold)
    assert torch.equal(pruned.node_mask, node_mask)
    assert torch.equal(pruned.edge_mask, edge_mask)
    assert 0 < int(node_mask[:graph.n_features].sum()) < graph.n_features
    assert not torch.equal(pruned_by_definition(graph, edge_threshold, node_threshold)[0], node_mask)
    without = pruned_by_definition(graph, node_threshold, edge_threshold, features_need_inputs=False)[0]
    assert torch.equal(without, node_mask) != inputs_rule_bites


def find_threshold_by_definition(scores, fraction):
    """circuit-tracer's `find_threshold`, written out: every score sorted, zeros included."""
    ordered = scores.sort(descending=True).values
    cumulative = ordered.cumsum(0) / ordered.sum()
    return ordered[min(int(torch.searchsorted(cumulative, fraction)), len(ordered) - 1)]


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.98, 1.0])
@pytest.mark.parametrize("zeros", [0, 1, 900])
def test_top_threshold_sorts_only_the_nonzero_scores_and_is_circuit_tracers_threshold(fraction, zeros):
    """`top_threshold` leaves the zeros out of its sort: the same threshold bit for bit, with none, one
    or most of the scores zero, and ties; at fraction 1.0 the running sum can stop short of 1 (rounding),
    where the threshold is the last score, a zero when there is one (every edge then reaches it)."""
    from hooked_models.attribution.graph import top_threshold

    generator = torch.Generator().manual_seed(zeros)
    scores = torch.exp(3 * torch.randn(100, generator=generator))
    scores[::7] = scores[3]  # ties
    scores = torch.cat([scores, torch.zeros(zeros)])[torch.randperm(100 + zeros, generator=generator)]
    expected = find_threshold_by_definition(scores, fraction)
    assert torch.equal(top_threshold(scores, fraction), expected)
    # a scratch buffer's contents (prune's: the kept edges' magnitudes) change nothing
    assert torch.equal(top_threshold(scores, fraction, scratch=torch.full_like(scores, float("nan"))), expected)
    with pytest.raises(ValueError, match=r"scratch is torch.float32 \(3,\)"):
        top_threshold(scores, fraction, scratch=torch.zeros(3))
    # the positive scores alone, the zeros counted by n_scores (prune's kept rows): the same, and past the
    # running sum's end the last score is a zero when one is counted
    part = scores[scores > 0]
    for fraction_ in (fraction, 1.5):
        expected_ = find_threshold_by_definition(scores, fraction_)
        assert torch.equal(top_threshold(part, fraction_, n_scores=len(scores)), expected_)
        assert torch.equal(top_threshold(part, fraction_, scratch=torch.full_like(scores, float("nan")),
                                         n_scores=len(scores)), expected_)
    with pytest.raises(ValueError, match=r"n_scores=3 is fewer than the 100"):
        top_threshold(part[:100], fraction, n_scores=3)
    assert float(top_threshold(torch.zeros(5), fraction)) == 0.0  # no score above zero: the threshold is zero
    # a fraction past the running sum's end: the last score
    assert torch.equal(top_threshold(scores, 1.5), find_threshold_by_definition(scores, 1.5))


# The side half: circuit-tracer's own prune_graph and compute_graph_scores on the same adjacency (its Graph
# read through the attributes they use; imports nothing of hooked_models).
SIDE_SCRIPT = textwrap.dedent("""
    import sys
    from types import SimpleNamespace
    import torch
    from circuit_tracer.graph import compute_graph_scores, prune_graph
    given = torch.load(sys.argv[1])
    graph = SimpleNamespace(**given["graph"], cfg=SimpleNamespace(n_layers=given["n_layers"]))
    pruned = {pair: prune_graph(graph, *pair) for pair in given["thresholds"]}
    torch.save({"pruned": {pair: tuple(result) for pair, result in pruned.items()},
                "scores": compute_graph_scores(graph)}, sys.argv[2])
""")


@pytest.mark.skipif(not SIDE_PYTHON.exists(), reason=f"no side environment at {SIDE_PYTHON} "
                    "(bash .ci/ct-env.sh builds it: circuit-tracer 0.5.0)")
def test_prune_and_scores_are_circuit_tracers_own_on_the_hand_built_graph(hand_built, tmp_path):
    graph = hand_built
    given = {"graph": {"adjacency_matrix": graph.adjacency_matrix, "input_tokens": graph.tokens,
                       "logit_targets": graph.logit_tokens.tolist(), "logit_probabilities": graph.logit_probabilities,
                       "selected_features": torch.arange(graph.n_features)},
             "n_layers": graph.n_layers, "thresholds": THRESHOLDS}
    torch.save(given, tmp_path / "graph.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(SIDE_PYTHON), "-c", SIDE_SCRIPT, str(tmp_path / "graph.pt"), str(tmp_path / "theirs.pt")],
                   check=True, env=env, cwd=tmp_path)
    theirs = torch.load(tmp_path / "theirs.pt")
    for pair in THRESHOLDS:
        node_mask, edge_mask, cumulative = theirs["pruned"][pair]
        ours = graph.prune(*pair)
        assert torch.equal(ours.node_mask, node_mask) and torch.equal(ours.edge_mask, edge_mask), pair
        torch.testing.assert_close(ours.cumulative_influence, cumulative, rtol=0, atol=1e-6)
    assert graph.scores() == pytest.approx(theirs["scores"], rel=1e-6)


# --------------------------------------------------------------------------------------------- JSON
def expected_nodes(graph) -> dict[str, dict]:
    """Each node of the graph under its circuit-tracer node id, with what the file must say of it: its
    layer, position (`ctx_idx`), kind, and index in the graph (features `{layer}_{index}_{position}`,
    errors `{layer}_-1_{position}`, embeddings `E_{token}_{position}`, logits `{n_layers + 1}_{token}_{last}`)."""
    nodes, last = {}, graph.n_pos - 1
    for i, (layer, pos, feature) in enumerate(graph.active_features.tolist()):
        nodes[f"{layer}_{feature}_{pos}"] = dict(index=i, layer=str(layer), ctx_idx=pos,
                                                 feature_type="cross layer transcoder")
    for layer in range(graph.n_layers):
        for pos in range(graph.n_pos):
            nodes[f"{layer}_-1_{pos}"] = dict(index=graph.n_features + layer * graph.n_pos + pos, layer=str(layer),
                                              ctx_idx=pos, feature_type="mlp reconstruction error")
    for pos, token in enumerate(graph.tokens.tolist()):
        nodes[f"E_{token}_{pos}"] = dict(index=graph.embedding_start + pos, layer="E", ctx_idx=pos,
                                         feature_type="embedding")
    for k, token in enumerate(graph.logit_tokens.tolist()):
        nodes[f"{graph.n_layers + 1}_{token}_{last}"] = dict(index=graph.logit_start + k, layer=str(graph.n_layers + 1),
                                                            ctx_idx=last, feature_type="logit")
    return nodes


def test_the_json_says_what_the_graph_says_node_by_node_and_link_by_link(logit_setup, tmp_path):
    """Every node of the pruned graph's file is a kept node of the graph with its layer, position, kind,
    cumulative influence, activation (features) and probability (logits); the links are exactly the kept
    edges, each from its source to its target with the adjacency's [target, source] weight."""
    same_in_the_file(logit_setup[-1].prune(0.8, 0.9), tmp_path)


def test_the_json_of_the_hand_built_graph_says_what_it_says(hand_built, tmp_path):
    same_in_the_file(hand_built.prune(0.8, 0.9), tmp_path)


def same_in_the_file(graph, tmp_path):
    data = json.loads(graph.to_json(tmp_path / "graph.json").read_text())
    expected = expected_nodes(graph)
    ids = {entry["index"]: node_id for node_id, entry in expected.items()}
    targets, sources = graph.edge_mask.nonzero(as_tuple=True)
    links = {(ids[s], ids[t]): float(graph.adjacency_matrix[t, s]) for t, s in zip(targets.tolist(), sources.tolist())}
    assert len(links) > 10 and any(graph.node_kind(s) == "feature" and graph.node_kind(t) == "feature"
                                   for t, s in zip(targets.tolist(), sources.tolist()))  # the fixture: feature to feature
    assert {(link["source"], link["target"]): link["weight"] for link in data["links"]} == links
    assert len(data["links"]) == len(links)

    linked = {node_id for pair in links for node_id in pair}
    kept = {ids[i] for i in graph.node_mask.nonzero().flatten().tolist()}
    shown = {node_id for node_id in kept if node_id in linked or expected[node_id]["feature_type"] in ("embedding", "logit")}
    assert sorted(node["node_id"] for node in data["nodes"]) == sorted(shown)  # each once
    for node in data["nodes"]:
        entry = expected[node["node_id"]]
        i = entry["index"]
        assert {key: node[key] for key in ("layer", "ctx_idx", "feature_type")} == {
            key: entry[key] for key in ("layer", "ctx_idx", "feature_type")}, node
        assert node["influence"] == pytest.approx(float(graph.cumulative_influence[i]), abs=1e-7), node
        if entry["feature_type"] == "cross layer transcoder":
            assert node["activation"] == pytest.approx(float(graph.activation_values[i]), abs=1e-7), node
        if entry["feature_type"] == "logit":
            assert node["token_prob"] == pytest.approx(float(graph.logit_probabilities[i - graph.logit_start])), node
    assert len({node["ctx_idx"] for node in data["nodes"]}) > 2 and len({node["influence"] for node in data["nodes"]}) > 5
