"""Running one task of the registry on a model: `run_eval` (the library's call, which records each
result in the run's `evals.jsonl`), `evaluate` (what `tinygpt eval` runs from its `EvalOptions`) and
`report` (what it prints)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from tinygpt.core.files import append_text, refuse_link
from tinygpt.core.paths import is_hub, is_sample, sample_path
from tinygpt.core.precision import resolve_device
from tinygpt.core.rundir import EVALS_JSONL, RunDir
from tinygpt.data.sources import check_source
from tinygpt.evals import sandbox
from tinygpt.evals.code import SANDBOX_NOTE
from tinygpt.evals.eval_options import EvalOptions
from tinygpt.evals.harness import Request, Task, load_for_eval
from tinygpt.evals.tasks import get_task


def check_request(task: Task, r: Request) -> None:
    """Refuse a request that cannot work before any model is loaded."""
    for name in ("limit", "max_chars", "batch_size"):
        v = getattr(r, name)
        if v is not None and v < 1:
            raise ValueError(f"{name} must be a positive number (or left out), got {v}")
    if task.data_help is None and r.data is not None:
        raise ValueError(
            f"task {task.name} reads no data file: leave out --data ({task.name}: {task.help})"
        )
    reads_data = task.data_help is not None and str(r.data) not in task.keywords
    if reads_data and not (r.data is None and task.data_default):
        if r.data is None:
            raise ValueError(f"task {task.name} needs data (--data): {task.data_help}")
        if not is_hub(r.data) and not Path(r.data).exists():
            raise FileNotFoundError(
                f"no data file at {r.data}; task {task.name} needs {task.data_help}"
            )
    if task.check is not None:
        task.check(r)


def run_eval(
    run_dir: str | Path, task: str, *, which: str = "latest", device: str = "cpu", **request: Any
) -> dict[str, Any]:
    """Evaluate a run folder (see `load_for_eval`) on one task of `TASKS`; `request` holds the
    fields of `Request` (data, limit, window, stride, max_chars, batch_size, n, k, max_new_tokens,
    temperature, progress, unsafe_exec, say: a function given one-line notes before long work, e.g.
    `print`); a field left None takes the task's default. Each task's module says what its `data`
    may be (`Task.data_help`)."""
    t = get_task(task)
    r = Request(**request)
    if not t.needs_model:
        return t.score(run_dir, r)
    r = dataclasses.replace(r, **{k: v for k, v in t.defaults.items() if getattr(r, k) is None})
    named = r.data
    # a sample that ships with the package: recorded by its name, read from its file
    if is_sample(r.data):
        r = dataclasses.replace(r, data=sample_path(r.data))
    check_request(t, r)
    # where the result goes: a link is refused before any work
    refuse_link(Path(run_dir) / EVALS_JSONL, writes=True)
    loaded = load_for_eval(run_dir, which, device)
    data = str(named) if named is not None else t.data_default
    head = {"run": Path(run_dir).name, "checkpoint": loaded.source, "task": task, "data": data}
    result = {**head, **t.score(loaded, r)}
    record_eval(run_dir, result)
    return result


def record_eval(run_dir: str | Path, result: dict[str, Any]) -> None:
    """Append a result's scalar figures to the run folder's evals.jsonl (tinygpt runs only, not a
    Hugging Face folder): what was evaluated, on what, and the scores."""
    run = RunDir(run_dir)
    if not (run.is_pretrain_run() or run.is_finetune_run()):
        return
    keep, scalar = ("run", "checkpoint", "task", "data"), (int, float, str, bool)
    scores = {k: v for k, v in result.items() if k not in keep and isinstance(v, scalar)}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record = {**{k: result[k] for k in keep}, "scores": scores, "time": stamp}
    try:  # never through a link or a hard link
        append_text(run.path / EVALS_JSONL, json.dumps(record) + "\n")
    except OSError as e:  # a read-only folder (someone else's run): the result is still returned
        warnings.warn(
            f"the result was not recorded in {run.path / EVALS_JSONL}: {e.strerror or e}",
            stacklevel=2,
        )


def evaluate(opts: EvalOptions, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`tinygpt eval`: `opts.task` on `opts.run_dir` (`run_eval`), with a bar unless the result is
    wanted as JSON. A task that runs generated code is refused where no kernel boundary exists
    (unless `unsafe_exec`) and says where the code runs, through `say`, before anything runs;
    SIGTERM then ends the sandboxes as Ctrl-C does."""
    task = get_task(opts.task)
    if task.runs_code:
        b = sandbox.boundary()
        if b.kind == "none" and not opts.unsafe_exec:
            raise sandbox.SandboxUnavailable(sandbox.unavailable_message(b))
        if say is not None:
            say(f"{task.name} {SANDBOX_NOTE}; here: {b.describe()}")
    if is_hub(opts.data):
        check_source(opts.data)  # offline: one line at once, not the datasets library's retries
    request = {f.name: getattr(opts, f.name) for f in dataclasses.fields(Request)}
    # a bar where one is drawn (a terminal, a notebook's widget): no carriage returns in a log file
    bar = not opts.as_json and (sys.stderr.isatty() or "ipykernel" in sys.modules)
    request.update(progress=bar, say=say)
    device = str(resolve_device(opts.device))
    with sandbox.sigterm_as_interrupt():
        return run_eval(opts.run_dir, opts.task, which=opts.which, device=device, **request)


def _jsonable(v):
    """NaN (a standard error of one item) as null: strict JSON readers refuse NaN."""
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return [_jsonable(x) for x in v] if isinstance(v, (list, tuple)) else v


def _fmt(v) -> str:
    """A figure as the table shows it: 4 significant digits, "-" for one not measured (None)."""
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def report(task: str, result: dict[str, Any], as_json: bool = False) -> str:
    """What `tinygpt eval` prints: the whole result as JSON, or its figures one per line (but those
    the task hides) followed by the task's own lines (`Task.more`: HellaSwag's reference table,
    ...)."""
    if as_json:
        return json.dumps(_jsonable(result), indent=1, default=str)
    t = get_task(task)
    width = max(len(k) for k in result)
    lines = [f"{k:<{width}}  {_fmt(v)}" for k, v in result.items() if k not in t.hidden]
    return "\n".join(lines + (t.more(result) if t.more is not None else []))
