"""The size planner: the model a time budget should train, chosen from the recipe's ladder of sizes
(`tinygpt.fit.ladder`, with its scaling law) for `pretrain --size auto --hours H` and `probe --hours
H`. Each rung gets this machine's tokens/s (a few rungs timed with the trainer's own step, the rest
scaled from them by FLOPs per token, and said so), the tokens the hours buy at that speed, and the
law's predicted loss; the lowest is chosen among the rungs the law speaks for (`within_law`). Where
none is left (a small text on a fast GPU), the rung nearest the recipe's own size is kept, said so.

Invariants: the plan is decided once, before anything is written, and kept in run.json ("plan"); a
resumed run takes its size from there (on another GPU too), never plans again.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from tinygpt.core.checkpoint import MODEL_FILE, CheckpointError, check_safetensors, list_checkpoints
from tinygpt.core.config import ConfigError
from tinygpt.core.precision import choose_precision
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import RUN_JSON
from tinygpt.fit.hardware import check_fits
from tinygpt.fit.ladder import (
    HEAD_DIM,
    ScalingLaw,
    apply_plan,
    depth_of,
    effective_tokens,
    ladder,
    law_for,
    resumed_at,
    rung_name,
    unique_tokens,
    within_law,
)
from tinygpt.fit.step_speed import compiled_speedup, trainer_speed
from tinygpt.model.gpt import meta_model

# rungs whose speed is measured; the others are scaled by FLOPs per token from the nearest
TIMED_RUNGS = 3
# the share of a budget that evaluations, checkpoints and samples take (not training)
BUDGET_OVERHEAD = 0.1
# optimizer steps timed per timed rung (after 2 of warm-up): the planner stays short
PLAN_SPEED_STEPS = 4
PLAN_WARMUP_STEPS = 2
# the longest a rung's timing may take (`timing_limit`); a larger rung is scaled, never timed (on a
# CPU a 12-hour budget keeps rungs of hundreds of millions of parameters, minutes per step)
MAX_TIMING_S = 10.0
TIMING_SHARE = 0.01
MAX_TIMING_CAP_S = 60.0
# the planner's whole time (`planning_limit`). The timings run eagerly and compile nothing: when
# each compiled its rung, on an H100 a 1-hour plan ran past 200 s (docs/BENCHMARKS.md section 5)
PLAN_TIME_SHARE = 0.02
PLAN_TIME_MIN_S = 90.0
PLAN_TIME_MAX_S = 300.0
# the choice is timed before it is kept: FLOP scaling misjudges a CPU's speed (a small model is bound
# by overheads, not FLOPs: on 2 cores d3 ran 855 tokens/s where d2's speed scaled said 598), and a
# rung that reads more than it seemed can cross MAX_EPOCHS; at most this many rungs more are timed
CONFIRM_RUNGS = 3
# a rung the hours buy fewer optimizer steps for is not a candidate (its warmup alone is most)
MIN_STEPS = 50


@dataclass
class Candidate:
    """One rung as the planner sees it (a row of the table)."""

    size: str
    params: int  # non-embedding
    tokens_per_s: float
    timed: bool  # measured here; else scaled from a timed rung by FLOPs per token
    tokens: float  # what the hours buy at that speed
    epochs: float | None  # of the source (None: its size unknown)
    predicted_loss: float
    chosen: bool = False

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params


@dataclass
class SizePlan:
    """What run.json keeps as "plan": the hours, the law, every candidate, the chosen size."""

    hours: float
    size: str
    law: dict
    candidates: list[Candidate]
    seconds: float  # the planner's own time
    # no rung is within the law (`within_law`) in the hours: the recipe's own size is kept
    outside_law: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def choice(self) -> Candidate:
        return next(c for c in self.candidates if c.chosen)


def plan_size(
    recipe: Recipe,
    hours: float,
    speed: Callable[[Recipe], float],
    *,
    fits: Callable[[Recipe], bool] = lambda r: True,
    unique_tokens: float | None = None,
    law: ScalingLaw | None = None,
    timed: int = TIMED_RUNGS,
    clock: Callable[[], float] = time.perf_counter,
    speedup: float = 1.0,
) -> SizePlan:
    """Choose the rung with the lowest predicted loss after `hours`; `speed(recipe)` measures
    tokens/s. The smallest rung is timed first and the rungs that would train fewer than MIN_STEPS
    steps are dropped; then `timed` rungs, up to the largest whose timing fits `timing_limit`; the
    rest are scaled by FLOPs per token. A scaled choice is timed and the choice made again, at most
    CONFIRM_RUNGS times. No timing but the first begins past `planning_limit(hours)`. The rungs
    train `speedup` times faster than `speed` times them (`compiled_speedup`: timed eagerly, trained
    compiled): the same for every rung, it moves the tokens the hours buy, not the timings."""
    start = clock()
    law = law or law_for(recipe)
    rungs = ladder(recipe, fits)
    if not rungs:
        raise ConfigError(f"no size of recipe {recipe.name}'s ladder fits this device's memory")
    seq, seconds = recipe.train.seq_len, hours * 3600 * (1 - BUDGET_OVERHEAD)
    flops = {d: meta_model(r.model).flops_per_token(seq) for d, r in rungs}
    speeds = RungSpeeds(speed, flops, planning_limit(hours), start, clock)
    speeds.time(*rungs[0])

    def trained(d: int) -> float:  # tokens/s as the run trains
        return speeds.tokens_per_s(d) * speedup

    rungs = [
        (d, r)
        for i, (d, r) in enumerate(rungs)
        if i == 0 or trained(d) * seconds >= MIN_STEPS * r.train.tokens_per_step
    ]
    timeable = timeable_rungs(rungs, speeds, hours)
    spread = list(timeable)
    picks = sorted({round(i * (len(spread) - 1) / max(1, timed - 1)) for i in range(timed)})
    for d in reversed([spread[i] for i in picks]):  # the largest first: it scales the others best
        if d not in speeds.measured:
            speeds.time(d, timeable[d])
    own = meta_model(recipe.model).num_params(non_embedding=True)

    def choose() -> tuple[list[Candidate], Candidate]:
        return candidates(rungs, trained, speeds.measured, seconds, unique_tokens, law, own)

    out, best = choose()
    for _ in range(CONFIRM_RUNGS):  # until the choice is a timed rung (or cannot be timed)
        d = depth_of(best.size)
        if d in speeds.measured or d not in timeable:
            break
        speeds.time(d, timeable[d])
        if d not in speeds.measured:
            break  # the planner's time is spent
        out, best = choose()
    outside = not within_law(best.epochs, best.tokens_per_param, law.min_tokens_per_param)
    return SizePlan(hours, best.size, asdict(law), out, clock() - start, outside)


class RungSpeeds:
    """Each rung's tokens/s: timed by `speed` (`measured`), else FLOP-scaled from the nearest."""

    def __init__(
        self,
        speed: Callable[[Recipe], float],
        flops: dict[int, float],
        limit: float,
        start: float,
        clock: Callable[[], float],
    ):
        self.speed, self.flops, self.clock = speed, flops, clock
        self.limit, self.start = limit, start
        self.measured: dict[int, float] = {}
        self.costs: list[float] = []  # each timing's wall time

    def time(self, d: int, r: Recipe) -> None:
        if may_time(self.clock() - self.start, self.costs, self.limit):
            began = self.clock()
            self.measured[d] = self.speed(r)
            self.costs.append(self.clock() - began)

    def tokens_per_s(self, d: int) -> float:
        flops, measured = self.flops, self.measured
        near = min(measured, key=lambda m: abs(math.log(flops[m] / flops[d])))
        return measured.get(d, measured[near] * flops[near] / flops[d])


