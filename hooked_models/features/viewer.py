"""circuit-tracer's local viewer, served by the package, offline: graphs written with `to_json(...,
features=stats)` and their feature files, in circuit-tracer's own pages, with no request leaving the machine.

    from hooked_models.features.viewer import serve
    serve("out")          # prints http://127.0.0.1:8032/index.html?slug=ioi for each graph; Ctrl-C stops it

The pages are circuit-tracer 0.5.0's (`viewer_static/circuit-tracer/`, unchanged); the scripts they load from
CDNs are served from `viewer_static/vendor/` (npm's d3, dagre, pako, d3-jetpack; viewer_static/README.md
says which stands for which), the script tags rewritten as the pages are sent. As circuit-tracer's own
`serve` does, `/data/...` and `/graph_data/...` are files of the data directory (`graph-metadata.json`, the
graphs, `features/<slug>/`): read only there (paths resolved, symlinks followed), never written.
"""

import http.server
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from hooked_models.features.circuit_tracer_files import METADATA

STATIC = Path(__file__).parent / "viewer_static"
PAGES = STATIC / "circuit-tracer"
VENDOR = STATIC / "vendor"
DEFAULT_PORT = 8032  # circuit-tracer's

_LIB = "https://transformer-circuits.pub/2025/attribution-graphs/static_js/lib/"
# Each CDN script the pages load, and the local scripts that stand for it (none: dropped).
SCRIPTS = {
    _LIB + "hotserver-client-ws.js": [],
    _LIB + "d3.js": ["d3-7.9.0.min.js"],
    _LIB + "jetpack_2024-07-20.js": ["d3-collection-1.0.7.min.js", "d3-jetpack-2.1.0.js", "jetpack-shim.js"],
    _LIB + "npy_v0.js": ["npy-stub.js"],
    "https://unpkg.com/dagre@0.8.5/dist/dagre.min.js": ["dagre-0.8.5.min.js"],
    "https://unpkg.com/pako@2.1.0/dist/pako.min.js": ["pako-2.1.0.min.js"],
}
TAG = re.compile(r"<script src='(https?://[^']+)'></script>")
TYPES = {".html": "text/html; charset=utf-8", ".js": "application/javascript", ".css": "text/css",
         ".json": "application/json", ".md": "text/plain; charset=utf-8"}


def page(path: Path) -> str:
    """A viewer page with its CDN script tags pointed at the vendored copies; a CDN script not in SCRIPTS
    is a ValueError (a newer page that would reach out of the machine)."""

    def local(match: re.Match) -> str:
        url = match.group(1)
        if url not in SCRIPTS:
            raise ValueError(f"{path.name} loads {url}, which is not vendored (viewer_static/README.md)")
        return "".join(f"<script src='/vendor/{name}'></script>" for name in SCRIPTS[url])

    return TAG.sub(local, path.read_text())


def _inside(root: Path, relative: str) -> Path | None:
    """`root / relative` if it resolves inside `root` and is a file, else None."""
    target = (root / relative).resolve()
    return target if (target == root or root in target.parents) and target.is_file() else None


class _Handler(http.server.BaseHTTPRequestHandler):
    data: Path  # set on the subclass `serve` makes

    def log_message(self, format, *args):  # noqa: A002 - quiet: the URL printed at start is what matters
        pass

    def do_GET(self):
        route = self.path.split("?")[0].split("#")[0]
        if route.startswith(("/data/", "/graph_data/")):
            found = _inside(self.data, route.split("/", 2)[2])
        elif route.startswith("/vendor/"):
            found = _inside(VENDOR, route[len("/vendor/"):])
        else:
            found = _inside(PAGES, route.lstrip("/") or "index.html")
        if found is None:
            return self.send_error(404, f"{route} is not served here")
        body = page(found).encode() if found.suffix == ".html" and found.parent == PAGES else found.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", TYPES.get(found.suffix, "application/octet-stream"))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@dataclass
class Viewer:
    """A running viewer: `urls` (one per graph listed in the data directory), `stop()`."""

    server: http.server.ThreadingHTTPServer
    thread: threading.Thread | None
    base: str
    urls: list[str]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def graph_urls(data_dir: str | os.PathLike, base: str) -> list[str]:
    """The viewer's address of each graph `graph-metadata.json` lists (its `?slug=`), or the index alone."""
    listing = Path(data_dir) / METADATA
    slugs = [g["slug"] for g in json.loads(listing.read_text())["graphs"]] if listing.is_file() else []
    return [f"{base}/index.html?slug={slug}" for slug in slugs] or [f"{base}/index.html"]


def serve(data_dir: str | os.PathLike, port: int = DEFAULT_PORT, host: str = "127.0.0.1",
          block: bool = True) -> Viewer:
    """Serve circuit-tracer's viewer over `data_dir` (where `to_json(..., features=stats)` wrote graphs) on
    http://host:port (127.0.0.1: this machine only; port 0: a free one), printing each graph's address.
    `block`: serve until Ctrl-C; else in a thread, returning the `Viewer` (its `stop()` ends it)."""
    data = Path(data_dir).resolve()
    if not data.is_dir():
        raise ValueError(f"data_dir {data_dir}: no such directory")
    handler = type("Handler", (_Handler,), {"data": data})
    try:
        server = http.server.ThreadingHTTPServer((host, port), handler)
    except OSError as error:
        raise ValueError(f"port {port} on {host} cannot be bound ({error.strerror}): pick another") from None
    server.daemon_threads = True
    base = f"http://{host}:{server.server_address[1]}"
    urls = graph_urls(data, base)
    print(f"circuit-tracer's viewer on {base}, graphs of {data}:", *urls, sep="\n  ", flush=True)
    if not block:
        thread = threading.Thread(target=server.serve_forever, name="viewer", daemon=True)
        thread.start()
        return Viewer(server, thread, base, urls)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return Viewer(server, None, base, urls)
