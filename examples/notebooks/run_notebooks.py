"""Execute the tutorials in place, so that they are committed with their outputs and figures.

    PYTHONPATH=. python examples/notebooks/run_notebooks.py            # every tutorial (05 only where SAELens is)
    PYTHONPATH=. python examples/notebooks/run_notebooks.py 02         # those whose name starts with 02
    PYTHONPATH=. .ci/sae-env/bin/python examples/notebooks/run_notebooks.py 05   # 05 needs the sae extra

Each runs top to bottom in a fresh python3 kernel with the repository root as its working directory and
on its path, figures drawn inline. What would differ from run to run is left out: no timings, no kernel
version details. tests/examples/test_notebooks.py runs them the same way and checks the committed
outputs are what they print now: the same words, integers exactly, other numbers within float32
rounding, and a cell's figures that come from training within the relative tolerance its metadata
states ({"tolerance": {"relative": ..., "why": ...}}, kept when the notebook is executed here).
"""

import importlib.util
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "examples" / "notebooks").glob("*.ipynb"))
# Tutorial -> the module it needs beyond the dev extra (the sae extra, in its own environment: .ci/run).
NEEDS = {"05_sparse_autoencoders": "sae_lens"}


def execute(path: Path, timeout: int = 300) -> nbformat.NotebookNode:
    """The notebook at `path`, its outputs cleared and then produced afresh (the file is not written)."""
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the kernel inherits them
    try:
        NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    notebook.metadata["language_info"] = {"name": "python"}  # not the kernel's version details
    return notebook


def main(prefixes: list[str]) -> None:
    for path in NOTEBOOKS:
        if prefixes and not any(path.name.startswith(p) for p in prefixes):
            continue
        needs = NEEDS.get(path.stem)
        if needs and importlib.util.find_spec(needs) is None:
            print(f"{path.relative_to(ROOT)}: skipped, it needs {needs} (the sae extra, in its own environment)")
            continue
        notebook = execute(path)
        nbformat.write(notebook, path)
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main(sys.argv[1:])
