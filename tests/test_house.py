"""A thin library that stays thin (docs/ARCHITECTURE.md): short functions, modules a reader can hold,
and one file per name, so that "open shards.py" means one file. Counted on the code as `ruff format`
writes it (tests/test_architecture.py checks that it is formatted)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = sorted((ROOT / "tinygpt").rglob("*.py"))
MAX_FUNCTION = 60  # lines, decorators and docstring included
MAX_MODULE = 450


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in PACKAGE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - first + 1 > MAX_FUNCTION:
                    long.append(
                        f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - first + 1})"
                    )
    assert not long, f"functions over {MAX_FUNCTION} lines: {long}"


def test_no_module_is_longer_than_450_lines():
    big = [
        f"{p.relative_to(ROOT)} ({n})"
        for p in PACKAGE
        if (n := len(p.read_text().splitlines())) > MAX_MODULE
    ]
    assert not big, f"modules over {MAX_MODULE} lines: {big}"


def test_no_module_name_repeats_across_packages():
    names = Counter(p.name for p in PACKAGE if p.name != "__init__.py")
    assert not [n for n, k in names.items() if k > 1], [n for n, k in names.items() if k > 1]
