"""The finetuning notebook's pieces: recipe and base tables, where a run stands, and smoke mode.

Library code (tinygpt.finetune) computes; this module only arranges it for `ui.Table` and the
notebook's cells.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinygpt.core.checkpoint import latest_valid, list_checkpoints
from tinygpt.core.paths import cache_root, shared_data_dir
from tinygpt.core.rundir import ADAPTER_DIR, RunDir, recipe_name_of
from tinygpt.finetune.recipes import FINETUNE_RECIPES, FULL_MODEL_DIR, device_need_gb, memory_table
from tinygpt.finetune.stdlib_instructions import write_stdlib_instructions
from tinygpt.train.pretrain import pretrain

# Notebook smoke mode (TINYGPT_SMOKE=1): a few tiny steps, enough to run every cell in seconds on a CPU. The
# learning rate is 5x the CPU recipe's so that 6 steps visibly change the answers of a small base (measured on a
# cpu-smoke base of 400 steps: blank before; at 2e-3 still blank after, at 1e-2 Python after).
SMOKE_TRAIN: dict[str, Any] = dict(max_steps=6, save_every=3, eval_every=3, seq_len=128, micro_batch_size=2,
                                   grad_accum_steps=1, eval_batches=1, log_every=1, warmup_steps=1,
                                   lr=1e-2, min_lr=1e-3)


def recipe_rows(base_config: dict[str, Any], hardware: str, memory_gb: float | None = None) -> list[tuple]:
    """Every recipe with its estimated peak memory for this base and whether it fits (for `ui.Table`)."""
    rows: list[tuple] = [("recipe", "memory", "fits", "what it is")]
    for name, r in FINETUNE_RECIPES.items():
        gb = device_need_gb(memory_table(r, hardware, base_config), hardware)
        fits = "-" if memory_gb is None else "yes" if gb <= 0.9 * memory_gb else "no"
        rows.append((name, f"{gb:.1f} GB", fits, r.description))
    return rows


def base_rows(base_config: dict[str, Any]) -> list[tuple]:
    """A base's shape at a glance (for `ui.Table`)."""
    keys = {"model type": "model_type", "layers": "num_hidden_layers", "hidden size": "hidden_size",
            "vocabulary": "vocab_size", "context": "max_position_embeddings"}
    return [(name, base_config.get(k, "-")) for name, k in keys.items()]


@dataclass
class FinetuneStatus:
    """Where a finetuning run stands: its local folder and, when given, its mirror on Drive."""
    local: Path
    mirror: Path | None = None

    def __str__(self) -> str:
        home, where = (self.mirror, "on Drive") if self.mirror is not None else (self.local, "here")
        steps = list_checkpoints(RunDir(home).checkpoints)
        lines = [f"local:  {self.local}"] + ([f"Drive:  {self.mirror}"] if self.mirror is not None else [])
        if steps:
            lines.append(f"{where}: step {steps[-1][0]} of recipe {recipe_name_of(home, self.local)}; "
                         "finetuning continues from there")
        else:
            lines.append(f"nothing {where} yet: a new run")
        if (home / ADAPTER_DIR / "adapter_model.safetensors").is_file():
            lines.append(f"adapter {where}: {home / ADAPTER_DIR}")
        if (self.local / FULL_MODEL_DIR / "config.json").is_file():  # full finetuning (its checkpoints go to Drive)
            lines.append(f"model here: {self.local / FULL_MODEL_DIR}")
        return "\n".join(lines)

    __repr__ = __str__


def run_status(local: str | Path, mirror: str | Path | None = None) -> FinetuneStatus:
    return FinetuneStatus(Path(local), Path(mirror) if mirror is not None else None)


# ----- notebook smoke mode ------------------------------------------------------------------------
def smoke_data() -> str:
    """Smoke mode's instruction data: the offline Code Alpaca sample where a machine has it, else the
    standard library's functions as instructions (every machine has those)."""
    shared = shared_data_dir()
    if shared is not None and (shared / "code_alpaca_2k.json").is_file():
        return str(shared / "code_alpaca_2k.json")
    path = cache_root("data") / "stdlib_instructions.json"
    return str(path if path.is_file() else write_stdlib_instructions(path))


def smoke_base(run_dir: str | Path) -> str:
    """A tinygpt base for smoke mode: cpu-smoke pretrained for 20 steps on the built-in corpus (seconds
    on a CPU, no network), made once and then reused."""
    if latest_valid(RunDir(run_dir).checkpoints) is None:
        pretrain("cpu-smoke", run_dir, max_steps=20, progress=False)
    return str(run_dir)
