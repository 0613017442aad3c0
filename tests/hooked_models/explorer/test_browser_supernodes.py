"""Supernodes in the explorer's graph view, in Debian's chromium driven by Playwright (as test_browser.py):
three nodes grouped under a name are drawn as one part with the library's part edges, saved into the graph
file and still there after a reload; the interventions run as a job whose figure and table are the job's
rows; while they run a prompt view answers, and a cancel leaves the model as it was."""

import json
import shutil
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("playwright.sync_api")

from hooked_models.attribution import AttributionGraph, Subgraph  # noqa: E402
from hooked_models.explorer import create_app  # noqa: E402
from hooked_models.explorer import jobs  # noqa: E402

from .conftest import PROMPT, serve_in_thread  # noqa: E402
from .test_browser import CHROMIUM, _page, browser, errors, view  # noqa: E402, F401
from .test_jobs import hooks_left  # noqa: E402

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")

NAME = "Mary's name"


@pytest.fixture
def served(tmp_path, data_dir, arcee, transcoders):
    """The explorer over a folder of its own (saves write there) holding the graph `attribute` wrote."""
    for name in ("real_graph.json", "real_graph.tensors.safetensors"):
        shutil.copy(data_dir / name, tmp_path / name)
    app = create_app(arcee, [tmp_path], {"tc": transcoders})
    url, server, thread = serve_in_thread(app)
    yield url, app.state.explorer, tmp_path
    app.state.explorer.queue.shutdown()
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def page(browser, served, errors):  # noqa: F811 - the browser fixture imported above
    yield from _page(browser, served[0], errors)


def three_nodes(folder) -> list[str]:
    """Two features and an error node the file keeps (drawn in the view), at one position."""
    nodes = json.loads((folder / "real_graph.json").read_text())["nodes"]
    kept = [n for n in nodes if n["feature_type"] in ("cross layer transcoder", "mlp reconstruction error")]
    position = max({n["ctx_idx"] for n in kept}, key=lambda p: sum(n["ctx_idx"] == p for n in kept))
    chosen = [n["node_id"] for n in kept if n["ctx_idx"] == position][:3]
    assert len(chosen) == 3, kept
    return chosen


def open_graph(page):
    view(page, "graph")
    page.fill("#graph-path", "real_graph.json")
    page.click("#graph-form button")
    page.wait_for_selector("#subgraph:not([hidden])")
    page.locator("#graph-threshold").fill("1")


def group(page, ids: list[str], name: str = NAME):
    for node in ids:  # shift-click: each joins the selection
        page.locator(f"#graph-svg .node[data-id='{node}']").dispatch_event("click", {"shiftKey": True})
    assert page.locator("#group-selection").get_attribute("data-count") == str(len(ids))
    page.fill("#group-name", name)
    page.click("#group-button")
    page.wait_for_selector(f"#supernode-list li[data-name=\"{name}\"]")


def test_three_nodes_grouped_are_saved_and_still_there_after_a_reload(page, served):
    url, explorer, folder = served
    ids = three_nodes(folder)
    open_graph(page)
    nodes = json.loads((folder / "real_graph.json").read_text())["nodes"]
    pins = [n["node_id"] for n in nodes if n["feature_type"] == "logit" or n["node_id"].startswith("1_")][:2]
    for node in pins:  # pinned in the view: parts of their own
        page.locator(f"#graph-svg .node[data-id='{node}']").dispatch_event("click")
        page.click("#graph-pin")
    group(page, ids)
    # the part graph: the supernode and each pinned node on its own, every edge the library's sum
    graph = AttributionGraph.from_json(folder / "real_graph.json")
    sub = Subgraph(graph, {NAME: ids}, pins)
    drawn = page.locator("#subgraph-svg .part").evaluate_all("gs => gs.map(g => g.dataset.name)")
    assert drawn == [p.name for p in sub.parts]
    edges = sub.edges()
    lines = page.locator("#subgraph-svg .part-edge").evaluate_all(
        "ls => ls.map(l => [l.dataset.source, l.dataset.target, +l.dataset.weight])")
    names = [p.name for p in sub.parts]
    expected = sorted([names[s], names[t], float(edges[t, s])] for t in range(len(names)) for s in range(len(names))
                      if t != s and float(edges[t, s]) != 0)
    assert sorted(lines) == expected and expected
    assert all("grouped" in page.get_attribute(f"#graph-svg .node[data-id='{i}']", "class") for i in ids)

    page.click("#subgraph-save")
    page.wait_for_function("document.querySelector('#subgraph-save').textContent === 'saved in the graph file'")
    assert json.loads((folder / "real_graph.json").read_text())["qParams"]["supernodes"] == [[NAME, *ids]]

    page.reload()  # the address keeps the graph file: it opens again, with its supernode
    page.wait_for_selector(f"#supernode-list li[data-name=\"{NAME}\"]")
    # the part graph comes from its own request after the list: waited for, not raced (a loaded machine)
    page.wait_for_selector(f"#subgraph-svg .part[data-name=\"{NAME}\"]")
    page.wait_for_function(f"document.querySelectorAll('#graph-svg .node.grouped').length >= {len(ids)}")
    assert page.locator("#supernode-list li").count() == 1
    assert page.locator(f"#subgraph-svg .part[data-name=\"{NAME}\"]").count() == 1
    assert all("grouped" in page.get_attribute(f"#graph-svg .node[data-id='{i}']", "class") for i in ids)


