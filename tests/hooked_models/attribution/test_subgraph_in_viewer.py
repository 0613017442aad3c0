"""Our subgraph in circuit-tracer's own viewer (its local server and scripts, in the side environment
.ci/ct-env, driven in Debian's chromium by tests/hooked_models/features/test_circuit_tracer_viewer.py's helper):
the IOI graph of the embedded Arcee with our supernodes saved into its file draws them in the viewer's
subgraph panel, each with its members; the viewer's own Save writes them back in a form `Subgraph.load` reads.

circuit-tracer 0.5.0's viewer takes the pinned nodes from the file's qParams but its supernodes only from its
address (init-cg.js sets them to the `supernodes` URL parameter, [] when there is none, over the file's), so the
page is opened at the link the viewer itself writes (`supernodesToUrl`): the qParams' supernodes as JSON."""

import json
from urllib.parse import quote

import pytest

from hooked_models import HookedArcee
from hooked_models.attribution import Subgraph, attribute
from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.transcoders import load_transcoders

from ..features.test_circuit_tracer_viewer import circuit_tracer_viewer, needs_ct, needs_viewer


@pytest.fixture(scope="module")
def ioi(tmp_path_factory):
    """The embedded Arcee's IOI graph, pruned into a file, and a subgraph of nodes the file keeps: the IO's name
    (layer 0 at its position), say the IO (layer 1 at the last position), the logit pinned on its own."""
    model = HookedArcee.from_pretrained("embedded")
    prompts = make_ioi_prompts(1, seed=1, tokenizer=model.tokenizer)
    tokens, io = prompts.clean_tokens[0], int(prompts.correct[0])
    graph = attribute(model, tokens, load_transcoders("embedded", model=model))
    out = tmp_path_factory.mktemp("viewer-subgraph")
    path = graph.prune().to_json(out / "ioi.json", slug="ioi")
    data = json.loads(path.read_text())
    nodes = data["nodes"]
    # the viewer's index of its graphs, as circuit-tracer's `add_graph_metadata` writes it
    (out / "graph-metadata.json").write_text(json.dumps({"graphs": [data["metadata"]]}))
    io_pos, last = int((tokens == io).nonzero()[0]), len(tokens) - 1
    kept = [n for n in nodes if n["feature_type"] == "cross layer transcoder"]
    name = [n["node_id"] for n in kept if n["layer"] == "0" and n["ctx_idx"] == io_pos][:2]
    say = [n["node_id"] for n in kept if n["layer"] == "1" and n["ctx_idx"] == last][:3]
    logit = next(n["node_id"] for n in nodes if n["feature_type"] == "logit")
    assert len(name) == 2 and len(say) == 3
    sub = Subgraph(graph, {"the IO's name": name, "say the IO": say}, pinned=[logit])
    sub.save(path)
    return out, path, graph, sub


@needs_ct
@needs_viewer
def test_circuit_tracers_viewer_draws_our_supernodes_and_saves_them_back(ioi):
    out, path, graph, sub = ioi
    qparams = json.loads(path.read_text())["qParams"]
    # pruningThreshold=1, the viewer's slider at its end: it draws no node whose influence is over the threshold,
    # pinned or not (util-cg.js's formatData reads d.nodeId for the pinned exception before it sets it)
    query = f"&pruningThreshold=1&supernodes={quote(json.dumps(qparams['supernodes']))}"
    with circuit_tracer_viewer(out, "ioi", query) as (page, errors):
        page.wait_for_selector(".subgraph .supernode-container", timeout=30_000)
        drawn = page.evaluate("""() => d3.selectAll('.subgraph .supernode-container').data().map(d =>
            [d.node.ppClerp, !!d.node.isSuperNode, d.node.memberNodes.map(m => m.nodeId)])""")
        texts = page.locator(".subgraph .supernode-container .node-text-container span").all_inner_texts()
        circles = page.locator(".subgraph .supernode-container").evaluate_all(
            "cs => cs.map(c => c.querySelectorAll('.member-circle').length)")
        page.click("button.save-button")  # the viewer's own Save: its /save_graph writes qParams into the file
        page.wait_for_function("document.querySelector('button.save-button').textContent === 'Saved!'")
    supernodes = {(d[0], tuple(d[2])) for d in drawn if d[1]}
    assert supernodes == {(g.name, g.members) for g in sub.supernodes}  # each with its members, as ours
    singles = [d[2] for d in drawn if not d[1]]
    assert singles == [[sub.pinned[0]]]  # the pinned logit, on its own
    assert {"the IO's name", "say the IO"} <= set(texts)
    assert sorted(circles) == sorted([len(g.members) for g in sub.supernodes] + [1])
    assert not errors, errors
    # what the viewer wrote (its URL's parameters: supernodes a JSON string, pinnedIds null: the page never
    # changed them) reads back here as the same supernodes
    saved = json.loads(path.read_text())["qParams"]
    assert isinstance(saved["supernodes"], str)
    back = Subgraph.load(path, graph)
    assert [(g.name, g.members) for g in back.supernodes] == [(g.name, g.members) for g in sub.supernodes]
