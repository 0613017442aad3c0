"""The explorer end to end in a real browser: Debian's chromium driven by Playwright's Python package
(Playwright's own browser download is never used). Each view loads with no console error, one interaction
works, and a screenshot is taken and is not blank. One server and one browser for the module.

EXPLORER_SCREENSHOTS=DIR keeps the screenshots there (docs/explorer/screenshots.py regenerates the ones
docs/guide/explorer.md shows).
"""

import io
import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")


from hooked_models import circuits, patching  # noqa: E402
from hooked_models.explorer import create_app  # noqa: E402

from .conftest import CORRUPTED, PROMPT, serve_in_thread as _serve  # noqa: E402


@pytest.fixture(scope="module")
def served_app(arcee, data_dir, sae, transcoders):
    app = create_app(arcee, [data_dir], {"resid 1": sae, "tc": transcoders})
    url, server, thread = _serve(app)
    yield url, app
    app.state.explorer.queue.shutdown()
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def base_url(served_app):
    return served_app[0]


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
    # the scores before the cap: the cache's, with every future key (masked by the causal softmax) blank
    drawn = page.evaluate("document.getElementById('attention-plot').data[0].z")
    raw = cache["layers.1.self_attn.score_mod.attention_raw_scores"][0, 2]
    for q, row in enumerate(drawn):
        assert row[q + 1:] == [None] * (len(row) - q - 1)
        assert row[:q + 1] == pytest.approx(raw[q, :q + 1].tolist(), abs=1e-6)


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
    assert inputs.count() == 2 and inputs.first.get_attribute("data-id") == "0_7_11"
    assert inputs.first.inner_text().startswith('L0 F7 @ " John"')  # named by what it is, not by its id
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


def test_a_head_loading_clicked_shows_its_qk_attributions(page, data_dir, real_graph):
    """A link through a head that has a QK table in the file: clicking the head's loading lists that head's
    pattern entries, each score split into (query node, key node) pairs."""
    import json

    from hooked_models.attribution.export import json_node

    written = json.loads((data_dir / "real_graph.json").read_text())
    tables = {(e["layer"], e["head"]) for e in written["qk_attributions"]}
    ids = {n["node_id"] for n in written["nodes"]}
    chosen = None
    for e, (t, s) in enumerate(real_graph.loading_edges.tolist()):
        target, source = json_node(real_graph, t)["node_id"], json_node(real_graph, s)["node_id"]
        inputs = sorted((l for l in written["links"] if l["target"] == target), key=lambda l: -abs(l["weight"]))[:10]
        heads = [(layer, h) for layer, h in tables if bool(real_graph.loading_heads[e, layer].any())]
        if target in ids and source in ids and heads and source in [l["source"] for l in inputs]:
            chosen = target, source, heads[0]
            break
    assert chosen, "no kept link passes through a head with a QK table"
    target, source, (layer, head) = chosen
    view(page, "graph")
    page.fill("#graph-path", "real_graph.json")
    page.click("#graph-form button")
    page.wait_for_selector("#graph-svg .node")
    page.locator("#graph-threshold").fill("1")
    page.locator(f"#graph-svg .node[data-id='{target}']").dispatch_event("click")
    page.locator(f"#graph-detail table.source tr.link[data-id='{source}']").first.click()
    page.locator(f"#graph-heads tr.head[data-head='layers.{layer}.self_attn.head.{head}']").click()
    text = page.inner_text("#graph-qk")
    entry = next(e for e in written["qk_attributions"] if (e["layer"], e["head"]) == (layer, head))
    assert f"query {entry['query_pos']} → key {entry['key_pos']}" in text and "score" in text
    assert entry["pairs"][0]["query"] in text


# ------------------------------------------------------------------------- what was changed, and faults
def test_a_long_prompt_and_unknown_words_are_noticed(page, arcee):
    words = "When" + " Mary" * 80 + " Zebra"
    page.fill("#prompt-text", words)
    page.click("#prompt-form button")
    page.wait_for_selector("#notices:not([hidden])")
    notices = page.locator("#notices .notice").all_inner_texts()
    # the oracle: the tokenizer itself (BOS first), and the model's positions
    n = 1 + len(arcee.tokenizer(words, add_special_tokens=False)["input_ids"])
    assert n > arcee.cfg.max_position_embeddings == 64
    assert any(f"the prompt is {n} tokens and the model takes 64: cut after token 63, dropping {n - 64} tokens" in x
               for x in notices), notices
    assert any("' Zebra' is not in the tokenizer's vocabulary" in x for x in notices), notices
    assert page.locator("#prompt-tokens .prompt-token").count() == 64


def test_a_failed_request_clears_the_results_under_it(page, errors):
    assert page.locator("#prompt-tokens .prompt-token").count() == 16
    page.fill("#prompt-text", "   ")
    page.click("#prompt-form button")
    page.wait_for_selector("#error:not([hidden])")
    assert "the prompt is empty" in page.inner_text("#error")
    assert page.locator("#prompt-tokens .prompt-token").count() == 0
    assert page.locator("#prompt-lens .heatmaplayer").count() == 0
    expect_refused(errors, 400)


