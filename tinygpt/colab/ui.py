"""Notebook pieces: Drive and run folders, the recipe picker, tables, the live loss plot, the download.

Every piece also works outside a notebook: tables print as text, the picker's `value` is its
default, the plot draws to `plots/loss.png` (or nothing without matplotlib). ipywidgets and
matplotlib are imported only where they are used (``pip install "tinygpt[notebooks]"``).
`TINYGPT_SMOKE=1` turns a notebook into a seconds-long smoke test (CI runs them that way).
"""
from __future__ import annotations

import html
import io
import json
import math
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tinygpt.colab.finetune_ui import (  # noqa: F401  (handed on: notebooks reach everything through `ui`)
    SMOKE_TRAIN,
    base_rows,
    recipe_rows,
    run_status,
    smoke_base,
    smoke_data,
)
from tinygpt.colab.mount import DRIVE_RUNS, drive_run_dir, in_colab, mount_drive  # noqa: F401  (for the notebooks)
from tinygpt.core.callback import Callback
from tinygpt.core.checkpoint import MANIFEST, STATE_FILE, latest_valid, list_checkpoints, read_manifest
from tinygpt.core.config import RECIPES, Recipe, get_recipe
from tinygpt.core.files import atomic_output, link_problem
from tinygpt.core.precision import resolve_device
from tinygpt.core.rundir import PLOTS, RUN_FILES, RunDir, recipe_name_of
from tinygpt.core.units import count, duration, size_gb
from tinygpt.finetune.recipes import FINETUNE_RECIPES, default_finetune_recipe, this_hardware
from tinygpt.model.generate import generate_text
from tinygpt.model.loading import load_run
from tinygpt.train.budget import Budget
from tinygpt.train.data import validation_text
from tinygpt.train.hardware import hardware_report
from tinygpt.train.init import pretrain_recipe, run_init  # noqa: F401  (pretrain_recipe: for the notebooks)
from tinygpt.train.memory import estimate_memory
from tinygpt.train.probe import ProbeError, expectations, probe, requested_precision

SMOKE_RECIPE = "cpu-smoke"
SMOKE_SETTINGS: dict[str, int] = {"max_steps": 12, "save_every": 4, "eval_every": 4}
INSTALL_HINT = 'pip install "tinygpt[notebooks]"  (or: pip install ipywidgets matplotlib)'


def smoke_mode() -> bool:
    """True when TINYGPT_SMOKE is set (to anything but 0): the tiny recipe and a few steps."""
    return os.environ.get("TINYGPT_SMOKE", "") not in ("", "0")


def smoke_settings() -> dict[str, int]:
    """Keyword arguments for `pretrain` that shorten a run in smoke mode; empty otherwise."""
    return dict(SMOKE_SETTINGS) if smoke_mode() else {}


