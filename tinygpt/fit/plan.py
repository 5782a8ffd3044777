"""The size planner: the model a time budget should
train, chosen from a ladder of sizes by a scaling law.

For `pretrain --size auto --hours H` (and `probe --hours H`): each rung of the recipe's
ladder (one family: depth with the width, heads and learning rate derived from it) gets
this machine's tokens/s (a few rungs timed with the trainer's own step, the chosen one
among them wherever its timing fits, the rest scaled from them by training FLOPs per
token, and said so), the tokens the hours buy at that
speed, and a predicted final loss L(N, D) = E + A/N^alpha + B/D^beta, with N the
non-embedding parameters and D the tokens seen (fewer than seen where the source is smaller
than the budget and would be read again: Muennighoff et al. 2023's effective data). The
lowest predicted loss is chosen among the rungs the law can speak for: those that read the source
at most MAX_EPOCHS times and see at least the tokens per parameter of the runs the law was fitted on;
tokens per parameter is a result, not an input. Where no rung is left (a small text on a fast GPU),
the recipe's own size is kept (the rung nearest it), said so.

Invariants: the plan is decided once, before anything is written, and kept in run.json ("plan"); a
resumed run takes its size from there (on another GPU too), never plans again. A rung is the
recipe's model with only the ladder's fields (n_layer, d_model, n_head, n_kv_head, d_ff) changed,
and its train config with only lr and min_lr scaled by width: everything else (vocabulary, context,
data, schedule) is the recipe's.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

import torch

from tinygpt.core.checkpoint import MODEL_FILE, CheckpointError, check_safetensors, list_checkpoints
from tinygpt.core.config import ConfigError, Recipe
from tinygpt.core.files import read_json_safe
from tinygpt.core.precision import choose_precision
from tinygpt.core.rundir import RUN_JSON
from tinygpt.data.sources import DataError, source_chars
from tinygpt.fit.hardware import check_fits
from tinygpt.fit.probe import trainer_speed
from tinygpt.model.gpt import meta_model

HEAD_DIM = 64  # each rung's width is depth * HEAD_DIM (nanochat's aspect ratio), in heads of 64 ...
# ... but never fewer than MIN_HEADS (Pythia-14M's 4 heads of 32 at width 128): on the built-in corpus, 2,235
# equal steps of d3 in 4 heads of 48 ended 1.5% below 3 of 64 (1.212 bits per byte against 1.231; 6 of 32:
# 1.238; docs/BENCHMARKS.md section 13), and the ladder's d3 is then cpu-fast itself
MIN_HEADS = 4
LADDER_DEPTHS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
# what a rung changes in a model
LADDER_FIELDS = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff")
PLANNED_FIELDS = frozenset(LADDER_FIELDS) | {"lr", "min_lr"}  # what a plan changes in a recipe
# rungs whose speed is measured; the others are scaled by FLOPs per token from the nearest
TIMED_RUNGS = 3
# the share of a budget that evaluations, checkpoints and samples take (not training)
BUDGET_OVERHEAD = 0.1
# optimizer steps timed per timed rung (after 2 of warm-up): the planner stays short
PLAN_SPEED_STEPS = 4
PLAN_WARMUP_STEPS = 2
# the longest a rung's timing may take, by its FLOP-scaled speed: MAX_TIMING_S, or TIMING_SHARE of a
# longer budget up to MAX_TIMING_CAP_S; a larger rung is scaled, never timed (on a CPU a 12-hour budget
# keeps rungs of hundreds of millions of parameters, minutes per step)
MAX_TIMING_S = 10.0
TIMING_SHARE = 0.01
MAX_TIMING_CAP_S = 60.0
# the planner's whole time: PLAN_TIME_SHARE of the budget, at least PLAN_TIME_MIN_S, at most
# PLAN_TIME_MAX_S. A timing is begun only while the time spent plus the longest timing so far fits; the
# rungs left untimed are scaled (~). The timings run eagerly (`trainer_speed`) and compile nothing: when
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
# R*_D of Muennighoff et al. (2023): how fast repeated epochs lose their value
REPEAT_HALF_LIFE = 15.4
# a rung that would read its source more often than this is not chosen while another is left: past
# ~4 epochs repeats stop paying (Muennighoff et al.), and on the CPU ladder they cost: d2 on ~12
# epochs of WikiText-2 memorised it (training loss 1.97, validation 4.35, rising in the decay;
# docs/BENCHMARKS.md section 13), a loss R*_D = 15.4 does not predict
MAX_EPOCHS = 4.0


def rung(recipe: Recipe, depth: int, min_heads: int = MIN_HEADS) -> Recipe:
    """The recipe at ladder depth `depth`: width depth*HEAD_DIM, heads of
    HEAD_DIM but at least MIN_HEADS (grouped as the recipe groups them), an MLP
    of 8/3 the width (a multiple of 64, SwiGLU's usual), and the learning rates
    scaled inversely with width from the recipe's own (GPT-3's table: 6e-4 at
    768, 3e-4 at 1536). `min_heads` 1: the ladder as it was before MIN_HEADS."""
    m, t = recipe.model, recipe.train
    d_model = depth * HEAD_DIM
    n_head = max(min_heads, d_model // HEAD_DIM)
    group = (m.n_head // m.n_kv_head) if m.n_kv_head else 1
    n_kv = n_head // group if group > 1 and n_head % group == 0 else None
    d_ff = 64 * max(1, round(8 * d_model / 3 / 64))
    scale = m.d_model / d_model
    return recipe.replace(
        model=dict(n_layer=depth, d_model=d_model, n_head=n_head, n_kv_head=n_kv, d_ff=d_ff),
        train=dict(lr=t.lr * scale, min_lr=t.min_lr * scale),
    )


def rung_name(depth: int) -> str:
    return f"d{depth}"


@dataclass(frozen=True)
class ScalingLaw:
    """L(N, D) = E + A / N**alpha + B / D**beta (nats per token), with where its constants came from and
    the fewest tokens per parameter among the runs they were fitted on (below it the law extrapolates)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str
    min_tokens_per_param: float = 0.0

    def loss(self, n_params: float, tokens: float) -> float:
        return self.E + self.A / n_params**self.alpha + self.B / tokens**self.beta


