"""The one protocol between the Trainer and everything that happens beside training.

A callback decides its own timing: the Trainer calls every hook of every callback at the points
named below, in the order the callbacks were given, and a hook it does not need does nothing (this
base class). The side concerns of a run (progress, start-up record and compile cache, time budget,
TensorBoard, the Drive mirror, a notebook's plot) are callbacks; the loop itself knows none of them.
It lives in core because the mirror (tinygpt.sync) and the notebooks' plots are callbacks too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Callback:
    """Subclass and override the hooks you need. `trainer` is the running
    `tinygpt.train.trainer.Trainer`."""

    # True for a callback that shows the start-up breakdown itself (a notebook's table): the
    # start-up line is then not printed as well
    shows_startup: bool = False

    def on_start(self, trainer: Any, resumed_from: int | None) -> None:
        """Restored (`resumed_from`: the checkpoint's step,
        None for a fresh run); before the first step."""

    def on_step(self, trainer: Any) -> None:
        """After each optimizer step (`trainer.step` is its
        number), before that step's periodic actions."""

    def on_metrics(self, metrics: dict[str, Any]) -> None:
        """A logged step's record before it is written:
        the place to add a field to metrics.jsonl."""

    def on_log(self, metrics: dict[str, Any]) -> None:
        """A record as written to metrics.jsonl. An exception
        here is a warning, never the end of training."""

    def on_message(self, text: str) -> None:
        """A line for the person watching (the start-up breakdown, a budget's decision)."""

    def on_startup(self, record: dict[str, Any]) -> None:
        """After the first step of this process: where the start-up time went
        (`StartupClock.record`)."""

    def on_checkpoint(self, path: str | Path, step: int) -> None:
        """A checkpoint was written (also `best/`)."""

    def close(self) -> None:
        """Training is over (finished, interrupted or failed)."""
