"""Trainer callbacks of a pretraining run: TensorBoard scalars and the samples a run writes.

A callback may define `on_log(metrics)`, `on_checkpoint(path, step)` and `close()`; the Trainer calls
them after its periodic actions (the Drive `Mirror` in tinygpt.sync is one too).
"""
from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from tinygpt.core.config import ConfigError
from tinygpt.core.rundir import RunDir
from tinygpt.model.generate import generate_text
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import Tokenizer


class TensorBoardLogger:
    """Trainer callback: every logged metric as a TensorBoard scalar, x axis = step."""

    def __init__(self, writer):
        self.writer = writer

    @classmethod
    def create(cls, log_dir: Path, required: bool = False) -> "TensorBoardLogger | None":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: Colab has it; elsewhere `pip install tensorboard`
            if required:
                raise ConfigError("TensorBoard logging needs `pip install tensorboard`") from None
            return None
        return cls(SummaryWriter(str(log_dir)))

    def on_log(self, metrics: dict) -> None:
        step = metrics["step"]
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)) and v is not None:
                self.writer.add_scalar(f"train/{k}" if k != "val_loss" else "val/loss", v, step)

    def close(self) -> None:
        self.writer.close()


def write_sample(model: GPT, tokenizer: Tokenizer, run_dir: Path, step: int, prompt: str | None = None) -> str:
    """Append a generated sample to samples.txt and return it."""
    model.eval()
    text = generate_text(model, tokenizer, prompt or "def ", max_new_tokens=120, temperature=0.8, top_k=50, seed=0)
    RunDir(run_dir).append_sample(f"=== step {step} ===\n{text}\n\n")
    model.train()
    return text


def progress_bar(**kwargs):
    """A tqdm bar: text in a terminal, a widget in a notebook. In a notebook the widget is displayed
    under a display id and replaced by its final line when the bar closes, so the output a notebook
    saves (what GitHub and nbviewer show, which cannot run widgets) is the last state, not 0%."""
    try:
        from tqdm.notebook import tqdm as notebook_tqdm  # needs ipywidgets
    except ImportError:
        notebook_tqdm = None
    if notebook_tqdm is None or not issubclass(tqdm, notebook_tqdm):  # a terminal bar
        return tqdm(**kwargs)
    bar = tqdm(display=False, **kwargs)
    handle = _display(bar.container, display_id=True)
    close = bar.close

    def close_and_keep_last_state() -> None:
        text = str(bar)  # the final line, e.g. "training: 100%|##########| 300/300 [01:49<00:00, ...]"
        close()
        if handle is not None:  # the widget becomes that line: in the live view and in the saved output
            handle.update({"text/plain": text}, raw=True)

    bar.close = close_and_keep_last_state
    return bar


def _display(obj, display_id: bool):
    try:
        from IPython.display import display
    except ImportError:  # pragma: no cover - a notebook bar implies IPython
        return None
    return display(obj, display_id=display_id)
