"""Notebook smoke mode: `TINYGPT_SMOKE=1` turns every notebook into a seconds-long test on a CPU (CI
runs them that way): the tiny recipe and a few steps for pretraining; a tiny base, offline data and
a few steps for finetuning; the samples that ship with the package for evaluation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tinygpt.core.checkpoint import latest_valid
from tinygpt.core.paths import cache_root, shared_data_dir
from tinygpt.core.rundir import RunDir
from tinygpt.evals.tasks import eval_data as standard_eval_data
from tinygpt.finetune.stdlib_instructions import write_stdlib_instructions
from tinygpt.pretrain.run_pretrain import pretrain

SMOKE_RECIPE = "cpu-smoke"
SMOKE_SETTINGS: dict[str, int] = {"max_steps": 12, "save_every": 4, "eval_every": 4}
# Finetuning: a few tiny steps, enough to run every cell in seconds on a CPU. The learning rate is
# 5x the CPU recipe's so that 6 steps visibly change the answers of a small base (measured on a
# cpu-smoke base of 400 steps: blank before; at 2e-3 still blank after, at 1e-2 Python after).
SMOKE_TRAIN: dict[str, Any] = {
    **dict(max_steps=6, save_every=3, eval_every=3, seq_len=128, micro_batch_size=2),
    **dict(grad_accum_steps=1, eval_batches=1, log_every=1, warmup_steps=1, lr=1e-2, min_lr=1e-3),
}


def smoke_mode() -> bool:
    """True when TINYGPT_SMOKE is set (to anything but 0): the tiny recipe and a few steps."""
    return os.environ.get("TINYGPT_SMOKE", "") not in ("", "0")


def smoke_settings() -> dict[str, int]:
    """Keyword arguments for `pretrain` that shorten a run in smoke mode; empty otherwise."""
    return dict(SMOKE_SETTINGS) if smoke_mode() else {}


def smoke_data() -> str:
    """Smoke mode's instruction data: the offline Code Alpaca sample where a machine has it, else
    the standard library's functions as instructions (every machine has those)."""
    shared = shared_data_dir()
    if shared is not None and (shared / "code_alpaca_2k.json").is_file():
        return str(shared / "code_alpaca_2k.json")
    path = cache_root("data") / "stdlib_instructions.json"
    return str(path if path.is_file() else write_stdlib_instructions(path))


def eval_data(task: str) -> str:
    """An evaluation task's data for a notebook: in smoke mode the sample that ships with the
    package (no network, no data folder: `sample:wikitext2`...), else its standard set
    (`tinygpt.evals.eval_data`: an offline copy where the machine has one, else the Hub)."""
    return standard_eval_data(task, sample=smoke_mode())


def smoke_base(run_dir: str | Path) -> str:
    """A tinygpt base for smoke mode: cpu-smoke pretrained for 20 steps on the built-in corpus
    (seconds on a CPU, no network), made once and then reused."""
    if latest_valid(RunDir(run_dir).checkpoints) is None:
        pretrain(SMOKE_RECIPE, run_dir, max_steps=20, progress=False)
    return str(run_dir)
