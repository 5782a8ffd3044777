"""What a Drive mirror may tell a pretraining run: nothing that chooses the run. Its run.json is
compared with the command, and the run files a restore would copy home are read as a start reads
them, before a byte is copied from or to it (`check_mirror_run`, called by
`pretrain.run_pretrain.pretrain`)."""

from __future__ import annotations

import os
from pathlib import Path

from tinygpt.core.config import ConfigError
from tinygpt.core.files import link_problem, read_json_safe
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import BUDGET_JSON, METRICS, RUN_JSON, SAMPLES, RunDir
from tinygpt.core.same_settings import config_differences
from tinygpt.fit.ladder import PLANNED_FIELDS
from tinygpt.fit.plan import kept_plan
from tinygpt.fit.probe import PROBED_TRAIN_FIELDS
from tinygpt.train.budget import Budget
from tinygpt.train.exact_resume import RESUMABLE_CHANGES

# what a run's run.json may hold otherwise than the command that resumes it: what a resume may
# change, and what the probe chose on the GPU it began on (decided again here unless this user
# signed run.json: `probe.fit_to_device`)
MIRROR_MAY_DIFFER = RESUMABLE_CHANGES | set(PROBED_TRAIN_FIELDS) | {"activation_checkpointing"}


def check_mirror_run(recipe: Recipe, mirror: str | Path | None, sized: bool = False) -> None:
    """A mirror is a shared folder: its run.json is evidence, never a source. What a run trains (the
    recipe, its base, data and tokenizer) comes from the command and the local run folder; a mirror
    whose run.json records another run is refused in one line naming the fields, before anything is
    copied from or to it (so nothing it names, a base folder or a data folder, is read, and nothing
    is uploaded); the refusal names the fields that differ, never the other run's values (its
    private paths). An unreachable mirror is left to the restore, which says so. `sized` (--size
    auto): the model's ladder fields and learning rates are decided here (`plan.planned_here`)."""
    if mirror is None:
        return
    path = Path(mirror) / RUN_JSON
    try:
        if not os.path.lexists(path):
            return
        info = read_json_safe(path, what=" (on the mirror)")
        theirs = Recipe.from_dict(info["recipe"]).to_dict()
    except OSError:
        return
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{path} on the mirror cannot be read as a run's ({str(e).splitlines()[0]}); "
            f"nothing was copied from or to {mirror}: use another --mirror folder"
        ) from None
    check_mirror_files(mirror)
    if sized:  # a plan tinygpt could not have written: refused before anything is copied
        kept_plan(info, f"{path} (nothing was copied from or to the mirror)")
    ours = recipe.to_dict()
    diffs = config_differences(
        {k: theirs.get(k) for k in ("model", "train", "data")},
        {k: ours[k] for k in ("model", "train", "data")},
        MIRROR_MAY_DIFFER | (PLANNED_FIELDS if sized else set()),
    )
    fields = [d.split(":", 1)[0] for d in diffs]  # the names only: its values may be private paths
    if theirs.get("name") != recipe.name:
        fields.insert(0, "recipe")
    if fields:
        raise ConfigError(
            f"the mirror {mirror} holds another run than this command's ({path} differs in "
            f"{', '.join(fields)}): nothing was copied from or to it, and nothing it names was "
            "read; use another --mirror folder"
        )


def check_mirror_files(mirror: str | Path) -> None:
    """The run files a restore would copy home and a later start parses (budget.json, metrics.jsonl,
    samples.txt), read as a start reads them: one tinygpt could not have written is refused, named,
    before it is copied into the local folder (where it would stop every later start)."""
    run = RunDir(mirror)
    reads = {BUDGET_JSON: lambda: Budget.load(run.path), METRICS: run.metrics, SAMPLES: run.samples}
    try:
        for name, read in reads.items():
            # a link is not copied: the restore says so, and goes on
            if link_problem(run.path / name) is None:
                read()
    except OSError:
        return  # an unreachable mirror: the restore says so
    except ValueError as e:  # RunDirError, UnsafePathError, FileTooLarge: each names its file
        raise ConfigError(
            f"the mirror holds a file tinygpt did not write: {str(e).splitlines()[0]}; nothing was "
            f"copied from or to {mirror}: delete that file there, or use another --mirror folder"
        ) from None
