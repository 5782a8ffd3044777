"""Tables: rows of cells shown as HTML in a notebook and as aligned text elsewhere, and the tables
the notebooks show (hardware, recipes with their memory and time here, one recipe's summary,
start-up, a run's result, a finetuning base and its recipes). They arrange what the library
computes; nothing here decides."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from tinygpt.core.precision import resolve_device
from tinygpt.core.recipes import RECIPES, Recipe, get_recipe
from tinygpt.core.units import count, duration, size_gb
from tinygpt.finetune.memory_plan import device_need_gb, memory_table
from tinygpt.finetune.presets import FINETUNE_RECIPES
from tinygpt.fit.memory import estimate_memory
from tinygpt.fit.plan import choose_size
from tinygpt.fit.probe import ProbeError, probe, requested_precision
from tinygpt.fit.report import expectations, plan_note, plan_table


@dataclass
class Table:
    """Rows of cells, shown as an HTML table in a notebook and as aligned text elsewhere."""

    rows: list[tuple]
    title: str = ""
    header: bool = True  # the first row names the columns
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        widths = [max(len(str(c)) for c in column) for column in zip(*self.rows)]
        lines = [self.title] if self.title else []
        lines += [
            "  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in self.rows
        ]
        return "\n".join(lines + [f"  - {n}" for n in self.notes])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        out = [f"<h4>{html.escape(self.title)}</h4>"] if self.title else []
        out.append('<table style="border-collapse:collapse">')
        for i, row in enumerate(self.rows):
            tag = "th" if self.header and i == 0 else "td"
            cells = "".join(
                f'<{tag} style="text-align:left;padding:2px 10px">{html.escape(str(c))}</{tag}>'
                for c in row
            )
            out.append(f"<tr>{cells}</tr>")
        out.append("</table>")
        if self.notes:
            out.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in self.notes) + "</ul>")
        return "\n".join(out)


class Tables(list):
    """Several tables shown one after the other."""

    def __str__(self) -> str:
        return "\n\n".join(map(str, self))

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return "\n".join(t._repr_html_() for t in self)


def hardware_table(report: Any) -> Table:
    """The probe's hardware report (`probe.hardware_report()`) as a table."""
    return Table(report.rows(), "Hardware", header=False)


def _precision_for(recipe: Recipe, report: Any) -> str:
    """The recipe's precision; the probe's where it says auto, or bf16 this GPU only emulates."""

    p, _ = requested_precision(recipe, report.device, report.native_bf16)
    return report.precision if p == "auto" else p


def trial_search(recipe: Recipe | str, report: Any, time_limit_s: float = 15.0) -> Any:
    """The probe's trial search (largest micro-batch that fits) where it is meaningful: on a CUDA
    GPU, or a cpu recipe anywhere (capped at `time_limit_s`); else, or when nothing fits, None."""

    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if report.device != "cuda" and recipe.hardware != "cpu":
        return None
    try:
        return probe(recipe, time_limit_s=None if report.device == "cuda" else time_limit_s)
    except ProbeError:
        return None


def summary(
    recipe: Recipe | str,
    report: Any,
    search: Any = None,
    hardware: bool = True,
    hours: float | None = None,
) -> Tables:
    """Hardware (unless not `hardware`), the recipe's memory breakdown, the trial search (if given)
    and the expected memory, tokens/s and time to finish, for one recipe on this runtime; with
    `hours`, the size planner's table for that budget (what `pretrain(..., hours=hours,
    size="auto")` trains)."""

    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    t, prec = recipe.train, _precision_for(recipe, report)
    est = estimate_memory(
        recipe.model, t.micro_batch_size, t.seq_len, prec, device_type=report.device, loss=t.loss
    )
    tables = [hardware_table(report)] if hardware else []
    tables.append(
        Table(
            est.rows(),
            f"Memory of {recipe.name}: micro-batch {t.micro_batch_size}, "
            f"context {t.seq_len}, {prec} (estimated)",
            notes=(recipe.description,),
        )
    )
    if search is not None:
        rows = [
            ("micro-batch", search.micro_batch_size),
            ("accumulation steps", search.grad_accum_steps),
            ("context", search.seq_len),
            ("activation checkpointing", "on" if search.activation_checkpointing else "off"),
            ("precision", search.precision),
            ("measured peak", f"{search.peak_gb:.2f} of {search.memory_limit_gb:.1f} GB"),
        ]
        title = "Trial search" + (" (cached)" if search.from_cache else "")
        tables.append(Table(rows, title, header=False, notes=tuple(search.notes)))
    tables.append(
        Table(expectations(recipe, report, search).rows(), "Expected on this runtime", header=False)
    )
    if hours is not None:
        plan = choose_size(recipe, hours, resolve_device(report.device), None)[1]
        tables.append(
            Table(plan_table(plan), f"Size plan for {hours:g} h", notes=(plan_note(plan),))
        )
    return Tables(tables)


