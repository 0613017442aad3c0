"""Graphs over a dataset (hooked_models/attribution/dataset.py, store.py, aggregate.py, search.py) on the
embedded Arcee and its shipped transcoders, a handful of IOI prompts of one template:

- each stored graph is `attribute` on its prompt bit for bit (every tensor, and the file pair `to_json` writes
  of it, byte for byte), for contrastive pairs (a logit difference each) and for text prompts (salient logits);
- a run cancelled after k graphs (by its progress callback, or killed mid-write: temporaries left behind)
  resumes to the uninterrupted store, byte for byte;
- the aggregate's counts, means and sds, edges and exceptions equal a brute-force pass over the stored files
  written here (numpy, float64, influence by the closed form w N (I - N)^-1 rather than the package's series),
  by role and by token;
- search answers equal each graph's own pruned mask;
- bad input is a one-line error and leaves the store's bytes as they were.
The Ray engine: test_dataset_ray.py. The aggregate file in circuit-tracer's viewer: test_dataset_viewer.py.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from hooked_models import HookedArcee
from hooked_models.attribution import (
    AttributionGraph,
    GraphStore,
    aggregate,
    attribute,
    attribute_dataset,
    cooccurring,
    graphs_containing,
    graphs_led_by,
    supernode_shares,
)
from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.explorer.graph_file import GraphFile
from hooked_models.progress import Cancelled
from hooked_models.transcoders import load_transcoders

N_PROMPTS = 5
OPTIONS = dict(head_loadings="pruned", qk=2, max_feature_nodes=96, batch_size=64)


@pytest.fixture(scope="module")
def arcee():
    return HookedArcee.from_pretrained("embedded").eval()


@pytest.fixture(scope="module")
def transcoders(arcee):
    return load_transcoders("embedded", model=arcee)


@pytest.fixture(scope="module")
def ioi(arcee):
    return make_ioi_prompts(N_PROMPTS, seed=3, tokenizer=arcee.tokenizer, templates=(0,))


def files(out: Path) -> dict[str, bytes]:
    """Every file of a store (not the lock), by its path in it."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def store(tmp_path_factory, arcee, transcoders, ioi):
    out = tmp_path_factory.mktemp("store") / "ioi"
    return attribute_dataset(arcee, ioi, transcoders, out, progress=False, **OPTIONS)


def test_each_stored_graph_is_attribute_on_its_prompt_bit_for_bit(store, arcee, transcoders, ioi, tmp_path):
    assert len(store) == N_PROMPTS and store.settings["qk"] == 2
    for i in range(N_PROMPTS):
        pair = (int(ioi.correct[i]), int(ioi.incorrect[i]))
        assert store.entries[i] == {"prompt": None, "tokens": ioi.clean_tokens[i].tolist(), "target": list(pair)}
        expected = attribute(arcee, ioi.clean_tokens[i], transcoders, targets=[pair], **OPTIONS)
        stored = store[i]
        assert stored.n_logits == 1 and stored.logit_tokens.tolist() == [-1]  # the logit difference, one node
        for name in ("tokens", "active_features", "activation_values", "logit_probabilities", "adjacency_matrix",
                     "loading_edges", "loading_heads", "loading_skips"):
            assert torch.equal(getattr(stored, name), getattr(expected, name)), (i, name)
        assert sorted(stored.qk_tables) == sorted(expected.qk_tables) and stored.qk_tables
        # The file pair as to_json writes it, byte for byte.
        written = expected.to_json(tmp_path / f"{i:05d}.json", node_threshold=OPTIONS.get("node_threshold", 0.8))
        assert written.read_bytes() == store.file(i).read_bytes()
        side = f"{i:05d}.tensors.safetensors"
        assert (tmp_path / side).read_bytes() == (store.path / "graphs" / side).read_bytes()


def test_text_prompts_get_their_salient_logits(arcee, transcoders, tmp_path):
    prompts = ["When Mary and John went to the store together, John gave a drink to",
               "When Kate and Paul went to the park together, Paul gave a book to"]
    salient = dict(head_loadings=False, desired_logit_prob=0.99999, max_n_logits=3)  # more than one logit
    store = attribute_dataset(arcee, prompts, transcoders, tmp_path / "text", progress=False, **salient)
    for i, prompt in enumerate(prompts):
        expected = attribute(arcee, prompt, transcoders, **salient)
        assert store.entries[i]["prompt"] == prompt and store[i].prompt == prompt and store.entries[i]["target"] is None
        assert torch.equal(store[i].adjacency_matrix, expected.adjacency_matrix)
        assert store[i].logit_tokens.tolist() == expected.logit_tokens.tolist() and expected.n_logits > 1


