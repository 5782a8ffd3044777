"""The evaluation tasks, one module each (its data sources, help, default sizes, scorer and how its
result prints, in one `TASK`). The import below is the registry: `TASKS` holds the `TASK` of every
module it names, in its order, and `tinygpt eval --task`, `run_eval`, the model card and the
notebooks read it. A new task is a module here and one line in that import."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tinygpt.core.options import did_you_mean
from tinygpt.evals.harness import Task, default_data
from tinygpt.evals.tasks import (  # noqa: F401  (TASKS reads them)
    hellaswag,
    humaneval,
    mbpp,
    perplexity,
    stdlib_functions,
    summary,
)

TASKS: dict[str, Task] = {
    m.TASK.name: m.TASK
    for m in list(globals().values())
    if isinstance(m, ModuleType) and isinstance(getattr(m, "TASK", None), Task)
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(
            f"unknown task {name!r}{did_you_mean(name, TASKS)}; choose one of {', '.join(TASKS)}"
        )
    return TASKS[name]


def eval_data(task: str, data_dir: str | Path | None = None, sample: bool = False) -> str:
    """Where a task's standard data set is, for `run_eval` (`default_data`): its offline file in
    `data_dir` when there, else its Hub name; with `sample`, the sample that ships with tinygpt."""
    return default_data(get_task(task), data_dir, sample)
