"""The Jupyter tutorials are committed executed, with their figures, and still show what they print now.

Each runs top to bottom as examples/notebooks/run_notebooks.py runs it (a fresh python3 kernel, cwd at the
repository root): no error, no warning (nothing on stderr, so no "TqdmWarning: IProgress not found"), its
plots drawn, and the printed outputs those of the committed copy (numbers within 2e-3: thread counts can
move the last digits). Refresh the committed copies with `PYTHONPATH=. python examples/notebooks/run_notebooks.py`.
"""

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "examples" / "notebooks" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def test_the_tutorials_are_all_here():
    assert [n.name[:2] for n in run_notebooks.NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07", "08"]


def printed(notebook) -> list[str]:
    """Each code cell's printed text and results' plain text, in order."""
    return ["".join(o.get("text", "") if o.output_type == "stream" else o.get("data", {}).get("text/plain", "")
                    for o in cell.outputs if o.output_type != "display_data")
            for cell in notebook.cells if cell.cell_type == "code"]


def images(notebook) -> int:
    return sum("image/png" in o.get("data", {}) for c in notebook.cells if c.cell_type == "code" for o in c.outputs)


def same_text(fresh: str, committed: str) -> bool:
    """The same words; numbers equal within 2e-3 (absolute or relative)."""
    if NUMBER.sub("#", fresh) != NUMBER.sub("#", committed):
        return False
    return all(abs(float(a) - float(b)) <= 2e-3 * max(1.0, abs(float(b)))
               for a, b in zip(NUMBER.findall(fresh), NUMBER.findall(committed)))


@pytest.mark.parametrize("path", run_notebooks.NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_as_committed(path):
    committed = nbformat.read(path, as_version=4)
    code = [cell for cell in committed.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "commit it executed, in order"
    assert images(committed), "commit it with its outputs and figures"
    assert committed.metadata.get("language_info") == {"name": "python"}
    assert not [cell for cell in code if "execution" in cell.metadata], "no timings in the committed copy"

    needs = run_notebooks.NEEDS.get(path.stem)
    if needs:  # 05 needs SAELens: it runs in the environment with the sae extra (CI's second)
        pytest.importorskip(needs, reason=f"{path.name} needs {needs} (pip install -e '.[sae]')")
    fresh = run_notebooks.execute(path)
    outputs = [o for cell in fresh.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    warnings = [o.text for o in outputs if o.output_type == "stream" and o.name == "stderr"]
    assert not warnings, f"{path.name} printed to stderr: {warnings}"
    assert images(fresh) == images(committed)
    for index, (now, then) in enumerate(zip(printed(fresh), printed(committed))):
        assert same_text(now, then), f"{path.name}, cell {index + 1} prints\n{now}\nbut the committed copy shows\n{then}"
