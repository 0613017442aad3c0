"""Subgraphs (hooked_models/attribution/subgraph.py): part edges against sums written out member by member,
kept influence against influence computed path by path on a small graph built by hand and by a matrix
inverse on a real one, the graph file's qParams round trip (ours and the viewer's indented files), a
viewer's qParams written by hand in its shape, Neuronpedia's save body, and every refusal in one line."""

import itertools
import json

import pytest
import torch

from hooked_models.attribution import AttributionGraph, Subgraph, attribute, linear_response
from hooked_models.attribution.export import node_id


@pytest.fixture(scope="module")
def real(tl_model_factory, make_untied):
    """A graph of the tiny Arcee (every active feature a node) and a subgraph over several layers and positions."""
    model = tl_model_factory("arcee")
    tokens = torch.randint(0, model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(3))
    graph = attribute(model, tokens, make_untied(model), head_loadings=False, qk=0)
    layer0 = (graph.active_features[:, 0] == 0).nonzero().flatten().tolist()
    layer1 = (graph.active_features[:, 0] == 1).nonzero().flatten().tolist()
    supernodes = {"early": layer0[:5], "mixed": [layer0[7], layer1[3], graph.error_start + 9],
                  "late": layer1[-6:]}
    pinned = [graph.embedding_start + 2, graph.logit_start, layer1[1]]
    # Labels on features whose layer and index differ (and are not 0), so that a swapped pair cannot pass.
    labelled = [tuple(graph.active_features[i, ::2].tolist()) for i in layer1 if graph.active_features[i, 2] > 1][:2]
    return graph, Subgraph(graph, supernodes, pinned, labels={labelled[0]: "x", labelled[1]: "y ü"})


def test_a_parts_edge_is_the_sum_of_its_members_edges(real):
    graph, sub = real
    edges = sub.edges()
    for (t, target), (s, source) in itertools.product(enumerate(sub.parts), repeat=2):
        total = sum(float(graph.adjacency_matrix[i, j]) for i in target.nodes for j in source.nodes)
        assert float(edges[t, s]) == pytest.approx(total, rel=1e-6, abs=1e-9), (target.name, source.name)
    assert float(edges.abs().sum()) > 0


def test_parts_are_the_supernodes_then_the_pinned_nodes_outside_them(real):
    graph, sub = real
    assert [p.name for p in sub.parts[:3]] == ["early", "mixed", "late"]
    singles = [graph.embedding_start + 2, graph.logit_start, sub.parts[-1].nodes[0]]
    assert [(p.name, p.nodes) for p in sub.parts[3:]] == [(graph.node_name(i), (i,)) for i in singles]
    assert graph.node_kind(singles[-1]) == "feature" and not sub.parts[-1].supernode
    assert set(sub.pinned) >= {m for g in sub.supernodes for m in g.members}  # members pinned too


def _hand_graph(seed: int = 0) -> AttributionGraph:
    """3 layers x 2 positions: features (layer 0, pos 0), (1, 1), (2, 1); 6 errors (3 + 2 layer + pos); 2
    embeddings (9, 10); 2 logits (11, 12). Edges only from earlier layers and positions, random, some negative."""
    g = torch.Generator().manual_seed(seed)
    features = torch.tensor([[0, 0, 5], [1, 1, 2], [2, 1, 7]])
    n = 3 + 6 + 2 + 2
    graph = AttributionGraph(tokens=torch.tensor([11, 12]), active_features=features,
                             activation_values=torch.tensor([1.5, 0.7, 2.0], dtype=torch.float64),
                             logit_tokens=torch.tensor([4, 9]), logit_probabilities=torch.tensor([0.6, 0.3], dtype=torch.float64),
                             adjacency_matrix=torch.zeros(n, n, dtype=torch.float64), n_layers=3)
    a = graph.adjacency_matrix
    sources = {0: [9], 1: [0, 3, 9, 10], 2: [0, 1, 3, 4, 5, 6, 9, 10]}  # features, errors, embeddings before them
    for t, ss in sources.items():
        for s in ss:
            a[t, s] = torch.randn((), generator=g, dtype=torch.float64)
    for t in (11, 12):  # the logits read everything
        for s in range(11):
            a[t, s] = torch.randn((), generator=g, dtype=torch.float64)
    return graph


