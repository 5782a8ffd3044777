"""Evaluation: one module per task under `tasks/` with its registry (`TASKS`), the machinery they
share (`harness`: the task record, loading, generation; `lm`: language-model scoring; `code`: code
metrics and the sandbox), `evaluate` (`run_eval`, and `evaluate` from `EvalOptions` for `tinygpt
eval`), and run summaries, tables and plots (`compare_runs`). The names a notebook uses are handed
on here."""

from tinygpt.evals.compare_runs import (  # noqa: F401
    compare_runs,
    list_runs,
    plot_runs,
    read_metrics,
    summarize_run,
)
from tinygpt.evals.evaluate import run_eval  # noqa: F401
from tinygpt.evals.tasks import TASKS, eval_data  # noqa: F401
from tinygpt.evals.tasks.hellaswag import hellaswag_rows  # noqa: F401