def timeable_rungs(
    rungs: list[tuple[int, Recipe]], speeds: RungSpeeds, hours: float
) -> dict[int, Recipe]:
    """The rungs timed already and those whose FLOP-scaled timing fits `timing_limit(hours)`."""
    steps = PLAN_SPEED_STEPS + PLAN_WARMUP_STEPS
    return {
        d: r
        for d, r in rungs
        if d in speeds.measured
        or steps * r.train.tokens_per_step / speeds.tokens_per_s(d) <= timing_limit(hours)
    }


def planning_limit(hours: float) -> float:
    return min(max(PLAN_TIME_MIN_S, PLAN_TIME_SHARE * hours * 3600), PLAN_TIME_MAX_S)


def may_time(spent: float, costs: list[float], limit: float) -> bool:
    """Whether a timing may begin: the first always, others while spent + max(costs) <= limit."""
    return not costs or spent + max(costs) <= limit


def timing_limit(hours: float) -> float:
    return min(max(MAX_TIMING_S, TIMING_SHARE * hours * 3600), MAX_TIMING_CAP_S)


def candidates(
    rungs: list[tuple[int, Recipe]],
    tokens_per_s: Callable[[int], float],
    measured: dict,
    seconds: float,
    unique_tokens: float | None,
    law: ScalingLaw,
    own_params: int,
) -> tuple[list[Candidate], Candidate]:
    """Each rung as a row of the table, and the one with the lowest predicted loss among those the law
    speaks for (`within_law`), marked chosen; when none is, the rung nearest the recipe's own size
    (`own_params`): the law alone would choose, on a GPU with a small text, hundreds of millions of
    parameters read hundreds of times (repeats are discounted, parameters never are)."""
    out = []
    for d, r in rungs:
        tps = tokens_per_s(d)
        tokens = tps * seconds
        n = meta_model(r.model).num_params(non_embedding=True)
        epochs = tokens / unique_tokens if unique_tokens else None
        loss = law.loss(n, effective_tokens(tokens, unique_tokens))
        out.append(Candidate(rung_name(d), n, tps, d in measured, tokens, epochs, loss))
    floor = law.min_tokens_per_param
    eligible = [c for c in out if within_law(c.epochs, c.tokens_per_param, floor)]
    if eligible:
        best = min(eligible, key=lambda c: c.predicted_loss)
    else:
        best = min(out, key=lambda c: abs(math.log(c.params / own_params)))
    best.chosen = True
    return out, best


