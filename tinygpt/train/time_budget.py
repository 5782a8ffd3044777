"""`--hours H` as a callback: `TimeBudget` measures steady steps and fixes the step count that
fits the budget (the arithmetic and budget.json are budget.py's)."""

from __future__ import annotations

import time
import warnings
from typing import Any

from tinygpt.core.callback import Callback
from tinygpt.train import distributed as dist_
from tinygpt.train.budget import (
    BUDGET_SCHEDULE,
    BUDGET_SCHEDULE_WHY,
    MEASURE_STEPS,
    REFIX_NOTE,
    Budget,
    end_time,
    extend,
    refix,
    steps_for,
)
from tinygpt.train.trainer import TrainingError


class TimeBudget(Callback):
    """`--hours H` (the rules are budget.py's): a new run's budget is measured after MEASURE_STEPS
    steady steps (a budget.json there, a mirror's, decides nothing); a resumed run's budget.json
    holds until this process has measured its own steps. The count is fixed again at each
    checkpoint of the stable phase (`refix`), said when it moves by REFIX_NOTE or more."""

    def __init__(self, hours: float):
        self.hours = hours
        self.budget: Budget | None = None
        # after the first step of this process: the budget counts from here
        self.t_from: float | None = None
        self.step_from = 0
        self.steps_timed = 0
        self.final_s = 0.0  # the end's last evaluation and checkpoint, as measured
        self.said_steps, self.said_step_s = 0, 0.0  # the count last told, and its step time
        self.before = 0  # the steps a resumed run made before this process, costed at its step time

    def on_start(self, trainer: Any, resumed_from: int | None) -> None:
        if trainer.cfg.schedule != BUDGET_SCHEDULE:
            raise TrainingError(
                f"a time budget trains with train.schedule={BUDGET_SCHEDULE} "
                f"({BUDGET_SCHEDULE_WHY})"
            )
        # with no checkpoint there is nothing to resume: the budget is measured here
        budget = Budget.load(trainer.run_dir) if trainer.is_main and resumed_from else None
        self.before = resumed_from or 0
        if trainer.world_size > 1:  # rank 0 read it: the others take its step count
            steps = dist_.agree_sum([budget.max_steps or 0 if budget else 0])[0]
            budget = Budget(self.hours, steps or None)
        if budget is not None and budget.max_steps is not None:
            budget, note = extend(budget, self.hours, trainer.step, trainer.cfg.decay_fraction)
            if note:
                warnings.warn(note, stacklevel=3)
            if trainer.is_main:
                budget.save(trainer.run_dir)
            trainer.step_s = budget.step_s
        else:
            budget = Budget(self.hours)
        self.budget, trainer.max_steps = budget, budget.max_steps

    def on_step(self, trainer: Any) -> None:
        if self.budget is None:
            return
        if self.t_from is None:  # the first step (its compile) is start-up, not training
            self.t_from, self.step_from = time.perf_counter(), trainer.step
            return
        self.steps_timed += 1
        if self.budget.max_steps is None:
            if self.steps_timed >= MEASURE_STEPS:
                self._decide(trainer)
            return
        every = trainer.cfg.save_every
        # a resumed run's count is fixed again once this process has measured its steps
        if self.steps_timed == MEASURE_STEPS or every and trainer.step % every == 0:
            self._refix(trainer)  # this process measured it: the same clock

    def _decide(self, trainer: Any) -> None:
        cfg = trainer.cfg
        step_s = (time.perf_counter() - self.t_from) / self.steps_timed
        t = time.perf_counter()
        trainer.evaluate()
        eval_s = time.perf_counter() - t
        t = time.perf_counter()
        trainer.save()
        save_s = time.perf_counter() - t
        per_step = step_s + (eval_s / cfg.eval_every if cfg.eval_every else 0)
        per_step += save_s / cfg.save_every if cfg.save_every else 0
        spent = time.perf_counter() - self.t_from
        steps = steps_for(self.hours, spent, trainer.step, per_step, eval_s + save_s)
        if trainer.world_size > 1:
            steps = dist_.agree_sum([steps if trainer.is_main else 0])[0]
        self.budget = Budget(self.hours, steps, trainer.step, per_step, time.time())
        self.final_s, self.said_steps, self.said_step_s = eval_s + save_s, steps, per_step
        trainer.max_steps, trainer.step_s = steps, per_step
        if trainer.is_main:
            self.budget.save(trainer.run_dir)
        trainer.say(
            f"time budget {self.hours:g} h: {steps} steps of {per_step:.3g} s (evaluations and "
            f"checkpoints included); training ends about {end_time(trainer.step, steps, per_step)}"
        )

    def _refix(self, trainer: Any) -> None:
        if self.steps_timed < MEASURE_STEPS:
            return  # too few steps of this process to go by
        spent = time.perf_counter() - self.t_from
        step_s = spent / max(1, trainer.step - self.step_from)
        spent += self.before * step_s  # a resumed run's earlier steps, at this process's step time
        old = self.budget
        assert old is not None
        new = refix(
            old, trainer.step, spent, step_s, self.final_s, trainer.cfg.decay_fraction, time.time()
        )
        if trainer.world_size > 1:  # rank 0's clock decides for all
            steps = dist_.agree_sum([new.max_steps if trainer.is_main else 0])[0]
            new = Budget(new.hours, steps, new.decided_at_step, new.step_s, new.decided_at)
        if new.max_steps == old.max_steps:
            return
        self.budget, trainer.max_steps, trainer.step_s = new, new.max_steps, step_s
        if trainer.is_main:
            new.save(trainer.run_dir)
        if abs(new.max_steps - self.said_steps) >= REFIX_NOTE * self.said_steps:
            trainer.say(
                f"time budget {self.hours:g} h: a step has taken {step_s:.3g} s on average, not "
                f"{self.said_step_s:.3g} s: {new.max_steps} steps, not {self.said_steps}; training "
                f"ends about {end_time(trainer.step, new.max_steps, step_s)}"
            )
            self.said_steps, self.said_step_s = new.max_steps, step_s
