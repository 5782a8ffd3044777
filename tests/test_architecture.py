"""The house rules that a reader relies on: imports point down the layers (import-linter's contract
in .importlinter), the code passes `ruff check` and is laid out by `ruff format`, and no tinygpt module
imports another inside a function."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_imports_point_down_the_layers():
    if shutil.which("lint-imports") is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    r = _run("lint-imports", "--no-cache")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_ruff_passes():
    r = _run(sys.executable, "-m", "ruff", "check", ".")
    if "No module named ruff" in r.stderr:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    assert r.returncode == 0, r.stdout[-3000:]


def test_ruff_format_owns_the_layout():
    """`ruff format` (ruff.toml's [format]) lays out the code; a file it would change fails here."""
    r = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    if "No module named ruff" in r.stderr:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    assert r.returncode == 0, "run `ruff format .`:\n" + r.stdout[-3000:]


# The command line imports each command's modules inside that command (issue 37: `tinygpt --help`
# loads no torch, a command only what it runs), and what a command ends with (cli_report.py) the
# sync modules, which import torch; tests/test_imports.py counts what each one loads.
IMPORTS_AS_USED = {
    "tinygpt/cli.py",
    "tinygpt/cli_report.py",
    "tinygpt/__main__.py",
}  # __main__: SIGINT first


def test_package_imports_stand_at_the_top_of_files():
    """An import of a tinygpt module inside a function hides the dependency graph from file headers."""
    hidden = []
    for path in sorted((ROOT / "tinygpt").rglob("*.py")):
        if str(path.relative_to(ROOT)) in IMPORTS_AS_USED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and (
                        inner.level or (inner.module or "").startswith("tinygpt")
                    ):
                        hidden.append(f"{path.relative_to(ROOT)}:{inner.lineno}")
                    elif isinstance(inner, ast.Import) and any(
                        a.name.startswith("tinygpt") for a in inner.names
                    ):
                        hidden.append(f"{path.relative_to(ROOT)}:{inner.lineno}")
    assert not hidden, f"imports of tinygpt inside functions: {hidden}"