# The prior: Chinchilla's parametric fit (Hoffmann et al. 2022, approach 3) as re-fitted
# on its own data by Besiroglu et al. (2024, "Chinchilla Scaling: A replication
# attempt"), whose optimum agrees with Chinchilla's approaches 1 and 2 (~20 tokens per
# parameter); the constants as published (E 1.69, A 406.4, B 410.7, 0.34, 0.28) put it
# at 3-10 here. Fitted on 70M to 16B parameters: the law for GPU-scale rungs.
CHINCHILLA = ScalingLaw(
    1.8172,
    482.01,
    2085.43,
    0.3478,
    0.3658,
    "Chinchilla's fit (Hoffmann et al. 2022, as re-fitted by Besiroglu et al. 2024)",
    # its runs: 70M to 16B parameters on 5B to 500B tokens, so none saw fewer than 5B/16B per parameter
    5e9 / 16e9,
)
LAWS_FILE = "scaling_laws.json"  # beside this module, written by benchmarks/fit_scaling.py


def fitted_laws() -> dict[str, ScalingLaw]:
    """The laws benchmarks/fit_scaling.py fitted on
    tinygpt's own runs, by the recipe they ladder."""
    with resources.as_file(resources.files("tinygpt.fit") / LAWS_FILE) as path:
        if not path.is_file():
            return {}
        laws = read_json_safe(path, limit=1 << 20)["laws"]
    return {
        name: ScalingLaw(
            **{k: law[k] for k in ("E", "A", "B", "alpha", "beta", "source")},
            min_tokens_per_param=min(r["tokens"] / r["params"] for r in law["runs"]),
        )
        for name, law in laws.items()
    }


def law_for(recipe: Recipe) -> ScalingLaw:
    """The law fitted on this recipe's own ladder (same corpus
    and tokenizer) where there is one, else Chinchilla's."""
    return fitted_laws().get(recipe.name, CHINCHILLA)


def effective_tokens(tokens: float, unique: float | None) -> float:
    """Tokens seen, counted as Muennighoff et al.'s effective data when
    a source of `unique` tokens is read more than once: each repeat is
    worth less, and never more than REPEAT_HALF_LIFE epochs of it."""
    if unique is None or tokens <= unique:
        return tokens
    repeats = tokens / unique - 1
    return unique * (1 + REPEAT_HALF_LIFE * (1 - math.exp(-repeats / REPEAT_HALF_LIFE)))


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


