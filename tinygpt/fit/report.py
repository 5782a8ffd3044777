"""What `tinygpt probe` and the notebooks show of a probe: expected peak memory, tokens/s and time
to finish (`expectations`), and the report as text or JSON (`probe_report`). Formatting only: the
caller prints."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tinygpt.core.callback import Callback
from tinygpt.core.gpu_classes import size_auto_recipe
from tinygpt.core.options import option
from tinygpt.core.precision import resolve_device
from tinygpt.core.recipes import Recipe, get_recipe
from tinygpt.core.units import count, duration, size_gb
from tinygpt.fit.hardware import HardwareReport, hardware_report, mfu
from tinygpt.fit.ladder import MAX_EPOCHS
from tinygpt.fit.memory import CUDA_CONTEXT_GB, MemoryEstimate, estimate_memory
from tinygpt.fit.plan import MIN_STEPS, SizePlan, choose_size
from tinygpt.fit.probe import ProbeError, apply_probe, probe, requested_precision
from tinygpt.fit.probe_cache import ProbeResult
from tinygpt.fit.step_speed import SPEED_STEPS, trainer_speed
from tinygpt.model.gpt import meta_model

ASSUMED_MFU = 0.4  # what a well-tuned small GPT reaches on one GPU (nanoGPT: ~40-50% on an A100)
# a rough guess of what PyTorch gets from one core in fp32; for expectations only
CPU_GFLOPS_PER_CORE = 25.0


@dataclass
class Expectations:
    recipe: str
    peak_memory_gb: float
    memory_source: str
    fits: bool | None  # None where total memory is unknown
    tokens_per_s: float | None
    tokens_per_s_source: str
    mfu: float | None
    token_budget: int
    time_to_finish_s: float | None

    def to_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        tps = "-"
        if self.tokens_per_s is not None:
            tps = f"{self.tokens_per_s:,.0f} ({self.tokens_per_s_source})"
        return [
            ("peak memory", f"{size_gb(self.peak_memory_gb)} ({self.memory_source})"),
            ("fits", "-" if self.fits is None else "yes" if self.fits else "no"),
            ("tokens/s", tps),
            ("MFU", "-" if self.mfu is None else f"{self.mfu:.0%}"),
            ("token budget", f"{self.token_budget:,}"),
            ("time to finish", duration(self.time_to_finish_s)),
        ]


def expectations(
    recipe: Recipe,
    report: HardwareReport,
    probe_result: ProbeResult | None = None,
    measured_tokens_per_s: float | None = None,
) -> Expectations:
    """Expected peak memory, tokens/s and time to finish the recipe's token budget on this hardware;
    `measured_tokens_per_s`: the trainer's own step timed where no probe searched (the CPU)."""
    if probe_result is not None:
        recipe = apply_probe(recipe, probe_result)
    t = recipe.train
    fpt = meta_model(recipe.model).flops_per_token(t.seq_len)
    context = CUDA_CONTEXT_GB if report.device == "cuda" else 0.0
    if probe_result is not None and not math.isnan(probe_result.peak_gb):
        peak = probe_result.peak_gb + context
        mem_src = "measured by trial" + (" + CUDA context" if context else "")
    else:
        peak, mem_src = _estimate(recipe, report).total_gb, "estimated"
    if probe_result is not None and probe_result.tokens_per_s:
        tps, tps_src = probe_result.tokens_per_s, probe_result.tokens_per_s_source
    elif measured_tokens_per_s:
        tps = measured_tokens_per_s
        tps_src = f"measured: the trainer's step, median of {SPEED_STEPS}"
    elif report.peak_tflops:
        tps = report.peak_tflops * 1e12 * ASSUMED_MFU / fpt
        tps_src = f"{report.peak_tflops:.0f} TFLOP/s peak x {ASSUMED_MFU:.0%} MFU assumed"
    elif report.device == "cpu":
        tps = report.cpu_cores * CPU_GFLOPS_PER_CORE * 1e9 / fpt
        tps_src = f"rough guess: {report.cpu_cores} cores x {CPU_GFLOPS_PER_CORE:.0f} GFLOP/s"
    else:
        tps, tps_src = None, "unknown on this device"
    fits = None if report.total_memory_gb is None else peak <= report.total_memory_gb
    budget, utilisation = recipe.token_budget, tps and mfu(tps, fpt, report.peak_tflops)
    finish = budget / tps if tps else None
    return Expectations(recipe.name, peak, mem_src, fits, tps, tps_src, utilisation, budget, finish)


