"""Training runs as a user compares them: a summary with a diagnosis, comparison tables, loss plots.

A run folder's files are read through `tinygpt.core.rundir.RunDir` (see docs/ARCHITECTURE.md)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from tinygpt.core.datafiles import DataFormatError
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import METRICS, RunDir, missing_run_message
from tinygpt.model.gpt import meta_model


def list_runs(root: str | Path, names: Sequence[str] | None = None) -> list[Path]:
    """The run folders (those with a run.json) under `root`, by name; only `names` when given."""
    root = Path(root)
    folders = sorted(root.iterdir()) if root.is_dir() else []
    found = {p.name: p for p in folders if RunDir(p).is_pretrain_run()}
    if not names:
        if not found:
            raise FileNotFoundError(
                f"no run folders (with a run.json) under {root}; train one with "
                f"`tinygpt pretrain --run-dir {root / 'NAME'}` or the 01_pretrain notebook"
            )
        return list(found.values())
    missing = [n for n in names if n not in found]
    if missing:
        raise FileNotFoundError(
            f"no run {', '.join(missing)} under {root}; there are: {', '.join(found) or 'none'}"
        )
    return [found[n] for n in names]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl records (a last line cut off by a kill mid-write is skipped)."""
    run = RunDir(run_dir)
    if not run.path.exists():
        raise FileNotFoundError(missing_run_message(run.path))
    if not run.metrics_path.is_file():
        raise FileNotFoundError(
            f"{run.metrics_path} does not exist; is {run_dir} a run folder that has trained "
            "and logged?"
        )
    return run.metrics()


def _tokens_per_step(info: dict[str, Any]) -> int | None:
    return Recipe.from_dict(info["recipe"]).train.tokens_per_step if "recipe" in info else None


def _tokens(m: dict[str, Any], per_step: int | None) -> int | None:
    # The trainer logs "tokens" (with the DDP world size); older records only have the step.
    if m.get("tokens") is not None:
        return int(m["tokens"])
    return m["step"] * per_step if per_step else None


def _diagnose(train: list[dict], val: list[dict]) -> list[str]:
    notes = []
    bad = [m for m in train if not math.isfinite(m["loss"])]
    if bad:
        notes.append(
            f"the loss became {bad[0]['loss']} at step {bad[0]['step']}: lower the learning rate "
            "or use bf16/fp32 instead of fp16, and resume from the last checkpoint before it"
        )
    good = [m["loss"] for m in train if math.isfinite(m["loss"])]
    if len(good) >= 3 and min(good[-3:]) >= good[0]:
        notes.append(
            "the training loss has not decreased: check the learning rate (too high or too low) "
            "and the data"
        )
    if len(val) >= 3:
        best = min(val, key=lambda m: m["val_loss"])
        if best is not val[-1] and val[-1]["val_loss"] > 1.02 * best["val_loss"]:
            notes.append(
                f"validation loss has risen since step {best['step']} ({best['val_loss']:.4g} -> "
                f"{val[-1]['val_loss']:.4g}): overfitting; use best/, more data or fewer steps"
            )
    norms = [(m["grad_norm"], m["step"]) for m in train if m.get("grad_norm") is not None]
    if len(norms) >= 5:
        med = statistics.median(n for n, _ in norms)
        top = max(norms)
        if med > 0 and top[0] > 10 * med:
            notes.append(
                f"gradient norm spike of {top[0]:.3g} at step {top[1]} (median {med:.3g}): "
                "a lower learning rate or longer warmup may help"
            )
    if len(good) >= 10:
        q = len(good) // 5
        if good[-1] < good[-q - 1] * 0.97:
            notes.append("the loss was still falling at the end: a longer run would likely help")
    return notes


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """A run's numbers from metrics.jsonl and run.json, with a diagnosis (a list of findings)."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    info = RunDir(run_dir).info_or_empty()
    per_step = _tokens_per_step(info)
    train = [m for m in records if m.get("loss") is not None]
    val = [m for m in records if m.get("val_loss") is not None]
    if not train:
        raise DataFormatError(f"{run_dir / METRICS} has no record with a training loss yet")
    # The first interval includes start-up and compilation: leave it out of the speed figures.
    timed = [m for m in train[1:] or train if m.get("tokens_per_s")]

    def med(key: str) -> float | None:
        xs = [m[key] for m in timed if m.get(key) is not None]
        return statistics.median(xs) if xs else None

    best = min(val, key=lambda m: m["val_loss"]) if val else None
    mem = [m["memory_gb"] for m in records if m.get("memory_gb") is not None]
    norms = [m["grad_norm"] for m in train if m.get("grad_norm") is not None]
    return {
        "run": run_dir.name,
        "recipe": info.get("recipe", {}).get("name"),
        "steps": train[-1]["step"],
        "tokens_seen": _tokens(train[-1], per_step),
        "loss_first": train[0]["loss"],
        "loss_last": train[-1]["loss"],
        "loss_min": min(m["loss"] for m in train),
        "val_loss_last": val[-1]["val_loss"] if val else None,
        "val_loss_best": best["val_loss"] if best else None,
        "val_loss_best_step": best["step"] if best else None,
        "val_bits_per_token": best["val_loss"] / math.log(2) if best else None,
        "lr_last": train[-1].get("lr"),
        "tokens_per_s": med("tokens_per_s"),
        "mfu": med("mfu"),
        "memory_gb_max": max(mem) if mem else None,
        "grad_norm_max": max(norms, default=None),
        "diagnosis": _diagnose(train, val) or ["no problems found"],
    }


def _num_params(info: dict[str, Any]) -> int | None:
    if "recipe" not in info:
        return None
    # shapes only, nothing allocated
    return meta_model(Recipe.from_dict(info["recipe"]).model).num_params()


# the figures of a summary a comparison shows, after the run, its recipe and its size
COMPARED = "steps tokens_seen loss_last val_loss_best tokens_per_s mfu memory_gb_max".split()


def compare_runs(run_dirs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """A table (one dict per run) of the runs' sizes and final metrics, ready for a DataFrame."""
    rows = []
    for d in run_dirs:
        s = summarize_run(d)
        params = _num_params(RunDir(d).info_or_empty())
        rows.append(
            {"run": s["run"], "recipe": s["recipe"], "params": params} | {k: s[k] for k in COMPARED}
        )
    return rows


def plot_runs(run_dirs: Sequence[str | Path], ax: Any = None, log_x: bool = False) -> Any:
    """Training (lines) and validation (dots) loss of several runs against tokens seen, on one
    matplotlib figure, which is returned."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plot_runs needs matplotlib: pip install matplotlib") from e
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(8, 5))
    for d in run_dirs:
        d = Path(d)
        per_step, records = _tokens_per_step(RunDir(d).info_or_empty()), read_metrics(d)
        if per_step is None and not any("tokens" in m for m in records):
            raise DataFormatError(
                f"{d} has no run.json with a recipe and its metrics have no token counts; "
                "cannot put it on a tokens axis"
            )
        train = [(_tokens(m, per_step), m["loss"]) for m in records if m.get("loss") is not None]
        val = [
            (_tokens(m, per_step), m["val_loss"]) for m in records if m.get("val_loss") is not None
        ]
        (line,) = ax.plot(*zip(*train), label=f"{d.name} train") if train else ax.plot([], [])
        if val:
            ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{d.name} val")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats / token)")
    if log_x:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig
