"""Restore from the mirror: on a new VM, the newest valid checkpoint, local or mirrored, comes back
(with best/ and the run files the local folder lacks), each copy verified by `sync.copy`. A corrupt
or cut-short checkpoint is skipped with a warning; a mirror that holds another run's tokenizer is
refused before anything is copied."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from tinygpt.core.checkpoint import list_checkpoints, verify_checkpoint
from tinygpt.core.files import link_problem, read_bytes_safe, write_bytes_atomic
from tinygpt.core.rundir import ADAPTER_CONFIG, RUN_FILES, TOKENIZER_JSON, RunDir, run_file_limit
from tinygpt.sync.copy import (
    Backoff,
    CopyFile,
    MirrorTaken,
    SyncError,
    copy_checkpoint,
    is_permanent,
    manifest_step,
    new_tag,
    plain_copy,
)


def restore_latest(
    local_run_dir: str | Path,
    mirror_run_dir: str | Path | None,
    *,
    backoff: Backoff | None = None,
    copy_file: CopyFile = plain_copy,
) -> Path | None:
    """The newest valid checkpoint among local and mirror, copied locally when it is on the mirror
    (with best/ and the run files the local folder lacks or has older). None if there is none.
    Corrupt or truncated ones are skipped with a warning; ties go to the local one."""
    local = Path(local_run_dir)
    backoff, tag = backoff or Backoff(), new_tag()
    candidates = [(s, 1, p) for s, p in list_checkpoints(RunDir(local).checkpoints)]
    mirror = Path(mirror_run_dir) if mirror_run_dir is not None else None
    if mirror is not None:
        # another run's tokenizer: refused before anything is copied
        _check_defining_files(local, mirror)
        try:  # no wait where it cannot help
            listed = backoff.run(
                lambda: list_checkpoints(RunDir(mirror).checkpoints),
                permanent=lambda e: is_permanent(e, mirror),
            )
            candidates += [(s, 0, p) for s, p in listed]
        except OSError as e:
            warnings.warn(
                f"cannot read the mirror {mirror} ({e}); resuming from local checkpoints only",
                stacklevel=2,
            )
            mirror = None
    chosen, mirror = _first_valid(candidates, local, mirror, backoff, copy_file, tag)
    if chosen is None and candidates:
        warnings.warn(
            f"none of the {len(candidates)} checkpoints here or on the mirror passed verification: "
            "training starts from step 0 (the failing folders are kept; see the warnings above)",
            stacklevel=2,
        )
    if mirror is not None:
        try:
            # came from the mirror
            ahead = chosen is not None and not any(p == chosen for _, _, p in candidates)
            _restore_run_files(local, mirror, backoff, copy_file, tag, ahead)
        except OSError as e:
            warnings.warn(f"could not restore best/ or run files from {mirror}: {e}", stacklevel=2)
    return chosen


def _first_valid(
    candidates: list[tuple[int, int, Path]],
    local: Path,
    mirror: Path | None,
    backoff: Backoff,
    copy_file: CopyFile,
    tag: str,
) -> tuple[Path | None, Path | None]:
    """(chosen, mirror): the newest candidate (step, is_local, folder) that verifies, local first on
    a tie, copied into the local run folder when it is the mirror's (None if none verifies); and the
    mirror, None once it fails with an OSError (its other checkpoints are then skipped). Every
    candidate passed over gets a warning saying why."""
    for _, is_local, p in sorted(candidates, key=lambda c: c[:2], reverse=True):
        if is_local:
            ok, why = verify_checkpoint(p)
            if ok:
                return p, mirror
        elif mirror is not None:
            dst = RunDir(local).checkpoints / p.name

            def fetch(p: Path = p, dst: Path = dst) -> None:
                # cheap; the sha256 is checked on the copy
                ok, why = verify_checkpoint(p, deep=False)
                if not ok:
                    raise SyncError(why)
                copy_checkpoint(p, dst, copy_file, tag)

            try:
                backoff.run(fetch, fatal=(SyncError,))
                return dst, mirror
            except SyncError as e:
                why = str(e)
            except OSError as e:
                why, mirror = f"{e}; not using the mirror", None
        else:
            continue  # the mirror went away during this restore
        warnings.warn(f"skipping checkpoint {p}: {why}", stacklevel=3)  # restore_latest's caller
    return None, mirror


ON_MIRROR = " (on the mirror)"  # added to a refused file's name in messages
DEFINING_FILES = (TOKENIZER_JSON, ADAPTER_CONFIG)  # written once: a different one is another run's


def _check_defining_files(local: Path, mirror: Path) -> None:
    for name in DEFINING_FILES:
        limit = run_file_limit(name)
        try:
            if not os.path.lexists(mirror / name):
                continue
            # a resumed run cannot do without it
            theirs = read_bytes_safe(mirror / name, limit, ON_MIRROR)
            if not (local / name).is_file():
                continue
            same = read_bytes_safe(local / name, limit) == theirs
        except OSError:
            continue  # an unreadable mirror: the restore below says so
        # a link, or larger than tinygpt writes: named, before anything is copied
        except ValueError as e:
            raise MirrorTaken(f"{e}; nothing was copied from the mirror") from None
        if not same:
            raise MirrorTaken(
                f"{name} on the mirror {mirror} differs from {local / name}: the mirror holds "
                "another run's files; nothing was copied or overwritten. Use another --mirror "
                "folder (one per run), or another run folder to continue the mirror's run"
            )


def _restore_run_files(
    local: Path,
    mirror: Path,
    backoff: Backoff,
    copy_file: CopyFile,
    tag: str,
    mirror_ahead: bool = True,
) -> None:
    """best/ when the mirror's is newer; a run file the local folder lacks, or holds a shorter copy
    of (metrics.jsonl the mirror has more of); when the mirror's checkpoint was newer than every
    local one (`mirror_ahead`), its newer files too. A local file that differs is never overwritten
    otherwise. A link on the mirror is never followed (it could point at any file of this VM, which
    the next sync would carry to the shared folder)."""
    best_there, best_here = RunDir(mirror).best, RunDir(local).best
    if verify_checkpoint(best_there, deep=False)[0] and (
        not verify_checkpoint(best_here)[0] or manifest_step(best_here) < manifest_step(best_there)
    ):
        try:
            backoff.run(
                lambda: copy_checkpoint(best_there, best_here, copy_file, tag), fatal=(SyncError,)
            )
        except SyncError as e:
            warnings.warn(f"skipping {best_there}: {e}", stacklevel=3)
    local.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        src, dst = mirror / name, local / name
        if (why := link_problem(src)) is not None:
            warnings.warn(
                f"{why}: not followed, {name} is not restored from the mirror", stacklevel=3
            )
            continue
        if not src.is_file():
            continue
        limit = run_file_limit(name)
        try:
            # read once, bounded: what is compared is what is copied
            theirs = read_bytes_safe(src, limit, ON_MIRROR)
        # larger than tinygpt writes, or not a plain file: named, and not copied
        except ValueError as e:
            warnings.warn(f"{e}; {name} is not restored from the mirror", stacklevel=3)
            continue
        if dst.is_file():
            if name in DEFINING_FILES:
                continue  # equal (checked before the restore)
            ours = read_bytes_safe(dst, limit)
            newer = src.stat().st_mtime > dst.stat().st_mtime
            if theirs == ours or not newer or not (mirror_ahead or theirs.startswith(ours)):
                continue
        mtime_ns = src.stat().st_mtime_ns
        backoff.run(lambda: write_bytes_atomic(dst, theirs, mtime_ns, tag))
