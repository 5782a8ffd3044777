"""A real instruction data set every machine has: the Python standard library's functions, each with
its docstring as the instruction and its source as the response (Alpaca format).

It is what the notebooks' smoke mode and the tests finetune on when the larger offline sets (Code
Alpaca, MBPP) are not at hand. Deterministic: the same Python gives the same records, in order."""

from __future__ import annotations

import ast
import io
import json
import textwrap
from pathlib import Path

from tinygpt.core.files import write_text_atomic
from tinygpt.data.sources import builtin_files

# short functions (like Code Alpaca's answers): a small model can learn to write them
MAX_SOURCE_CHARS = 220
MAX_INSTRUCTION_CHARS = 110


def stdlib_instructions(limit: int = 2_000) -> list[dict[str, str]]:
    """Up to `limit` records {"instruction", "input", "output"}: a public stdlib function's (or
    method's) docstring (first paragraph) asks for it, its source (docstring removed) answers."""
    records: list[dict[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for path in builtin_files():
        try:
            # outside run folders: the standard library's sources
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
            # split once per file, as ast does
            file_lines = io.StringIO(source, newline="").readlines()
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        # module-level functions and the methods of module-level classes
        nodes = [
            n
            for top in tree.body
            for n in ([top] if not isinstance(top, ast.ClassDef) else top.body)
        ]
        for node in nodes:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 20:
                continue
            body = node.body[1:]  # without the docstring
            if not body:
                continue
            # a method: its body keeps the class's indentation, its first line not
            code = textwrap.dedent(" " * node.col_offset + _segment(file_lines, node))
            if len(code) > MAX_SOURCE_CHARS:
                continue
            docstring_node = node.body[0]
            lines = code.splitlines(keepends=True)
            start = docstring_node.lineno - node.lineno
            end = docstring_node.end_lineno - node.lineno + 1
            output = "".join(lines[:start] + lines[end:])
            instruction = doc.split("\n\n")[0].replace("\n", " ").strip().split(". ")[0].rstrip(".")
            if len(instruction) > MAX_INSTRUCTION_CHARS or len(output.strip()) < 20:
                continue
            record = {
                "instruction": f"Write a Python function `{node.name}`: {instruction}",
                "input": "",
                "output": output,
            }
            # the same helper defined in several modules
            if (record["instruction"], output) in seen:
                continue
            seen.add((record["instruction"], output))
            records.append(record)
            if len(records) >= limit:
                return records
    return records


def _segment(lines: list[str], node: ast.stmt) -> str:
    """`ast.get_source_segment(source, node)` from the file's lines split once: that function splits
    the whole file again for every node (most of the time this data set took)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return "".join([head, *lines[first + 1 : last], tail])


def write_stdlib_instructions(path: str | Path, limit: int = 2_000) -> Path:
    """The data set as an Alpaca-format JSON file (what `tinygpt finetune --data` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(stdlib_instructions(limit), indent=1))
    return path