def recipes_table(report: Any) -> Table:
    """Every recipe with its size and the expected memory, speed and time to finish here."""

    rows: list[tuple] = [
        ("recipe", "for", "params", "context", "tokens", "memory", "fits", "tokens/s", "time")
    ]
    for name in RECIPES:
        r = get_recipe(name)
        n = estimate_memory(r.model, 1, 1, "fp32", device_type=report.device).n_params
        e = expectations(r, report)
        mark = " (default here)" if name == report.default_recipe else ""
        rows.append(
            (
                name + mark,
                r.hardware,
                count(n),
                r.train.seq_len,
                count(r.token_budget),
                size_gb(e.peak_memory_gb),
                "-" if e.fits is None else "yes" if e.fits else "no",
                "-" if e.tokens_per_s is None else f"{e.tokens_per_s:,.0f}",
                duration(e.time_to_finish_s),
            )
        )
    note = "memory is estimated; tokens/s and time are rough until measured (see the trial search)"
    return Table(rows, f"Recipes on this runtime ({report.name})", notes=(note,))


def startup_table(record: dict[str, Any]) -> Table:
    """A run's start-up breakdown (its metrics.jsonl "startup" record) as a table of phases."""
    rows: list[tuple] = [("phase", "seconds")]
    rows += [
        (k[:-2].replace("_", " "), f"{v:.1f}")
        for k, v in record.items()
        if k.endswith("_s") and k not in ("total_s", "compile_s")
    ]
    if record.get("compile_s"):
        rows.append(("  of which compile", f"{record['compile_s']:.1f}"))
    rows.append(("to the first step", f"{record.get('total_s', 0):.1f}"))
    return Table(rows, title="Start-up", notes=tuple(record.get("notes", ())))


def result_table(result: Any) -> Table:
    """What `pretrain` returned, as a table."""

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    rows = [
        ("step", result.step),
        ("loss", num(result.loss)),
        ("val_loss", num(result.val_loss)),
        ("best val_loss", num(result.best_val_loss)),
        ("checkpoint", result.checkpoint),
        ("tokens/s", "-" if not result.tokens_per_s else f"{result.tokens_per_s:,.0f}"),
        (
            "resumed",
            "no: a new run" if result.resumed_from is None else f"from step {result.resumed_from}",
        ),
    ]
    stopped = "stopped before the end: run the training cell again to continue"
    return Table(rows, "Training", header=False, notes=(stopped,) if result.interrupted else ())


# ---- finetuning ----------------------------------------------------------------------------------
def finetune_recipe_rows(
    base_config: dict[str, Any], hardware: str, memory_gb: float | None = None
) -> list[tuple]:
    """Every finetuning recipe with its estimated peak memory
    for this base and whether it fits (for `Table`)."""
    rows: list[tuple] = [("recipe", "memory", "fits", "what it is")]
    for name, r in FINETUNE_RECIPES.items():
        gb = device_need_gb(memory_table(r, hardware, base_config), hardware)
        fits = "-" if memory_gb is None else "yes" if gb <= 0.9 * memory_gb else "no"
        rows.append((name, f"{gb:.1f} GB", fits, r.description))
    return rows


def base_rows(base_config: dict[str, Any]) -> list[tuple]:
    """A base's shape at a glance (for `Table`)."""
    keys = {
        "model type": "model_type",
        "layers": "num_hidden_layers",
        "hidden size": "hidden_size",
        "vocabulary": "vocab_size",
        "context": "max_position_embeddings",
    }
    return [(name, base_config.get(k, "-")) for name, k in keys.items()]