def test_alpha_er_pads_a_short_prompt_as_generate_does(alpha_er_page, alpha_er):
    page = alpha_er_page
    page.fill("#prompt-text", "When Mary")
    page.click("#prompt-form button")
    page.wait_for_selector("#notices:not([hidden])")
    assert "padded after the text to 16 with 13" in page.inner_text("#notices")
    boxes = page.locator("#prompt-tokens .prompt-token")
    assert boxes.count() == 16 and page.locator("#prompt-tokens .prompt-token.pad").count() == 13
    # the oracle: generate's greedy next token after the prompt's last real position
    following = alpha_er.generate("When Mary", max_new_tokens=1, do_sample=False, return_type="str", verbose=False)
    shown = boxes.nth(2).locator("small").first.inner_text()
    assert following.startswith("When Mary") and shown.startswith(following[len("When Mary"):])


def test_a_job_is_cancelled_from_the_page(page, served_app):
    import threading

    from hooked_models.progress import Step

    explorer = served_app[1].state.explorer
    started = threading.Event()

    def endless(model, job):  # a job of a million batches, reporting each as the library's functions do
        for done in range(10**6):
            started.set()
            job.report(Step(done, 10**6, "waiting", "batch"))
            threading.Event().wait(0.01)

    job = explorer.submit("endless", endless)["job"]
    assert started.wait(30)
    page.wait_for_selector(f"#queue .queued[data-id='{job}']")
    assert "endless" in page.inner_text("#queue")
    page.click(f"#queue .queued[data-id='{job}'] .cancel-job")
    page.wait_for_selector("#queue", state="hidden")
    assert explorer.queue.get(job).state == "cancelled"


# ----------------------------------------------------------------------------------------------- pictures
def _pixels(page, selector: str):
    from PIL import Image

    box = page.locator(selector).bounding_box()
    return Image.open(io.BytesIO(page.screenshot(clip=box))).convert("RGB"), box


def test_attention_draws_more_attention_darker_and_the_masked_keys_blank(page, arcee):
    view(page, "attention")
    page.click("#attention-form button")
    page.wait_for_selector("#head-1-3")
    page.click("#head-1-3")
    page.wait_for_function("document.querySelector('#attention-plot .gtitle').textContent.includes('layer 1 head 3')")
    page.mouse.move(2, 2)
    _, cache = arcee.run_with_cache(PROMPT)
    pattern = cache["layers.1.self_attn.attention_probabilities"][0, 3]
    image, box = _pixels(page, "#attention-plot .nsewdrag")
    n = pattern.shape[0]

    def ink(query: int, key: int) -> int:  # darkness of the cell's centre (query 0 at the top)
        x, y = (key + 0.5) * box["width"] / n, (query + 0.5) * box["height"] / n
        return 765 - sum(image.getpixel((int(x), int(y))))

    seen = [(q, k) for q in range(n) for k in range(q + 1)]
    largest = max(seen, key=lambda qk: float(pattern[qk]))
    smallest = min(seen, key=lambda qk: float(pattern[qk]))
    assert ink(*largest) == max(ink(*qk) for qk in seen) and ink(*largest) > ink(*smallest)
    assert ink(0, n - 1) == 0 and ink(3, 9) == 0  # future keys: blank (the white of the plot)
    ticks = page.locator("#attention-plot .xtick text").all_inner_texts()
    assert len(ticks) == n  # every token labelled


@pytest.mark.parametrize("size", [(1400, 900), (1024, 768)], ids=["1400x900", "1024x768"])
@pytest.mark.parametrize("graph", ["graph.json", "real_graph.json"])
def test_no_two_graph_nodes_overlap(browser, base_url, errors, graph, size):
    page = browser.new_page(viewport={"width": size[0], "height": size[1]})
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto(base_url)
    page.wait_for_selector("#prompt-lens .heatmaplayer")
    view(page, "graph")
    page.fill("#graph-path", graph)
    page.click("#graph-form button")
    page.wait_for_selector("#graph-svg .node")
    page.locator("#graph-threshold").fill("1")
    marks = page.locator("#graph-svg .node").evaluate_all(
        "nodes => nodes.map(n => { const b = n.getBBox(); return [b.x + b.width / 2, b.y + b.height / 2, b.width / 2]; })")
    assert len(marks) == int(page.locator("#graph-count").get_attribute("data-nodes"))
    for i, (x, y, r) in enumerate(marks):
        for x2, y2, r2 in marks[i + 1:]:
            assert ((x - x2) ** 2 + (y - y2) ** 2) ** 0.5 >= r + r2, "two nodes overlap"
    assert errors == []
    page.close()
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

    shutil.copy(data_dir / "real_graph.json", tmp_path / "graph.json")  # with its tensors' side file
    shutil.copy(data_dir / "real_graph.tensors.safetensors", tmp_path / "real_graph.tensors.safetensors")  # under the name the JSON records
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
