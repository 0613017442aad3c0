"""The documentation site builds, documents every public name, and reads offline.

`mkdocs build --strict` runs once for the module (into a temporary directory, never `site/`): any warning fails
it, and mkdocs.yml's `validation` makes a link to a missing page or anchor a warning, so the build is the link
check; a copy of the site's sources with a broken link and a broken anchor planted must fail it. Every public name
of `hooked_models` (the `__all__` of the package and of each subpackage, and the public names of each module the
reference documents) has an entry in the built inventory (objects.inv, written by mkdocstrings). The built site
opens from its files in Debian's chromium (Playwright, never its own browser download) with no request outside
file:// and no console error, and its search answers from file:// too.

The `docs` extra is needed (CI's main environment has it; the SAE environment skips this file).
"""

import ast
import importlib
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

for tool in ("mkdocs", "material", "mkdocstrings_handlers.python", "mkdocs_jupyter"):
    pytest.importorskip(tool, reason="the docs extra is not installed (pip install -e '.[docs]')")

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def build(config_dir: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of the mkdocs.yml in `config_dir`, this checkout's code first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=config_dir, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("docs") / "site"
    result = build(ROOT, site)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    assert "WARNING" not in result.stderr, result.stderr
    return site


def test_the_site_builds_strict(site):
    pages = {p.relative_to(site).as_posix() for p in site.rglob("*.html")}
    assert {"index.html", "which-tool.html", "guide/patching.html", "reference/hooked_models.html",
            "notebooks/02_activation_patching.html"} <= pages, sorted(pages)


def test_the_search_index_holds_no_notebook_furniture(site):
    # A notebook's prompts ("In [5]:") and its copy buttons' hidden "Copied!" are not what a search should find;
    # the pages still show them.
    import json

    index = json.loads((site / "search" / "search_index.json").read_text())["docs"]
    notebooks = [d for d in index if d["location"].startswith("notebooks/")]
    assert notebooks and any("run_with_cache" in d["text"] for d in notebooks)
    for doc in notebooks:
        assert "Copied!" not in doc["text"] and not re.search(r"(In|Out)(&nbsp;|\s)\[\d*\]:", doc["text"]), \
            (doc["location"], doc["text"][:300])
    page = (site / "notebooks" / "02_activation_patching.html").read_text()
    assert "Copied!" in page and re.search(r"In(&nbsp;|\s)\[\d+\]:", page)


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The link check can fail: the same sources with a link to a missing page and one to a missing anchor."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("examples", "hooked_models", "weight_conversion"):  # the notebooks and the code, as in ROOT
        (tmp_path / name).symlink_to(ROOT / name)
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + "\n[gone](guide/no-such-page.md) and [lost](guide/patching.md#no-such-anchor)\n")
    result = build(tmp_path, tmp_path / "site")
    assert result.returncode != 0
    assert "guide/no-such-page.md" in result.stderr and "no-such-anchor" in result.stderr, result.stderr


def documented_modules() -> list[str]:
    """The module paths the reference pages render (`::: module`)."""
    return [m for page in sorted(REFERENCE.glob("*.md"))
            for m in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), re.M)]


def defined_public_names(module: str) -> set[str]:
    """The public names a module without `__all__` defines itself (functions, classes, assignments), read
    from its source; for a package, also what its `__init__` imports from its own submodules (what it offers:
    the reference renders those only when `__all__` names them, so this test then fails)."""
    origin = Path(importlib.util.find_spec(module).origin)
    tree = ast.parse(origin.read_text())
    names = set()
    for node in tree.body:
        if origin.name == "__init__.py" and isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith(f"{module}.")):
            names.update(alias.asname or alias.name for alias in node.names)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


def foreign(module: str, name: str) -> bool:
    """A class or function another library defines, re-exported (`FactoredMatrix` is TransformerLens's): its
    documentation is that library's."""
    defined_in = getattr(getattr(importlib.import_module(module), name), "__module__", None)
    return isinstance(defined_in, str) and defined_in.split(".")[0] not in ("hooked_models", "weight_conversion")


def required_modules() -> list[str]:
    """The modules the reference must render: `hooked_models`, every subpackage, and every public module directly
    under it (`hooked_models.patching`, ...: a public import path, whether a module or, once split, a package)."""
    import hooked_models

    packages = [m.name for m in pkgutil.walk_packages(hooked_models.__path__, "hooked_models.") if m.ispkg]
    modules = [f"hooked_models.{m.name}" for m in pkgutil.iter_modules(hooked_models.__path__)
               if not m.name.startswith("_")]
    return list(dict.fromkeys(["hooked_models", *modules, *packages]))


def public_names() -> dict[str, set[str]]:
    """{module: its public names}: those the reference must render and those it renders besides, each its
    `__all__`, else what it defines; less the re-exports of other libraries' objects."""
    out = {}
    for module in dict.fromkeys([*required_modules(), *documented_modules()]):
        names = getattr(importlib.import_module(module), "__all__", None)
        names = set(names) if names is not None else defined_public_names(module)
        out[module] = {name for name in names if not foreign(module, name)}
    return out


def inventory(site: Path) -> set[str]:
    """The object names in the site's objects.inv (Sphinx's format: four header lines, then zlib)."""
    data = (site / "objects.inv").read_bytes()
    body = zlib.decompress(data.split(b"\n", 4)[4]).decode()
    return {line.split(" ", 1)[0] for line in body.splitlines()}


def test_every_public_name_is_in_the_reference(site):
    names, documented = public_names(), inventory(site)
    assert "hooked_models.HookedArcee" in documented  # the inventory is read as it is written
    undocumented = sorted(set(required_modules()) - set(documented_modules()))
    assert not undocumented, f"modules with no `::: module` in docs/reference/: {undocumented}"
    missing = sorted(f"{module}.{name}" for module, members in names.items() for name in members
                     if f"{module}.{name}" not in documented)
    assert not missing, (f"public names missing from the API reference: {missing} (a package's __init__ names what "
                         "it offers in __all__, with its imports for type checkers, as hooked_models/__init__.py does)")


# Pages opened in the browser: the front page, one of each kind (guide with images, notebook, reference).
PAGES = ["index.html", "which-tool.html", "guide/explorer.html", "notebooks/08_attribution_graphs.html",
         "reference/hooked_models.html"]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_site_reads_offline_in_a_browser(site):
    sync_api = pytest.importorskip("playwright.sync_api")
    outside, errors, inside = [], [], []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("request", lambda request: (inside if request.url.startswith(("file://", "data:", "blob:", "about:"))
                                                 else outside).append(request.url))
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            for name in PAGES:
                page.goto((site / name).as_uri(), wait_until="load")
                assert page.title(), name
                page.wait_for_timeout(200)  # scripts that start after load (search's worker) report here
            # Search from file:// (the offline plugin's inlined index and the vendored iframe-worker shim).
            page.goto((site / "index.html").as_uri(), wait_until="load")
            page.fill("input.md-search__input", "attribution")
            page.wait_for_selector(".md-search-result__item", timeout=10_000)
        finally:
            browser.close()
    assert any(url.endswith(".css") for url in inside) and any(url.endswith(".js") for url in inside), inside
    assert not outside, f"requests outside file://: {outside}"
    assert not errors, f"console errors: {errors}"
