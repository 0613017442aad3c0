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