@dataclass
class ProbeOptions:
    """What `tinygpt probe` reports on; each field is one of its options (core/options.py)."""

    recipe: str | None = option(
        None, help="probe for this recipe (default: the one this hardware suits)"
    )
    as_json: bool = option(False, flag="--json", help="print the report as JSON")
    hours: float | None = option(
        None,
        help="a time budget: the size planner's table for it (what "
        "`pretrain --hours H --size auto` would train here)",
    )


def format_table(rows: list[tuple]) -> str:
    """Rows as aligned text columns (the first row is not special)."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows
    )


def probe_report(
    recipe: str | None = None,
    as_json: bool = False,
    hours: float | None = None,
    *,
    cache_dir: str | Path | None = "default",
) -> str:
    """What `tinygpt probe [--recipe NAME] [--json] [--hours H]` prints. The trial search runs on a
    CUDA GPU; elsewhere the estimate stands in for it. With `hours`, the size planner's plan too."""
    report = hardware_report()
    rec = get_recipe(recipe or _default_recipe(report, hours))
    est = _estimate(rec, report)
    result, note, speed = _search_here(rec, report, cache_dir)
    exp = expectations(rec, report, result, speed)
    plan = (
        None if hours is None else choose_size(rec, hours, resolve_device(report.device), None)[1]
    )
    if as_json:
        return json.dumps(
            {
                "hardware": report.to_dict(),
                "recipe": rec.name,
                "memory_estimate": est.to_dict(),
                "search": result and result.to_dict(),
                "expectations": exp.to_dict(),
                "note": note,
                **({"plan": plan.to_dict()} if plan else {}),
            },
            indent=2,
        )
    out = [
        "Hardware",
        format_table(report.rows()),
        f"\nRecipe: {rec.name} (default here: {report.default_recipe})",
        f"\nMemory estimate at micro-batch {rec.train.micro_batch_size}, context "
        f"{rec.train.seq_len}, {est.precision}",
        format_table(est.rows()),
    ]
    if result is not None:
        out += _search_lines(result)
    if note:
        out.append(f"\n{note}")
    out += ["\nExpectations", format_table(exp.rows())]
    if plan is not None:
        out += [
            f"\nSize plan for {hours:g} h (pretrain --hours {hours:g} --size auto)",
            format_table(plan_table(plan)),
            plan_note(plan),
        ]
    return "\n".join(out)


def _default_recipe(report: HardwareReport, hours: float | None) -> str:
    """This machine's default; with hours, the recipe whose ladder --size auto plans here."""
    if hours:
        return size_auto_recipe(report.hardware_class, report.default_recipe)
    return report.default_recipe


def _estimate(rec: Recipe, report: HardwareReport) -> MemoryEstimate:
    """The estimate at the recipe's micro-batch and context, in the precision it takes here."""
    requested, _ = requested_precision(rec, report.device, report.native_bf16)
    prec = report.precision if requested == "auto" else requested
    t = rec.train
    return estimate_memory(
        rec.model, t.micro_batch_size, t.seq_len, prec, device_type=report.device, loss=t.loss
    )


def _search_here(
    rec: Recipe, report: HardwareReport, cache_dir: str | Path | None
) -> tuple[ProbeResult | None, str | None, float | None]:
    """(the probe's result, a note, the trainer's tokens/s): the trial search on a CUDA GPU; on a CPU
    a CPU recipe's step timed instead."""
    result, note, speed = None, None, None
    if report.device == "cuda":
        try:
            result = probe(rec, cache_dir=cache_dir)
        except ProbeError as e:
            note = str(e)
    else:  # host memory is plentiful and trials on a CPU mostly measure its speed: keep the recipe
        note = (
            f"the trial search runs on a CUDA GPU; on {report.device} the recipe's micro-batch "
            "is used as is and the estimate above stands in for a measurement"
        )
        # a CPU recipe's step takes a second: time it (a GPU recipe's would take minutes)
        if rec.hardware == "cpu":
            speed = trainer_speed(rec, report.device)
    return result, note, speed


def _search_lines(result: ProbeResult) -> list[str]:
    """The trial search's result and notes, as `probe_report` prints them."""
    limit = f" of its {result.time_limit_s:.0f} s limit" if result.time_limit_s else ""
    searched = f" ({len(result.trials)} trials, {result.search_s:.1f} s{limit})"
    cached = " (cached)" if result.from_cache else searched
    ckpt = "on" if result.activation_checkpointing else "off"
    return [
        f"\nSearch{cached}: micro-batch {result.micro_batch_size} x {result.grad_accum_steps} "
        f"accumulation steps x context {result.seq_len}, checkpointing {ckpt}, {result.precision}, "
        f"peak {result.peak_gb:.2f} of {result.memory_limit_gb:.1f} GB"
    ] + [f"  - {n}" for n in result.notes]