def ladder(recipe: Recipe, fits: Callable[[Recipe], bool]) -> list[tuple[int, Recipe]]:
    """The rungs of the recipe's family that `fits` (this device's memory), smallest first."""
    return [(d, r) for d in LADDER_DEPTHS if fits(r := rung(recipe, d))]


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
) -> SizePlan:
    """Choose the rung with the lowest predicted loss after `hours`. `speed(recipe)` measures
    tokens/s (the probe's `trainer_speed`): the smallest rung first; the rungs that speed, scaled by
    FLOPs per token, buys fewer than MIN_STEPS steps in the hours are dropped (never timed); then
    the largest left whose timing takes at most MAX_TIMING_S (or TIMING_SHARE of a longer budget;
    by that scaled speed) and rungs between, `timed` in all; every other rung is scaled by FLOPs per
    token from the nearest timed one. A choice that was scaled is then timed (when its timing fits)
    and the choice made again, at most CONFIRM_RUNGS times: the chosen rung's speed is measured
    wherever it can be. Every timing but the first is begun only if it fits `planning_limit(hours)`
    by `clock` (`may_time`): the planner's own time is bounded."""
    start = clock()
    law = law or law_for(recipe)
    rungs = ladder(recipe, fits)
    if not rungs:
        raise ConfigError(f"no size of recipe {recipe.name}'s ladder fits this device's memory")
    seq, seconds = recipe.train.seq_len, hours * 3600 * (1 - BUDGET_OVERHEAD)
    flops = {d: meta_model(r.model).flops_per_token(seq) for d, r in rungs}
    measured: dict[int, float] = {}
    costs: list[float] = []  # each timing's wall time

    def time_rung(d: int, r: Recipe) -> None:
        if may_time(clock() - start, costs, planning_limit(hours)):
            began = clock()
            measured[d] = speed(r)
            costs.append(clock() - began)

    time_rung(*rungs[0])

    def tokens_per_s(d: int) -> float:
        near = min(measured, key=lambda m: abs(math.log(flops[m] / flops[d])))
        return measured.get(d, measured[near] * flops[near] / flops[d])

    rungs = [
        (d, r)
        for i, (d, r) in enumerate(rungs)
        if i == 0 or tokens_per_s(d) * seconds >= MIN_STEPS * r.train.tokens_per_step
    ]
    steps = PLAN_SPEED_STEPS + PLAN_WARMUP_STEPS
    timeable = {
        d: r
        for d, r in rungs  # the smallest is timed already, whatever it cost
        if d in measured or steps * r.train.tokens_per_step / tokens_per_s(d) <= timing_limit(hours)
    }
    spread = list(timeable)
    picks = sorted({round(i * (len(spread) - 1) / max(1, timed - 1)) for i in range(timed)})
    for d in reversed([spread[i] for i in picks]):  # the largest first: it scales the others best
        if d not in measured:
            time_rung(d, timeable[d])
    own = meta_model(recipe.model).num_params(non_embedding=True)
    out, best = candidates(rungs, tokens_per_s, measured, seconds, unique_tokens, law, own)
    for _ in range(CONFIRM_RUNGS):  # until the choice is a timed rung (or cannot be timed)
        d = depth_of(best.size)
        if d in measured or d not in timeable:
            break
        time_rung(d, timeable[d])
        if d not in measured:
            break  # the planner's time is spent
        out, best = candidates(rungs, tokens_per_s, measured, seconds, unique_tokens, law, own)
    outside = not within_law(best.epochs, best.tokens_per_param, law.min_tokens_per_param)
    return SizePlan(hours, best.size, asdict(law), out, clock() - start, outside)


def planning_limit(hours: float) -> float:
    """The planner's whole time for a budget of `hours` (PLAN_TIME_SHARE)."""
    return min(max(PLAN_TIME_MIN_S, PLAN_TIME_SHARE * hours * 3600), PLAN_TIME_MAX_S)


def may_time(spent: float, costs: list[float], limit: float) -> bool:
    """Whether another timing may begin: the first always; later ones while the time `spent` plus
    the longest timing so far (`costs`) stays within `limit`."""
    return not costs or spent + max(costs) <= limit


def timing_limit(hours: float) -> float:
    """The longest one rung's timing may take (by its FLOP-scaled speed) when planning `hours`."""
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
    speaks for (`within_law`), marked chosen. When none is, the rung nearest the recipe's own size
    (`own_params`, non-embedding): the law alone would choose the largest rung that fits (repeats are
    discounted, parameters never are), which on a GPU with a small text is hundreds of millions of
    parameters read hundreds of times."""
    out = []
    for d, r in rungs:
        tps = tokens_per_s(d)
        tokens = tps * seconds
        n = meta_model(r.model).num_params(non_embedding=True)
        out.append(
            Candidate(
                rung_name(d),
                n,
                tps,
                d in measured,
                tokens,
                tokens / unique_tokens if unique_tokens else None,
                law.loss(n, effective_tokens(tokens, unique_tokens)),
            )
        )
    eligible = [
        c for c in out if within_law(c.epochs, c.tokens_per_param, law.min_tokens_per_param)
    ]
    if eligible:
        best = min(eligible, key=lambda c: c.predicted_loss)
    else:
        best = min(out, key=lambda c: abs(math.log(c.params / own_params)))
    best.chosen = True
    return out, best


def within_law(epochs: float | None, tokens_per_param: float, min_tokens_per_param: float) -> bool:
    """Whether the law's prediction for a rung may choose it: it reads the source at most MAX_EPOCHS
    times (`epochs`; past that, repeats cost more than the law discounts) and sees at least the tokens
    per parameter of the law's own runs (fewer is extrapolation: a 12M-token text on an A100 for an
    hour would otherwise train 1.6B parameters on 0.02 tokens each)."""
    return (epochs is None or epochs <= MAX_EPOCHS) and tokens_per_param >= min_tokens_per_param


def row_within_law(plan: dict, row: dict) -> bool:
    """`within_law` for a row of a plan read back from run.json (`kept_plan` checked its numbers); a plan
    written before the law kept its runs' fewest tokens per parameter is judged by epochs alone."""
    law = plan.get("law")
    floor = law.get("min_tokens_per_param", 0.0) if isinstance(law, dict) else 0.0
    return within_law(
        row.get("epochs"), row["tokens"] / row["params"], floor if _number(floor) else 0.0
    )