def in_notebook() -> bool:
    """True inside a Jupyter / Colab kernel (not in a terminal IPython, not in plain Python)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _display(obj: Any, **kwargs: Any) -> Any:
    from IPython.display import display
    return display(obj, **kwargs)


# ---- tables ----------------------------------------------------------------------------------------

@dataclass
class Table:
    """Rows of cells, shown as an HTML table in a notebook and as aligned text elsewhere."""
    rows: list[tuple]
    title: str = ""
    header: bool = True  # the first row names the columns
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        widths = [max(len(str(r[i])) for r in self.rows) for i in range(len(self.rows[0]))] if self.rows else []
        lines = [self.title] if self.title else []
        lines += ["  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in self.rows]
        return "\n".join(lines + [f"  - {n}" for n in self.notes])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        out = [f"<h4>{html.escape(self.title)}</h4>"] if self.title else []
        out.append('<table style="border-collapse:collapse">')
        for i, row in enumerate(self.rows):
            tag = "th" if self.header and i == 0 else "td"
            cells = "".join(f'<{tag} style="text-align:left;padding:2px 10px">{html.escape(str(c))}</{tag}>'
                            for c in row)
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
    """The recipe's precision; the probe's where it says auto, or bf16 on a GPU that only emulates it."""

    p, _ = requested_precision(recipe, report.device, report.native_bf16)
    return report.precision if p == "auto" else p


def trial_search(recipe: Recipe | str, report: Any, time_limit_s: float = 15.0) -> Any:
    """The probe's trial search (largest micro-batch that fits) where it is meaningful: on a CUDA GPU,
    or a cpu recipe anywhere (capped at `time_limit_s`); None elsewhere or when nothing fits."""

    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if report.device != "cuda" and recipe.hardware != "cpu":
        return None
    try:
        return probe(recipe, time_limit_s=None if report.device == "cuda" else time_limit_s)
    except ProbeError:
        return None


def summary(recipe: Recipe | str, report: Any, search: Any = None, hardware: bool = True) -> Tables:
    """Hardware (unless not `hardware`), the recipe's memory breakdown, the trial search (if given) and
    the expected memory, tokens/s and time to finish, for one recipe on this runtime."""

    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    t, prec = recipe.train, _precision_for(recipe, report)
    est = estimate_memory(recipe.model, t.micro_batch_size, t.seq_len, prec, device_type=report.device, loss=t.loss)
    tables = [hardware_table(report)] if hardware else []
    tables.append(Table(est.rows(), f"Memory of {recipe.name}: micro-batch {t.micro_batch_size}, "
                                    f"context {t.seq_len}, {prec} (estimated)", notes=(recipe.description,)))
    if search is not None:
        tables.append(Table([("micro-batch", search.micro_batch_size), ("accumulation steps", search.grad_accum_steps),
                             ("context", search.seq_len),
                             ("activation checkpointing", "on" if search.activation_checkpointing else "off"),
                             ("precision", search.precision),
                             ("measured peak", f"{search.peak_gb:.2f} of {search.memory_limit_gb:.1f} GB")],
                            "Trial search" + (" (cached)" if search.from_cache else ""), header=False,
                            notes=tuple(search.notes)))
    tables.append(Table(expectations(recipe, report, search).rows(), "Expected on this runtime", header=False))
    return Tables(tables)


def recipes_table(report: Any) -> Table:
    """Every recipe with its size and the expected memory, speed and time to finish on this runtime."""

    rows: list[tuple] = [("recipe", "for", "params", "context", "tokens", "memory", "fits", "tokens/s", "time")]
    for name in RECIPES:
        r = get_recipe(name)
        n = estimate_memory(r.model, 1, 1, "fp32", device_type=report.device).n_params
        e = expectations(r, report)
        mark = " (default here)" if name == report.default_recipe else ""
        rows.append((name + mark, r.hardware, count(n), r.train.seq_len, count(r.token_budget),
                     size_gb(e.peak_memory_gb), "-" if e.fits is None else "yes" if e.fits else "no",
                     "-" if e.tokens_per_s is None else f"{e.tokens_per_s:,.0f}", duration(e.time_to_finish_s)))
    return Table(rows, f"Recipes on this runtime ({report.name})",
                 notes=("memory is estimated; tokens/s and time are rough until measured (see the trial search)",))


def startup_table(record: dict[str, Any]) -> Table:
    """A run's start-up breakdown (its metrics.jsonl "startup" record) as a table of phases."""
    rows: list[tuple] = [("phase", "seconds")]
    rows += [(k[:-2].replace("_", " "), f"{v:.1f}") for k, v in record.items()
             if k.endswith("_s") and k not in ("total_s", "compile_s")]
    if record.get("compile_s"):
        rows.append(("  of which compile", f"{record['compile_s']:.1f}"))
    rows.append(("to the first step", f"{record.get('total_s', 0):.1f}"))
    return Table(rows, title="Start-up", notes=tuple(record.get("notes", ())))


