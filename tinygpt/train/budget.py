"""A time budget: the number of steps that fit in H hours, measured once, kept with the run.

`tinygpt pretrain --hours H` trains with the warmup-stable-decay schedule, whose learning rate does
not depend on the step count until the decay begins. After a few steady steps the trainer measures
the time of a step, of an evaluation and of a checkpoint, fixes `max_steps` so that training
(start-up not counted) ends within the budget, and writes ``budget.json`` in the run folder. Until
the decay begins it fixes the count again at each checkpoint (`refix`) from the mean time of every
step so far, evaluations and saves included: a machine that slows down or a lucky first measurement
no longer moves the end. A resumed run keeps budget.json's count until it has measured its own
steps, then fixes it again from that step time: the steps always come from a step time the training
process measured, never from budget.json's (which a shared mirror brings back). Once the decay has
begun the count holds, so the run ends with its schedule complete however often it was interrupted;
more hours extend it only before then. A run with no checkpoint measures its budget anew.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tinygpt.core.checkpoint import latest_valid, step_of
from tinygpt.core.files import write_json_atomic
from tinygpt.core.rundir import BUDGET_JSON, RunDir, RunDirError, read_json, recipe_name_of

# The rule, stated here once: a time budget trains with the warmup-stable-decay schedule, whose rate
# does not depend on the step count until its decay, so the budget may fix the count after warm-up
# (PretrainOptions.apply sets it, check_budget_overrides refuses a --set of another, TimeBudget checks).
BUDGET_SCHEDULE = "wsd"
BUDGET_SCHEDULE_WHY = "its rate does not depend on the step count, fixed after warm-up"
MEASURE_STEPS = 8  # steady steps (after the compile) timed before the step count is fixed
# a count fixed again is told when it moved this much since last told (smaller moves are noise)
REFIX_NOTE = 0.1
# a month of GPU time: far past any Colab session, and a bound on what budget.json may say
MAX_HOURS = 24 * 30
# no optimizer step of any recipe takes less (the smallest CPU recipe takes milliseconds)
MIN_STEP_S = 1e-4
MAX_BUDGET_STEPS = 10**8  # the most steps a budget may fix, whatever its hours and step time say


@dataclass
class Budget:
    """What budget.json holds: the hours asked for and the steps they buy, with the measurements."""

    hours: float
    max_steps: int | None = None  # None until decided
    decided_at_step: int | None = None
    step_s: float | None = None  # seconds per optimizer step, evaluations and saves included
    decided_at: float | None = None  # wall clock (time.time()) when decided

    @classmethod
    def load(cls, run_dir: Path) -> "Budget | None":
        path = Path(run_dir) / BUDGET_JSON
        if not path.is_file():
            return None
        d = read_json(path)
        fix = f"; delete {path}: the budget is measured again"

        def number(v, whole: bool = False) -> bool:
            kinds = (int,) if whole else (int, float)
            return isinstance(v, kinds) and not isinstance(v, bool) and math.isfinite(v) and v > 0

        if not isinstance(d, dict):
            raise RunDirError(
                f"{path} does not hold a time budget (a JSON object with hours and max_steps){fix}"
            )
        if not number(d.get("hours")):
            raise RunDirError(
                f"{path}: hours must be a positive, finite number, got {d.get('hours')!r}{fix}"
            )
        measured = ("max_steps", "decided_at_step", "step_s", "decided_at")
        for name in measured:
            whole = name in ("max_steps", "decided_at_step")
            if d.get(name) is not None and not number(d[name], whole):
                kind = "a positive whole number" if whole else "a positive number"
                raise RunDirError(f"{path}: {name} must be {kind} or null, got {d[name]!r}{fix}")
        budget = cls(d["hours"], *(d.get(k) for k in measured))
        if (why := budget.out_of_bounds()) is not None:
            raise RunDirError(f"{path}: {why}: not a budget tinygpt decided{fix}")
        return budget

    def out_of_bounds(self) -> str | None:
        """Why these figures cannot be a budget tinygpt decided (None when they can): budget.json
        comes back from a shared mirror, so it must not set a run that never ends. No step count
        above what the hours buy at the step time (`steps_for`, `extend`) nor MAX_BUDGET_STEPS."""
        if self.hours > MAX_HOURS:
            return f"hours {self.hours:g} is more than {MAX_HOURS}"
        if self.step_s is not None and self.step_s < MIN_STEP_S:
            return f"step_s {self.step_s:g} is less than {MIN_STEP_S:g} s"
        if self.max_steps is None:
            return None
        if self.max_steps > MAX_BUDGET_STEPS:
            return f"max_steps {self.max_steps} is more than {MAX_BUDGET_STEPS}"
        if self.step_s is not None:
            bought = (self.decided_at_step or 0) + math.ceil(self.hours * 3600 / self.step_s) + 1
            if self.max_steps > bought:
                return (
                    f"max_steps {self.max_steps} is more than {self.hours:g} h buy at "
                    f"{self.step_s:g} s a step ({bought})"
                )
        return None

    def save(self, run_dir: Path) -> None:
        write_json_atomic(Path(run_dir) / BUDGET_JSON, asdict(self))


def steps_for(hours: float, spent_s: float, step: int, step_s: float, final_s: float) -> int:
    """The step count that ends training `hours` after it began: `spent_s` are gone at `step`, each
    further step costs `step_s`, and the end (a last evaluation and checkpoint) `final_s`."""
    left = hours * 3600 - spent_s - final_s
    return max(step + 1, step + math.floor(left / step_s))


def decay_start(max_steps: int, decay_fraction: float) -> int:
    """The first step of the warmup-stable-decay schedule's decay."""
    return max_steps - max(1, round(decay_fraction * max_steps))


