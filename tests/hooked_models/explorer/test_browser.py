"""The explorer end to end in a real browser: Debian's chromium driven by Playwright's Python package
(Playwright's own browser download is never used). Each view loads with no console error, one interaction
works, and a screenshot is taken and is not blank. One server and one browser for the module.

EXPLORER_SCREENSHOTS=DIR keeps the screenshots there (docs/explorer/screenshots.py regenerates the README's).
"""

import io
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")

import uvicorn  # noqa: E402

from hooked_models import circuits, patching  # noqa: E402
from hooked_models.explorer import create_app  # noqa: E402

from .conftest import CORRUPTED, PROMPT  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(app):
    """The app on a free port of 127.0.0.1, in a thread: (url, server)."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread


@pytest.fixture(scope="module")
def base_url(arcee, data_dir, sae, transcoders):
    url, server, thread = _serve(create_app(arcee, [data_dir], {"resid 1": sae, "tc": transcoders}))
    yield url
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def alpha_er_url(alpha_er):
    url, server, thread = _serve(create_app(alpha_er))
    yield url
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    kept = os.environ.get("EXPLORER_SCREENSHOTS")
    return Path(kept) if kept else tmp_path_factory.mktemp("screenshots")


@pytest.fixture
def errors() -> list[str]:
    """The page's console errors and uncaught exceptions; a test that provokes a refusal removes the browser's
    report of the refused request ("Failed to load resource: ... 400") after checking it."""
    return []


def expect_refused(errors: list[str], *codes: int) -> None:
    refused = [e for e in errors if "Failed to load resource" in e]
    assert [int(e.split("status of ")[1][:3]) for e in refused] == list(codes)
    for e in refused:
        errors.remove(e)


@pytest.fixture
def page(browser, base_url, errors):
    """The explorer's page, opened; after the test, no console error and no page error may have occurred."""
    yield from _page(browser, base_url, errors)


@pytest.fixture
def alpha_er_page(browser, alpha_er_url, errors):
    yield from _page(browser, alpha_er_url, errors)


def _page(browser, url: str, errors: list[str]):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(url)
    page.wait_for_selector("#prompt-lens .heatmaplayer")
    yield page
    assert errors == []
    page.close()