def result_table(result: Any) -> Table:
    """What `pretrain` returned, as a table."""
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    rows = [("step", result.step), ("loss", num(result.loss)), ("val_loss", num(result.val_loss)),
            ("best val_loss", num(result.best_val_loss)), ("checkpoint", result.checkpoint),
            ("tokens/s", "-" if not result.tokens_per_s else f"{result.tokens_per_s:,.0f}"),
            ("resumed", "no: a new run" if result.resumed_from is None else f"from step {result.resumed_from}")]
    notes = ("stopped before the end: run the training cell again to continue",) if result.interrupted else ()
    return Table(rows, "Training", header=False, notes=notes)


# ---- Drive and run folders -------------------------------------------------------------------------

def workdir() -> Path:
    """Where runs and Drive live on this machine: $TINYGPT_WORKDIR, else /content in Colab, else here."""
    if os.environ.get("TINYGPT_WORKDIR"):
        return Path(os.environ["TINYGPT_WORKDIR"])
    return Path("/content") if in_colab() else Path.cwd()


def connect_drive(root: str | Path | None = None) -> Path:
    """Your Drive's MyDrive folder: mounted at <workdir>/drive in Colab (it asks for permission);
    elsewhere a local folder at the same place stands in for it."""
    drive_dir = Path(root or workdir()) / "drive"
    if in_colab():
        return mount_drive(drive_dir)
    mydrive = drive_dir / "MyDrive"
    mydrive.mkdir(parents=True, exist_ok=True)
    return mydrive


@dataclass
class RunFolders:
    """A run's two homes: `local` (fast disk, lost with the VM) and `mirror` (on Drive, kept)."""
    name: str
    local: Path
    mirror: Path

    def mirrored_step(self) -> int | None:
        """The newest checkpoint step on the mirror (None when there is none)."""
        ckpts = list_checkpoints(RunDir(self.mirror).checkpoints)
        return ckpts[-1][0] if ckpts else None

    def __str__(self) -> str:
        step, recipe = self.mirrored_step(), recipe_name_of(self.mirror, self.local)
        state = (f"on Drive: step {step} of recipe {recipe}; training continues from there" if step is not None
                 else "nothing on Drive yet: a new run")
        return f"run {self.name!r}\n  local:  {self.local}\n  Drive:  {self.mirror}\n  {state}"

    __repr__ = __str__


def run_folders(name: str, mydrive: str | Path) -> RunFolders:
    """<workdir>/runs/<name> locally, mirrored to MyDrive/tinygpt/runs/<name>."""
    if not name or name.strip() != name or any(c in name for c in "/\\") or name.startswith("."):
        raise ValueError(f"run name {name!r} must be a plain folder name, e.g. 'my-first-gpt'")
    return RunFolders(name, workdir() / "runs" / name, drive_run_dir(name, mydrive))


def default_recipe(report: Any = None, resume_from: RunFolders | str | Path | None = None) -> tuple[str, str]:
    """(recipe name, why): the run being resumed decides first, then smoke mode, then the probe."""
    folders = (resume_from.mirror, resume_from.local) if isinstance(resume_from, RunFolders) else (resume_from,)
    resumed = recipe_name_of(*folders)
    if resumed in RECIPES:
        return resumed, "the recipe of the run on Drive (it continues where it stopped)"
    if smoke_mode():
        return SMOKE_RECIPE, "TINYGPT_SMOKE is set"
    if report is None:
        report = hardware_report()
    return report.default_recipe, f"the probe's choice for this {report.hardware_class} runtime"


# ---- the recipe picker -----------------------------------------------------------------------------

# The time a runtime of each class usually gives one session (Colab's free T4 and L4 about 3 h before
# a disconnect is likely; an A100 or H100 costs compute units by the hour): the default budget.
SESSION_HOURS: dict[str, float | None] = {"cpu": None, "mps": None, "t4": 3.0, "l4": 3.0, "a100": 2.0,
                                          "h100": 2.0, "h200": 2.0}
HOURS_CHOICES: list[tuple[str, float | None]] = [("the recipe's steps", None), ("15 min", 0.25), ("30 min", 0.5),
                                                 ("1 h", 1.0), ("2 h", 2.0), ("3 h", 3.0), ("6 h", 6.0),
                                                 ("12 h", 12.0), ("24 h", 24.0)]