def test_interventions_drawn_as_the_job_answered(page, served):
    url, explorer, folder = served
    open_graph(page)
    group(page, three_nodes(folder))
    page.fill("#intervention-scales", "0 2")
    page.click("#intervention-form button")
    page.wait_for_selector("#intervention-table .intervention-row")
    job = next(j for j in explorer.queue.jobs.values() if j.kind == "interventions")
    rows = [r for r in job.result["rows"] if r["mode"] == "frozen"]
    assert page.locator("#intervention-table .intervention-row").count() == len(rows) > 0
    shown = page.locator("#intervention-table .intervention-row td:nth-child(3)").all_inner_texts()
    assert shown == [r["outcome"] for r in rows]
    plots = page.locator("#intervention-plots .plot.intervention")
    assert plots.count() == len({r["intervened"] for r in rows})
    data = plots.first.evaluate("p => p.data.map(t => [t.name, t.y])")
    first = [r for r in rows if r["intervened"] == rows[0]["intervened"] and r["scale"] == 0.0]
    assert data[0] == ["×0 measured", [r["measured"] for r in first]]
    assert data[1] == ["×0 predicted", [r["predicted"] for r in first]]
    page.select_option("#intervention-mode", "free")
    assert "recomputed" in page.inner_text("#intervention-note")


def test_a_prompt_view_answers_while_they_run_and_a_cancel_leaves_the_model_as_it_was(page, served, arcee,
                                                                                      monkeypatch):
    url, explorer, folder = served
    tokens = arcee.to_tokens(PROMPT)
    with torch.no_grad():
        logits_before = arcee(tokens)
    weights_before = {name: tensor.clone() for name, tensor in arcee.state_dict().items()}
    report = jobs.Job.report

    def slow(self, step):  # each batch as slow as a big model's, so that the job is still running below
        time.sleep(0.4)
        return report(self, step)

    monkeypatch.setattr(jobs.Job, "report", slow)
    open_graph(page)
    group(page, three_nodes(folder))
    page.fill("#intervention-scales", "-1 0 0.5 2 3")
    page.fill("#intervention-batch", "1")
    page.click("#intervention-form button")
    page.wait_for_selector("#intervention-progress:not([hidden])")
    job = next(j for j in explorer.queue.jobs.values() if j.kind == "interventions")
    for _ in range(200):
        if job.done:
            break
        time.sleep(0.05)
    assert job.state == "running" and 0 < job.done < job.total == 10

    view(page, "prompt")  # the view answers while the job runs
    page.fill("#prompt-text", "When John and Mary went to the store")
    page.click("#prompt-form button")
    page.wait_for_function("document.querySelectorAll('#prompt-tokens .prompt-token').length === 9")
    assert job.state == "running" and job.done < job.total

    view(page, "graph")
    page.click("#intervention-progress-cancel")
    page.wait_for_function("document.querySelector('#error').textContent.includes('interventions cancelled')")
    assert job.state == "cancelled" and job.done < job.total
    assert hooks_left(arcee) == 0 and hooks_left(explorer.queue.model) == 0
    after = arcee.state_dict()
    assert all(torch.equal(weights_before[name], after[name]) for name in weights_before)
    with torch.no_grad():
        assert torch.equal(arcee(tokens), logits_before)
        assert torch.equal(explorer.queue.model(tokens), logits_before)
