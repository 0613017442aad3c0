"""The Jupyter tutorials are committed executed, with their figures, and still show what they print now.

Each runs top to bottom as examples/notebooks/run_notebooks.py runs it (a fresh python3 kernel, cwd at the
repository root): no error, no warning (nothing on stderr, so no "TqdmWarning: IProgress not found"), its
plots drawn, and the printed outputs those of the committed copy, on any CPU. The words must be the same and
the numbers are parsed and compared (`same_text`):
- an integer (a count, an id, a shape) exactly;
- any other number within float32 rounding: one unit in its last printed digit, or 1e-5 of the largest
  non-integer number the cell prints (another CPU's vector units sum in another order: measured with
  `ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2`, -8.374610 became -8.374609, a restored
  fraction -3.9335e-04 became -3.9331e-04);
- in a cell whose figures come from training in the notebook, within the relative tolerance its metadata
  states (`"tolerance": {"relative": r, "why": ...}`): training amplifies that rounding (05's SAE: L0 25.6
  here, 25.2 on an AVX-512/AMX CPU, 24.9 with the variables above).
Refresh the committed copies with `PYTHONPATH=. python examples/notebooks/run_notebooks.py`.
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
    assert [n.name[:2] for n in run_notebooks.NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12"]


def test_the_tutorials_are_titled_alike():
    # The site's Tutorials section is titled by each notebook's first heading: "# 9. ...", as "# 1. ..."
    import json

    for path in run_notebooks.NOTEBOOKS:
        first = next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
        title = "".join(first["source"]).splitlines()[0]
        assert re.fullmatch(rf"# {int(path.name[:2])}\. \S.*", title), (path.name, title)


def printed(notebook) -> list[str]:
    """Each code cell's printed text and results' plain text, in order."""
    return ["".join(o.get("text", "") if o.output_type == "stream" else o.get("data", {}).get("text/plain", "")
                    for o in cell.outputs if o.output_type != "display_data")
            for cell in notebook.cells if cell.cell_type == "code"]


def images(notebook) -> int:
    return sum("image/png" in o.get("data", {}) for c in notebook.cells if c.cell_type == "code" for o in c.outputs)


def same_text(fresh: str, committed: str, relative: float = 0.0) -> bool:
    """The same words, and numbers equal as the module docstring says: integers exactly, others within
    float32 rounding (`FLOAT32`) or, for a cell of trained figures, within `relative` of the committed one."""
    if NUMBER.sub("#", fresh) != NUMBER.sub("#", committed):
        return False
    pairs = list(zip(NUMBER.findall(fresh), NUMBER.findall(committed)))
    scale = max([abs(float(b)) for _, b in pairs if not INTEGER.fullmatch(b)], default=0.0)
    for a, b in pairs:
        if INTEGER.fullmatch(b):
            if a != b:
                return False
        elif abs(float(a) - float(b)) > max(last_digit(b), FLOAT32 * scale, relative * abs(float(b))):
            return False
    return True


INTEGER = re.compile(r"-?\d+")
FLOAT32 = 1e-5   # float32 rounding of a forward's long sums, relative to the cell's largest figure


def last_digit(number: str) -> float:
    """One unit in the last digit shown: 0.01 for "13.55", 1e-8 for "-3.9335e-04"."""
    mantissa, _, exponent = number.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def tolerance(cell) -> float:
    """The relative tolerance a cell of trained figures states in its metadata, with the reason; else 0."""
    stated = cell.metadata.get("tolerance")
    if stated is None:
        return 0.0
    assert set(stated) == {"relative", "why"} and 0 < stated["relative"] < 1 and stated["why"], stated
    return stated["relative"]


def test_same_text_compares_numbers_as_stated():
    assert same_text("L0 25.6 of 256, loss 1.062", "L0 25.6 of 256, loss 1.062")
    assert not same_text("L0 25.6 of 256", "L0 25.6 of 255")                        # an integer: exactly
    assert not same_text("features [73, 165]", "features [73, 166]", relative=0.5)  # ids too, whatever the cell
    assert same_text("clean 13.55", "clean 13.56") and not same_text("clean 13.54", "clean 13.56")
    assert same_text("-8.374609947204590 and 13.7", "-8.374610900878906 and 13.7")  # 1e-5 of 13.7
    assert same_text("-8.3746 and 13.7", "-8.3747 and 13.7")                          # one unit in the last digit
    assert not same_text("-8.3745 and 13.7", "-8.3747 and 13.7")
    assert not same_text("-8.37 and 13.7", "-8.39 and 13.7")
    assert same_text("[-3.9331e-04, 1.0004e+00]", "[-3.9335e-04, 1.0004e+00]")     # 1e-5 of 1.0004
    assert not same_text("L0 24.9 of 256", "L0 25.6 of 256")
    assert same_text("L0 24.9 of 256", "L0 25.6 of 256", relative=0.06)
    assert not same_text("L0 23.9 of 256", "L0 25.6 of 256", relative=0.06)
    assert not same_text("L0 25.6 of 256 features", "L0 25.6 of 256")                 # the words too


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
        pytest.importorskip(needs, reason=f"{path.name} needs {needs}: the sae extra, in its own environment "
                                          "(docs/guide/saes.md)")
    fresh = run_notebooks.execute(path)
    outputs = [o for cell in fresh.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    warnings = [o.text for o in outputs if o.output_type == "stream" and o.name == "stderr"]
    assert not warnings, f"{path.name} printed to stderr: {warnings}"
    assert images(fresh) == images(committed)
    for index, (now, then, cell) in enumerate(zip(printed(fresh), printed(committed), code)):
        assert same_text(now, then, tolerance(cell)), \
            f"{path.name}, cell {index + 1} prints\n{now}\nbut the committed copy shows\n{then}"
