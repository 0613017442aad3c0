"""The aggregate graph file of a store opens in circuit-tracer's own local viewer (its `serve`, in the side
environment .ci/ct-env; Debian's chromium through Playwright; the setup of
tests/hooked_models/features/test_circuit_tracer_viewer.py): every node of the file (recurring features and
errors, embeddings, the output) is drawn, with no error on the page."""

import json

from ..features.test_circuit_tracer_viewer import circuit_tracer_viewer, needs_ct, needs_viewer
from .test_dataset import OPTIONS, arcee, ioi, store, transcoders  # noqa: F401

from hooked_models.attribution import aggregate  # noqa: E402


@needs_ct
@needs_viewer
def test_the_aggregate_opens_in_circuit_tracers_viewer(store, tmp_path):  # noqa: F811
    path = aggregate(store, min_fraction=0.4, progress=False).to_json(tmp_path / "ioi-aggregate.json")
    data = json.loads(path.read_text())
    # The viewer's index lists the graphs of its data directory (circuit-tracer's `add_graph_metadata`).
    (tmp_path / "graph-metadata.json").write_text(json.dumps({"graphs": [data["metadata"]]}))
    with circuit_tracer_viewer(tmp_path, "ioi-aggregate") as (page, errors):
        drawn = page.evaluate("() => d3.selectAll('text.node').data().map(d => d.node_id)")
    wanted = {n["node_id"] for n in data["nodes"]}
    assert any(n["feature_type"] == "cross layer transcoder" for n in data["nodes"])
    assert wanted <= set(drawn), wanted - set(drawn)
    assert not errors, errors