def test_a_cancelled_or_killed_run_resumes_to_the_uninterrupted_store(store, arcee, transcoders, ioi, tmp_path):
    out = tmp_path / "resumed"
    steps = []

    def stop_after_two(step):
        steps.append((step.done, step.total, step.unit))
        if step.done == 2:
            raise Cancelled("stopped")

    with pytest.raises(Cancelled):
        attribute_dataset(arcee, ioi, transcoders, out, progress=stop_after_two, **OPTIONS)
    assert steps[-1] == (2, N_PROMPTS, "graph")
    index = json.loads((out / "index.json").read_text())
    assert index["done"] == [0, 1] and sorted(p.name for p in (out / "graphs").glob("*.json")) == ["00000.json", "00001.json"]
    with pytest.raises(ValueError, match="incomplete: 3 of 5"):
        GraphStore(out)
    # Killed while writing: a graph's temporaries and a half-written index left behind.
    (out / ".tmp" / "dead").mkdir(parents=True)
    (out / ".tmp" / "dead" / "00002.json").write_text("{")
    (out / ".index.json.dead").write_text("{")
    seen = []
    resumed = attribute_dataset(arcee, ioi, transcoders, out, progress=lambda s: seen.append(s.done), **OPTIONS)
    assert seen[0] == 2 and seen[-1] == N_PROMPTS  # the graphs written before counted done at once
    assert files(resumed.path) == files(store.path)
    # Run again on the finished store: nothing computed, nothing changed.
    again = attribute_dataset(arcee, ioi, transcoders, out, progress=False, **OPTIONS)
    assert files(again.path) == files(store.path)


def test_a_missing_graph_is_refused_by_readers_and_recomputed_by_a_rerun(store, arcee, transcoders, ioi, tmp_path):
    out = tmp_path / "missing"
    shutil.copytree(store.path, out)
    (out / "graphs" / "00003.tensors.safetensors").unlink()
    before = files(out)
    for read in (GraphStore, aggregate):
        with pytest.raises(ValueError) as error:
            read(out)
        assert "graph 3 (graphs/00003.json)" in str(error.value) and "\n" not in str(error.value)
    assert files(out) == before  # nothing in the store lost
    attribute_dataset(arcee, ioi, transcoders, out, progress=False, **OPTIONS)
    assert files(out) == files(store.path)


def test_bad_input_is_one_line_and_leaves_the_store_as_it_was(store, arcee, transcoders, ioi, tmp_path):
    def one_line(call, match):
        with pytest.raises(ValueError, match=match) as error:
            call()
        assert "\n" not in str(error.value), str(error.value)

    one_line(lambda: attribute_dataset(arcee, [], transcoders, tmp_path / "empty"), "dataset is empty")
    one_line(lambda: attribute_dataset(arcee, {"tokens": []}, transcoders, tmp_path / "empty"), "dataset is empty")
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir())
    one_line(lambda: attribute_dataset(arcee, {"tokens": ioi.clean_tokens, "answer": ioi.correct}, transcoders,
                                       tmp_path / "x"), "no 'wrong'")
    one_line(lambda: attribute_dataset(arcee, ioi, transcoders, tmp_path / "x", heads=True), "unknown options")
    # Another model or other transcoders than the store's.
    out = tmp_path / "other"
    shutil.copytree(store.path, out)
    before = files(out)
    other_model = HookedArcee.from_pretrained("embedded").eval()
    with torch.no_grad():
        other_model.layers[0].mlp.up_proj.weight.mul_(1.5)
    other_tcs = load_transcoders("embedded", model=arcee)
    with torch.no_grad():
        other_tcs[1].W_enc.mul_(-1.0)
    one_line(lambda: attribute_dataset(other_model, ioi, transcoders, out, **OPTIONS), r"another job \(model")
    one_line(lambda: attribute_dataset(arcee, ioi, other_tcs, out, **OPTIONS), r"another job \(transcoders")
    one_line(lambda: attribute_dataset(arcee, ioi, transcoders, out, max_feature_nodes=50), r"another job \(settings")
    one_line(lambda: GraphStore(out).check(model=other_model), "another model")
    one_line(lambda: GraphStore(out).check(transcoders=other_tcs), "another transcoders")
    GraphStore(out).check(model=arcee, transcoders=transcoders)  # its own: no error
    # Mixed lengths where positions are matched by role.
    mixed = attribute_dataset(arcee, [ioi.clean_tokens[0], ioi.clean_tokens[1, :12]], transcoders, tmp_path / "mixed",
                              head_loadings=False, progress=False)
    one_line(lambda: aggregate(mixed, align="role"), "2 lengths")
    one_line(lambda: aggregate(out, align="place"), "align='place'")
    assert aggregate(mixed).align == "token"  # auto: by token where lengths differ
    assert files(out) == before