def _not_blank(png: bytes, what: str, share: float, least: int) -> None:
    """At least `least` distinct colours, and no one colour (the background) over `share` of the pixels."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) >= least, f"{what} looks blank"
    background = max(colours)[0] / (image.width * image.height)
    assert background < share, f"{what} is {background:.0%} one colour"


def shoot(page, screenshots: Path, name: str, drawing: str) -> None:
    """A screenshot of the page, asserted not blank, and of its main drawing (`drawing`, a selector) too: a
    plot whose layers hide each other leaves the page busy but the drawing empty."""
    path = screenshots / f"{name}.png"
    _not_blank(page.screenshot(path=str(path)), str(path), 0.9, 50)
    _not_blank(page.locator(drawing).screenshot(), f"{drawing} in {path}", 0.985, 4)


def view(page, name: str):
    page.click(f"#tabs button[data-view={name}]")


def test_prompt_view(page, screenshots, arcee):
    tokens = page.locator("#prompt-tokens .prompt-token")
    assert tokens.count() == 16
    # the top prediction at the last position, as the model gives it
    logits = arcee(arcee.to_tokens(PROMPT))[0, -1]
    best = arcee.to_str_tokens([int(logits.argmax())])[0]
    assert tokens.nth(15).locator("small").first.inner_text().startswith(best)
    assert "logit lens" in page.inner_text("#prompt-lens")
    shoot(page, screenshots, "prompt", "#prompt-lens")


def test_attention_view(page, screenshots, arcee):
    view(page, "attention")
    page.click("#attention-form button")
    page.wait_for_selector("#head-1-3")
    assert page.locator("#attention-heads .kv-group").count() == 4  # 2 layers x 2 key/value heads
    page.click("#head-1-3")
    page.wait_for_function("document.querySelector('#attention-plot .gtitle').textContent.includes('layer 1 head 3')")
    page.hover("#attention-from .token[data-index='15']")
    _, cache = arcee.run_with_cache(PROMPT)
    pattern = cache["layers.1.self_attn.attention_probabilities"][0, 3]
    shown = [float(t) for t in page.locator("#attention-from .token").evaluate_all("s => s.map(x => x.title)")]
    assert shown == pytest.approx(pattern[15].tolist(), abs=5e-5)  # titles print 4 decimals
    shoot(page, screenshots, "attention", "#attention-plot")


def test_attention_view_on_alpha_er(alpha_er_page, alpha_er):
    page = alpha_er_page
    view(page, "attention")
    page.click("#attention-form button")
    page.wait_for_selector("#attention-experts .token")
    assert "soft-capped, 30·tanh(s/30)" in page.inner_text("#attention-note")
    _, cache = alpha_er.run_with_cache(PROMPT)
    experts = cache["layers.0.mlp.mlp_expert_index"][0].tolist()
    shown = page.locator("#attention-experts .token").evaluate_all("s => s.map(x => x.title)")
    assert shown == [f"expert {e}" for e in experts] and experts == [i // 4 for i in range(16)]
    page.select_option("#attention-kind", "raw_scores")  # the scores before the cap, of the chosen head
    page.click("#head-1-2")
    page.wait_for_function("document.querySelector('#attention-plot .gtitle').textContent.includes('before the soft cap')")
    assert page.locator("#attention-heads .kv-group").count() == 8  # no GQA: a key/value head per head


def test_patching_view(page, screenshots, arcee):
    view(page, "patching")
    page.click("#patch-form button")
    page.wait_for_selector("#patch-plot .heatmaplayer")
    # hover the cell of layer 1, position 11 (the repeated name): its value is activation_patch's
    box = page.locator("#patch-plot .nsewdrag").bounding_box()
    columns, rows = 16, 2
    page.mouse.move(box["x"] + box["width"] * (11.5 / columns), box["y"] + box["height"] * (1.5 / rows))
    page.wait_for_selector("#patch-hover[data-value]")
    hover = page.locator("#patch-hover")
    row, column = int(hover.get_attribute("data-row")), int(hover.get_attribute("data-column"))
    assert (row, column) == (1, 11)
    metric = patching.logit_diff_metric([arcee.to_single_token(" Mary")], [arcee.to_single_token(" John")])
    result = patching.activation_patch(arcee, PROMPT, CORRUPTED, metric, "layer_input", progress=False)
    assert float(hover.get_attribute("data-value")) == float(result.values[row, column])
    assert "activation_patch gives" in hover.inner_text()
    page.mouse.move(5, 5)  # the hover label off the heatmap, so the check below sees the heatmap alone
    page.wait_for_selector("#patch-plot .hoverlayer .hovertext", state="detached")
    shoot(page, screenshots, "patching", "#patch-plot")


def test_patching_bad_input_shows_a_message(page, errors):
    view(page, "patching")
    page.fill("#patch-corrupted", "When Mary and John went to the store, Mary gave a drink to")
    page.click("#patch-form button")
    page.wait_for_selector("#error:not([hidden])")
    assert "16 tokens and the corrupted one 15" in page.inner_text("#error")
    page.fill("#patch-corrupted", CORRUPTED)
    page.fill("#patch-value", "no_such_value")
    page.click("#patch-form button")
    page.wait_for_function("document.querySelector('#error').textContent.includes('no_such_value')")
    expect_refused(errors, 400, 400)


def test_circuits_view(page, screenshots, arcee):
    view(page, "circuits")
    page.select_option("#circuit-method", "eap")
    page.click("#circuit-form button")
    page.wait_for_selector("#circuit-svg .hit")
    count = page.locator("#circuit-count")
    assert count.get_attribute("data-count") == "20"
    page.locator("#circuit-k").fill("5")  # moving the slider redraws with fewer edges
    assert count.get_attribute("data-count") == "5" and page.locator("#circuit-svg .hit").count() == 5
    assert page.locator("#circuit-curve .scatterlayer .trace").count() == 1
    page.locator("#circuit-k").fill("12")
    assert count.get_attribute("data-count") == "12"
    first = page.locator("#circuit-svg .hit").first
    writer, reader = first.get_attribute("data-writer"), first.get_attribute("data-reader")
    first.dispatch_event("click")
    page.wait_for_selector("#circuit-edge[data-value]")
    metric = patching.logit_diff_metric([arcee.to_single_token(" Mary")], [arcee.to_single_token(" John")])
    exact = circuits.edge_patch(arcee, PROMPT, CORRUPTED, metric, [[(writer, reader)]])
    assert float(page.locator("#circuit-edge").get_attribute("data-value")) == float(exact[0])
    shoot(page, screenshots, "circuits", "#circuit-svg")


def test_features_view(page, screenshots, sae):
    view(page, "features")
    page.wait_for_function("document.querySelector('#feature-harvest').value.endsWith('acts')")
    page.fill("#feature-token", " Mary")
    page.click("#feature-search")
    page.wait_for_selector("#feature-found button")
    page.locator("#feature-found button").first.click()  # open the strongest feature on " Mary"
    page.wait_for_selector("#feature-board .window")
    assert page.locator("#feature-board .window").count() == 8
    assert page.locator("#feature-board .plot .bars").count() == 1
    assert "promotes" in page.inner_text("#feature-board table")
    shoot(page, screenshots, "features", "#feature-board")


def test_graph_view(page, screenshots):
    view(page, "graph")
    page.fill("#graph-path", "graph.json")
    page.click("#graph-form button")
    page.wait_for_selector("#graph-svg .node")
    count = page.locator("#graph-count")
    # threshold 0.8 (the file's): 16 embeddings, 2 logits, the 4 features (influence <= 0.8), the error node
    assert count.get_attribute("data-nodes") == "23"
    page.locator("#graph-threshold").fill("0.6")
    assert count.get_attribute("data-nodes") == "22"
    page.locator("#graph-threshold").fill("0.2")
    assert count.get_attribute("data-nodes") == "20"  # the pinned node (influence 0.5) stays
    page.locator("#graph-threshold").fill("1")
    assert count.get_attribute("data-nodes") == "23"
    page.locator("#graph-svg .node[data-id='1_3_15']").dispatch_event("click")
    page.wait_for_selector("#graph-detail table.links")
    inputs = page.locator("#graph-detail table.source tr.link")
    assert inputs.count() == 2 and inputs.first.inner_text().startswith("0_7_11")
    inputs.first.click()  # the link through attention: its per-head loadings
    assert "layers.1.self_attn.head.2" in page.inner_text("#graph-heads")
    page.click("#graph-pin")
    assert "1_3_15" in page.inner_text("#graph-pinned")
    page.click("#graph-dashboard")  # the layer-1 feature's dashboard, from the SAE on layer 1
    page.wait_for_selector("#graph-board h3")
    assert "feature 3" in page.inner_text("#graph-board h3")


def test_graph_view_on_a_graph_attribute_wrote(page, screenshots, data_dir):
    import json

    written = json.loads((data_dir / "real_graph.json").read_text())
    view(page, "graph")
    page.fill("#graph-path", "real_graph.json")
    page.click("#graph-form button")
    page.wait_for_selector("#graph-svg .node")
    page.locator("#graph-threshold").fill("1")
    assert int(page.locator("#graph-count").get_attribute("data-nodes")) == len(written["nodes"])
    # the logit node with the most inputs: its inputs are listed, one with per-head loadings shown on click
    targets = [link["target"] for link in written["links"]]
    logit = max((n for n in written["nodes"] if n["feature_type"] == "logit"), key=lambda n: targets.count(n["node_id"]))
    page.locator(f"#graph-svg .node[data-id='{logit['node_id']}']").dispatch_event("click")
    rows = page.locator("#graph-detail table.source tr.link")
    assert rows.count() == min(10, targets.count(logit["node_id"])) > 0
    feature = next(n for n in written["nodes"] if n["feature_type"] == "cross layer transcoder")
    page.locator(f"#graph-svg .node[data-id='{feature['node_id']}']").dispatch_event("click")
    page.click("#graph-dashboard")
    page.wait_for_selector("#graph-board h3")
    assert f"tc[{feature['layer']}]: feature {feature['node_id'].split('_')[1]}" in page.inner_text("#graph-board h3")
    page.locator("#graph-detail table.target tr.link").first.click()
    assert "→" in page.inner_text("#graph-heads")
    shoot(page, screenshots, "graph", "#graph-svg")


def test_graph_that_does_not_parse_is_a_message(page, errors):
    view(page, "graph")
    for path, message in (("broken.json", "does not parse as JSON"), ("../secret.txt", "outside the data")):
        page.fill("#graph-path", path)
        page.click("#graph-form button")
        page.wait_for_function(f"document.querySelector('#error').textContent.includes({message!r})")
    assert not page.locator("#error").is_hidden()
    expect_refused(errors, 400, 403)


def test_features_view_default_harvest_fits_its_sae(browser, arcee, data_dir, sae, errors, tmp_path):
    """A harvest listed first that lacks the SAE's hook is not the default: the first that holds it is."""
    import json

    (tmp_path / "a_other").mkdir()
    (tmp_path / "a_other" / "manifest.json").write_text(json.dumps({"names": ["layers.0.mlp_input"]}))
    url, server, thread = _serve(create_app(arcee, [tmp_path, data_dir], {"resid 1": sae}))
    try:
        for page in _page(browser, url, errors):
            view(page, "features")
            page.wait_for_function("document.querySelector('#feature-harvest').value !== ''")
            options = page.eval_on_selector_all("#harvests option", "os => os.map((o) => o.value)")
            assert options[0].endswith("a_other")  # listed first, yet it lacks layers.1.layer_output
            assert page.input_value("#feature-harvest").endswith("acts")
    finally:
        server.should_exit = True
        thread.join(10)