def default_hours(report: Any, resume_from: RunFolders | str | Path | None = None) -> tuple[float | None, str]:
    """(hours or None, why): a resumed run keeps its own budget (or none); smoke mode and CPUs train the
    recipe's steps; a GPU gets what a session of its class usually lasts."""
    folders = (resume_from.mirror, resume_from.local) if isinstance(resume_from, RunFolders) else (resume_from,)
    for folder in folders:
        if folder is not None and RunDir(folder).is_pretrain_run():
            budget = Budget.load(Path(folder))
            return (budget.hours, "the run's own budget") if budget else (None, "the run has no time budget")
    if smoke_mode():
        return None, "TINYGPT_SMOKE is set"
    hours = SESSION_HOURS.get(report.hardware_class)
    return hours, (f"about one {report.hardware_class} session" if hours else "a CPU trains the recipe's steps")

def _widgets() -> Any:
    """ipywidgets for a dropdown, or None in a script without it (a picker's `value` is then its default);
    in a notebook without it, an ImportError that says what to install."""
    try:
        return __import__("ipywidgets")
    except ImportError:
        if in_notebook():
            raise ImportError(f"the recipe dropdown needs ipywidgets: {INSTALL_HINT}") from None
        return None


class RecipePicker:
    """A dropdown of the recipes with the right default and, under it, every recipe's memory and time
    on this runtime, then the chosen recipe's memory breakdown and expectations (updated on change).
    The training cell reads `value` when it runs, so Run all trains the default."""

    def __init__(self, report: Any, resume_from: RunFolders | str | Path | None = None):
        self.report = report
        self.default, self.reason = default_recipe(report, resume_from)
        self.default_hours, self.hours_reason = default_hours(report, resume_from)
        self.dropdown = self._output = self.hours_dropdown = None
        widgets = _widgets()
        if widgets is None:
            return  # a script: `value` is the default
        options = [(f"{name}  ({RECIPES[name].hardware})", name) for name in RECIPES]
        self.dropdown = widgets.Dropdown(options=options, value=self.default, description="recipe",
                                         layout=widgets.Layout(width="max-content"))
        # the summary is an HTML widget, not an Output one: it renders the same in Colab (ipywidgets 7),
        # classic Jupyter and JupyterLab (8), where capturing into an Output widget differs between them
        self.summary = widgets.HTML()
        self.dropdown.observe(lambda change: self._show_summary(), names="value")
        choices = HOURS_CHOICES if self.default_hours in [h for _, h in HOURS_CHOICES] else \
            HOURS_CHOICES + [(f"{self.default_hours:g} h", self.default_hours)]
        self.hours_dropdown = widgets.Dropdown(options=choices, value=self.default_hours, description="time",
                                               layout=widgets.Layout(width="max-content"))

    @property
    def value(self) -> str:
        return self.dropdown.value if self.dropdown is not None else self.default

    @property
    def hours(self) -> float | None:
        """The time budget chosen (None: train the recipe's steps); `pretrain(..., hours=picker.hours)`."""
        return self.hours_dropdown.value if self.hours_dropdown is not None else self.default_hours

    def _show_summary(self) -> None:
        tables = Tables([recipes_table(self.report), *summary(self.value, self.report, hardware=False)])
        self.summary.value = tables._repr_html_()

    def _ipython_display_(self) -> None:
        if self.dropdown is None:
            return _display(str(self))
        widgets = __import__("ipywidgets")
        self._show_summary()
        _display(widgets.VBox([self.dropdown, widgets.HTML(f"<i>default: {html.escape(self.reason)}</i>"),
                               self.hours_dropdown, widgets.HTML(
                                   f"<i>time available for training: {html.escape(self.hours_reason)}; the run "
                                   "measures its speed and sets its steps to end on time</i>"),
                               self.summary]))

    def __repr__(self) -> str:
        budget = "the recipe's steps" if self.hours is None else f"{self.hours:g} h"
        return f"recipe: {self.value} (default: {self.default}, {self.reason}); time: {budget}"


