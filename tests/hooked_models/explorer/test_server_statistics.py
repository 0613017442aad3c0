"""The explorer over a `features.statistics` result: `--data` lists it (kind "statistics"), and the features
view's dashboard request reads any feature of any layer from it, equal to the library's statistics, with no
pass over the corpus (the harvest it came from is not there)."""

import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from hooked_models import features  # noqa: E402
from hooked_models.explorer import create_app  # noqa: E402


def test_a_statistics_result_is_listed_and_opened(arcee, data_dir, transcoders, tmp_path):
    stats = features.statistics(data_dir / "acts", transcoders, model=arcee, k=3, radius=2, progress=False)
    stats.save(tmp_path / "stats")
    client = TestClient(create_app(arcee, [tmp_path], {"tc": transcoders}))
    listed = client.get(f"/api/files?path={tmp_path}").json()["entries"]
    assert [(e["name"], e["kind"]) for e in listed] == [("stats", "statistics")]
    for layer, feature in ((0, 2), (1, 5)):
        answer = client.post("/api/features/dashboard", json={"harvest": str(tmp_path / "stats"),
                                                              "sae": f"tc[{layer}]", "feature": feature}).json()
        for _ in range(200):
            status = client.get(f"/api/jobs/{answer['job']}").json()
            if status["state"] in ("done", "error"):
                break
            time.sleep(0.05)
        board = status["result"]
        mine = stats[layer]
        assert board["name"] == f"layers.{layer}.mlp_input" and board["feature"] == feature
        assert [w["tokens"] for w in board["windows"]] == [w.tokens for w in mine.top_windows(feature)]
        assert [w["activations"] for w in board["windows"]] == [w.activations for w in mine.top_windows(feature)]
        assert board["counts"] == mine.histogram(feature)[0]
        assert board["density"] == float(mine.frequency()[feature])
        assert [t for t, _ in board["promoted"]] == arcee.to_str_tokens(mine.top_logits[feature])


def test_the_listing_says_which_harvests_fit_each_sae(arcee, data_dir, sae, transcoders, tmp_path):
    """The features view's default harvest is the first listed holding its SAE's value: the listing gives
    each harvest's and statistics result's values, the model's SAEs theirs in the same (standard) spelling."""
    import json

    (tmp_path / "a_other").mkdir()  # listed first, a harvest without the SAE's hook (its manifest alone)
    (tmp_path / "a_other" / "manifest.json").write_text(json.dumps({"names": ["layers.0.mlp_input"]}))
    stats = features.statistics(data_dir / "acts", sae, model=arcee, k=2, radius=1, progress=False)
    stats.save(tmp_path / "b_stats")
    client = TestClient(create_app(arcee, [tmp_path, data_dir], {"sae": sae, "tc": transcoders}))
    saes = {s["name"]: s["value"] for s in client.get("/api/model").json()["saes"]}
    assert saes["sae"] == "layers.1.layer_output" and saes["tc[0]"] == "layers.0.mlp_input"
    listed = {e["name"]: e["values"] for root in (tmp_path, data_dir)
              for e in client.get(f"/api/files?path={root}").json()["entries"] if "values" in e}
    assert listed["a_other"] == ["layers.0.mlp_input"] and listed["b_stats"] == ["layers.1.layer_output"]
    assert set(listed["acts"]) >= {"layers.1.layer_output", "layers.0.mlp_input", "layers.1.mlp_input"}
    fits = [name for name, values in listed.items() if saes["sae"] in values]
    assert fits[0] == "b_stats" and "a_other" not in fits


def test_the_graph_nodes_carry_their_top_examples_from_statistics_beside_it(arcee, data_dir, transcoders, tmp_path):
    import shutil

    shutil.copy(data_dir / "real_graph.json", tmp_path / "graph.json")  # with its tensors' side file
    shutil.copy(data_dir / "real_graph.tensors.safetensors", tmp_path / "real_graph.tensors.safetensors")  # under the name the JSON records
    client = TestClient(create_app(arcee, [tmp_path], {"tc": transcoders}))
    bare = client.post("/api/graph", json={"path": str(tmp_path / "graph.json")}).json()
    assert not any("examples" in n for n in bare["nodes"])  # no statistics beside it: no examples
    stats = features.statistics(data_dir / "acts", transcoders, model=arcee, k=4, radius=2, progress=False)
    stats.save(tmp_path / "stats")
    nodes = client.post("/api/graph", json={"path": str(tmp_path / "graph.json")}).json()["nodes"]
    shown = [n for n in nodes if "transcoder" in n["feature_type"]]
    assert shown and all(len(n["examples"]) == min(3, len(stats[int(n["layer"])].top_windows(
        int(n["node_id"].split("_")[1])))) for n in shown)
    for n in shown:
        layer, feature = int(n["layer"]), int(n["node_id"].split("_")[1])
        for text, window in zip(n["examples"], stats[layer].top_windows(feature)):
            peak = window.position - window.start
            # the window's tokens in order, its peak token (the largest activation, first on a tie) in brackets
            assert peak == window.activations.index(max(window.activations))
            assert text == "".join(window.tokens[:peak]) + f"[{window.tokens[peak]}]" + "".join(window.tokens[peak + 1:])
    assert any(n["examples"] for n in shown)
    assert all("examples" not in n for n in nodes if "transcoder" not in n["feature_type"])