def plan_table(plan: SizePlan) -> list[tuple[str, ...]]:
    """The plan as rows: a header, then one per candidate, the choice marked."""
    rows = [("size", "params", "tokens/s", "tokens", "tokens/param", "epochs", "pred. loss", "")]
    return rows + [
        (
            c.size,
            count(c.params),
            f"{c.tokens_per_s:,.0f}" + ("" if c.timed else " ~"),
            count(c.tokens),
            _per_param(c.tokens_per_param),
            "-" if c.epochs is None else f"{c.epochs:.1f}",
            f"{c.predicted_loss:.3f}",
            "<- chosen" if c.chosen else "",
        )
        for c in plan.candidates
    ]


def plan_note(plan: SizePlan) -> str:
    c = plan.choice
    if plan.outside_law:
        fewest = plan.law.get("min_tokens_per_param", 0.0)
        return (
            f"size auto: {c.size}, the recipe's own size: in {plan.hours:g} h every size would read the "
            f"source more than {MAX_EPOCHS:g} times or see fewer than {fewest:.2g} tokens per parameter "
            "(the law's own runs' fewest), where the law does not hold; give more text, or finetune a "
            "pretrained model (tinygpt finetune)"
        )
    measured = (
        f"{count(c.params)} non-embedding parameters, {c.tokens_per_s:,.0f} tokens/s"
        f"{'' if c.timed else ' ~'}, {count(c.tokens)} tokens in {plan.hours:g} h, "
        f"{_per_param(c.tokens_per_param)} tokens per parameter"
    )
    scaled = ""
    if any(not x.timed for x in plan.candidates):
        scaled = "; ~ marks a speed scaled by FLOPs from a timed size"
    if len(plan.candidates) == 1:  # each larger rung would train fewer than MIN_STEPS steps
        return (
            f"size auto: {c.size}, the smallest size and the only one left: {plan.hours:g} h is "
            f"below the range the plan chooses in (every larger size would train fewer than "
            f"{MIN_STEPS} steps, or does not fit); measured: {measured}{scaled}"
        )
    return (
        f"size auto: {c.size} ({measured}), the lowest predicted loss "
        f"({c.predicted_loss:.3f}; law: {plan.law['source']}){scaled}"
    )


def _per_param(x: float) -> str:
    """Tokens per parameter as a figure that is never 0.0 for a short budget's fraction."""
    return f"{x:.1f}" if x >= 0.1 else f"{x:.2g}"


# a run whose time budget buys fewer than this share of the tokens its plan counted on is told so:
# the machine is slower than when the plan timed it, and the plan's choice may be too large
PLAN_SHORTFALL = 0.7


def shortfall_note(plan: SizePlan, tokens: float, tokens_per_s: float) -> str | None:
    """What to say when the run's budget buys `tokens` (at `tokens_per_s`, evaluations and saves
    included) and that is under PLAN_SHORTFALL of what the plan's choice counted on; else None."""
    c = plan.choice
    if tokens >= PLAN_SHORTFALL * c.tokens:
        return None
    return (
        f"size auto: {c.size} trains at {tokens_per_s:,.0f} tokens/s here now, not the "
        f"{c.tokens_per_s:,.0f} the plan {'measured' if c.timed else 'scaled from a timed size'}: "
        f"{count(tokens)} tokens in the hours, "
        f"{tokens / c.tokens:.0%} of the {count(c.tokens)} it counted on, so a smaller size may "
        "do better; `tinygpt probe --hours` plans again on the machine as it is"
    )


class PlanReport(Callback):
    """Says the plan when training starts (a resumed run: its kept size), and once the time budget
    has fixed the run's steps, whether they buy too few tokens (`shortfall_note`)."""

    def __init__(self, plan: SizePlan | dict):
        self.plan = plan
        self.told = False

    def on_step(self, trainer: Any) -> None:
        if self.told or isinstance(self.plan, dict) or not trainer.step_s or not trainer.max_steps:
            return
        per_step = trainer.cfg.tokens_per_step
        note = shortfall_note(self.plan, trainer.max_steps * per_step, per_step / trainer.step_s)
        if note:
            trainer.say(note)
            self.told = True

    def on_start(self, trainer: Any, resumed_from: int | None) -> None:
        if isinstance(self.plan, dict):
            trainer.say(
                f"size auto: {self.plan['size']}, as planned when the run began (kept in run.json)"
            )
            return
        for line in format_table(plan_table(self.plan)).splitlines():
            trainer.say(line)
        trainer.say(plan_note(self.plan))