# ------------------------------------------------------------------------------------ the aggregate's oracle
def brute_force(out: Path, align: str, min_fraction: float) -> tuple[dict, dict]:
    """Per key, the graphs a node occurs in with its influence, signed effect and activation; per (source key,
    target key), the graphs and weights of the edge: read from the store's files with json and numpy alone
    (the nodes and links a file keeps are what occurs; influence w N (I - N)^-1 + w in float64)."""
    index = json.loads((out / "index.json").read_text())
    nodes, edges = {}, {}
    for g in range(len(index["prompts"])):
        data = json.loads((out / "graphs" / f"{g:05d}.json").read_text())
        tensors = load_file(str(out / "graphs" / f"{g:05d}.tensors.safetensors"))
        hm = data["hooked_models"]
        A = tensors["adjacency_matrix"].astype(np.float64)
        F, L, P, n = len(hm["active_features"]), hm["n_layers"], len(hm["tokens"]), A.shape[0]
        w = np.zeros(n)
        w[F + L * P + P:] = tensors["logit_probabilities"].astype(np.float64)
        rows = np.abs(A).sum(1, keepdims=True)
        rows[rows < 1e-10] = 1e-10
        closed = lambda M: w @ M @ np.linalg.inv(np.eye(n) - M) + w  # noqa: E731
        influence, effect = closed(np.abs(A) / rows), closed(A / rows)
        tokens = hm["tokens"]

        def column(p):
            return p if align == "role" else (tokens[p], tokens[:p + 1].count(tokens[p]))

        def place(node):  # (key, row) of a node of the file
            layer, p = node["layer"], node["ctx_idx"]
            if node["feature_type"] == "embedding":
                return ("embedding", column(p)), F + L * P + p
            if node["feature_type"] == "logit":
                k = [t if t >= 0 else -1 for t in hm["logit_tokens"]].index(node["feature"])
                return ("logit", k), F + L * P + P + k
            if node["feature_type"] == "mlp reconstruction error":
                return ("error", int(layer), column(p)), F + int(layer) * P + p
            f = int(node["node_id"].split("_")[1])
            return ("feature", int(layer), f, column(p)), hm["active_features"].index([int(layer), p, f])

        keys = {}
        for node in data["nodes"]:
            key, row = place(node)
            keys[node["node_id"]] = key
            activation = float(tensors["activation_values"][row]) if key[0] == "feature" else None
            nodes.setdefault(key, []).append((g, influence[row], effect[row], activation))
        for link in data["links"]:
            edges.setdefault((keys[link["source"]], keys[link["target"]]), []).append((g, link["weight"]))
    return nodes, edges


