"""The benchmark scripts write their own dated evidence (benchmarks/results_file.py): the two cheapest run here
at their smallest settings into a temporary folder, and the file each wrote is read back: its name and date,
the command that ran, the device, and the figure rows the script printed. Counts and names only: timings on a
shared machine prove nothing."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE = ["--recipe", "cpu-smoke"]


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )


def rows(text: str) -> dict[str, list[str]]:
    """The markdown table rows of a file: first cell -> the other cells."""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]
    return {c[0]: c[1:] for c, line in zip(cells, text.splitlines()) if line.startswith("| ")}


def test_cpu_throughput_writes_the_figures_it_printed_to_a_dated_file(tmp_path):
    before = today()
    args = [*SMOKE, "--steps", "2", "--warmup", "1", "--results", str(tmp_path)]
    p = run("cpu_throughput.py", *args)
    assert p.returncode == 0, p.stderr[-3000:]
    [path] = tmp_path.iterdir()
    date = path.name[:10]
    assert date in (before, today()) and path.name == f"{date}-cpu-throughput.md"
    text = path.read_text()
    assert re.search(rf"^Written by `cpu_throughput.py`, {date} \d\d:\d\d UTC\.$", text, re.M)
    assert (
        "- command: `OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES='' python benchmarks/cpu_throughput.py "
        + " ".join(args)
        + "`"
        in text
    )
    assert re.search(r"^- device: CPU .+, \d+ cores, torch threads 1, .*; no GPU$", text, re.M)
    assert re.search(r"^- versions: torch \S+, Python 3\.\d+", text, re.M)
    assert "- reference: the issue's bound" in text
    printed = dict(re.findall(r"^\s*(\w+): (.+)$", p.stdout, re.M))
    table = rows(text)
    assert table["recipe"] == ["cpu-smoke"] and table["threads"] == ["1"]
    assert table["params"] == [
        f"{int(printed['params']):,}"
    ]  # the figure printed is the one written
    assert int(table["train_tokens_per_s"][0].replace(",", "")) == int(
        printed["train_tokens_per_s"]
    )
    assert p.stdout.rstrip().endswith(f"result file: {path}")


def test_a_second_run_on_the_same_day_gets_a_suffix_and_leaves_the_first_file(tmp_path):
    first = tmp_path / f"{today()}-batch-cost.md"
    first.write_text("the first run's evidence\n")
    p = run("batch_cost.py", *SMOKE, "--rounds", "1", "--results", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert first.read_text() == "the first run's evidence\n"
    second = tmp_path / f"{today()}-batch-cost-2.md"
    assert set(tmp_path.iterdir()) == {first, second}
    table = rows(second.read_text())
    assert list(table)[1:] == ["micro-batch 8", "micro-batch 8 x 2 accumulated", "micro-batch 16"]
    assert table["micro-batch 8"][1] == "1"  # the reference row: the recipe's own step, x1
    assert all(float(r[0]) > 0 and len(r[2].split(", ")) == 1 for r in list(table.values())[1:])


def test_a_results_option_that_names_a_file_is_one_line_before_any_work(tmp_path):
    (tmp_path / "taken").write_text("")
    p = run("batch_cost.py", *SMOKE, "--results", str(tmp_path / "taken"))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines()[-1].endswith(
        f"{tmp_path / 'taken'} is a file: give a folder, or none"
    )
