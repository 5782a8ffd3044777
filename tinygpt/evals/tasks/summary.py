"""A run's metrics.jsonl summarised, with a diagnosis (`runs.summarize_run`): no model, no data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tinygpt.evals.compare_runs import summarize_run
from tinygpt.evals.harness import Request, Task


def score(run_dir: str | Path, r: Request) -> dict[str, Any]:
    return summarize_run(run_dir)


TASK = Task(
    "summary",
    "a run's metrics.jsonl summarised, with a diagnosis (no model)",
    score,
    needs_model=False,
    hidden=("diagnosis",),
    more=lambda res: [f"- {note}" for note in res.get("diagnosis", [])],
)
