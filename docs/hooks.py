"""MkDocs hooks: the notebooks join the site from examples/notebooks (kept there, not copied), the
figures markers of benchmarks/figures.py stay out of the rendered pages, and a notebook's cell prompts
("In [5]:") and copy buttons' "Copied!" stay out of the search index."""

import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "examples" / "notebooks"
MARKER = re.compile(r"<!-- /?figures(: [\w-]+)? -->")
# mkdocs-jupyter's cell furniture: the prompts and the copy button (whose hidden notice reads "Copied!")
FURNITURE = re.compile(r'<div class="((?:zeroclipboard-container|jp-InputPrompt|jp-OutputPrompt)[^"]*)"')


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files, config):
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(File(f"notebooks/{notebook.name}", src_dir=str(NOTEBOOKS.parent),
                          dest_dir=config["site_dir"], use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    # A marker on its own line would start a raw HTML block that swallows the table under it.
    return MARKER.sub("", markdown)


def on_page_content(html, page, config, files):
    # Material's search skips an element marked data-search-exclude, with all it holds; the page shows it still.
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    return FURNITURE.sub(r'<div data-search-exclude class="\1"', html)
