"""`EvalOptions`: what `tinygpt eval` takes; the command's options are its fields with help
(core/options.py): a run folder and its checkpoint, one task of the registry, and the `Request`
fields every task reads."""

from __future__ import annotations

from dataclasses import dataclass

from tinygpt.core.checkpoint import RunCheckpoint
from tinygpt.core.options import option
from tinygpt.evals.harness import Request
from tinygpt.evals.tasks import TASKS


@dataclass(kw_only=True)
class EvalOptions(Request, RunCheckpoint):
    """What `tinygpt eval` runs: a `Request` with its model and task.

    Every field has the CLI's default; `run_dir` may also be a Hugging Face model folder."""

    task: str = option(
        choices=tuple(TASKS), help="; ".join(f"{t.name}: {t.help}" for t in TASKS.values())
    )
    device: str = option("auto", help="cpu, cuda, mps (default: the best available)")
    as_json: bool = option(False, flag="--json", help="print the whole result as JSON")
