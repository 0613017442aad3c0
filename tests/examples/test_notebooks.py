"""The Jupyter tutorials run top to bottom (nbclient, kernel python3, cwd at the repository root) and draw
their plots. They are committed without outputs, except those that need an optional extra (05 needs SAELens,
pip install -e ".[sae]"): those are committed executed, so their figures show without the extra, and run
where it is installed."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "examples" / "notebooks").glob("*.ipynb"))
# Tutorial -> the module it needs beyond the dev extra; these are committed executed.
NEEDS = {"05_sparse_autoencoders": "sae_lens"}


def test_the_tutorials_are_all_here():
    assert [n.name[:2] for n in NOTEBOOKS] == ["01", "02", "03", "04", "05"]


def _outputs(notebook):
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


def _check_outputs(notebook, name: str) -> None:
    outputs = _outputs(notebook)
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert images, f"{name} drew no plot"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_as_intended(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    if path.stem in NEEDS:
        assert all(cell.execution_count is not None for cell in code), "commit it executed, top to bottom"
        _check_outputs(notebook, path.name)
    else:
        assert all(not cell.outputs and cell.execution_count is None for cell in code), "commit it without outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    if path.stem in NEEDS:
        pytest.importorskip(NEEDS[path.stem], reason=f"{path.name} needs {NEEDS[path.stem]} (pip install -e '.[sae]')")
    notebook = nbformat.read(path, as_version=4)
    # The kernel imports this checkout's hooked_models (not an installed copy) and draws inline.
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    _check_outputs(notebook, path.name)
