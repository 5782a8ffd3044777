"""One owner for each run-folder name: `checkpoints`, `best`, `run.json`, `metrics.jsonl`, ... are spelled
in tinygpt/core/rundir.py alone; every other module takes them from there (`RunDir(path).checkpoints`,
`rundir.TOKENIZER_JSON`, ...), so moving a file of the run folder is a one-line change."""

from __future__ import annotations

import ast
from pathlib import Path

from tinygpt.core import rundir

PACKAGE = Path(__file__).resolve().parents[1] / "tinygpt"
OWNER = PACKAGE / "core" / "rundir.py"
# every name of a file or folder in a run folder: rundir's upper-case string constants
NAMES = {v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str)}
# A name that is also a word ("best" is a choice of `which` and a manifest's kind, "base" a key of
# finetune.json) counts only where it is used as a path: joined with `/` or written "best/...".
# A file name (with a dot) and `checkpoints` count wherever they are spelled.
ANYWHERE = {n for n in NAMES if "." in n} | {rundir.CHECKPOINTS}
# the same spelling for another format's file, not the run folder's
ELSEWHERE = {
    (module, rundir.TOKENIZER_JSON): "a Hugging Face model folder's file, named by transformers"
    for module in ("model/hf.py", "model/hf_import.py")
}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, kinds)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }


def _path_operands(tree: ast.AST) -> set[int]:
    return {
        id(side)
        for n in ast.walk(tree)
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
        for side in (n.left, n.right)
    }


def _spelled(value: str, as_path: bool) -> str | None:
    for name in NAMES:
        if (
            value == name
            and (name in ANYWHERE or as_path)
            or value.startswith(name + "/")
            or value.endswith("/" + name)
        ):
            return name
    return None


def run_folder_names_outside_rundir() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == OWNER:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip, paths = _docstrings(tree), _path_operands(tree)
        where = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in skip
            ):
                name = _spelled(node.value, id(node) in paths)
                if name is not None and (where, name) not in ELSEWHERE:
                    found.append(f"tinygpt/{where}:{node.lineno}: {node.value!r}")
    return found


def test_run_folder_names_are_spelled_only_in_rundir():
    found = run_folder_names_outside_rundir()
    assert not found, (
        "run-folder names spelled outside core/rundir.py (use its constants):\n" + "\n".join(found)
    )


def test_the_check_sees_a_spelled_name(tmp_path):
    """The scan itself: a path joined with "checkpoints" or "best" is caught; the word "best" as a value
    and the name inside a docstring are not."""
    tree = ast.parse(
        '"""a docstring naming checkpoints"""\nx = run / "best"\ny = {"kind": "best"}\n'
        'z = f"checkpoints/{s}"\n'
    )
    skip, paths = _docstrings(tree), _path_operands(tree)
    hits = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and id(n) not in skip
        and _spelled(n.value, id(n) in paths)
    ]
    assert hits == ["best", "checkpoints/"]
