"""The notebooks' dropdowns: the pretraining recipe (with a time budget), the base of a pretraining
run, and the finetuning recipe. Each defaults to the run being resumed, then smoke mode, then what
suits this hardware; the training cell reads `value` when it runs, so Run all trains the default.
Without ipywidgets (a script) a picker is its default."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from tinygpt.colab.notebook import display, load_ipywidgets
from tinygpt.colab.runs import RunFolders
from tinygpt.colab.smoke import SMOKE_RECIPE, smoke_mode
from tinygpt.colab.tables import Table, Tables, finetune_recipe_rows, recipes_table, summary
from tinygpt.core.gpu_classes import HARDWARE, size_auto_recipe
from tinygpt.core.recipes import RECIPES
from tinygpt.core.rundir import RunDir, recipe_name_of
from tinygpt.finetune.memory_plan import default_finetune_recipe
from tinygpt.finetune.presets import FINETUNE_RECIPES, this_hardware
from tinygpt.fit.hardware import hardware_report
from tinygpt.pretrain.init import run_init
from tinygpt.train.budget import Budget


def _homes(resume_from: RunFolders | str | Path | None) -> tuple:
    """The folders a resumed run may be in: its mirror on
    Drive first (the newest state), then its local copy."""
    return (
        (resume_from.mirror, resume_from.local)
        if isinstance(resume_from, RunFolders)
        else (resume_from,)
    )


def default_recipe(
    report: Any = None, resume_from: RunFolders | str | Path | None = None, sized: bool = False
) -> tuple[str, str]:
    """(recipe name, why): the run being resumed decides first, then smoke mode, then the probe;
    with `sized` (a time and size auto) the probe's choice gives way to the recipe whose ladder the
    planner climbs here, as `tinygpt pretrain --size auto` chooses it."""
    resumed = recipe_name_of(*_homes(resume_from))
    if resumed in RECIPES:
        return resumed, "the recipe of the run on Drive (it continues where it stopped)"
    if smoke_mode():
        return SMOKE_RECIPE, "TINYGPT_SMOKE is set"
    if report is None:
        report = hardware_report()
    if sized:
        return (
            size_auto_recipe(report.hardware_class, report.default_recipe),
            f"the ladder size auto plans on this {report.hardware_class} runtime",
        )
    return report.default_recipe, f"the probe's choice for this {report.hardware_class} runtime"


# The time budget dropdown's choices (a resumed run's own budget is added when it is none of them).
HOURS_CHOICES: list[tuple[str, float | None]] = [
    ("the recipe's steps", None),
    ("15 min", 0.25),
    ("30 min", 0.5),
    *((f"{h:g} h", h) for h in (1.0, 2.0, 3.0, 6.0, 12.0, 24.0)),
]


def default_hours(
    report: Any, resume_from: RunFolders | str | Path | None = None
) -> tuple[float | None, str]:
    """(hours or None, why): a resumed run keeps its own budget (or none); smoke mode and CPUs train
    the recipe's steps; a GPU gets what a session of its class usually lasts."""
    for folder in _homes(resume_from):
        if folder is not None and RunDir(folder).is_pretrain_run():
            if budget := Budget.load(Path(folder)):
                return budget.hours, "the run's own budget"
            return None, "the run has no time budget"
    if smoke_mode():
        return None, "TINYGPT_SMOKE is set"
    hours = (
        HARDWARE[report.hardware_class].session_hours if report.hardware_class in HARDWARE else None
    )
    return hours, (
        f"about one {report.hardware_class} session" if hours else "a CPU trains the recipe's steps"
    )


def dropdown(widgets: Any, options: list, value: Any, description: str) -> Any:
    """A dropdown that shows `value`'s label. Chosen by position: to ipywidgets a value of None means
    no selection, and the box is drawn empty although an option ("the recipe's steps", "from
    scratch") has that value."""
    index = [v for _, v in options].index(value)
    return widgets.Dropdown(
        options=options,
        index=index,
        description=description,
        layout=widgets.Layout(width="max-content"),
    )


# the size dropdown: auto (the planner, tinygpt.fit.plan) or the recipe's model as written
SIZE_CHOICES = [("auto (what the time buys)", "auto"), ("the recipe's", None)]