def test_graph_view_hover_shows_top_examples(browser, arcee, data_dir, transcoders, errors, tmp_path):
    """With a statistics result beside the graph, a feature node's hover text (its <title>) ends with its top
    windows, the peak token in brackets, as the library's statistics hold them."""
    import shutil

    from hooked_models import features

    shutil.copy(data_dir / "real_graph.json", tmp_path / "graph.json")
    stats = features.statistics(data_dir / "acts", transcoders, model=arcee, k=4, radius=1, progress=False)
    stats.save(tmp_path / "stats")
    url, server, thread = _serve(create_app(arcee, [tmp_path], {"tc": transcoders}))
    try:
        for page in _page(browser, url, errors):
            view(page, "graph")
            page.fill("#graph-path", str(tmp_path / "graph.json"))
            page.click("#graph-form button")
            page.wait_for_selector("#graph-svg .node")
            page.locator("#graph-threshold").fill("1")
            written = json.loads((tmp_path / "graph.json").read_text())
            node = next(n for n in written["nodes"] if "transcoder" in n["feature_type"])
            window = stats[int(node["layer"])].top_windows(int(node["node_id"].split("_")[1]))[0]
            peak = window.position - window.start
            title = page.locator(f"#graph-svg .node[data-id='{node['node_id']}'] title").first.text_content()
            assert f"\n{''.join(window.tokens[:peak])}[{window.tokens[peak]}]" in title
    finally:
        server.should_exit = True
        thread.join(10)
