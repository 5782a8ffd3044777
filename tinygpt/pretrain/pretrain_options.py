"""`tinygpt pretrain`'s options (`PretrainOptions`): how to run a recipe, each field one option
(core/options.py), checked when made; and the `--set` overrides that a time budget refuses
(`check_budget_overrides`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tinygpt.core.config import CompileMode, ConfigError
from tinygpt.core.fields import field_problem
from tinygpt.core.options import option, targets
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import BUDGET_JSON
from tinygpt.train.budget import BUDGET_SCHEDULE, BUDGET_SCHEDULE_WHY, MAX_HOURS, Budget


@dataclass
class PretrainOptions:
    """How to run a recipe (the recipe says what to train). Every field has the CLI's default; each
    with help is a `tinygpt pretrain` option (core/options.py), and each that "sets" a recipe field
    overrides it when given."""

    run_dir: str | Path = option(
        "runs/default",
        flag="RUN_DIR",
        alias="--run-dir",
        help="the run folder: made, or resumed when it holds this run",
    )
    data: str | None = option(
        None,
        help="builtin, a text file or folder, or hf:NAME[:CONFIG][@SPLIT] (default: the recipe's)",
        sets="data.source",
    )
    max_steps: int | None = option(
        None, help="train to this step (default: the recipe's)", sets="train.max_steps"
    )
    hours: float | None = option(
        None,
        help="a time budget: the steps that fit are measured after warm-up and "
        "fixed, with the warmup-stable-decay schedule ending on time (start-up not counted)",
    )
    size: Literal["auto"] | None = option(
        None,
        help="auto (with --hours): the model size the hours buy, chosen from the recipe's ladder "
        "of "
        "sizes by a scaling law and this machine's speed (docs/PLANNER.md); default: the recipe's",
    )
    save_every: int | None = option(
        None,
        help="save a checkpoint every N steps (default: the recipe's)",
        sets="train.save_every",
    )
    eval_every: int | None = option(
        None, help="evaluate every N steps (default: the recipe's)", sets="train.eval_every"
    )
    resume: Literal["auto", "never"] = option(
        "auto",
        help="auto: from the newest valid checkpoint (local or mirror); never: refuse a "
        "folder that has checkpoints",
    )
    mirror: str | Path | None = option(
        None, help="a folder (e.g. on Google Drive) that mirrors the run's checkpoints"
    )
    device: str | None = option(
        None, help="cpu, cuda, cuda:1, mps (default: the best available)", sets="train.device"
    )
    compile: CompileMode | None = option(
        None,
        sets="train.compile",
        help="torch.compile the whole model (on), by regions: each block, then the head and the "
        "loss (regional), or not (off); default: the recipe's (auto: regional on CUDA)",
    )
    cache_dir: str | Path | None = None  # token caches; default $TINYGPT_CACHE/tokens
    # extra trainer callbacks (tinygpt.core.callback.Callback)
    callbacks: list | tuple = ()
    progress: bool = option(True, flag="--quiet", help="no progress bar")
    sample_prompt: str | None = None  # default: how a held-out document begins
    peak_tflops: float | None = None  # for MFU; default from the GPU table
    parallel: Literal["ddp", "fsdp"] = option(
        "ddp", help="under torchrun: DDP, or FSDP2 to shard a model too big for one GPU"
    )
    probe: Literal["auto", "off"] = option(
        "auto",
        help="on a GPU, let the probe choose micro-batch, context and precision (off: the "
        "recipe as written)",
    )
    tensorboard: bool | None = None  # None: when installed; True: required; False: off

    def __post_init__(self):
        if (problem := field_problem(self)) is not None:  # resume, probe, parallel: their Literals
            raise ConfigError(problem)
        if self.hours is not None and not (
            isinstance(self.hours, (int, float))
            and math.isfinite(self.hours)
            and 0 < self.hours <= MAX_HOURS
        ):
            raise ConfigError(
                f"hours must be a positive, finite number of hours up to {MAX_HOURS} (e.g. 1.5), "
                f"got {self.hours!r}"
            )
        if self.hours is not None and self.max_steps is not None:
            raise ConfigError(
                "give --hours or --max-steps, not both: a time budget sets the step count itself"
            )
        if (
            self.size == "auto"
            and self.hours is None
            and not (Path(self.run_dir) / BUDGET_JSON).is_file()
        ):
            raise ConfigError(
                "--size auto chooses the size that --hours buys: give --hours too (e.g. --hours 1)"
            )
        self.run_dir = Path(self.run_dir)
        if self.hours is None and (budget := Budget.load(self.run_dir)) is not None:
            self.hours = budget.hours  # a budgeted run resumes with its budget

    def apply(self, recipe: Recipe) -> Recipe:
        """The recipe with this run's overrides. A time budget trains with BUDGET_SCHEDULE: it
        replaces the recipe's own (`budget_note` says so at start-up)."""
        changes = targets(self)
        if self.hours is not None:
            changes.setdefault("train", {})["schedule"] = BUDGET_SCHEDULE
        return recipe.replace(**changes)

    def budget_note(self, recipe: Recipe) -> str | None:
        """What the time budget changes in `recipe`, for the start-up line (None: nothing)."""
        if self.hours is None or recipe.train.schedule == BUDGET_SCHEDULE:
            return None
        return f"--hours trains with schedule {BUDGET_SCHEDULE}, not the recipe's {recipe.train.schedule}"


def check_budget_overrides(changes: dict[str, dict[str, Any]], hours: float | None) -> None:
    """Refuse, in one line before any work, a `--set` (`parse_overrides`) that a time budget cannot
    honour: a schedule other than BUDGET_SCHEDULE, or a step count (it decides both)."""
    train = changes.get("train", {}) if hours is not None else {}
    if train.get("schedule", BUDGET_SCHEDULE) != BUDGET_SCHEDULE:
        raise ConfigError(
            f"--set train.schedule={train['schedule']} cannot be honoured with "
            f"--hours: a time budget trains with schedule {BUDGET_SCHEDULE} "
            f"({BUDGET_SCHEDULE_WHY}); drop the --set, or give --max-steps instead of --hours"
        )
    if "max_steps" in train:
        raise ConfigError(
            f"--set train.max_steps={train['max_steps']} and --hours both set the "
            "step count: give one (a time budget measures its steps after warm-up)"
        )
