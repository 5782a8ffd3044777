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
    section = text[text.index("## Recipes"):]
    section = section[:section.index("\n## ", 1)]
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]


def test_the_readmes_recipe_table_is_what_tinygpt_recipes_prints(capsys):
    assert main(["recipes", "--json"]) == 0
    recipes = json.loads(capsys.readouterr().out)
    rows = readme_recipe_rows()
    assert [r[0].split("`")[1] for r in rows] == [r["name"] for r in recipes], "README's recipe table: one row each"
    for row, r in zip(rows, recipes):
        _, hardware, params, context, per_step, budget, precision, data = row
        assert r["hardware"] in hardware.lower(), (r["name"], hardware)
        assert _near(_count(params.split()[0].rstrip(",")), r["params"]), (r["name"], params, r["params"])
        assert int(context) == r["context"] and _count(per_step) == r["tokens_per_step"], (r["name"], row)
        assert _near(_count(budget), r["token_budget"]), (r["name"], budget, r["token_budget"])
        assert precision.split()[0] == r["precision"], (r["name"], precision)
        source = r["data"].removeprefix("hf:").split("/")[-1].replace(":", " ").lower()
        assert (data == "built-in corpus") if r["data"] == "builtin" else data.lower() == source, (r["name"], data)
