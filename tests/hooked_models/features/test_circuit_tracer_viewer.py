"""Our feature files in circuit-tracer's own tools: they validate against its pydantic `Model`
(`frontend/feature_models.py`, in the side environment .ci/ct-env), and its local viewer (its `serve`, run
there) opens a graph of ours with them: in Debian's chromium through Playwright, a clicked feature node
shows our top windows and quantile examples, and our label.

The viewer loads its scripts from CDNs, which cannot be reached here. The test routes those requests to
the copies the package vendors for its own serving of the viewer (hooked_models/features/viewer_static:
npm's d3 v7, dagre and pako, and for transformer-circuits.pub's jetpack build, which has no npm package,
d3-jetpack with d3-collection and a shim); the hot-reload client (development only) is stubbed empty.
circuit-tracer's files are never edited. The last tests serve the viewer with the package alone."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from hooked_models import features

from ..explorer.conftest import PROMPT, alpha_er, arcee, data_dir, real_graph, sae, transcoders  # noqa: F401

ROOT = Path(__file__).resolve().parents[3]
CT_PYTHON = ROOT / ".ci" / "ct-env" / "bin" / "python"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_ct = pytest.mark.skipif(not CT_PYTHON.exists(), reason="no circuit-tracer side environment (.ci/ct-env.sh)")


@pytest.fixture(scope="module")
def labelled_graph(tmp_path_factory, arcee, data_dir, transcoders, real_graph):
    """A graph of PROMPT through the explorer tests' transcoders, written with their statistics over the
    explorer tests' harvest, and one user label."""
    stats = features.statistics(data_dir / "acts", transcoders, model=arcee, k=4, radius=3, progress=False)
    out = tmp_path_factory.mktemp("ct-viewer")
    node = next(n for n in json.loads(real_graph.to_json(out / "plain.json").read_text())["nodes"]
                if n["feature_type"] == "cross layer transcoder")
    layer, feature = int(node["layer"]), int(node["node_id"].split("_")[1])
    (out / "labels.csv").write_text(f"layer,feature,label\n{layer},{feature},my own label\n")
    (out / "plain.json").unlink()
    path = real_graph.to_json(out / "ioi.json", features=stats, labels=out / "labels.csv")
    return out, path, stats, (layer, feature)


