"""The two test tiers (issue 36, docs/TESTING.md): `pytest -m "not slow"` is the inner loop and still holds the
short form of each promise (exact resume, the model's logits against transformers, a notebook in smoke mode)
and a test of every part of the package; `-m slow` holds the rest, which the README's command runs too."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ANCHORS = [
    "tests/test_fast_recipe.py::test_cpu_fast_resumes_bit_for_bit",  # exact resume, in process
    "tests/test_model.py::test_logits_match_transformers_llama",  # the model against transformers' Llama
    "tests/test_notebooks.py::test_setup_notebook",  # a notebook, executed in smoke mode
    "tests/test_tiers.py::test_the_fast_tier_keeps_its_anchors_and_every_part_of_the_package",
]


def collect(*args: str) -> tuple[list[str], str]:
    """The node ids `pytest --collect-only` lists (strict markers: `slow` must be registered), and its last line."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "--strict-markers",
            "-p",
            "no:cacheprovider",
            "tests",
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    return [ln for ln in lines if "::" in ln], next(ln for ln in reversed(lines) if ln.strip())


def test_the_fast_tier_keeps_its_anchors_and_every_part_of_the_package():
    fast, summary = collect("-m", "not slow")
    for anchor in ANCHORS:
        assert any(i == anchor or i.startswith(anchor + "[") for i in fast), (
            f"{anchor} left the fast tier"
        )
    # `-m slow` selects what `-m "not slow"` leaves out: more than nothing
    deselected = re.search(r"(\d+) deselected", summary)
    assert deselected and int(deselected.group(1)) > 0, summary
    # every subpackage and top-level module of tinygpt is imported by some fast test file
    files = {i.split("::")[0] for i in fast}
    text = "\n".join((REPO / f).read_text(encoding="utf-8") for f in files)
    parts = [p.name for p in (REPO / "tinygpt").iterdir() if (p / "__init__.py").is_file()] + [
        p.stem for p in (REPO / "tinygpt").glob("*.py") if not p.name.startswith("_")
    ]
    untested = [
        p
        for p in sorted(parts)
        if not re.search(rf"tinygpt\.{p}\b|from tinygpt import [\w\s,()]*\b{p}\b", text)
    ]
    assert not untested, f"no fast test imports tinygpt.{untested}"
