"""The explorer's subgraph routes (hooked_models/explorer/subgraphs.py): the parts and edges it sends are the
library's `Subgraph` (and each edge the sum of its members' adjacency entries, summed here in float64), a save
writes the graph file's qParams as `Subgraph.save` does and the file opens again with them, a file in the form
circuit-tracer's viewer saves opens, the interventions job is `intervene_supernodes` bit for bit, and every bad
value is a one-line 422 naming it, with the file left as it was."""

import json
import shutil
import time
from dataclasses import asdict

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from hooked_models.attribution import AttributionGraph, Subgraph, intervene_supernodes  # noqa: E402
from hooked_models.attribution.export import node_id  # noqa: E402
from hooked_models.attribution.subgraph_files import uncantor  # noqa: E402
from hooked_models.explorer import create_app  # noqa: E402


@pytest.fixture
def folder(tmp_path, data_dir):
    """A data directory of its own (saves write into it): the graph `attribute` wrote, with its tensors,
    and the hand-written graph file (no tensors: not a whole graph)."""
    for name in ("real_graph.json", "real_graph.tensors.safetensors", "graph.json"):
        shutil.copy(data_dir / name, tmp_path / name)
    return tmp_path


@pytest.fixture
def client(arcee, folder, transcoders):
    return TestClient(create_app(arcee, [folder], {"tc": transcoders}))


def feature_ids(folder) -> list[str]:
    """The graph's feature nodes, the most influential first within layer 0, then layer 1 (a supernode of
    each, and a mixed one; a member need not be kept in the file's pruned nodes)."""
    graph = AttributionGraph.from_json(folder / "real_graph.json")
    order = Subgraph(graph).node_influence()[:graph.n_features].argsort(descending=True).tolist()
    return [node_id(graph, i) for layer in (0, 1) for i in order if int(graph.active_features[i, 0]) == layer]


def grouping(folder) -> dict:
    ids = feature_ids(folder)
    return {"path": "real_graph.json", "supernodes": [["early", *ids[:3]], ["late", *ids[-3:]], ["mixed", ids[3], ids[-4]]],
            "pinned": [ids[4]]}


def wait(client, answer: dict) -> dict:
    for _ in range(1200):
        status = client.get(f"/api/jobs/{answer['job']}").json()
        if status["state"] in ("done", "error", "cancelled"):
            return status
        time.sleep(0.05)
    raise AssertionError(f"job {answer} did not finish")


def test_the_parts_and_edges_are_the_librarys(client, folder):
    body = grouping(folder)
    view = client.post("/api/subgraph", json=body).json()
    graph = AttributionGraph.from_json(folder / "real_graph.json")
    sub = Subgraph(graph, [(s[0], s[1:]) for s in body["supernodes"]], body["pinned"])
    assert [p["name"] for p in view["parts"]] == [p.name for p in sub.parts] == ["early", "late", "mixed",
                                                                                 graph.node_name(sub.parts[3].nodes[0])]
    assert view["edges"] == sub.edges().tolist()  # bit for bit: JSON carries float32's every digit
    assert [p["influence"] for p in view["parts"]] == sub.influence().tolist()
    assert view["kept"] == sub.kept_influence()._asdict() and view["qParams"] == sub.qparams()
    assert view["transcoders"] == "tc"
    # the independent sum: member by member, in float64, from the adjacency itself
    ids = [p["ids"] for p in view["parts"]]
    lookup = {node_id(graph, i): i for i in range(graph.n_nodes)}
    adjacency = graph.adjacency_matrix.double()
    for t, targets in enumerate(ids):
        for s, sources in enumerate(ids):
            expected = sum(float(adjacency[lookup[a], lookup[b]]) for a in targets for b in sources)
            assert view["edges"][t][s] == pytest.approx(expected, rel=1e-5, abs=1e-6), (t, s)
    assert any(abs(w) > 1e-3 for t, row in enumerate(view["edges"]) for s, w in enumerate(row) if t != s)


def test_a_saved_subgraph_opens_again_with_the_files_labels_kept(client, folder):
    path = folder / "real_graph.json"
    data = json.loads(path.read_text())
    data["qParams"]["clerps"] = json.dumps([["12", "a label of mine"]], separators=(",", ":"))
    path.write_text(json.dumps(data))
    body = grouping(folder)
    saved = client.post("/api/subgraph/save", json=body)
    assert saved.status_code == 200, saved.json()
    after = json.loads(path.read_text())
    graph = AttributionGraph.from_json(path)
    expected = Subgraph(graph, [(s[0], s[1:]) for s in body["supernodes"]], body["pinned"], {uncantor(12): "a label of mine"})
    assert after["qParams"] == expected.qparams()  # what Subgraph.save writes, the file's label kept
    assert {k: v for k, v in after.items() if k != "qParams"} == {k: v for k, v in data.items() if k != "qParams"}
    opened = client.post("/api/graph", json={"path": "real_graph.json"}).json()
    assert opened["whole_graph"] and opened["qParams"]["supernodes"] == body["supernodes"]
    assert opened["qParams"]["pinnedIds"] == expected.qparams()["pinnedIds"]
    again = Subgraph.load(path, graph)
    assert [(g.name, g.members) for g in again.supernodes] == [(s[0], tuple(s[1:])) for s in body["supernodes"]]


