"""`tinygpt finetune`'s options: each field is one option (core/options.py) and, but `merge`, a
keyword of `run.finetune` of the same name, so a new option is a field here and a keyword there."""

from __future__ import annotations

from dataclasses import dataclass, fields

from tinygpt.core.gpu_classes import HARDWARE
from tinygpt.core.options import option
from tinygpt.finetune.run_finetune import FinetuneResult, finetune


@dataclass(kw_only=True)
class FinetuneOptions:
    """What to finetune, on what, and where."""

    recipe: str = option(
        "lora-r16",
        help="lora-r8, lora-r16, lora-r32, qlora-r16, or full (every weight trains: 16 "
        "bytes per parameter, for small bases)",
    )
    base: str = option(help="a tinygpt run folder, a model folder, or a Hugging Face id")
    data: str = option(
        help="a JSON/JSONL file, a saved dataset folder, or hf:NAME[:CONFIG][@SPLIT]"
    )
    run_dir: str = option(
        flag="RUN_DIR",
        alias="--run-dir",
        help="the finetuning run's folder: made, or resumed when it holds this run",
    )
    max_steps: int | None = option(None, help="train to this step (default: the recipe's)")
    hardware: str | None = option(
        None,
        choices=sorted({c.finetune for c in HARDWARE.values()}),
        help="which of the recipe's settings to use (default: detected)",
    )
    resume: str = option(
        "auto",
        choices=("auto", "never"),
        help="auto: from the newest valid checkpoint (local or mirror); never: refuse a folder "
        "that has checkpoints",
    )
    mirror: str | None = option(
        None, help="a folder (e.g. on Google Drive) that mirrors the run's checkpoints"
    )
    device: str | None = option(None, help="cpu, cuda, cuda:1, mps (default: the best available)")
    merge: bool = option(False, help="also save the base with the adapter folded in")
    progress: bool = option(True, flag="--quiet", help="no progress bar")

    def run(self) -> FinetuneResult:
        """`finetune` with these options (merging is the caller's, after: `lora.merge_adapter`)."""
        return finetune(
            **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "merge"}
        )