def row_within_law(plan: dict, row: dict) -> bool:
    """`within_law` for a row of a plan read back from run.json (`kept_plan` checked its numbers); a plan
    written before the law kept its runs' fewest tokens per parameter is judged by epochs alone."""
    law = plan.get("law")
    floor = law.get("min_tokens_per_param", 0.0) if isinstance(law, dict) else 0.0
    return within_law(
        row.get("epochs"), row["tokens"] / row["params"], floor if _number(floor) else 0.0
    )


FIX_PLAN = '; delete its "plan" entry, or use a new run folder (or another --mirror folder)'


def kept_plan(info: dict | None, where: str = RUN_JSON) -> dict | None:
    """The plan a run folder's run.json keeps, checked to name a ladder rung (`where`: the file)."""
    plan = (info or {}).get("plan")
    if plan is None:
        return None
    cands = plan.get("candidates", []) if isinstance(plan, dict) else None
    if (
        not isinstance(cands, list)
        or not all(map(_is_candidate, cands))
        or not _number(plan.get("hours", 1))
        or plan.get("hours", 1) <= 0
    ):
        raise ConfigError(f"the plan in {where} is not a plan tinygpt wrote{FIX_PLAN}")
    try:
        depth_of(plan.get("size"))
    except ConfigError as e:
        raise ConfigError(f"the plan in {where}: {e}{FIX_PLAN}") from None
    return plan


