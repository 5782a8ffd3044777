"""The evaluation tasks, one module each (its data sources, help, default sizes, scorer and how its result
prints, in one `TASK`). `TASKS` is the registry that `tinygpt eval --task`, `run_eval`, the model card and
the notebooks read: a new task is a module here and one line in it."""
from __future__ import annotations

from pathlib import Path

from tinygpt.evals.harness import Task, default_data
from tinygpt.evals.tasks import hellaswag, humaneval, mbpp, perplexity, summary

TASKS: dict[str, Task] = {m.TASK.name: m.TASK for m in (  # in the order `tinygpt eval --help` lists them
    perplexity,
    hellaswag,
    humaneval,
    mbpp,
    summary,
)}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def eval_data(task: str, data_dir: str | Path | None = None) -> str:
    """Where a task's standard data set is: the offline file in `data_dir` (default `shared_data_dir()`)
    when it is there, else its Hugging Face Hub name, for `run_eval`."""
    return default_data(get_task(task), data_dir)
