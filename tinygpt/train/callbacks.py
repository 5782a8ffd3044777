"""Trainer callbacks of a pretraining run: TensorBoard scalars and the samples a run writes.

A callback may define `on_log(metrics)`, `on_checkpoint(path, step)` and `close()`; the Trainer calls
them after its periodic actions (the Drive `Mirror` in tinygpt.sync is one too).
"""
from __future__ import annotations

from pathlib import Path

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
