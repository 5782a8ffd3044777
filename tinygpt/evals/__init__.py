"""Evaluation: the task registry and `run_eval` (tasks), language-model metrics (lm), code metrics
(code), and run summaries, tables and plots (runs). The names a notebook uses are handed on here."""
from tinygpt.evals.lm import eval_data, hellaswag_rows  # noqa: F401
from tinygpt.evals.runs import (  # noqa: F401
    compare_runs,
    list_runs,
    plot_runs,
    read_metrics,
    read_samples,
    summarize_run,
)
from tinygpt.evals.tasks import TASKS, run_eval  # noqa: F401
