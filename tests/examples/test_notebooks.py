"""The Jupyter tutorials run top to bottom (nbclient, kernel python3, cwd at the repository root) and draw
their plots; each is committed either without outputs or executed whole, in order, without an error."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "examples" / "notebooks").glob("*.ipynb"))


def test_the_tutorials_are_all_here():
    assert [n.name[:2] for n in NOTEBOOKS] == ["01", "02", "03", "04", "06"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    clean = all(not cell.outputs and cell.execution_count is None for cell in code)
    executed = [cell.execution_count for cell in code] == list(range(1, len(code) + 1)) and not any(
        output.output_type == "error" for cell in code for output in cell.outputs)
    assert clean or executed, "commit it without outputs, or executed top to bottom in one session"
    # The kernel imports this checkout's hooked_models (not an installed copy) and draws inline.
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no plot"