def _paths_influence(graph, inside=None) -> torch.Tensor:
    """Each node's influence summed over every path to a logit, enumerated one by one: the product of
    |edge| / (the sum of |edges| into its target) along the path, times the logit's weight; with `inside`,
    only paths whose every node but the logit is inside."""
    a = graph.adjacency_matrix.abs()
    norm = a / a.sum(1, keepdim=True).clamp(min=1e-10)
    out = torch.zeros(graph.n_nodes, dtype=torch.float64)

    def walk(node, product, start):
        for target in range(graph.n_nodes):
            if norm[target, node] == 0:
                continue
            if target >= graph.logit_start:
                out[start] += product * norm[target, node] * graph.logit_probabilities[target - graph.logit_start]
            elif inside is None or target in inside:
                walk(target, product * norm[target, node], start)

    for start in range(graph.logit_start):
        if inside is None or start in inside:
            walk(start, 1.0, start)
    return out


def test_kept_influence_is_the_influence_summed_path_by_path():
    graph = _hand_graph()
    sub = Subgraph(graph, {"first": [0, 1]}, pinned=["E_11_0"])
    total = _paths_influence(graph)
    inside = {0, 1, 9}
    assert sub.kept_influence().nodes == pytest.approx(float(total[list(inside)].sum() / total.sum()), rel=1e-12)
    within = _paths_influence(graph, inside)
    assert sub.kept_influence().paths == pytest.approx(float(within.sum() / total.sum()), rel=1e-12)
    assert sub.kept_influence().paths < sub.kept_influence().nodes  # the path 0 -> 2 -> logit is left out
    whole = Subgraph(graph, pinned=range(graph.n_nodes))
    assert whole.kept_influence() == pytest.approx((1.0, 1.0))


def test_kept_influence_on_a_real_graph_matches_a_matrix_inverse(real):
    graph, sub = real
    a = graph.adjacency_matrix.double().abs()
    norm = a / a.sum(1, keepdim=True).clamp(min=1e-10)
    w = graph.logit_weights().double()
    eye = torch.eye(graph.n_nodes, dtype=torch.float64)
    influence = w @ norm @ torch.linalg.inv(eye - norm)  # w (A + A² + ...)
    inside = sorted({i for p in sub.parts for i in p.nodes})
    assert sub.kept_influence().nodes == pytest.approx(float(influence[inside].sum() / influence.sum()), rel=1e-6)
    mask = torch.zeros(graph.n_nodes, dtype=torch.bool)
    mask[inside] = True
    rows = mask.clone()
    rows[graph.logit_start:] = True
    restricted = norm * rows[:, None] * mask[None, :]
    within = w @ restricted @ torch.linalg.inv(eye - restricted)
    assert sub.kept_influence().paths == pytest.approx(float(within[inside].sum() / influence.sum()), rel=1e-6)


def test_linear_response_on_the_hand_graph():
    """Feature 0 scaled by 0.5 (relative change r0 = -0.5), by hand: feature 1 moves by edge(1, 0) x r0,
    feature 2 by edge(2, 0) x r0 plus edge(2, 1) x feature 1's relative change, each logit by its edges
    times the three relative changes; errors and embeddings do not move."""
    graph = _hand_graph()
    a, act = graph.adjacency_matrix, graph.activation_values
    r0 = -0.5
    d1 = a[1, 0] * r0
    d2 = a[2, 0] * r0 + a[2, 1] * d1 / act[1]
    change = linear_response(graph, {0: 0.5})
    torch.testing.assert_close(change[:3], torch.stack([act[0] * r0, d1, d2]), rtol=1e-12, atol=0)
    logits = a[11:, 0] * r0 + a[11:, 1] * d1 / act[1] + a[11:, 2] * d2 / act[2]
    torch.testing.assert_close(change[11:], logits, rtol=1e-12, atol=0)
    assert not change[3:11].any() and bool(d2 != 0)