class RecipePicker:
    """A dropdown of the recipes with the right default and, under it, every recipe's memory and
    time on this runtime, then the chosen recipe's memory breakdown and expectations (updated on
    change). The training cell reads `value` when it runs, so Run all trains the default.

    Until the user picks a recipe, the default follows the time and size dropdowns as `tinygpt
    pretrain` does: with a time and size auto, the recipe whose ladder the planner climbs here (on
    a CPU, cpu-fast's); a resumed run and smoke mode keep theirs."""

    def __init__(self, report: Any = None, resume_from: RunFolders | str | Path | None = None):
        self.report = report if report is not None else hardware_report()  # `probe`'s
        self.default, self.reason = default_recipe(self.report, resume_from)
        self.sized_default = default_recipe(self.report, resume_from, sized=True)  # (name, why)
        self.default_hours, self.hours_reason = default_hours(self.report, resume_from)
        self.dropdown = self._output = self.hours_dropdown = self.size_dropdown = None
        self.user_chose = False  # the recipe dropdown was changed by the user, not by following
        self._following = False
        widgets = load_ipywidgets()
        if widgets is None:
            return  # a script: `value` is the default
        options = [(f"{name}  ({RECIPES[name].hardware})", name) for name in RECIPES]
        self.dropdown = dropdown(widgets, options, self.default, "recipe")
        # the summary is an HTML widget, not an Output one: it renders the
        # same in Colab (ipywidgets 7), classic Jupyter and JupyterLab
        # (8), where capturing into an Output widget differs between them
        self.summary = widgets.HTML()
        self.reason_line = widgets.HTML()
        self.dropdown.observe(self._recipe_changed, names="value")
        choices = (
            HOURS_CHOICES
            if self.default_hours in [h for _, h in HOURS_CHOICES]
            else HOURS_CHOICES + [(f"{self.default_hours:g} h", self.default_hours)]
        )
        self.hours_dropdown = dropdown(widgets, choices, self.default_hours, "time")
        self.size_dropdown = dropdown(widgets, SIZE_CHOICES, "auto", "size")
        for follows in (self.hours_dropdown, self.size_dropdown):
            follows.observe(lambda change: self._follow_size(), names="value")
        self._follow_size()

    def current_default(self) -> tuple[str, str]:
        """(recipe, why) that the time and size chosen now make the default."""
        if self.size == "auto" and self.sized_default[0] != self.default:
            return self.sized_default
        return self.default, self.reason

    def _recipe_changed(self, change: Any) -> None:
        self.user_chose = self.user_chose or not self._following
        self._show_summary()

    def _follow_size(self) -> None:
        """Set the recipe dropdown to `current_default()`, unless the user picked one."""
        name, why = self.current_default()
        self.reason_line.value = f"<i>default: {html.escape(why)}</i>"
        if self.user_chose or self.dropdown.value == name:
            return
        self._following = True
        try:
            self.dropdown.value = name
        finally:
            self._following = False

    @property
    def value(self) -> str:
        return self.dropdown.value if self.dropdown is not None else self.current_default()[0]

    @property
    def hours(self) -> float | None:
        """The time budget chosen (None: the recipe's steps): `pretrain(hours=picker.hours)`."""
        return self.hours_dropdown.value if self.hours_dropdown is not None else self.default_hours

    @property
    def size(self) -> str | None:
        """ "auto" (the size the time buys: `pretrain(..., size=picker.size)`), or None: the recipe's
        own size, and always without a time budget (the planner needs hours)."""
        if self.hours is None:
            return None
        return self.size_dropdown.value if self.size_dropdown is not None else "auto"

    def _show_summary(self) -> None:
        tables = Tables(
            [recipes_table(self.report), *summary(self.value, self.report, hardware=False)]
        )
        self.summary.value = tables._repr_html_()

    def _ipython_display_(self) -> None:
        if self.dropdown is None:
            return display(str(self))
        widgets = __import__("ipywidgets")
        self._show_summary()
        time_note, size_note = (
            widgets.HTML(f"<i>{note}</i>")
            for note in (
                f"time available for training: {html.escape(self.hours_reason)}; the run "
                "measures its speed and sets its steps to end on time",
                "size: auto chooses the model the time buys (a ladder of sizes, a scaling law, "
                "this GPU's speed), shown before training starts",
            )
        )
        rows = [self.dropdown, self.reason_line, self.hours_dropdown, time_note, self.size_dropdown]
        display(widgets.VBox([*rows, size_note, self.summary]))

    def __repr__(self) -> str:
        budget = "the recipe's steps" if self.hours is None else f"{self.hours:g} h"
        size = "the recipe's" if self.size is None else self.size
        return "recipe: {} (default: {}, {}); time: {}; size: {}".format(
            self.value, *self.current_default(), budget, size
        )


