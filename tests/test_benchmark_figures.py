"""Every benchmark figure the READMEs and the site's pages quote comes from the results file its benchmark wrote
(benchmarks/results/<name>.json): each generated part of README.md, benchmarks/README.md and every
docs/**/*.md page holding one equals what benchmarks/figures.py renders from those files, every part is shown
and every file is read, and a changed result changes every place that quotes it (so a summary row cannot drift
from its table)."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import figures  # noqa: E402


@pytest.mark.parametrize("document", figures.DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_generated_part_is_what_its_results_render_to(document):
    text = document.read_text()
    for match in figures.PART.finditer(text):
        rendered = figures.render(match.group(0))
        assert rendered == match.group(0), (
            f"{document.relative_to(ROOT)}: the part {match['name']!r} differs from its results; "
            f"run python benchmarks/figures.py\n--- shown\n{match['body']}\n--- rendered\n{rendered}")


def test_every_part_is_shown_and_every_results_file_is_read(monkeypatch):
    shown = [m["name"] for document in figures.DOCUMENTS for m in figures.PART.finditer(document.read_text())]
    assert sorted(set(shown)) == sorted(figures.PARTS)
    read = set()
    load = figures.load
    monkeypatch.setattr(figures, "load", lambda name: read.add(name) or load(name))
    for part in figures.PARTS.values():
        part()
    assert read == {path.stem for path in figures.RESULTS.glob("*.json")}


@pytest.mark.parametrize("path", sorted(figures.RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_each_results_file_says_how_and_when_it_was_measured(path):
    record = json.loads(path.read_text())
    assert record["benchmark"] == path.stem
    assert record["command"].startswith("python benchmarks/") and record["figures"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2} UTC)?", record["date"])
    if record.get("published"):  # figures kept from an earlier run: the file says so, and why
        assert "Not rerun" in record["published"] and record["date"] in figures.when(record)
    else:
        loads = [record["machine"][k] for k in ("load_average_before", "load_average_after")]
        assert all(len(x) == 3 for x in loads) and record["machine"]["torch_threads"] >= 1
        assert record["versions"]["torch"].startswith("2.")


def test_a_changed_result_changes_the_summary_and_its_table(tmp_path, monkeypatch):
    """Move one median in a copy of the results: the summary row, the detailed table and the circuits page's
    sentence all follow (they are one number rendered three times)."""
    shutil.copytree(figures.RESULTS, tmp_path / "results")
    path = tmp_path / "results" / "circuits.json"
    record = json.loads(path.read_text())
    model = record["figures"]["models"][figures.CIRCUIT_MODELS["mha"]]
    model["circuits edge_patch, every edge"]["cpu_s"] *= 3
    path.write_text(json.dumps(record))
    before = {name: figures.PARTS[name]() for name in ("summary", "circuits", "circuits-sentence")}
    monkeypatch.setattr(figures, "RESULTS", tmp_path / "results")
    after = {name: figures.PARTS[name]() for name in before}
    exact = model["circuits edge_patch, every edge"]["cpu_s"] / next(
        v["cpu_s"] for k, v in model.items() if k.startswith("circuits EAP-IG"))
    for name in before:
        assert after[name] != before[name], name
    assert f"{exact:.1f}x" in after["summary"] and f"({exact:.1f})" in after["circuits"]
    assert f"1/{exact:.0f} (a 4-layer" in after["circuits-sentence"]


@pytest.mark.parametrize("name", sorted(figures.IMAGES))
def test_every_image_is_drawn_from_its_results(name):
    """An image drawn from results carries the numbers it plots (PNG text): they are the results' now."""
    path, data, _ = figures.IMAGES[name]
    assert figures.drawn_from(path) == data(), (
        f"{path.relative_to(ROOT)} was drawn from other numbers than its results': run python benchmarks/figures.py")
