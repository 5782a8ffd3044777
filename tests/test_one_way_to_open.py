"""Every file in a run folder is opened one way (issue 32, item 2): through tinygpt.core.files (`read_*_safe`,
`append_text`, `write_*_atomic`, `atomic_output`, `open_nofollow`), which never follows a link nor writes through a
hard link, and bounds what it reads. This scan of the package fails on any other way to open a file (`open(`,
`Path.read_text/read_bytes/write_text/write_bytes`, `os.open` without O_NOFOLLOW) unless its line says why the file
is not a run file (a comment "outside run folders: ..."): /proc, the package's own data, the standard library,
a data file the user named, a temporary folder the same process made."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tinygpt"
MARK = "outside run folders"
# the one way itself, and the programs that run inside the code sandbox (its own tmpfs, no run folder in sight)
EXEMPT = {"core/files.py", *(f"evals/sandbox_{m}.py" for m in ("init", "child", "jail", "seccomp"))}
METHODS = {"read_text", "read_bytes", "write_text", "write_bytes"}


def segment(source: str, node: ast.AST) -> str:
    """The call's text, asked only of calls that open a file (it splits the whole source each time: asked of every
    call, the scan took 10 CPU-seconds)."""
    return ast.get_source_segment(source, node) or ""


def opens(tree: ast.AST, source: str) -> list[tuple[int, str]]:
    """(line, call) of each way to open a file that is not tinygpt.core.files'."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "open":
            if (
                node.args
                and isinstance(node.args[0], ast.Call)
                and getattr(node.args[0].func, "id", "") == "open_nofollow"
            ):
                continue  # open() on a descriptor the one way opened
            out.append((node.lineno, segment(source, node)))
        elif isinstance(f, ast.Attribute) and f.attr in METHODS:
            out.append((node.lineno, segment(source, node)))
        elif (
            isinstance(f, ast.Attribute)
            and f.attr == "open"
            and getattr(f.value, "id", "") == "os"
            and "O_NOFOLLOW" not in (text := segment(source, node))
        ):
            out.append((node.lineno, text))
    return out


def marked(lines: list[str], lineno: int) -> bool:
    """The call's line, or the comment line just above it, says why it is not a run file."""
    here = lines[lineno - 1]
    above = lines[lineno - 2].strip() if lineno > 1 else ""
    return MARK in here or (above.startswith("#") and MARK in above)


def test_no_file_is_opened_but_the_one_way_or_with_a_reason():
    found, checked = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in EXEMPT:
            continue
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for lineno, call in opens(ast.parse(source), source):
            checked += 1
            if not marked(lines, lineno):
                found.append(f"tinygpt/{rel}:{lineno}: {call.splitlines()[0][:100]}")
    assert checked > 10  # the scan sees the package's opens (it is not looking at nothing)
    assert not found, (
        "opened another way than tinygpt.core.files, with no 'outside run folders: why' on its line "
        "(use read_*_safe, append_text or write_*_atomic for a run folder's files):\n  "
        + "\n  ".join(found)
    )


def test_the_scan_catches_a_plain_open():
    """The scan itself can fail: a plain open of a run file, as evals.jsonl was appended before."""
    source = (
        'def record(run):\n    with open(run / "evals.jsonl", "a") as f:\n        f.write("x")\n'
    )
    assert [n for n, _ in opens(ast.parse(source), source)] == [2]
    assert not marked(source.splitlines(), 2)
    source = (
        "p.read_text()  # outside run folders: /proc\nos.open(p, os.O_RDONLY | os.O_NOFOLLOW)\n"
    )
    assert [n for n, _ in opens(ast.parse(source), source)] == [1]
    assert marked(source.splitlines(), 1)