def least_stable_steps(step: int, decay_fraction: float) -> int:
    """The fewest steps a run can have whose decay has not begun by `step` (`decay_start` is after it);
    none when the decay is the whole run (`decay_fraction` 1)."""
    if not 0 <= decay_fraction < 1:
        raise ValueError(f"no run with decay_fraction {decay_fraction} has a stable phase")
    n = max(step + 2, math.floor((step + 1) / (1 - decay_fraction)) - 2)
    while decay_start(n, decay_fraction) <= step:
        n += 1
    return n


def refix(
    budget: Budget,
    step: int,
    spent_s: float,
    step_s: float,
    final_s: float,
    decay_fraction: float,
    now: float,
) -> Budget:
    """The budget fixed again at `step` from `step_s`, the mean time of the steps since training began
    (`spent_s` ago): the count that ends within the hours. Only in the stable phase, and never a
    count whose decay would already have begun (the rate would jump down): a run too slow for that
    starts its decay at the next step. The figures stay within `Budget.out_of_bounds`."""
    if budget.max_steps is None or step >= decay_start(budget.max_steps, decay_fraction):
        return budget
    steps = steps_for(budget.hours, spent_s, step, step_s, final_s)
    least = least_stable_steps(step, decay_fraction)
    if steps >= least:
        return Budget(budget.hours, steps, step, step_s, now)
    if least < budget.max_steps:  # fewer steps than decided: within its bounds
        return Budget(budget.hours, least, budget.decided_at_step, budget.step_s, budget.decided_at)
    return budget


def extend(
    budget: Budget, hours: float, step: int, decay_fraction: float
) -> tuple[Budget, str | None]:
    """A resumed run asked for other hours: more (or fewer) steps while the decay has not begun."""
    if budget.max_steps is None or budget.step_s is None or math.isclose(hours, budget.hours):
        return budget, None
    start = decay_start(budget.max_steps, decay_fraction)
    if step >= start:
        return budget, (
            f"the learning rate began its decay at step {start}: this run ends at step "
            f"{budget.max_steps} as budgeted for {budget.hours:g} h; for more, start a new run"
        )
    more = math.floor((hours - budget.hours) * 3600 / budget.step_s)
    steps = max(step + 1, budget.max_steps + more)
    new = Budget(hours, steps, budget.decided_at_step, budget.step_s, budget.decided_at)
    return new, f"budget {budget.hours:g} h -> {hours:g} h: {budget.max_steps} -> {steps} steps"


def expected_final_loss(history: list[dict], max_steps: int, warmup_steps: int) -> float | None:
    """The loss the run is heading for: L(s) = a + b / sqrt(s), least squares on the logged losses
    after warm-up, read at max_steps (the stable phase; a decay usually ends lower). None with fewer
    than 5 points or a curve that does not fall."""
    pts = [
        (m["step"], m["loss"])
        for m in history
        if m.get("loss") is not None and m["step"] > warmup_steps
    ]
    if len(pts) < 5:
        return None
    s, loss = np.array(pts, dtype=np.float64).T
    A = np.stack([np.ones_like(s), 1 / np.sqrt(s)], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, loss, rcond=None)
    if not (b > 0 and math.isfinite(a)):
        return None
    return float(a + b / math.sqrt(max_steps))


def end_time(
    step: int, max_steps: int, step_s: float | None, now: float | None = None
) -> str | None:
    """When the run should end, as local HH:MM (for the progress bar)."""
    if not step_s:
        return None
    return time.strftime(
        "%H:%M", time.localtime((now or time.time()) + (max_steps - step) * step_s)
    )


def finished_run(run_dir: str | Path, recipe_name: str, max_steps: int | None = None) -> str | None:
    """For a pretraining run of `recipe_name` that already reached its last step (`max_steps`, else
    its budget's, else its recipe's), what to say instead of training nothing: that it is complete,
    its final figures, and how to train longer; None otherwise."""
    run = RunDir(run_dir)
    if not run.is_pretrain_run() or recipe_name_of(run_dir) != recipe_name:
        return None
    last = latest_valid(run.checkpoints)
    budget = Budget.load(Path(run_dir))
    max_steps = (
        max_steps
        or (budget.max_steps if budget else None)
        or run.recipe_dict().get("train", {}).get("max_steps")
    )
    step = step_of(last) if last is not None else None
    if step is None or max_steps is None or step < max_steps:
        return None
    records = run.metrics()
    loss = next((m["loss"] for m in reversed(records) if m.get("loss") is not None), None)
    val = next((m["val_loss"] for m in reversed(records) if m.get("val_loss") is not None), None)
    figures = "".join(
        f", {k} {v:.4g}" for k, v in (("loss", loss), ("val_loss", val)) if v is not None
    )
    return (
        f"run {run_dir} is complete: step {step} of {max_steps}{figures}; checkpoint {last}. To "
        f"train longer: the same command with --max-steps {2 * max_steps} (the learning-rate "
        "schedule is recomputed for the new end)"
    )
