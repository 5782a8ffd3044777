"""What a folder is: a pretraining run, a finetuning run, an export, or none of these (by
core.rundir's file names), and the command that fits each kind."""

from __future__ import annotations

import shlex
from pathlib import Path

from tinygpt.core.config import ConfigError
from tinygpt.core.rundir import ADAPTER_CONFIG, FINETUNE_JSON, FULL_MODEL_DIR, RUN_JSON


def folder_kind(path: str | Path) -> str | None:
    """What a folder holds: "pretraining run", "finetuning run", "GGUF export", "Hugging Face model
    folder" (an export, or a model), or None (anything else, or nothing)."""
    p = Path(path)
    if (p / RUN_JSON).is_file():
        return "pretraining run"
    if (
        (p / FINETUNE_JSON).is_file()
        or (p / ADAPTER_CONFIG).is_file()
        or (p / FULL_MODEL_DIR).is_dir()
    ):
        return "finetuning run"
    if p.is_dir() and any(p.glob("*.gguf")):
        return "GGUF export"
    return "Hugging Face model folder" if (p / "config.json").is_file() else None


def refuse_other_kind(path: str | Path, want: str, command: str) -> None:
    """Before `tinygpt COMMAND` writes a `want` ("pretraining run")
    into `path`: a ConfigError when the folder holds something else
    (a finetuning run, an export), which is left exactly as it is."""
    kind = folder_kind(path)
    if kind not in (None, want):
        raise ConfigError(
            f"{path} is a {kind}, not a {want}: tinygpt {command} leaves it as it is; give "
            f"another folder (tinygpt {command} runs/NAME ...)"
        )


def not_a_run_message(path: Path) -> str:
    """One line for a folder without run.json: what it is (a finetuning
    run, an export) and the command that opens it; a folder that is
    none of these gets the pretraining command that makes it a run."""
    p, q, kind = path, shlex.quote(str(path)), folder_kind(path)
    if kind == "finetuning run":
        return (
            f"{p} is a finetuning run, not a pretraining run (no {RUN_JSON}): sample it with "
            f"`tinygpt generate {q} --prompt TEXT`, or evaluate and export it with `tinygpt "
            "eval`/`tinygpt export`"
        )
    if kind == "GGUF export":
        return (
            f"{p} is a GGUF export, not a run folder: run it with `cd {q} && ollama create mymodel "
            "-f Modelfile`, or llama.cpp's `llama-cli -m "
            f"{shlex.quote(str(sorted(p.glob('*.gguf'))[0]))}`"
        )
    if kind is not None:
        return (
            f"{p} is a Hugging Face model folder (an export?), not a run folder: load it with "
            f"AutoModelForCausalLM.from_pretrained({str(p)!r}), evaluate it with `tinygpt eval {q} "
            f"--task TASK`, or finetune it with `tinygpt finetune --base {q}`"
        )
    return f"{p} is not a tinygpt run folder (no {RUN_JSON}); train one with `tinygpt pretrain {q}`"