@pytest.mark.parametrize("align", ["role", "token"])
def test_the_aggregate_equals_a_brute_force_pass_over_the_files(store, align, tmp_path):
    agg = aggregate(store, align=align, min_fraction=0.4, progress=False)
    nodes, edges = brute_force(store.path, align, 0.4)
    assert agg.align == align and set(agg.nodes) == set(nodes) and set(agg.edges) == set(edges)
    n = len(store)
    for key, rows in nodes.items():
        got = agg.nodes[key]
        assert got.graphs == [r[0] for r in rows] and got.count == len(rows) and got.frequency == len(rows) / n
        for name, column in (("influence", 1), ("effect", 2)):
            values = np.array([r[column] for r in rows])
            assert got.mean(name) == pytest.approx(values.mean(), rel=1e-9, abs=1e-12), (key, name)
            assert got.sd(name) == pytest.approx(values.std(), rel=1e-7, abs=1e-12), (key, name)
        if key[0] == "feature":
            assert got.mean("activation") == pytest.approx(np.mean([r[3] for r in rows]), rel=1e-12)
        assert got.absent() == [g for g in range(n) if g not in got.graphs]
        mean_effect = np.mean([r[2] for r in rows])
        assert got.reversed() == [r[0] for r in rows if r[2] * mean_effect < 0]
    for key, rows in edges.items():
        assert agg.edges[key].graphs == [g for g, _ in rows]
        assert agg.edges[key].mean() == pytest.approx(np.mean([w for _, w in rows]), rel=1e-12)
    # Recurring features, and the prompts where one is absent or reversed.
    recurring = {k for k, rows in nodes.items() if k[0] == "feature" and len(rows) >= 0.4 * n}
    assert {node.key for node in agg.recurring()} == recurring and recurring
    assert {e["key"] for e in agg.exceptions()} == {k for k in recurring if agg.nodes[k].absent() or agg.nodes[k].reversed()}
    assert any(len(rows) < n for k, rows in nodes.items() if k in recurring)  # an exception to find
    assert any(agg.nodes[k].reversed() for k in nodes)  # and a reversal


def test_the_aggregate_graph_file_carries_each_nodes_spread(store, tmp_path):
    agg = aggregate(store, min_fraction=0.4, progress=False)
    nodes, edges = brute_force(store.path, "role", 0.4)
    path = agg.to_json(tmp_path / "aggregate.json")
    data = json.loads(path.read_text())
    assert data["metadata"]["hooked_models_aggregate"]["n_graphs"] == N_PROMPTS
    # Viewers show a node whose influence is at most the file's node_threshold: every node of the file.
    assert data["metadata"]["node_threshold"] == 1.0 and all(n["influence"] <= 1.0 for n in data["nodes"])
    features = [n for n in data["nodes"] if n["feature_type"] == "cross layer transcoder"]
    # The recurring features and errors, every embedding and the output: those of them with a link to another.
    kept = {k for k, rows in nodes.items() if k[0] in ("embedding", "logit") or len(rows) >= 0.4 * N_PROMPTS}
    linked = {k for edge in edges for k in edge if all(end in kept for end in edge)}
    shown = {k for k in kept if k[0] in ("embedding", "logit") or k in linked}
    assert {tuple(n["hooked_models_aggregate"]["key"]) for n in data["nodes"]} == shown
    assert len(features) == len({k for k in shown if k[0] == "feature"}) > 0
    for node in data["nodes"]:
        spread = node.get("hooked_models_aggregate")
        key = tuple(spread["key"])
        rows = nodes[key]
        assert spread["count"] == len(rows) and spread["per_prompt"]["graphs"] == [r[0] for r in rows]
        assert spread["influence"]["mean"] == pytest.approx(np.mean([r[1] for r in rows]), rel=1e-9)
        assert spread["influence"]["sd"] == pytest.approx(np.std([r[1] for r in rows]), rel=1e-7, abs=1e-12)
    # `influence`: the cumulative share of the nodes' mean influences, largest first (circuit-tracer's meaning).
    means = {n["node_id"]: n["hooked_models_aggregate"]["influence"]["mean"] for n in data["nodes"]}
    for node in data["nodes"]:
        above = sum(m for m in means.values() if m >= means[node["node_id"]])
        assert node["influence"] == pytest.approx(above / sum(means.values()), rel=1e-5)
    ids = {n["node_id"]: tuple(n["hooked_models_aggregate"]["key"]) for n in data["nodes"]}
    for link in data["links"]:
        rows = edges[(ids[link["source"]], ids[link["target"]])]
        assert link["weight"] == pytest.approx(np.mean([w for _, w in rows]), rel=1e-6)
        assert link["hooked_models_aggregate"]["count"] == len(rows)
    GraphFile.model_validate(data).checked()  # the explorer's reader of circuit-tracer's schema takes it
    back = AttributionGraph.from_json(path)  # the file reads back as a graph
    assert back.n_features == len(features) and back.str_tokens == [agg.column_label(c) for c in agg.column_order()]