recipe_picker = RecipePicker  # the notebooks' name for it


class FinetunePicker:
    """02_finetune's recipe dropdown (the run's own recipe, or this base's default on this runtime)
    over the table of every recipe's memory here, read (`value`) when the training cell runs."""

    def __init__(self, base_config: dict[str, Any], run: RunFolders | None = None):
        self.hardware, self.gpu_gb = this_hardware()
        resume = [run.mirror, run.local] if run is not None else []
        self.default, self.reason = default_finetune_recipe(
            base_config, self.hardware, self.gpu_gb, resume_from=resume
        )
        self.table = Table(
            finetune_recipe_rows(base_config, self.hardware, self.gpu_gb),
            f"Recipes on this {self.hardware} runtime",
            notes=(self.reason,),
        )
        self.dropdown = None
        widgets = load_ipywidgets()
        if widgets is None:
            return  # a script: `value` is the default
        self.dropdown = widgets.Dropdown(
            options=list(FINETUNE_RECIPES), value=self.default, description="recipe"
        )

    @property
    def value(self) -> str:
        return self.dropdown.value if self.dropdown is not None else self.default

    def _ipython_display_(self) -> None:
        if self.dropdown is not None:
            display(self.dropdown)
        display(self.table)

    def __repr__(self) -> str:
        return f"recipe: {self.value} (default: {self.default}, {self.reason})\n{self.table}"


finetune_picker = FinetunePicker  # the notebooks' name for it


# 01_pretrain's base dropdown: small Hub models whose
# architecture tinygpt's GPT is (Llama's layers, no biases).
HUB_BASES = (
    ("from scratch", None),
    ("SmolLM2-135M (Hub, 135M, any GPU)", "hf:HuggingFaceTB/SmolLM2-135M"),
    ("SmolLM2-360M (Hub, 362M, L4 / A100)", "hf:HuggingFaceTB/SmolLM2-360M"),
    ("TinyLlama 1.1B v1.1 (Hub, A100)", "hf:TinyLlama/TinyLlama_v1.1"),
)


class BasePicker:
    """01_pretrain's base dropdown: from scratch, or a Hub model whose weights and tokenizer the run
    starts from (`tinygpt pretrain --init`). It defaults to the run's own base when resuming.
    `value` is the base (None: from scratch), read by the training cell when it runs."""

    def __init__(self, resume_from: RunFolders | str | Path | None = None):
        local, mirror = (
            (resume_from.local, resume_from.mirror)
            if isinstance(resume_from, RunFolders)
            else (resume_from, None)
        )
        # the local run's own base; a mirror's (a shared folder: it could name any folder of this
        # VM) only when it is one of the Hub bases listed here, which Run all may then pick without
        # reading anything local
        theirs = run_init(mirror)
        self.default = run_init(local) or (theirs if theirs in dict(HUB_BASES).values() else None)
        self.reason = (
            "the run's own base"
            if self.default
            else "a new run trains from scratch unless you pick a base"
        )
        options = list(HUB_BASES) + (
            [(self.default, self.default)] if self.default not in dict(HUB_BASES).values() else []
        )
        self.dropdown = None
        widgets = load_ipywidgets()
        if widgets is not None:
            self.dropdown = dropdown(widgets, options, self.default, "base")

    @property
    def value(self) -> str | None:
        return self.dropdown.value if self.dropdown is not None else self.default

    def _ipython_display_(self) -> None:
        if self.dropdown is None:
            return display(str(self))
        widgets = __import__("ipywidgets")
        why = widgets.HTML(
            f"<i>default: {html.escape(self.reason)}; a base brings its own architecture, "
            "tokenizer and context, trained at a lower learning rate</i>"
        )
        display(widgets.VBox([self.dropdown, why]))

    def __repr__(self) -> str:
        return (
            f"base: {self.value or 'from scratch'} (default: {self.default or 'from scratch'}, "
            f"{self.reason})"
        )


base_picker = BasePicker  # the notebooks' name for it
