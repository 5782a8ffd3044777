"""What the mirror lacks, and catching it up: `mirror_lag` says what a local run holds that its
mirror does not (at every start, and after training), `catch_up` copies it with a `Mirror` that
runs once (a run that ended with the mirror full or offline).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from tinygpt.core.checkpoint import (
    MANIFEST,
    list_checkpoints,
    newest_complete,
    step_of,
    verify_checkpoint,
)
from tinygpt.core.files import read_bytes_safe
from tinygpt.core.rundir import ADAPTER_DIR, BEST, CHECKPOINTS, METRICS, run_file_limit
from tinygpt.sync.copy import Backoff, manifest_step, whole_lines
from tinygpt.sync.identity import read_identity
from tinygpt.sync.mirror import Mirror


def _same_folder(local: Path, there: Path) -> bool:
    try:
        return (
            read_bytes_safe(there / MANIFEST) == read_bytes_safe(local / MANIFEST)
            and verify_checkpoint(there, deep=False)[0]
        )
    except (OSError, ValueError):  # a link or an oversized manifest on the mirror: not the same
        return False


def _missing(path: Path) -> bool:
    """Whether nothing is at `path` (not: a file where a folder's parent should be, or an
    unreadable mount)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:
        pass
    return False


# how mirror_lag begins when the mirror takes nothing more of this run (and why)
NOTHING_MORE = "everything: "


def mirror_lag(local_run_dir: str | Path, mirror_run_dir: str | Path) -> list[str]:
    """What the local run holds and the mirror lacks, in words ([] when the mirror has it all): the
    newest checkpoint, best/, the adapter, metrics.jsonl's logged steps."""
    local, mirror = Path(local_run_dir), Path(mirror_run_dir)
    out: list[str] = []
    if _missing(mirror) and list_checkpoints(local / CHECKPOINTS):
        return [
            f"{NOTHING_MORE}the folder is gone (Drive unmounted, or the folder deleted); "
            "remount Drive and run again to copy it"
        ]
    try:
        mine, theirs = read_identity(local), read_identity(mirror)
    except (OSError, ValueError):
        mine = theirs = None
    if mine is not None and theirs is not None and mine["run_id"] != theirs["run_id"]:
        return [
            f"{NOTHING_MORE}it belongs to run {theirs['run_id']} (another VM or tab claimed it "
            f"first), so this run copies nothing there: use another --mirror folder for it"
        ]
    try:
        newest = newest_complete(local / CHECKPOINTS)
        if newest is not None and not _same_folder(newest, mirror / CHECKPOINTS / newest.name):
            there = newest_complete(mirror / CHECKPOINTS)
            out.append(
                f"checkpoint step {manifest_step(newest)} (the mirror's newest: "
                f"{f'step {step_of(there)}' if there else 'none'})"
            )
        for name in (BEST, ADAPTER_DIR):
            if (local / name / MANIFEST).is_file() and not _same_folder(
                local / name, mirror / name
            ):
                out.append(f"{name}/")
        if (local / METRICS).is_file():
            ours = whole_lines(local / METRICS)
            theirs = b""
            if (mirror / METRICS).is_file():
                theirs = read_bytes_safe(mirror / METRICS, run_file_limit(METRICS))
            if not theirs.startswith(ours):
                out.append(METRICS)
    except OSError as e:
        return [f"everything (the mirror cannot be read: {e})"]
    return out


def catch_up(
    local_run_dir: str | Path,
    mirror_run_dir: str | Path,
    *,
    identity: dict | None = None,
    timeout: float | None = None,
    backoff: Backoff | None = None,
) -> list[str]:
    """Copy to the mirror what the local run holds and it lacks (a run that ended with the mirror
    full or offline), within `timeout`; what it still lacks afterwards ([] when nothing)."""
    # the answer is the list returned: one line, said by the caller
    with warnings.catch_warnings(action="ignore"):
        m = Mirror(
            local_run_dir,
            mirror_run_dir,
            identity=identity,
            backoff=backoff,
            close_timeout_s=timeout,
        )
        m.close()
    return mirror_lag(local_run_dir, mirror_run_dir)
