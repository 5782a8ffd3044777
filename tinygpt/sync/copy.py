"""Copy-and-verify: how a folder reaches the mirror (or comes back from it) whole or not at all.

Data files go into a temporary folder, each checked against the source's manifest (size and sha256),
manifest.json last, then the folder is renamed into place: a `step_*` folder on the mirror is
complete by construction. A name that leaves its folder, or a link, is refused for good
(SyncRefused). An error waiting can cure (a dropped FUSE mount says ENOTCONN, a full quota ENOSPC)
is retried with exponential backoff (`Backoff`); one it cannot (`is_permanent`: a read-only file
system, the mirror a file) is not. The mirror's old checkpoints are pruned here (`prune_mirror`:
only what the full check verified counts), and a finetune's adapter is copied once (`mirror_adapter`).
This module knows files and folders, never models.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tinygpt.core.checkpoint import MANIFEST, list_checkpoints, verify_checkpoint, write_manifest
from tinygpt.core.files import (
    UnsafePathError,
    fresh_tmp_dir,
    link_problem,
    read_bytes_safe,
    replace_dir,
    safe_name,
    sha256_file,
    tmp_sibling,
    try_fsync,
)
from tinygpt.core.rundir import ADAPTER_DIR, CHECKPOINTS, RunDirError, run_file_limit

CopyFile = Callable[[Path, Path], Any]


class SyncError(OSError):
    """A copy that does not match its source's manifest."""


class SyncRefused(SyncError):
    """A name that leaves its folder or a link: refused for good, never retried."""


class SyncAborted(Exception):
    """The mirror was told to give up (its time after training ran out): no more retries."""


class MirrorTaken(ValueError):
    """The mirror folder belongs to another run (its
    identity.json says so): refused before any write."""


class MirrorGone(OSError):
    """The mirror folder this run was copying to is no longer there
    (Drive unmounted, the folder deleted or replaced): nothing more is
    copied, and nothing is made in its place on the VM's own disk."""

    def __init__(self, mirror: Path, local: Path, why: str) -> None:
        super().__init__(
            errno.ENOENT,
            f"the mirror at {mirror} is gone ({why}); local checkpoints are safe in "
            f"{local}; remount Drive and run again to copy them",
        )

    def __str__(self) -> str:
        return self.strerror


