"""The house's layers (pyproject.toml's import-linter contract) hold, and an import against them fails.

The contract lists the layers bottom up in the README's Layout: vocabulary/config/dtypes/devices,
hooks and the TransformerLens-facing helpers, components, the model's mixins, the cache, the model,
the converters, the families, patching, the rooms above it, the command line.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_logo=True, no_cache=True))"


def lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the packages under `root` (first on the path, whatever is installed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True)


def test_the_layers_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, planted, reported", [
    # A component reaching up to a room: the components <-> transformer_lens_compat circle, generalised.
    ("hooked_models/components/norms.py", "from hooked_models import corpus", "hooked_models.corpus"),
    # A converter importing its family: the family <-> converter circle this contract broke.
    ("weight_conversion/arcee.py", "from hooked_models.families.arcee import HookedArcee", "hooked_models.families"),
    # Sideways: two rooms of one layer.
    ("hooked_models/circuits/eap.py", "import hooked_models.corpus", "hooked_models.corpus"),
])
def test_an_upward_import_breaks_the_contract(tmp_path, module, planted, reported):
    for package in ("hooked_models", "weight_conversion"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{planted}  # planted\n")

    result = lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "hooked_models layers BROKEN" in result.stdout
    assert reported in result.stdout and module.removesuffix(".py").replace("/", ".") in result.stdout


def _contract_layers() -> list[set[str]]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: import-linter's own TOML reader
        import tomli as tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (house,) = [c for c in contracts if c["name"] == "hooked_models layers"]
    return [{name.strip() for name in layer.split("|")} for layer in house["layers"]]


def test_the_readme_layout_is_the_contract():
    """README's Layout lists the contract's layers, top first, in the same order and with the same rooms."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Layout\n"):]
    section = section[:section.find("\n## ", 5) if "\n## " in section[5:] else len(section)]
    listed = []
    for line in section.splitlines():
        if line.startswith("- `"):
            rooms = line[2:].split(": ", 1)[0]
            names = {room.strip().strip("`") for room in rooms.split("|")}
            listed.append({n if n.lstrip("(").startswith("weight_conversion") else
                           (f"(hooked_models.{n[1:]}" if n.startswith("(") else f"hooked_models.{n}") for n in names})
    assert listed == _contract_layers()
