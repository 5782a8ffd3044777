"""The live loss plot: a trainer callback that draws loss and val_loss
in the notebook as training goes (one picture, updated in place), shows
the start-up table after the first step, and saves plots/loss.png."""

from __future__ import annotations

import io
import math
import time
from pathlib import Path
from typing import Any, Callable

from tinygpt.colab.notebook import INSTALL_HINT, display, in_notebook
from tinygpt.colab.tables import startup_table
from tinygpt.core.callback import Callback
from tinygpt.core.config import ConfigError
from tinygpt.core.files import refuse_link, write_bytes_atomic
from tinygpt.core.rundir import PLOTS, RUN_JSON, RunDir
from tinygpt.fit.ladder import MAX_EPOCHS
from tinygpt.fit.plan import kept_plan, row_within_law


class LossPlot(Callback):
    """Trainer callback: loss and val_loss against steps (tokens on the top axis), redrawn at most
    every `min_interval_s` in the notebook and saved to <run_dir>/plots/loss.png at the end.
    In a kernel it needs matplotlib; elsewhere, without matplotlib, it does nothing."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        min_interval_s: float = 2.0,
        show: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
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
            # a resumed run: the curve so far
            self.history = self._earlier(int(metrics.get("step", 0)))
        self.history.append(dict(metrics))
        if self.enabled and self.clock() - self._last_draw >= self.min_interval_s:
            self.draw()

    @property
    def shows_startup(self) -> bool:
        """Whether the start-up table shows here (the trainer then prints no line of it)."""
        return bool(self.show)

    def on_startup(self, record: dict[str, Any]) -> None:
        """After the first step: where the start-up time went, as a table above the plot."""
        if self.show:
            display(startup_table(record))

    def _earlier(self, step: int) -> list[dict]:
        """metrics.jsonl's entries before `step` (the trainer has cut it at the resumed step)."""
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
        per_step = next(
            (m["tokens"] / m["step"] for m in self.history if m.get("tokens") and m.get("step")),
            None,
        )
        if per_step:
            top = ax.secondary_xaxis(
                "top", functions=(lambda s: s * per_step, lambda t: t / per_step)
            )
            top.xaxis.set_major_formatter(EngFormatter())
            top.set_xlabel("tokens")
        latest = {
            k: next((m[k] for m in reversed(self.history) if m.get(k) is not None), None)
            for k in ("step", "loss", "val_loss", "expected_final_loss")
        }
        ax.set_title(
            ", ".join(
                f"{k.replace('_', ' ').replace('expected final loss', 'heading for')} {v:.4g}"
                for k, v in latest.items()
                if v is not None
            ),
            fontsize=10,
        )
        self.figure = fig
        self.draws += 1
        if self.show:
            from IPython.display import Image

            buf = io.BytesIO()
            fig.savefig(buf, format="png")
            image = Image(data=buf.getvalue(), format="png")
            if self._handle is None:
                self._handle = display(image, display_id=True)
            else:
                self._handle.update(image)
        return fig

    def close(self) -> None:
        """The final picture, always drawn, and saved with the run."""
        if not self.enabled or not self.history:
            return
        fig = self.draw()
        if self.run_dir is not None:
            save_plot(fig, self.run_dir, "loss.png")


def save_plot(fig: Any, run_dir: str | Path, name: str) -> bytes:
    """`fig` as <run_dir>/plots/<name>, a PNG written as every run file is (`write_bytes_atomic`: a
    link at that name is replaced, never written through); a plots/ folder that is a link is
    refused in one line. The PNG's bytes."""
    plots = Path(run_dir) / PLOTS
    refuse_link(plots)
    plots.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_bytes_atomic(plots / name, buf.getvalue())
    return buf.getvalue()


# what a plan read back from run.json may hold to be drawn: a ladder has a few dozen rungs, each
# named in a few characters, with numbers no run reaches past these
MAX_ROWS, MAX_LABEL = 200, 24
_BOUNDS = {"params": (1, 1e13), "tokens": (1, 1e16), "predicted_loss": (1e-6, 100)}