@needs_ct
def test_feature_files_validate_against_circuit_tracers_model(labelled_graph):
    out, path, stats, _ = labelled_graph
    files = sorted((out / "features" / "ioi").glob("*.json"))
    graph = json.loads(path.read_text())
    wanted = {n["feature"] for n in graph["nodes"] if n["feature_type"] == "cross layer transcoder"}
    assert {int(f.stem) for f in files} == wanted and files
    check = ("import json, sys\nfrom circuit_tracer.frontend.feature_models import Model\n"
             "for f in sys.argv[1:]:\n    Model.model_validate(json.load(open(f)))\nprint(len(sys.argv) - 1)")
    done = subprocess.run([str(CT_PYTHON), "-c", check, *map(str, files)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == str(len(files)), done.stderr
    data = json.loads(files[0].read_text())
    layer_index, feature = data["transcoder_id"], data["index"]
    layer = stats[int(layer_index.removeprefix("layer_"))]
    assert data["examples_quantiles"][0]["examples"][0]["tokens"] == layer.top_windows(feature)[0].tokens
    assert data["act_max"] == float(layer.partial.act_max[feature])


def test_quantile_values_are_the_percentiles_of_the_activations(arcee, data_dir, sae):
    """`quantile_values[q - 1]` (q = 1 ... 100): the upper edge of the histogram bin holding the q-th
    percentile of the feature's positive activations (the ceil(q n / 100)-th smallest of n), from the
    harvest's activations themselves, lowest percentile first."""
    import math

    import numpy as np

    from hooked_models.features.circuit_tracer_files import feature_file

    from .test_neuronpedia import activations

    bins = 16
    stats = features.statistics(data_dir / "acts", sae, model=arcee, k=3, radius=2, bins=bins, progress=False)
    acts = activations(data_dir, sae, 1, layered=False)
    (layer,), checked = stats.layers, 0
    for f in range(layer.d_sae):
        positive = np.sort(acts[..., f][acts[..., f] > 0].double().numpy())
        data = feature_file(layer, f)
        if not len(positive):
            assert data["quantile_values"] == []
            continue
        top = 2.0 ** int(np.frexp(positive[-1])[1])  # the histogram's range [0, 2^e), max = m 2^e, m in [0.5, 1)
        expected = []
        for q in range(1, 101):
            value = positive[math.ceil(q * len(positive) / 100) - 1]
            expected.append((math.floor(value * bins / top) + 1) * top / bins)
        assert data["quantile_values"] == expected, f
        checked += len(set(expected)) > 1  # percentiles in more than one bin: an order to get wrong
    assert checked > 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


needs_viewer = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")


@contextmanager
def circuit_tracer_viewer(data_dir: Path, slug: str, query: str = ""):
    """circuit-tracer's local viewer (its `serve`, in the side environment) over `data_dir`, and a chromium
    page (Playwright) on graph `slug` (`query`: more of the address's parameters, "&key=value...") once its
    nodes are drawn: yields (page, errors), the page's uncaught errors. Its CDN scripts are routed to the
    package's vendored copies (the module docstring)."""
    playwright = pytest.importorskip("playwright.sync_api")
    from hooked_models.features.viewer import VENDOR

    port = _free_port()
    serve = ("import sys, time\nfrom circuit_tracer.frontend.local_server import serve\n"
             "serve(data_dir=sys.argv[1], port=int(sys.argv[2]))\nwhile True: time.sleep(1)")
    server = subprocess.Popen([str(CT_PYTHON), "-c", serve, str(data_dir), str(port)], stderr=subprocess.PIPE)
    # the scripts its pages load from CDNs, from the copies the package vendors (features/viewer_static)
    routes = {"d3.js": VENDOR / "d3-7.9.0.min.js", "dagre.min.js": VENDOR / "dagre-0.8.5.min.js",
              "pako.min.js": VENDOR / "pako-2.1.0.min.js", "npy_v0.js": VENDOR / "npy-stub.js"}
    jetpack = "\n".join((VENDOR / name).read_text() for name in
                         ("d3-collection-1.0.7.min.js", "d3-jetpack-2.1.0.js", "jetpack-shim.js"))
    stubs = {"jetpack_2024-07-20.js": jetpack,
             "hotserver-client-ws.js": "/* stub: the development hot-reload client */"}

    def route(r):
        name = r.request.url.split("/")[-1]
        if name in routes:
            return r.fulfill(path=str(routes[name]), content_type="application/javascript")
        if name in stubs:
            return r.fulfill(body=stubs[name], content_type="application/javascript")
        return r.abort()

    errors: list[str] = []
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route(lambda url: not url.startswith(f"http://localhost:{port}"), route)
            page.goto(f"http://localhost:{port}/index.html?slug={slug}{query}")
            page.wait_for_selector("text.node", timeout=90_000)  # the server gzips the graph first
            yield page, errors
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=10)


def click_feature(page, layer: int, feature: int) -> tuple[str, list[str]]:
    """Click feature (layer, feature)'s node in a drawn viewer page: (its example list's text, its clerps)."""
    nodes = page.evaluate("() => d3.selectAll('text.node').data().map(d => [d.feature_type, d.node_id])")
    wanted = next(i for i, (kind, node_id) in enumerate(nodes) if kind == "cross layer transcoder"
                  and node_id.startswith(f"{layer}_{feature}_"))
    page.locator("text.node").nth(wanted).click(force=True)
    page.wait_for_selector(".feature-example-list .quantile-title", timeout=30_000)
    listed = page.inner_text(".feature-example-list")
    return listed, [page.inner_text(".pp-clerp").strip()] if page.locator(".pp-clerp").count() == 1 else []


@needs_ct
@needs_viewer
def test_circuit_tracers_viewer_shows_our_examples(labelled_graph, tmp_path):
    out, path, stats, (layer, feature) = labelled_graph
    with circuit_tracer_viewer(out, "ioi") as (page, errors):
        listed, clerps = click_feature(page, layer, feature)
        page.screenshot(path=str(tmp_path / "circuit-tracer-viewer.png"))
        if shot := os.environ.get("FEATURES_SCREENSHOTS"):
            page.screenshot(path=str(Path(shot) / "circuit-tracer-viewer.png"))
    top = stats[layer].top_windows(feature)[0]
    assert "Top activations" in listed and "Subsample interval 0" in listed
    # our window's tokens, as the viewer shows them (its own whitespace rendering aside)
    assert all(token.strip() in listed for token in top.tokens if token.strip())
    assert clerps == ["my own label"]  # the user's label, as the clicked node's clerp
    assert not errors, errors


# ---------------------------------------------------------------------------------- served by the package
def test_the_viewer_pages_load_only_vendored_scripts():
    """Every script tag of circuit-tracer's pages, as `features.viewer` sends them, is local and exists."""
    import re

    from hooked_models.features import viewer

    for html in (viewer.PAGES / "index.html", viewer.PAGES / "feature-view.html"):
        assert re.findall(r"src='https?://", html.read_text())  # the pages as circuit-tracer ships them
        sent = viewer.page(html)
        sources = re.findall(r"<script src='([^']+)'", sent)
        assert sources and not [s for s in sources if "://" in s], sources
        for source in sources:
            found = (viewer.VENDOR / source.removeprefix("/vendor/")) if source.startswith("/vendor/") else \
                viewer.PAGES / source.removeprefix("./")
            assert found.is_file(), source


def test_serve_prints_each_graphs_address_and_reads_only_the_data_directory(labelled_graph, capsys):
    import urllib.error
    import urllib.request

    from hooked_models.features import viewer

    out, path, _, _ = labelled_graph
    running = viewer.serve(out, port=0, block=False)
    try:
        port = int(running.base.rsplit(":", 1)[1])
        assert running.urls == [f"http://127.0.0.1:{port}/index.html?slug=ioi"]
        printed = capsys.readouterr().out
        assert f"http://127.0.0.1:{port}/index.html?slug=ioi" in printed and str(out) in printed
        graph = json.loads(urllib.request.urlopen(f"{running.base}/graph_data/ioi.json").read())
        assert graph == json.loads(path.read_text())
        up = "../" * len(out.parts)  # from the data directory to / and no further
        for outside in (f"/data/{up}etc/passwd", f"/graph_data/{up}etc/passwd", "/vendor/../../viewer.py",
                        "/../../viewer.py", "/data/missing.json"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{running.base}{outside}")
            assert refused.value.code == 404, outside
    finally:
        running.stop()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_package_serves_circuit_tracers_viewer_offline(labelled_graph, tmp_path):
    """`features.viewer.serve` alone (no circuit-tracer, no route stubs): in chromium the viewer draws the
    graph, a clicked feature node shows our top windows and its label, and no request leaves the machine
    (each is recorded, and any to another host is aborted)."""
    playwright = pytest.importorskip("playwright.sync_api")
    from hooked_models.features import viewer

    out, path, stats, (layer, feature) = labelled_graph
    running = viewer.serve(out, port=0, block=False)
    local, outside, errors = f"{running.base}/", [], []

    def record(route):
        outside.append(route.request.url)
        return route.abort()

    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route(lambda url: not url.startswith(local), record)
            page.goto(running.urls[0])
            page.wait_for_selector("text.node", timeout=90_000)
            nodes = page.evaluate("() => d3.selectAll('text.node').data().map(d => [d.feature_type, d.node_id])")
            listed, clerps = click_feature(page, layer, feature)
            page.screenshot(path=str(tmp_path / "served-viewer.png"))
            browser.close()
    finally:
        running.stop()
    assert outside == [] and errors == []
    graph = json.loads(path.read_text())
    assert {node_id for _, node_id in nodes} == {n["node_id"] for n in graph["nodes"]}  # the whole graph drawn
    top = stats[layer].top_windows(feature)[0]
    assert "Top activations" in listed and all(t.strip() in listed for t in top.tokens if t.strip())
    assert clerps == ["my own label"]