def test_search_finds_the_graphs_and_the_features_beside_a_feature(store):
    kept = [{(l, f) for l, _, f in g.active_features[g.prune(0.8, 0.98).node_mask[:g.n_features]].tolist()}
            for g in store]
    layer, feature = max({lf for s in kept for lf in s}, key=lambda lf: (sum(lf in s for s in kept), lf))
    holding = [i for i, s in enumerate(kept) if (layer, feature) in s]
    assert graphs_containing(store, layer, feature) == holding and 1 < len(holding)
    active = [i for i, g in enumerate(store) if any(row[0] == layer and row[2] == feature
                                                    for row in g.active_features.tolist())]
    assert graphs_containing(store.path, layer, feature, kept=False) == active
    g = store[holding[0]]
    kept_rows = g.active_features[g.prune(0.8, 0.98).node_mask[:g.n_features]].tolist()
    pos = next(p for l, p, f in kept_rows if (l, f) == (layer, feature))
    assert holding[0] in graphs_containing(store, layer, feature, position=pos)
    absent = next(p for p in range(g.n_pos) if [layer, p, feature] not in kept_rows)
    assert holding[0] not in graphs_containing(store, layer, feature, position=absent)
    found = cooccurring(store, layer, feature)
    counts = {}
    for i in holding:
        for other in kept[i] - {(layer, feature)}:
            counts[other] = counts.get(other, 0) + 1
    assert {(c["layer"], c["feature"]): c["count"] for c in found} == counts
    assert [c["count"] for c in found] == sorted(counts.values(), reverse=True)
    assert all(c["fraction"] == c["count"] / len(holding) for c in found)


def closed_form_influence(out: Path, g: int) -> tuple[np.ndarray, list]:
    """Graph g's influence on its outputs, every node, w N (I - N)^-1 in float64 from its files; its active
    features ([layer, position, feature] rows, the first nodes)."""
    tensors = load_file(str(out / "graphs" / f"{g:05d}.tensors.safetensors"))
    hm = json.loads((out / "graphs" / f"{g:05d}.json").read_text())["hooked_models"]
    A = tensors["adjacency_matrix"].astype(np.float64)
    n = A.shape[0]
    w = np.zeros(n)
    w[n - len(hm["logit_tokens"]):] = tensors["logit_probabilities"]
    N = np.abs(A) / np.maximum(np.abs(A).sum(1, keepdims=True), 1e-10)
    return w @ N @ np.linalg.inv(np.eye(n) - N), hm["active_features"]


def test_supernode_shares_are_each_graphs_influence_share(store):
    """A supernode's share in each graph: its members' influence over all nodes', by the closed form in float64
    from the files; `graphs_led_by`: the graphs where it carries more than the others, largest share first.
    The supernodes: a feature at one position (a node id) and another feature anywhere ((layer, feature)),
    chosen so that each leads in some graph, and one no graph has."""
    graphs = [closed_form_influence(store.path, g) for g in range(len(store))]

    def share(g, layer, feature, pos=None):
        influence, active = graphs[g]
        rows = [i for i, (l, p, f) in enumerate(active) if (l, f) == (layer, feature) and pos in (None, p)]
        return influence[rows].sum() / influence.sum()

    recurring = [n.key for n in aggregate(store, min_fraction=0.2, progress=False).recurring()]
    a, b = next((a, b) for a in recurring for b in recurring if a[1:3] != b[1:3] and
                len({share(g, *a[1:]) > share(g, *b[1:3]) for g in range(len(store))}) == 2)
    supernodes = {"one place": [f"{a[1]}_{a[2]}_{a[3]}"], "anywhere": [(b[1], b[2])], "nowhere": ["0_100000_0"]}
    shares = supernode_shares(store, supernodes)
    for g in range(len(store)):
        assert shares[g]["one place"] == pytest.approx(share(g, *a[1:]), rel=1e-5, abs=1e-9)
        assert shares[g]["anywhere"] == pytest.approx(share(g, *b[1:3]), rel=1e-5, abs=1e-9)
        assert shares[g]["nowhere"] == 0.0
    for name in ("one place", "anywhere"):
        led = [g for g, row in enumerate(shares) if 0 < row[name] == max(row.values())]
        assert graphs_led_by(store, supernodes, name) == sorted(led, key=lambda g: -shares[g][name])
        assert 0 < len(led) < len(store)