def test_a_subgraph_the_viewer_saved_in_its_copy_opens_and_imports(client, folder):
    """circuit-tracer's viewer saves into its own copy of the graph file, qParams as its URL holds them."""
    body = grouping(folder)
    copy = json.loads((folder / "real_graph.json").read_text())
    copy["qParams"] = {"pinnedIds": ",".join(body["pinned"]), "linkType": None, "clickedId": None, "sg_pos": None,
                       "supernodes": json.dumps(body["supernodes"] + [["early", body["pinned"][0]]]), "clerps": None}
    (folder / "viewer").mkdir()
    (folder / "viewer" / "ioi.json").write_text(json.dumps(copy, indent=2))
    opened = client.post("/api/graph", json={"path": "viewer/ioi.json"})
    assert opened.status_code == 200 and opened.json()["qParams"]["supernodes"][-1] == ["early", body["pinned"][0]]
    imported = client.post("/api/subgraph/import", json={"path": "real_graph.json", "source": "viewer/ioi.json"}).json()
    # two supernodes of one name, told apart as circuit-tracer's decode_url_features does
    assert [s[0] for s in imported["qParams"]["supernodes"]] == ["early", "late", "mixed", "early (2)"]
    assert imported["qParams"]["supernodes"][:3] == body["supernodes"]


def refusals(folder):
    ids = feature_ids(folder)
    base = {"path": "real_graph.json", "pinned": []}
    return [
        ("/api/subgraph", {**base, "supernodes": [["a", "9_9_9"]]}, ["'9_9_9'", "not a node of this graph"]),
        ("/api/subgraph/save", {**base, "supernodes": [["a", ids[0]], ["empty"]]}, ["'empty'", "no members"]),
        ("/api/subgraph/save", {**base, "supernodes": [["a", ids[0]], ["b", ids[1], ids[0]]]},
         [f"'{ids[0]}'", "'b'", "in 'a' too"]),
        ("/api/subgraph", {**base, "supernodes": [[]]}, ["[]", "no name"]),
        ("/api/subgraph/interventions", {**base, "supernodes": [["a", ids[0]]], "scales": [0, "half"]},
         ["scales.1='half'", "valid number"]),
        ("/api/subgraph/interventions", {**base, "supernodes": [["a", ids[0]]], "scales": [True]}, ["scales.0=True"]),
        ("/api/subgraph/interventions", {**base, "supernodes": [["a", ids[0]]], "parts": ["nope"]}, ["'nope'"]),
        ("/api/subgraph/import", {"path": "real_graph.json", "source": "other.json"}, ["another graph", "prompt_tokens"]),
        ("/api/subgraph", {**base, "path": "graph.json", "supernodes": []}, ["'graph.json'", "hooked_models section"]),
    ]


def test_bad_values_are_a_one_line_422_and_the_file_stays_as_it_was(client, folder):
    other = json.loads((folder / "real_graph.json").read_text())
    other["metadata"]["prompt_tokens"] = other["metadata"]["prompt_tokens"][::-1]
    (folder / "other.json").write_text(json.dumps(other))
    before = (folder / "real_graph.json").read_bytes()
    for route, body, words in refusals(folder):
        answer = client.post(route, json=body)
        error = answer.json()["error"]
        assert answer.status_code == 422 and "\n" not in error and all(w in error for w in words), (route, body, error)
    # NaN is no JSON, but Python's parser reads it: refused as not finite
    raw = '{"path": "real_graph.json", "supernodes": [["a", "%s"]], "scales": [NaN]}' % feature_ids(folder)[0]
    answer = client.post("/api/subgraph/interventions", content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 422 and answer.json()["error"] == "scales.0=nan: Input should be a finite number"
    assert (folder / "real_graph.json").read_bytes() == before
    assert client.get("/api/jobs").json()["jobs"] == []  # nothing was queued
    # outside the data directories: the server's 403, as for every file route
    assert client.post("/api/subgraph", json={"path": "../x.json", "supernodes": []}).status_code == 403


def test_the_interventions_job_is_intervene_supernodes(client, folder, arcee, transcoders):
    body = {**grouping(folder), "scales": [0, 2.5], "logit_diff": [" Mary", " John"], "batch_size": 2}
    status = wait(client, client.post("/api/subgraph/interventions", json=body).json())
    assert status["state"] == "done", status["error"]
    graph = AttributionGraph.from_json(folder / "real_graph.json")
    sub = Subgraph(graph, [(s[0], s[1:]) for s in body["supernodes"]], body["pinned"])
    table = intervene_supernodes(arcee, graph.tokens, transcoders, sub, (0.0, 2.5), batch_size=2,
                                 logit_diff=(arcee.to_single_token(" Mary"), arcee.to_single_token(" John")))
    expected = [{k: None if isinstance(v, float) and v != v else v for k, v in asdict(r).items()} for r in table.rows]
    assert status["result"]["rows"] == expected  # bit for bit: the same batches on the replica's shared weights
    assert status["result"]["modes"] == ["frozen", "free"] and status["result"]["transcoders"] == "tc"
    assert status["total"] == 4 * 2 and status["unit"] == "batch"  # (4 parts x 2 scales) / 2 a batch, x 2 modes
    assert any(r["measured"] != 0 for r in status["result"]["rows"])
