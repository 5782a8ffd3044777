"""The docs as a reference: README's recipe table agrees with `tinygpt recipes` (the code), docs/ states what
is true now (no commit hashes, no diary of what was tried), docs/BENCHMARKS.md stays an index of at most
300 lines, and every link between the docs, and every "BENCHMARKS.md section N", points at something that is
there."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tinygpt.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
SCALE = {"k": 1e3, "M": 1e6, "B": 1e9}


def _count(text: str) -> float:
    """'0.6M', '15k', '1.3B', '2,048' as a number."""
    m = re.fullmatch(r"([\d.,]+)([kMB]?)", text.strip())
    assert m, f"not a count: {text!r}"
    return float(m.group(1).replace(",", "")) * SCALE.get(m.group(2), 1)


def _near(shown: float, actual: float) -> bool:
    """A rounded figure: within 5%, or within half of its last decimal (0.2M for 172k parameters)."""
    return abs(shown - actual) <= max(0.05 * actual, 0.05e6 if actual < 1e6 else 0)


def readme_recipe_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Recipes") :]
    section = section[: section.index("\n## ", 1)]
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| `")
    ]


def test_the_readmes_recipe_table_is_what_tinygpt_recipes_prints(capsys):
    assert main(["recipes", "--json"]) == 0
    recipes = json.loads(capsys.readouterr().out)
    rows = readme_recipe_rows()
    assert [r[0].split("`")[1] for r in rows] == [r["name"] for r in recipes], (
        "README's recipe table: one row each"
    )
    for row, r in zip(rows, recipes):
        _, hardware, params, context, per_step, budget, precision, data = row
        assert r["hardware"] in hardware.lower(), (r["name"], hardware)
        assert _near(_count(params.split()[0].rstrip(",")), r["params"]), (
            r["name"],
            params,
            r["params"],
        )
        assert int(context) == r["context"] and _count(per_step) == r["tokens_per_step"], (
            r["name"],
            row,
        )
        assert _near(_count(budget), r["token_budget"]), (r["name"], budget, r["token_budget"])
        assert precision.split()[0] == r["precision"], (r["name"], precision)
        source = r["data"].removeprefix("hf:").split("/")[-1].replace(":", " ").lower()
        assert (data == "built-in corpus") if r["data"] == "builtin" else data.lower() == source, (
            r["name"],
            data,
        )


# A commit's abbreviated or full hash: 7 to 40 hex digits with at least one digit and one letter (no word,
# no plain number), as `git log --oneline` and "at ee92b4d" spell them.
COMMIT = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/-])")
# a diary of what was tried: the doc says what is true now, the dated result file what was measured when
HISTORY = re.compile(
    r"\b(earlier|re-?scored|reverted|runs to do|until now|before this change|"
    r"used to (?:be|have|take|read|run))\b",
    re.I,
)


def test_the_docs_state_what_is_true_now_without_commit_hashes_or_a_diary():
    found = []
    for path in [ROOT / "README.md", *DOCS]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [
                f"{path.relative_to(ROOT)}:{n}: commit {m.group()}" for m in COMMIT.finditer(line)
            ]
            found += [
                f"{path.relative_to(ROOT)}:{n}: {m.group()!r}" for m in HISTORY.finditer(line)
            ]
    assert not found, (
        "say what is true now; move the dated detail to benchmarks/results/:\n" + "\n".join(found)
    )


def test_benchmarks_md_is_an_index_whose_entries_each_link_a_result_file():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 300, (
        "docs/BENCHMARKS.md is an index: the detail goes to benchmarks/results/"
    )
    sections = re.split(r"\n(?=## \d+\. )", text)[1:]
    assert sections
    for section in sections:
        linked = re.findall(
            r"\]\(\.\./benchmarks/results/(\d{4}-\d\d-\d\d-[a-z0-9-]+\.md)\)", section
        )
        assert linked, f"docs/BENCHMARKS.md: {section.splitlines()[0]!r} links no dated result file"


def test_every_link_between_the_docs_and_every_benchmarks_section_named_exists():
    numbers = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "BENCHMARKS.md").read_text(), re.M))
    pages = [
        ROOT / "README.md",
        ROOT / "benchmarks" / "README.md",
        *DOCS,
        *sorted((ROOT / "benchmarks" / "results").glob("*.md")),
    ]
    sources = [
        *pages,
        ROOT / ".ci" / "run",
        *sorted(ROOT.glob("tinygpt/**/*.py")),
        *sorted(ROOT.glob("benchmarks/*.py")),
        *sorted(ROOT.glob("tests/*.py")),
    ]
    broken = []
    for path in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: link to {target}")
    for path in sources:
        text = " ".join(path.read_text().split())  # a reference may break across lines
        for n in re.findall(r"BENCHMARKS\.md\)?,? section (\d+)", text):
            if n not in numbers:
                broken.append(f"{path.relative_to(ROOT)}: BENCHMARKS.md section {n}")
    assert not broken, broken
