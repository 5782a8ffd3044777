"""What a command ends with: a run's figures, what to run next ("next:"), and the line that says the
mirror is behind the local run.

The sync modules these read import torch, so each is imported inside the function that reads it
(`tinygpt --help` imports no torch: tests/test_imports.py counts the modules)."""

from __future__ import annotations

import shlex
from pathlib import Path

from tinygpt.core.rundir import RunDir


def say_complete(done: str, run_dir: Path, mirror: str | None) -> None:
    """A finished run's line; "complete" includes the mirror: what it lacks goes there now."""
    from tinygpt.sync.catchup import catch_up
    from tinygpt.sync.identity import run_identity

    print(done)
    if mirror:
        recipe = RunDir(run_dir).recipe()
        lag = catch_up(run_dir, mirror, identity=run_identity(run_dir, mirror, recipe.identity()))
        print(mirror_line(mirror, lag) or f"the mirror {mirror} has all of it")


def report_pretrain(res, run_dir: Path, mirror: str | None) -> int:
    """A pretraining run's end: its figures, a sample, what to run next, the mirror's lag."""
    from tinygpt.sync.catchup import mirror_lag

    print(
        f"step {res.step}: "
        + figures_line(loss=res.loss, val_loss=res.val_loss, checkpoint=res.checkpoint)
    )
    samples = RunDir(run_dir).samples()
    if samples and not res.interrupted:
        print("sample:\n" + samples.split("===\n")[-1].strip())
    behind = mirror_line(mirror, mirror_lag(run_dir, mirror)) if mirror else None
    if res.interrupted:
        print("stopped by a signal; run the same command again to resume")
        if behind:
            print(behind)
        return 130  # like an interrupted shell command: a script can tell the run did not finish
    print(next_steps(run_dir))
    if behind:
        print(behind)  # the last line: the run is done here, not yet on the mirror
    return 0


def figures_line(**figures) -> str:
    """ "loss 2.1234, val_loss 2.3456, ...": the measured figures (a short run may have none)."""
    said = [
        f"{k} {round(v, 4) if isinstance(v, float) else v}"
        for k, v in figures.items()
        if v is not None
    ]
    return ", ".join(said) or "no loss measured yet"


def next_steps(run_dir: str | Path) -> str:
    """What to run after a finished pretraining run: sample, evaluate, export (the README's order;
    no export where the model has options transformers has no equivalent of: `export_gaps`)."""
    d = shlex.quote(str(run_dir))
    if gaps := RunDir(run_dir).recipe().model.export_gaps("hf"):
        export = f"  (no export: transformers has no equivalent of {', '.join(gaps)})"
    else:
        export = (
            f"  tinygpt export {d} hf-model/              # a Hugging Face folder "
            "(transformers, llama.cpp)"
        )
    return (
        "next:\n"
        f'  tinygpt generate {d} --prompt "def main(" --max-new-tokens 100   # text from the '
        "model\n"
        f"  tinygpt eval {d} --task perplexity        # loss, perplexity, bits per byte on its "
        "validation text\n" + export
    )


def mirror_line(mirror: str | Path, lag: list[str]) -> str | None:
    """A command's last line when the mirror is behind the local run (None when it is not)."""
    from tinygpt.sync.catchup import NOTHING_MORE

    if not lag:
        return None
    if lag[0].startswith(NOTHING_MORE):  # gone, or another run's: the line says what to do instead
        return (
            f"the mirror {mirror} is behind: {lag[0][len(NOTHING_MORE) :]}; the local run "
            "folder has everything"
        )
    return (
        f"the mirror {mirror} is behind: it lacks {'; '.join(lag)}; the local run folder has "
        "everything, and the same command again (with --mirror) copies the rest once the mirror "
        "has room and is reachable"
    )


def finetune_next_steps(run_dir: str | Path, full: bool = False) -> str:
    """What to run after a finished finetuning run: ask it, evaluate it, export it (a LoRA's
    adapter merged into its base; a full finetune is a whole model already)."""
    d = shlex.quote(str(run_dir))
    what = "the finetuned model" if full else "base + adapter merged"
    return (
        "next:\n"
        f'  tinygpt generate {d} --prompt "Write a function that reverses a string."   # its '
        "answer\n"
        f"  tinygpt eval {d} --task stdlib-functions   # writes functions from their docstrings\n"
        f"  tinygpt export {d} hf-model/               # {what}, as a Hugging Face folder"
    )