def recipe_picker(report: Any = None, resume_from: RunFolders | str | Path | None = None) -> RecipePicker:
    """The recipe dropdown; `report` defaults to `probe.hardware_report()`."""
    if report is None:
        report = hardware_report()
    return RecipePicker(report, resume_from)


class FinetunePicker:
    """02_finetune's recipe dropdown (the run's own recipe, or the default for this base on this runtime)
    over the table of every recipe's memory here. The training cell reads `value` when it runs."""

    def __init__(self, base_config: dict[str, Any], run: RunFolders | None = None):
        self.hardware, self.gpu_gb = this_hardware()
        resume = [run.mirror, run.local] if run is not None else []
        self.default, self.reason = default_finetune_recipe(base_config, self.hardware, self.gpu_gb,
                                                            resume_from=resume)
        self.table = Table(recipe_rows(base_config, self.hardware, self.gpu_gb),
                           f"Recipes on this {self.hardware} runtime", notes=(self.reason,))
        self.dropdown = None
        widgets = _widgets()
        if widgets is None:
            return  # a script: `value` is the default
        self.dropdown = widgets.Dropdown(options=list(FINETUNE_RECIPES), value=self.default, description="recipe")

    @property
    def value(self) -> str:
        return self.dropdown.value if self.dropdown is not None else self.default

    def _ipython_display_(self) -> None:
        if self.dropdown is not None:
            _display(self.dropdown)
        _display(self.table)

    def __repr__(self) -> str:
        return f"recipe: {self.value} (default: {self.default}, {self.reason})\n{self.table}"


def finetune_picker(base_config: dict[str, Any], run: RunFolders | None = None) -> FinetunePicker:
    """The finetuning recipe dropdown and the memory table, in one call."""
    return FinetunePicker(base_config, run)


# ---- the base of a pretraining run (continued pretraining) ------------------------------------------

# 01_pretrain's base dropdown: small Hub models whose architecture tinygpt's GPT is (Llama's layers, no biases).
HUB_BASES = (("from scratch", None),
             ("SmolLM2-135M (Hub, 135M, any GPU)", "hf:HuggingFaceTB/SmolLM2-135M"),
             ("SmolLM2-360M (Hub, 362M, L4 / A100)", "hf:HuggingFaceTB/SmolLM2-360M"),
             ("TinyLlama 1.1B v1.1 (Hub, A100)", "hf:TinyLlama/TinyLlama_v1.1"))


class BasePicker:
    """01_pretrain's base dropdown: from scratch, or a Hub model whose weights and tokenizer the run starts from
    (`tinygpt pretrain --init`). It defaults to the run's own base when resuming. `value` is the base (None: from
    scratch), read by the training cell when it runs."""

    def __init__(self, resume_from: RunFolders | str | Path | None = None):
        folders = (resume_from.local, resume_from.mirror) if isinstance(resume_from, RunFolders) else (resume_from,)
        self.default = run_init(*folders)
        self.reason = "the run's own base" if self.default else "a new run trains from scratch unless you pick a base"
        options = list(HUB_BASES) + ([(self.default, self.default)] if self.default not in dict(HUB_BASES).values()
                                     else [])
        self.dropdown = None
        widgets = _widgets()
        if widgets is not None:
            self.dropdown = widgets.Dropdown(options=options, value=self.default, description="base",
                                             layout=widgets.Layout(width="max-content"))

    @property
    def value(self) -> str | None:
        return self.dropdown.value if self.dropdown is not None else self.default

    def _ipython_display_(self) -> None:
        if self.dropdown is None:
            return _display(str(self))
        _display(__import__("ipywidgets").VBox([self.dropdown, __import__("ipywidgets").HTML(
            f"<i>default: {html.escape(self.reason)}; a base brings its own architecture, tokenizer and context, "
            "trained at a lower learning rate</i>")]))

    def __repr__(self) -> str:
        return f"base: {self.value or 'from scratch'} (default: {self.default or 'from scratch'}, {self.reason})"