def apply_plan(recipe: Recipe, plan: SizePlan | dict) -> Recipe:
    """The recipe at the plan's chosen size."""
    size = plan.size if isinstance(plan, SizePlan) else plan["size"]
    return rung(recipe, depth_of(size))


def resumed_at(recipe: Recipe, plan: dict, began: dict | None) -> Recipe:
    """The plan's rung as a resumed run trains it: the rung of the ladder the run `began` on
    (run.json's recipe), this one or the one before its small rungs kept MIN_HEADS. Only those
    two: a run.json (a mirror's too) may not choose the model."""
    depth = depth_of(plan["size"])
    before = rung(recipe, depth, min_heads=1)
    try:
        if began and ladder_fields(Recipe.from_dict(began)) == ladder_fields(before):
            return before
    except (ConfigError, KeyError, TypeError, ValueError):
        pass  # the run folder's check says what is wrong with it
    return rung(recipe, depth)


def ladder_fields(recipe: Recipe) -> dict:
    return {k: getattr(recipe.model, k) for k in LADDER_FIELDS}


def depth_of(size: str) -> int:
    """A rung's depth from its name ("d6"), refusing any name that is not on the ladder (run.json's
    plan comes back from a mirror: it may choose only among the ladder's rungs)."""
    if not (
        isinstance(size, str)
        and size[:1] == "d"
        and size[1:].isdigit()
        and int(size[1:]) in LADDER_DEPTHS
    ):
        raise ConfigError(
            f"size {size!r} is not on the ladder ({', '.join(map(rung_name, LADDER_DEPTHS))})"
        )
    return int(size[1:])


# Characters per token of a source, before its tokenizer exists (the plan comes first): a 4096-token
# BPE trained on the source (the CPU recipes') reads 3.61 on the built-in corpus and 3.66 on
# WikiText-2's test file (their token caches: 4.00M characters, 1.109M tokens; 1.255M, 343k); GPT-2's
# on English text. An estimate: the planner says "epochs ~"; only data-limited sources depend on it.
CHARS_PER_TOKEN = {"gpt2": 4.2, "train": 3.6}


def unique_tokens(recipe: Recipe) -> float | None:
    """About how many tokens training reads from the source before it repeats: its characters
    (`source_chars`: the files' sizes, at most `data.max_chars`) at CHARS_PER_TOKEN, less the
    validation split (`data.val_fraction`); None for a Hub corpus with no cap (more than any budget
    here reads)."""
    try:
        chars = source_chars(recipe.data)
    except DataError:
        chars = recipe.data.max_chars  # the source is refused later, with its own message
    if chars is None:
        return None
    per_token = CHARS_PER_TOKEN.get(recipe.data.tokenizer, CHARS_PER_TOKEN["train"])
    return chars * (1 - recipe.data.val_fraction) / per_token


FIX_PLAN = '; delete its "plan" entry, or use a new run folder (or another --mirror folder)'


def kept_plan(info: dict | None, where: str = RUN_JSON) -> dict | None:
    """The plan a run folder's run.json keeps (a resumed run's size), checked to name a ladder rung
    (`where`: the file, named in the refusal)."""
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
    """`--size auto` with a base to continue (`--init`): refused in one line (the CLI asks before
    reading the base)."""
    if init:
        raise ConfigError(
            "--size auto chooses a new model's size; a continued base (--init) keeps its own: "
            "leave out --size"
        )


def choose_size(
    recipe: Recipe, hours: float, dev: torch.device, kept: dict | None, began: dict | None = None
) -> tuple[Recipe, SizePlan | dict]:
    """`--size auto`: the run's kept plan (a resumed run keeps its size), else a new plan on this
    device, timing rungs with the trainer's own step (`trainer_speed`: eager, a short measurement).
    `began` is the recipe the run began with (run.json's; `resumed_at` says what it may keep)."""
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
    )
    return apply_plan(recipe, plan), plan