def _plain_label(text: Any) -> str:
    """A size's name as drawn: printable characters only, at most MAX_LABEL of them (drawn with
    mathtext and TeX off)."""
    s = "".join(ch for ch in str(text)[: MAX_LABEL + 1] if ch.isprintable())
    return s if len(s) <= MAX_LABEL else s[: MAX_LABEL - 1] + "…"


def _plan_problem(plan: dict) -> str | None:
    """Why run.json's plan cannot be drawn (too many rows, not one chosen row, a number out of
    bounds), in words; None when it can."""
    cands = plan["candidates"]
    if len(cands) > MAX_ROWS:
        return f"has {len(cands)} sizes (at most {MAX_ROWS})"
    chosen = sum(c.get("chosen") is True for c in cands)
    if chosen != 1:
        return f"marks {chosen} sizes as chosen (one)"
    hours = plan.get("hours", 1)
    if not (isinstance(hours, (int, float)) and 0 < hours <= 1e6):
        return f"asks {str(hours)[:20]} hours"
    for c in cands:
        for key, (low, high) in _BOUNDS.items():
            v = c.get(key)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and low <= v <= high):
                return f"gives size {_plain_label(c.get('size'))} {key} {str(v)[:20]}"
        epochs = c.get("epochs")
        if epochs is not None and not (isinstance(epochs, (int, float)) and 0 <= epochs <= 1e9):
            return f"gives size {_plain_label(c.get('size'))} {str(epochs)[:20]} epochs"
    return None


def _plain_text(texts: Any) -> None:
    """Draw these texts as they are written: no mathtext (`$...$`), no TeX."""
    for t in texts:
        t.set_parse_math(False)
        t.set_usetex(False)


def plan_plot(run_dir: str | Path, show: bool | None = None) -> Any:
    """`--size auto`'s plan as a picture: predicted loss against non-embedding parameters, a point
    per size of the ladder, the chosen one marked; saved as <run_dir>/plots/plan.png and shown in a
    notebook. The Figure, or None (a run not planned, or no matplotlib)."""
    plan = kept_plan(RunDir(run_dir).info_or_empty())
    if plan is None or not plan.get("candidates"):
        return None
    if (why := _plan_problem(plan)) is not None:
        raise ConfigError(
            f"{Path(run_dir) / RUN_JSON}'s plan {why}: it was not written by tinygpt; "
            "delete the plan from run.json or start a new run folder"
        )
    try:
        __import__("matplotlib")
    except ImportError:
        return None
    fig = _draw_plan(plan)
    png = save_plot(fig, run_dir, "plan.png")
    if in_notebook() if show is None else show:
        from IPython.display import Image

        display(Image(data=png, format="png"))
    return fig


def _draw_plan(plan: dict) -> Any:
    """The plan's figure (`_plan_problem` found nothing wrong with it)."""
    from matplotlib.figure import Figure

    def xy(rows: list[dict]) -> tuple[list, list]:
        return [c["params"] for c in rows], [c["predicted_loss"] for c in rows]

    cands = plan["candidates"]
    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(*xy(cands), "o-", color="tab:blue")
    _plain_text(
        ax.annotate(
            _plain_label(c["size"]),
            (c["params"], c["predicted_loss"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
        for c in cands
    )
    outside = [c for c in cands if not row_within_law(plan, c)]
    if outside:  # the law's prediction did not choose these
        label = f"outside the law: over {MAX_EPOCHS:g} epochs, or too few tokens per parameter"
        ax.plot(*xy(outside), "x", ms=9, color="tab:gray", label=label)
    best = next(c for c in cands if c["chosen"] is True)
    why = "" if row_within_law(plan, best) else ", the recipe's own size"
    label = (
        f"chosen: {_plain_label(best['size'])}{why}, "
        f"{best['tokens'] / best['params']:.1f} tokens per parameter"
    )
    ax.plot(*xy([best]), "o", ms=12, mfc="none", color="tab:red", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters")
    ax.set_ylabel("predicted loss")
    ax.set_title(f"the sizes {plan['hours']:g} h buy here", fontsize=10)
    _plain_text(ax.legend(fontsize=8).get_texts())
    return fig