def base_picker(resume_from: RunFolders | str | Path | None = None) -> BasePicker:
    """The base dropdown of 01_pretrain (from scratch or a Hub model)."""
    return BasePicker(resume_from)


# ---- the live loss plot ----------------------------------------------------------------------------

class LossPlot(Callback):
    """Trainer callback: loss and val_loss against steps (tokens on the top axis), redrawn at most
    every `min_interval_s` in the notebook and saved to <run_dir>/plots/loss.png at the end.
    In a kernel it needs matplotlib; elsewhere, without matplotlib, it does nothing."""

    def __init__(self, run_dir: str | Path | None = None, *, min_interval_s: float = 2.0,
                 show: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.show = in_notebook() if show is None else show
        self.min_interval_s, self.clock = min_interval_s, clock
        self.history: list[dict] = []
        self.draws, self.figure, self._handle, self._last_draw = 0, None, None, -math.inf
        try:
            __import__("matplotlib")
            self.enabled = True
        except ImportError:
            if self.show:
                raise ImportError(f"the live loss plot needs matplotlib: {INSTALL_HINT}") from None
            self.enabled = False

    def on_log(self, metrics: dict[str, Any]) -> None:
        if not self.history and self.run_dir is not None:
            self.history = self._earlier(int(metrics.get("step", 0)))  # a resumed run: the curve so far
        self.history.append(dict(metrics))
        if self.enabled and self.clock() - self._last_draw >= self.min_interval_s:
            self.draw()

    @property
    def shows_startup(self) -> bool:
        """True when the start-up table is shown here: the trainer then does not print it as a line too."""
        return bool(self.show)

    def on_startup(self, record: dict[str, Any]) -> None:
        """After the first step: where the start-up time went, as a table above the plot."""
        if self.show:
            _display(startup_table(record))

    def _earlier(self, step: int) -> list[dict]:
        """Entries before `step` in metrics.jsonl (the trainer cut it at the resumed step already)."""
        try:
            return [m for m in RunDir(self.run_dir).metrics() if m.get("step", 0) < step]
        except (OSError, ValueError):  # an unreadable log: the plot starts here instead
            return []

    def draw(self) -> Any:
        """Render the figure now (and show it in the notebook); the matplotlib Figure."""
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter

        self._last_draw = self.clock()
        fig = Figure(figsize=(7.5, 3.6), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        for key, style in (("loss", dict(lw=1.2)), ("val_loss", dict(marker="o", ms=3, lw=1.2))):
            pts = [(m["step"], m[key]) for m in self.history if m.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), label=key.replace("_", " "), **style)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.grid(alpha=0.3)
        if any(m.get("loss") is not None or m.get("val_loss") is not None for m in self.history):
            ax.legend(loc="upper right")
        per_step = next((m["tokens"] / m["step"] for m in self.history if m.get("tokens") and m.get("step")), None)
        if per_step:
            top = ax.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda t: t / per_step))
            top.xaxis.set_major_formatter(EngFormatter())
            top.set_xlabel("tokens")
        latest = {k: next((m[k] for m in reversed(self.history) if m.get(k) is not None), None)
                  for k in ("step", "loss", "val_loss", "expected_final_loss")}
        ax.set_title(", ".join(f"{k.replace('_', ' ').replace('expected final loss', 'heading for')} {v:.4g}"
                               for k, v in latest.items() if v is not None), fontsize=10)
        self.figure = fig
        self.draws += 1
        if self.show:
            from IPython.display import Image
            buf = io.BytesIO()
            fig.savefig(buf, format="png")
            image = Image(data=buf.getvalue(), format="png")
            if self._handle is None:
                self._handle = _display(image, display_id=True)
            else:
                self._handle.update(image)
        return fig

    def close(self) -> None:
        """The final picture, always drawn, and saved with the run."""
        if not self.enabled or not self.history:
            return
        fig = self.draw()
        if self.run_dir is not None:
            (self.run_dir / PLOTS).mkdir(parents=True, exist_ok=True)
            fig.savefig(self.run_dir / PLOTS / "loss.png")


