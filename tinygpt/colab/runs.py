"""Run folders in a notebook: where runs live on this machine, Drive
(mounted in Colab, a local stand-in elsewhere), a run's two homes
(fast local disk and its mirror on Drive) and where a run stands."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tinygpt.colab.mount import drive_run_dir, in_colab, mount_drive
from tinygpt.core.checkpoint import list_checkpoints
from tinygpt.core.rundir import ADAPTER_DIR, FULL_MODEL_DIR, RunDir, recipe_name_of


def workdir() -> Path:
    """Where runs and Drive live: $TINYGPT_WORKDIR, else /content in Colab, else here."""
    if os.environ.get("TINYGPT_WORKDIR"):
        return Path(os.environ["TINYGPT_WORKDIR"])
    return Path("/content") if in_colab() else Path.cwd()


def connect_drive(root: str | Path | None = None) -> Path:
    """Your Drive's MyDrive folder: mounted at <workdir>/drive in Colab (it asks for permission);
    elsewhere a local folder at the same place stands in for it."""
    drive_dir = Path(root or workdir()) / "drive"
    if in_colab():
        return mount_drive(drive_dir)
    mydrive = drive_dir / "MyDrive"
    mydrive.mkdir(parents=True, exist_ok=True)
    return mydrive


@dataclass
class RunFolders:
    """A run's two homes: `local` (fast disk, lost with the VM) and `mirror` (on Drive, kept)."""

    name: str
    local: Path
    mirror: Path

    def mirrored_step(self) -> int | None:
        """The newest checkpoint step on the mirror (None when there is none)."""
        ckpts = list_checkpoints(RunDir(self.mirror).checkpoints)
        return ckpts[-1][0] if ckpts else None

    def __str__(self) -> str:
        step, recipe = self.mirrored_step(), recipe_name_of(self.mirror, self.local)
        state = (
            f"on Drive: step {step} of recipe {recipe}; training continues from there"
            if step is not None
            else "nothing on Drive yet: a new run"
        )
        return f"run {self.name!r}\n  local:  {self.local}\n  Drive:  {self.mirror}\n  {state}"

    __repr__ = __str__


def run_folders(name: str, mydrive: str | Path) -> RunFolders:
    """<workdir>/runs/<name> locally, mirrored to MyDrive/tinygpt/runs/<name>."""
    if not name or name.strip() != name or any(c in name for c in "/\\") or name.startswith("."):
        raise ValueError(f"run name {name!r} must be a plain folder name, e.g. 'my-first-gpt'")
    return RunFolders(name, workdir() / "runs" / name, drive_run_dir(name, mydrive))


@dataclass
class FinetuneStatus:
    """Where a finetuning run stands: its local folder and, when given, its mirror on Drive."""

    local: Path
    mirror: Path | None = None

    def __str__(self) -> str:
        home, where = (self.mirror, "on Drive") if self.mirror is not None else (self.local, "here")
        steps = list_checkpoints(RunDir(home).checkpoints)
        lines = [f"local:  {self.local}"]
        lines += [f"Drive:  {self.mirror}"] if self.mirror is not None else []
        if steps:
            lines.append(
                f"{where}: step {steps[-1][0]} of recipe {recipe_name_of(home, self.local)}; "
                "finetuning continues from there"
            )
        else:
            lines.append(f"nothing {where} yet: a new run")
        if (home / ADAPTER_DIR / "adapter_model.safetensors").is_file():
            lines.append(f"adapter {where}: {home / ADAPTER_DIR}")
        # full finetuning (its checkpoints go to Drive)
        if (self.local / FULL_MODEL_DIR / "config.json").is_file():
            lines.append(f"model here: {self.local / FULL_MODEL_DIR}")
        return "\n".join(lines)

    __repr__ = __str__


def run_status(local: str | Path, mirror: str | Path | None = None) -> FinetuneStatus:
    """Where a finetuning run stands (printed by the notebook's first and last cells)."""
    return FinetuneStatus(Path(local), Path(mirror) if mirror is not None else None)
