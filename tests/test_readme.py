"""The snippets of README.md and of the documentation site's pages (docs/**/*.md) run as written.

Every ```python block of each document runs, in order, as a user who pasted it would run it: in a fresh
namespace, with a fresh temporary directory as the working directory (blocks write out/..., never into
the repository). A failure names the document and the block's line, and shows the traceback in that
document's own line numbers. A block that imports an optional tool that is not installed here is skipped with the
reason: SAELens (the `sae` extra; CI's second environment runs it) or a TransformerLens module that only
4.x ships.

Every command line a ```bash block shows for `python -m hooked_models`, `python examples/*.py` or
`python benchmarks/*.py` is handed to that program as its argv, and its own argparse parser must accept
it; the parse ends the program there, so nothing (no benchmark) runs.
"""

import argparse
import ast
import importlib
import importlib.util
import os
import re
import runpy
import shlex
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The front page and every page of the site, in a fixed order.
DOCUMENTS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
# Optional tools a block may import; anything else it imports must be installed.
OPTIONAL = {"sae_lens": "SAELens is not installed (the `sae` extra; CI's SAE environment runs this block)",
            # nnterp 1.3 pins nnsight 0.6, which no environment shares with this package's pins
            "nnsight": "nnsight runs in .ci/nn-env (test_nnterp.py runs this block there)",
            "nnterp": "nnterp runs in .ci/nn-env (test_nnterp.py runs this block there)"}
# The programs whose command lines are checked; `python -m pytest` takes pytest's own options.
UNCHECKED = ("-m pytest",)


def name(document: Path) -> str:
    return str(document.relative_to(ROOT))


def fenced_blocks(document: Path, language: str) -> list[tuple[int, str]]:
    """(the line number of the block's first line, its text) for each ```language block, in order."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(document.read_text().splitlines(), 1):
        if current is None and line.strip() == f"```{language}":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, "\n".join(current) + "\n"))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def first_line(source: str) -> str:
    return next(line for line in source.splitlines() if line.strip())


PYTHON_BLOCKS = [(name(d), start, source) for d in DOCUMENTS for start, source in fenced_blocks(d, "python")]


def missing_optional_tool(source: str) -> str | None:
    """Why the block cannot run here, if it imports an optional tool that is not installed."""
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            top = name.split(".")[0]
            if top in OPTIONAL and importlib.util.find_spec(top) is None:
                return OPTIONAL[top]
            if top == "transformer_lens" and importlib.util.find_spec(name) is None:
                import transformer_lens

                version = getattr(transformer_lens, "__version__", "?")
                return f"{name} is a TransformerLens 4.x tool; TransformerLens {version} is installed"
    return None


def test_the_documents_have_python_blocks_to_run():
    # A change to the fences, or a page moved out of docs/, must not silently test nothing.
    assert any(document == "README.md" for document, _, _ in PYTHON_BLOCKS), "README.md has no python block"
    assert len({document for document, _, _ in PYTHON_BLOCKS}) >= 10 and len(PYTHON_BLOCKS) >= 12, PYTHON_BLOCKS


@pytest.mark.parametrize("document,start,source", PYTHON_BLOCKS,
                         ids=[f"{document}:line{start}" for document, start, _ in PYTHON_BLOCKS])
def test_python_block_runs_as_written(document, start, source, tmp_path, monkeypatch):
    reason = missing_optional_tool(source)
    if reason:
        pytest.skip(reason)
    repository = set(os.listdir(ROOT))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # Padded to its place in the document, so a traceback points at the document's own lines.
    code = compile("\n" * (start - 1) + source, str(ROOT / document), "exec")
    failure = None
    try:
        exec(code, {"__name__": "__main__"})
    except Exception:
        failure = traceback.format_exc()
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")
    if failure:
        pytest.fail(f"{document} line {start}, the block that starts {first_line(source)!r}, raised:\n{failure}",
                    pytrace=False)
    assert set(os.listdir(ROOT)) == repository, "the block wrote into the repository"


def python_command_lines(document: Path) -> list[tuple[int, list[str]]]:
    """(line, argv after `python`) of every python command in the document's ```bash blocks: continued
    lines joined, comments dropped, `&&` chains split, leading VAR=value assignments dropped."""
    commands = []
    for start, block in fenced_blocks(document, "bash"):
        logical, first = "", start
        for number, line in enumerate(block.splitlines(), start):
            if not logical:
                first = number
            if line.endswith("\\"):
                logical += line[:-1] + " "
                continue
            words, logical = shlex.split(logical + line, comments=True), ""
            while words:
                argv = words[:words.index("&&")] if "&&" in words else words
                words = words[len(argv) + 1:]
                while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
                    argv = argv[1:]
                if argv and argv[0] == "python":
                    commands.append((first, argv[1:]))
    return commands


COMMANDS = [(name(document), line, argv) for document in DOCUMENTS for line, argv in python_command_lines(document)
            if not any(" ".join(argv).startswith(form) for form in UNCHECKED)]


class Parsed(Exception):
    """Raised by the patched `parse_args` once the program's parser accepted its argv."""


def test_the_documents_show_the_command_lines_checked_here():
    shown = {" ".join(argv[:2]) if argv[0] == "-m" else argv[0] for _, _, argv in COMMANDS}
    assert {"-m hooked_models", "examples/activation_patching.py", "examples/train_sae.py"} <= shown, shown
    assert any(program.startswith("benchmarks/") for program in shown), shown


@pytest.mark.parametrize("document,line,argv", COMMANDS,
                         ids=[f"{document}:line{line}-{' '.join(argv)[:60]}" for document, line, argv in COMMANDS])
def test_bash_command_line_parses(document, line, argv, tmp_path, monkeypatch, capsys):
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    command = "python " + shlex.join(argv)
    if argv[0] == "-m":
        # Only the package's command line: another module may not parse with argparse, and would run.
        assert argv[1] == "hooked_models", \
            f"{document} line {line}: {command}: teach tests/test_readme.py to check this program"
        program, args = argv[1], argv[2:]
        # What `python -m hooked_models` runs; its main() reads sys.argv (runpy would warn that the corpus
        # tests imported hooked_models.__main__ already).
        run = lambda: importlib.import_module("hooked_models.__main__").main()  # noqa: E731
    else:
        script = ROOT / argv[0]
        assert argv[0].split("/")[0] in ("examples", "benchmarks") and script.is_file(), \
            f"{document} line {line}: {command}: no such script in examples/ or benchmarks/"
        program, args = str(script), argv[1:]
        run = lambda: runpy.run_path(program, run_name="__main__")  # noqa: E731
    # Scripts edit sys.path and os.environ at import (offline flags, their folder first): restored after.
    saved_environ = dict(os.environ)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", [program, *args])
    first = [str(Path(program).parent)] if argv[0] != "-m" else []  # as `python examples/x.py` puts its folder first
    monkeypatch.setattr(sys, "path", [*first, *sys.path])
    monkeypatch.chdir(tmp_path)
    try:
        run()
    except Parsed:
        return
    except SystemExit as exit:
        pytest.fail(f"{document} line {line}: {command}: the parser refused it (exit {exit.code}):\n"
                    f"{capsys.readouterr().err}", pytrace=False)
    finally:
        for name in set(os.environ) - set(saved_environ):
            del os.environ[name]
        os.environ.update(saved_environ)
    pytest.fail(f"{document} line {line}: {command} ended without parsing its arguments with argparse",
                pytrace=False)
