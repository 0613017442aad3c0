"""The explorer on a graph store (`attribution.attribute_dataset`): its aggregate (`aggregate(store).to_json`)
opens in the graph view in Debian's chromium, a node clicked shows its values over the prompts (the ones the
file carries, each prompt's row; the absent ones marked), and a prompt clicked opens that prompt's own graph."""

import json
import shutil

import pytest

pytest.importorskip("fastapi")
playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")

from hooked_models.attribution import aggregate, attribute_dataset  # noqa: E402
from hooked_models.embedded.task import make_ioi_prompts  # noqa: E402
from hooked_models.explorer import create_app  # noqa: E402
from hooked_models.transcoders import load_transcoders  # noqa: E402

from .conftest import serve_in_thread  # noqa: E402


def test_an_aggregate_opens_and_each_prompts_graph_is_a_click_away(tmp_path, arcee):
    data = tmp_path / "data"
    ioi = make_ioi_prompts(5, seed=3, tokenizer=arcee.tokenizer, templates=(0,))
    store = attribute_dataset(arcee, ioi, load_transcoders("embedded", model=arcee), data / "ioi",
                              head_loadings=False, max_feature_nodes=96, progress=False)
    path = aggregate(store, min_fraction=0.4, progress=False).to_json(data / "ioi-aggregate.json")
    written = json.loads(path.read_text())
    node = max((n for n in written["nodes"] if n["feature_type"] == "cross layer transcoder"),
               key=lambda n: (n["hooked_models_aggregate"]["n_graphs"] - n["hooked_models_aggregate"]["count"]))
    spread = node["hooked_models_aggregate"]
    present, absent = spread["per_prompt"]["graphs"], spread["absent"]
    assert present and absent  # a node with prompts of both kinds
    app = create_app(arcee, [data], {})
    url, server, thread = serve_in_thread(app)
    errors = []
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(url)
            page.click("#tabs button[data-view=graph]")
            page.fill("#graph-path", "ioi-aggregate.json")
            page.click("#graph-form button")
            page.wait_for_selector("#graph-svg .node")
            page.locator(f"#graph-svg .node[data-id='{node['node_id']}']").dispatch_event("click")
            page.wait_for_selector("#graph-spread table")
            summary = page.inner_text("#graph-spread p")
            rows = page.locator("#graph-spread tr.prompt")
            shown = [rows.nth(i).get_attribute("class") for i in range(rows.count())]
            page.locator(f"#graph-spread tr[data-graph='{present[0]}']").click()
            page.wait_for_function(f"document.querySelector('#graph-title').textContent.startsWith('{present[0]:05d}:')")
            title = page.inner_text("#graph-title")
            nodes = page.locator("#graph-svg .node").count()
            browser.close()
    finally:
        app.state.explorer.queue.shutdown()
        server.should_exit = True
        thread.join(10)
    assert summary.startswith(f"in {spread['count']} of {spread['n_graphs']} prompts")
    assert len(shown) == spread["n_graphs"]
    assert [i for i, c in enumerate(shown) if "absent" in c] == absent
    assert [i for i, c in enumerate(shown) if "reversed" in c] == spread["reversed"]
    own = json.loads(store.file(present[0]).read_text())
    assert title.startswith(f"{present[0]:05d}:") and nodes > 0 and len(own["nodes"]) > 0
    assert errors == []