# ------------------------------------------------------------------------------------------- files
def test_the_subgraph_round_trips_through_the_graph_file(real, tmp_path):
    graph, sub = real
    path = graph.prune().to_json(tmp_path / "g.json")
    before = json.loads(path.read_text())
    sub.save(path)
    back = Subgraph.load(path, graph)
    assert back.qparams() == sub.qparams() and back.labels == sub.labels and back.pinned == sub.pinned
    assert [(p.name, p.nodes) for p in back.parts] == [(p.name, p.nodes) for p in sub.parts]
    after = json.loads(path.read_text())
    assert {k: v for k, v in after.items() if k != "qParams"} == {k: v for k, v in before.items() if k != "qParams"}
    text = path.read_text()
    back.save(path)
    assert path.read_text() == text  # bit for bit


def test_a_subgraph_the_viewer_saved_opens_here_and_saves_back_bit_for_bit(real, tmp_path):
    """The viewer's /save_graph writes the file back indented by 2 with its qParams: pinnedIds, supernodes
    as [label, *ids] (two of one label allowed), clerps as a JSON string, and keys of its own."""
    graph, _ = real
    path = graph.prune().to_json(tmp_path / "g.json")
    data = json.loads(path.read_text())
    ids = [n["node_id"] for n in data["nodes"] if n["feature_type"] == "cross layer transcoder"]
    # The first pinned one of layer 1, its index above 1: its label's key cannot be read back swapped.
    ids = sorted(ids, key=lambda i: not (i.startswith("1_") and int(i.split("_")[1]) > 1))
    feature = next(n for n in data["nodes"] if n["node_id"] == ids[0])["feature"]
    data["qParams"] = {"pinnedIds": ids[:5], "supernodes": [["say", ids[0], ids[1]], ["say", ids[2]]],
                       "linkType": "both", "clickedId": ids[3], "sg_pos": "", "hiddenIds": [],
                       "clerps": json.dumps([[str(feature), "my label"]], separators=(",", ":"))}
    path.write_text(json.dumps(data, indent=2))
    sub = Subgraph.load(path, graph)
    index = {node_id(graph, i): i for i in range(graph.n_nodes)}
    assert [p.name for p in sub.parts] == ["say", "say (2)", *[graph.node_name(index[i]) for i in ids[3:5]]]
    assert [p.nodes for p in sub.parts[:2]] == [(index[ids[0]], index[ids[1]]), (index[ids[2]],)]
    layer, feature_index = (int(x) for x in ids[0].split("_")[:2])
    assert sub.labels == {(layer, feature_index): "my label"} and sub.view["hiddenIds"] == []
    sub.save(path)
    data["qParams"]["supernodes"][1][0] = "say (2)"  # the one change: the second name told apart
    assert path.read_text() == json.dumps(data, indent=2)


def test_the_viewers_save_button_form_opens_here(real, tmp_path):
    """What the viewer's Save button actually posts (its index.html: each key read back from the page's URL):
    pinnedIds a comma-joined string, supernodes the JSON.stringify of [[label, *ids], ...], keys it never set
    null; /save_graph writes them as they came."""
    graph, sub = real
    path = graph.prune().to_json(tmp_path / "g.json")
    data = json.loads(path.read_text())
    entries = [[g.name, *g.members] for g in sub.supernodes]
    data["qParams"] = {"pinnedIds": ",".join(sub.pinned), "supernodes": json.dumps(entries, separators=(",", ":")),
                       "linkType": None, "clickedId": None, "sg_pos": None, "pruningThreshold": None, "clerps": None}
    path.write_text(json.dumps(data, indent=2))
    back = Subgraph.load(path, graph)
    assert back.pinned == sub.pinned
    assert [(g.name, g.members) for g in back.supernodes] == [(g.name, g.members) for g in sub.supernodes]
    data["qParams"]["supernodes"] = "[[\"x\", "  # cut short: refused in one line, naming it
    path.write_text(json.dumps(data, indent=2))
    _one_line_error(lambda: Subgraph.load(path, graph), "supernodes", "JSON")


