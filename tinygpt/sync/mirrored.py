"""A run and its mirror (a folder on Drive, or any folder),
wired in one place for pretraining and finetuning.

`mirrored` is the whole story: the run's identity is settled first (a mirror that another run owns
is refused before anything is copied or written), a new VM brings the mirror's newest valid
checkpoint and run files home, the `RunMirror` it yields is the trainer's callback (when training
starts it writes identity.json and starts the `Mirror`, which copies each checkpoint as it is
saved), and when the block ends, however it ends, the mirror finishes its copies (or gives up and
says what the mirror lacks: a dead Drive never blocks the run; the local run folder has everything).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from tinygpt.core.callback import Callback
from tinygpt.sync.identity import run_identity, write_identity
from tinygpt.sync.mirror import Mirror
from tinygpt.sync.restore import restore_latest


class RunMirror(Callback):
    """The trainer's callback for a run's mirror (None: no mirror, only
    identity.json). The `Mirror` starts with training, keeping the trainer's
    `keep_last` newest checkpoints there; `mirrored` closes it."""

    def __init__(self, run_dir: Path, mirror: Path | None, identity: dict) -> None:
        self.run_dir, self.mirror, self.identity = run_dir, mirror, identity
        self.copying: Mirror | None = None

    def on_start(self, trainer: Any, resumed_from: int | None) -> None:
        write_identity(self.run_dir, self.identity)  # kept once written
        if self.mirror is not None and self.copying is None:
            self.copying = Mirror(
                self.run_dir, self.mirror, keep_last=trainer.cfg.keep_last, identity=self.identity
            )

    def on_log(self, metrics: dict[str, Any]) -> None:
        if self.copying is not None:
            self.copying.on_log(metrics)

    def on_checkpoint(self, path: str | Path, step: int) -> None:
        if self.copying is not None:
            self.copying.on_checkpoint(path, step)

    def close(self) -> None:
        """Finish the copies (within the mirror's wait) and stop: the Trainer calls it when training
        ends, `mirrored` when its block ends (a second close does nothing)."""
        if self.copying is not None:
            self.copying.close()
            self.copying = None


@contextlib.contextmanager
def mirrored(run_dir: str | Path, mirror: str | Path | None, config: dict) -> Iterator[RunMirror]:
    """The run's mirror for the block, entered under the run folder's lock:
    identity checked, the mirror's newest checkpoint restored (with best/ and the
    run files the folder lacks), closed at the end. `config` is what makes two runs
    the same run (a mirror holding another configuration is another run's)."""
    run_dir, mirror = Path(run_dir), Path(mirror) if mirror is not None else None
    run_mirror = RunMirror(run_dir, mirror, run_identity(run_dir, mirror, config))
    if mirror is not None:
        # a new VM: the newest valid checkpoint, local or mirrored, wins
        restore_latest(run_dir, mirror)
    try:
        yield run_mirror
    finally:
        run_mirror.close()