# ---- the download ----------------------------------------------------------------------------------

_STORED = {".safetensors", ".pt", ".png"}  # already dense: deflating them costs time and saves ~nothing


def zip_run(run_dir: str | Path, dest: str | Path | None = None, resumable: bool = False) -> Path:
    """<run>.zip beside the run folder with what a user keeps: run files (config, tokenizer, metrics,
    samples), plots and the newest valid checkpoint's weights and manifest, enough to generate and
    export (`unzip` it, then `tinygpt generate --run-dir <run>`). The optimizer state (state.pt, twice
    the model: 1.5 GB for 124M) stays on Drive unless `resumable`, which packs the whole checkpoint."""
    run_dir = Path(run_dir)
    ckpt = latest_valid(RunDir(run_dir).checkpoints)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir} holds no valid checkpoint to download; train first")
    files = [run_dir / n for n in RUN_FILES if (run_dir / n).is_file() or (run_dir / n).is_symlink()]
    plots = run_dir / PLOTS
    files += sorted(p for p in plots.iterdir() if p.is_file() or p.is_symlink()) if plots.is_dir() else []
    skip = set() if resumable else {STATE_FILE, MANIFEST}
    files += sorted(p for p in ckpt.iterdir() if (p.is_file() or p.is_symlink()) and p.name not in skip)
    # a link is never followed into the download (it could point at any file of this VM): left out, said once
    links = [why for p in [plots, *files] if (why := link_problem(p, writes=True)) is not None]
    files = [f for f in files if link_problem(f, writes=True) is None
             and (f.parent == run_dir or link_problem(f.parent) is None)]
    if links:
        print(f"left out of the zip, never followed: {'; '.join(links)}")
    dest = Path(dest) if dest is not None else run_dir.parent / f"{run_dir.name}.zip"
    with atomic_output(dest) as tmp, zipfile.ZipFile(tmp, "w") as z:  # never half a zip under the real name
        for f in files:
            kind = zipfile.ZIP_STORED if f.suffix in _STORED else zipfile.ZIP_DEFLATED
            z.write(f, Path(run_dir.name) / f.relative_to(run_dir), compress_type=kind)
        if not resumable:  # the manifest of what is in the zip, so the weights verify (and load) there too
            manifest = read_manifest(ckpt)
            manifest["files"] = {k: v for k, v in manifest["files"].items() if k != STATE_FILE}
            z.writestr(str(Path(run_dir.name) / ckpt.relative_to(run_dir) / MANIFEST), json.dumps(manifest, indent=1))
    return dest


# ---- samples ---------------------------------------------------------------------------------------

def sample_prompt(run_dir: str | Path) -> str:
    """A prompt that suits what the run trained on: `def ` for the built-in Python corpus, else how one
    of its held-out documents begins (a story for TinyStories, a sentence for FineWeb-Edu)."""
    recipe = Recipe.from_dict(RunDir(run_dir).recipe_dict())
    if recipe.data.source in ("builtin", "stdlib"):
        return "def "
    text = validation_text(recipe.data, max_chars=400)
    words = text.split()
    return " ".join(words[:6]) + " " if words else "The "


def samples(run_dir: str | Path, n: int = 3, which: str = "latest", prompt: str | None = None,
            max_new_tokens: int = 150, device: str = "auto") -> list[str]:
    """`n` samples (seeds 0..n-1) from a run's checkpoint, from `prompt` or one that suits its data."""
    model, tokenizer, _, _ = load_run(run_dir, which, resolve_device(device))
    prompt = prompt or sample_prompt(run_dir)
    return [generate_text(model, tokenizer, prompt, max_new_tokens=max_new_tokens, seed=seed) for seed in range(n)]