def test_neuronpedias_save_body_round_trips(real):
    graph, sub = real
    body = sub.neuronpedia("my-graph", "grouped")
    assert set(body) == {"modelId", "slug", "displayName", "pinnedIds", "supernodes", "clerps",
                         "pruningThreshold", "densityThreshold"}
    assert all(isinstance(x, str) for entry in body["supernodes"] + body["clerps"] for x in entry)
    back = Subgraph.from_neuronpedia(json.loads(json.dumps(body)), graph)
    assert back.pinned == sub.pinned and back.labels == sub.labels
    assert [(g.name, g.members) for g in back.supernodes] == [(g.name, g.members) for g in sub.supernodes]


# ------------------------------------------------------------------------------------------ refusals
def _one_line_error(fn, *match):
    with pytest.raises(ValueError) as caught:
        fn()
    message = str(caught.value)
    assert "\n" not in message and all(m in message for m in match), message


def test_bad_subgraphs_are_refused_in_one_line(real, tmp_path):
    graph, sub = real
    feature = sub.supernodes[0].members[0]
    _one_line_error(lambda: Subgraph(graph, {"x": ["9_9_9"]}), "'9_9_9'", "not a node of this graph")
    _one_line_error(lambda: Subgraph(graph, {"x": [graph.n_nodes]}), str(graph.n_nodes), "not a node")
    _one_line_error(lambda: Subgraph(graph, {"x": []}), "'x'", "no members")
    _one_line_error(lambda: Subgraph(graph, {"x": [feature], "y": [feature]}), feature, "'x'", "one supernode")
    _one_line_error(lambda: Subgraph(graph, [("x", [0]), ("x", [1])]), "'x'", "named")
    _one_line_error(lambda: Subgraph(graph, pinned=["nope"]), "'nope'")
    _one_line_error(lambda: Subgraph(graph, labels={"a": "b"}), "labels")
    path = graph.prune().to_json(tmp_path / "g.json")
    other = json.loads(path.read_text())
    other["metadata"]["prompt_tokens"] = other["metadata"]["prompt_tokens"][::-1]
    (tmp_path / "other.json").write_text(json.dumps(other))
    before = (tmp_path / "other.json").read_text()
    _one_line_error(lambda: Subgraph.load(tmp_path / "other.json", graph), "another graph", "prompt_tokens")
    _one_line_error(lambda: sub.save(tmp_path / "other.json"), "another graph")
    assert (tmp_path / "other.json").read_text() == before  # nothing half-written
    _one_line_error(lambda: Subgraph.load(path, graph, slug="elsewhere"), "slug")
    _one_line_error(lambda: sub.save(tmp_path / "missing.json"), "not a file")
    _one_line_error(lambda: Subgraph.from_neuronpedia({**sub.neuronpedia("s"), "modelId": "gemma"}, graph), "gemma")


def test_the_plot_draws_each_part_and_each_edge_between_parts(real, tmp_path):
    graph, sub = real
    fig = sub.plot(tmp_path / "sub.png")
    ax = fig.axes[0]
    assert sorted(t.get_text().split("\n")[0] for t in ax.texts) == sorted(p.name for p in sub.parts)
    edges = sub.edges()
    drawn = sum(1 for t in range(len(sub.parts)) for s in range(len(sub.parts)) if t != s and edges[t, s] != 0)
    assert len(ax.patches) == drawn > 0
    assert (tmp_path / "sub.png").stat().st_size > 0