def _fuse_mount(path: Path) -> bool:
    """Whether `path` lies on a FUSE mount (Colab's Drive),
    where EACCES/EPERM can pass; elsewhere they do not."""
    try:
        # outside run folders
        mounts = [ln.split()[1:3] for ln in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return False
    target = os.path.abspath(path)
    best = max(
        (m for m in mounts if target == m[0] or target.startswith(m[0].rstrip("/") + "/")),
        key=lambda m: len(m[0]),
        default=None,
    )
    return best is not None and best[1].startswith("fuse")


def is_permanent(e: BaseException, path: str | Path) -> bool:
    """An error that waiting will not cure: the mirror (or a parent) is not a
    folder, the file system is read-only, or permission is denied off FUSE;
    or the mirror belongs to another run. ENOSPC, EIO, ENOTCONN and the rest
    are transient (a full quota is freed, a dropped mount comes back)."""
    if isinstance(e, (MirrorTaken, MirrorGone, RunDirError)):
        return True
    if not isinstance(e, OSError):
        return False
    if e.errno in (errno.ENOTDIR, errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP):
        return True
    if isinstance(e, FileExistsError) and not Path(path).is_dir():  # the mirror is a file
        return True
    return e.errno in (errno.EACCES, errno.EPERM) and not _fuse_mount(Path(path))


def plain_copy(src: Path, dst: Path) -> None:
    """The default `copy_file`: the bytes alone. (copyfile, not copy2: Drive's FUSE mount refuses
    some of the chmod/xattr calls that copystat makes.)"""
    shutil.copyfile(src, dst)


@dataclass
class Backoff:
    """How a copy to or from the mirror is retried: after delays base, 2*base, ... (capped), at most
    `max_attempts` tries. Once `stop` is set (the mirror gives up) no retry
    starts and a wait ends at once (SyncAborted). `wait(stop, seconds)` is the
    wait itself: the event's own (cut short when it is set) unless another is
    passed (one that returns at once, to test the policy without waiting)."""

    max_attempts: int = 8
    base_delay_s: float = 2.0
    max_delay_s: float = 60.0
    wait: Callable[[threading.Event, float], Any] = threading.Event.wait
    stop: threading.Event = field(default_factory=threading.Event)

    def run(
        self,
        fn: Callable[[], Any],
        on_error: Callable[[OSError], Any] | None = None,
        fatal: tuple[type[BaseException], ...] = (),
        permanent: Callable[[OSError], bool] | None = None,
    ) -> Any:
        """fn(), retried on OSError; `fatal` ones, and those that `permanent` says waiting cannot
        cure, are raised at once."""
        delay = self.base_delay_s
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except OSError as e:
                if on_error is not None:
                    on_error(e)
                if (
                    attempt >= self.max_attempts
                    or isinstance(e, fatal)
                    or (permanent is not None and permanent(e))
                ):
                    raise
                self._pause(min(delay, self.max_delay_s))
                delay *= 2

    def _pause(self, seconds: float) -> None:
        if self.stop.is_set() or self.wait(self.stop, seconds) or self.stop.is_set():
            raise SyncAborted()


# ---- folder copies -------------------------------------------------------------------------------


def check_copy(path: Path, info: dict[str, Any]) -> None:
    """A SyncError unless the file at `path` has the
    size and sha256 its manifest entry `info` gives."""
    size = path.stat().st_size
    if size != info["size"]:
        raise SyncError(f"{path} has {size} bytes, manifest says {info['size']}")
    if sha256_file(path) != info["sha256"]:
        raise SyncError(f"{path} fails its sha256 check")


def _files_of(manifest_bytes: bytes, where: Path) -> dict[str, dict[str, Any]]:
    """The files a checkpoint manifest lists, each a plain file name (a manifest on a shared mirror
    is anyone's: a name like ../../x would write outside the folder)."""
    try:
        files = json.loads(manifest_bytes)["files"]
        for name in files:
            safe_name(name, Path(where) / MANIFEST, plain=True)
        return files
    except UnsafePathError as e:
        raise SyncRefused(str(e)) from None
    except (ValueError, KeyError, TypeError) as e:
        raise SyncError(f"unreadable manifest in {where}: {e}") from None


def check_not_link(path: Path) -> None:
    """A SyncError (not retried) when `path` is a symbolic link: a copy never follows one."""
    if (why := link_problem(path)) is not None:
        raise SyncRefused(f"{why}: not followed")


def _copy_folder(
    src: Path,
    dst: Path,
    files: dict[str, dict[str, Any]],
    last: dict[str, bytes],
    copy_file: CopyFile,
    tag: str,
) -> None:
    """Copy `files` (name -> size, sha256) into a temp folder, verifying each, then write `last`
    (name -> bytes) in order and rename the folder into place."""
    # a linked checkpoints/ or step folder would copy from or to somewhere else (the mirror's own
    # path is the user's choice: a link there is theirs)
    for p in (src, *(d for d in (src.parent, dst.parent) if d.name == CHECKPOINTS)):
        check_not_link(p)
    tmp = tmp_sibling(dst, tag)
    try:  # made inside the try: a Ctrl-C that lands just after the mkdir still removes it
        fresh_tmp_dir(tmp)
        for name, info in files.items():
            check_not_link(src / name)
            copy_file(src / name, tmp / name)
            check_copy(tmp / name, info)
            try_fsync(tmp / name)
        for name, data in last.items():
            # outside run folders: the fresh temporary folder made above
            (tmp / name).write_bytes(data)
            try_fsync(tmp / name)
        replace_dir(tmp, dst, tag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_checkpoint(
    src: str | Path, dst: str | Path, copy_file: CopyFile = plain_copy, tag: str = ""
) -> None:
    """Copy a checkpoint folder, data files verified against src's manifest, the manifest last. The
    manifest's names must be plain file names and no file, nor either folder, may be a link."""
    check_not_link(Path(src) / MANIFEST)
    # read once: a best/ replaced meanwhile fails the checks
    raw = read_bytes_safe(Path(src) / MANIFEST)
    _copy_folder(
        Path(src), Path(dst), _files_of(raw, src), {MANIFEST: raw}, copy_file, tag or new_tag()
    )


def whole_lines(path: Path) -> bytes:
    """A run file's bytes as the mirror takes them
    (read the one way: no link, at most its limit)."""
    data = read_bytes_safe(path, run_file_limit(path.name))
    # metrics.jsonl may be mid-append: keep whole lines only, the rest comes with the next sync
    return data[: data.rfind(b"\n") + 1] if path.suffix == ".jsonl" else data


def new_tag() -> str:
    """This process's mark on its temporary files (a
    later session clears another's leftovers by it)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def manifest_step(folder: Path) -> int:
    """The step a checkpoint folder's manifest names; -1 when it has none that can be read."""
    try:
        return int(json.loads(read_bytes_safe(folder / MANIFEST)).get("step", -1))
    except (OSError, ValueError, AttributeError, TypeError):
        return -1


def said(e: BaseException) -> str:
    """An error in words for a message: what it says (its class only when it says nothing)."""
    return str(e) or type(e).__name__


def prune_mirror(
    ckpt_root: str | Path, keep_last: int, known_valid: set[str] | None = None
) -> list[Path]:
    """Keep the newest `keep_last` checkpoints that pass the FULL check (sha256 of every file) and
    delete older step folders; never delete the newest verified one, and with none verified delete
    nothing. A size check is not enough: a corrupt folder of the right size at a higher step would
    push every good one out. `known_valid` holds names verified already (by the copy that wrote
    them, or an earlier prune); names verified here are added to it, so each folder is hashed
    once."""
    known = known_valid if known_valid is not None else set()
    ckpts = list_checkpoints(ckpt_root)
    kept: list[int] = []
    for s, p in reversed(ckpts):  # newest first: stop hashing once enough are verified
        if len(kept) >= max(keep_last, 1):
            break
        if p.name in known or verify_checkpoint(p, deep=True)[0]:
            known.add(p.name)
            kept.append(s)
    if not kept:
        return []
    oldest_kept = min(kept)
    removed = [p for s, p in ckpts if s < oldest_kept]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
        known.discard(p.name)
    return removed


# ---- one-off folders (a finetuning run's adapter) ------------------------------------------------


def mirror_adapter(adapter_dir: Path, mirror: Path, step: int) -> Path | None:
    """Copy an adapter folder to mirror/adapter, each file checked against a manifest written here
    first, with a few retries (none for a permanent error); a Drive failure warns, it never stops a
    run."""
    write_manifest(adapter_dir, {"step": int(step), "kind": "adapter"})
    dst = mirror / ADAPTER_DIR
    try:
        Backoff(max_attempts=4).run(
            lambda: copy_checkpoint(adapter_dir, dst), permanent=lambda e: is_permanent(e, mirror)
        )
        return dst
    except OSError as e:
        warnings.warn(
            f"Drive mirror: could not copy the adapter to {dst} ({said(e)}); the local run folder "
            "has it",
            stacklevel=2,
        )
        return None