def checkpoint_depth(folder: Path) -> int | None:
    """The ladder depth of the model a checkpoint folder holds (its layers, when their width is
    depth * HEAD_DIM), read from its weights' header; None when it holds no ladder rung or cannot be
    read (the trainer then says what is wrong with it)."""
    from safetensors import safe_open

    path = folder / MODEL_FILE
    try:
        check_safetensors(path)
        with safe_open(str(path), "pt") as f:
            keys = list(f.keys())
            width = f.get_slice("model.embed_tokens.weight").get_shape()[1]
    except (CheckpointError, OSError, ValueError, KeyError, IndexError):
        return None
    layers = {k.split(".")[2] for k in keys if k.startswith("model.layers.")}
    return len(layers) if width == len(layers) * HEAD_DIM else None


def planned_here(
    recipe: Recipe,
    hours: float,
    dev: torch.device,
    info: dict,
    own: bool,
    checkpoints: Path,
    where: str,
) -> tuple[Recipe, SizePlan | dict]:
    """`--size auto` for a run folder whose run.json is `info`: its kept plan where this user signed
    it (`own`); else that plan is no evidence: with no checkpoint in `checkpoints` this machine plans,
    and with one the size is the checkpoint's, which must be the plan's rung of the ladder (refused
    in one line naming `where`, the file, otherwise)."""
    kept = kept_plan(info, where)
    if own and kept is not None:
        return choose_size(recipe, hours, dev, kept, info.get("recipe"))
    saved = list_checkpoints(checkpoints)
    if not saved:
        return choose_size(recipe, hours, dev, None)
    depth = checkpoint_depth(saved[-1][1])
    size = kept.get("size") if kept is not None else None
    if depth is None or size != rung_name(depth):
        held = f"a {rung_name(depth)} model" if depth is not None else "no rung of the ladder"
        says = f"the plan in {where} says {size}" if kept is not None else f"{where} keeps no plan"
        raise ConfigError(
            f"checkpoint {saved[-1][1]} holds {held}, but {says}: the size comes from the "
            "checkpoint and the plan must agree; use another --mirror folder or a new run folder "
            "(or leave out --size auto)"
        )
    return resumed_at(recipe, kept, info.get("recipe")), kept


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_candidate(c: object) -> bool:
    """A row of a plan read back as tinygpt writes it (what the notebook's plot draws)."""
    return (
        isinstance(c, dict)
        and isinstance(c.get("size"), str)
        and isinstance(c.get("chosen"), bool)
        and all(_number(c.get(k)) and c[k] > 0 for k in ("params", "tokens", "tokens_per_s"))
        and _number(c.get("predicted_loss"))
        and (c.get("epochs") is None or _number(c["epochs"]) and c["epochs"] > 0)
    )


def fits_in(dev: torch.device, precision: str) -> Callable[[Recipe], bool]:
    """Whether a rung trains in this device's memory at its recipe's micro-batch (`check_fits`)."""

    def fits(r: Recipe) -> bool:
        try:
            check_fits(
                r.model, r.train.micro_batch_size, r.train.seq_len, precision, dev, r.train.loss
            )
        except ConfigError:
            return False
        return True

    return fits


def refuse_sized_base(init: str | None) -> None:
    """`--size auto` with a base to continue (`--init`), refused before the base is read."""
    if init:
        raise ConfigError(
            "--size auto chooses a new model's size; a continued base (--init) keeps its own: "
            "leave out --size"
        )


def choose_size(
    recipe: Recipe, hours: float, dev: torch.device, kept: dict | None, began: dict | None = None
) -> tuple[Recipe, SizePlan | dict]:
    """`--size auto`: the kept plan, else a new one here (`began`: the run's first recipe)."""
    if kept is not None:
        return resumed_at(recipe, kept, began), kept
    refuse_sized_base(recipe.model.init)
    precision = choose_precision(dev, recipe.train.precision).name
    plan = plan_size(
        recipe,
        hours,
        lambda r: trainer_speed(r, dev, steps=PLAN_SPEED_STEPS, warmup=PLAN_WARMUP_STEPS),
        fits=fits_in(dev, precision),
        unique_tokens=unique_tokens(recipe),
        speedup=compiled_speedup(recipe.train.compile, dev),
    )
    return apply_plan(recipe, plan), plan
