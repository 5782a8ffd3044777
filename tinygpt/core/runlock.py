"""One writer per run folder: `lock` holds the folder for this process (the kernel's lock on its
.lock file, bound to the folder's identity: `RunDir.check_held`), and `undo_if_first_try_fails`
removes what a failed first try added, so a corrected try starts clean."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer is then the user's care
    fcntl = None

from tinygpt.core.rundir import (
    _HELD,
    _HELD_LOCK,
    ADAPTER_CONFIG,
    FINETUNE_JSON,
    IDENTITY,
    LOCK,
    RUN_JSON,
    RunDir,
    RunDirError,
    _identity,
)
from tinygpt.core.signals import signals_deferred


@contextlib.contextmanager
def lock(run: RunDir) -> Iterator[None]:
    """Hold the run folder for this process: a second writer (another tab, a double-run cell) is
    refused with a RunDirError naming the holder. The lock is the kernel's (flock): a process that
    dies, even by kill -9, releases it, so it never stays stuck. A folder this call made is removed
    again when nothing but the lock was written in it, even when a Ctrl-C or SIGTERM arrives while
    the lock is being taken (it is delivered once the lock is held, so the release always runs)."""
    created = not run.path.exists()
    made_lock = not os.path.lexists(run.path / LOCK)
    key = os.path.abspath(run.path)
    fd = None
    try:
        with signals_deferred():
            run.path.mkdir(parents=True, exist_ok=True)
            # (Windows: no advisory locks; one writer is then the user's care)
            if fcntl is not None:
                fd = _take_lock(run, key)
        yield
    finally:
        with _HELD_LOCK:
            held = _HELD.pop(key, None)
        if fd is not None:
            if made_lock and not created and held == _identity(run.path) and not _holds_a_run(run):
                # a folder that existed, left as found (still held here)
                with contextlib.suppress(OSError):
                    (run.path / LOCK).unlink()
            os.close(fd)  # releases the lock
        if created:
            _remove_if_unwritten(run, held)


def _holds_a_run(run: RunDir) -> bool:
    """Whether the folder holds a run's files (a failed
    first try in a folder that existed removed its own)."""
    return run.checkpoints.exists() or any(
        (run.path / n).exists() for n in (RUN_JSON, FINETUNE_JSON, ADAPTER_CONFIG, IDENTITY)
    )


def _remove_if_unwritten(run: RunDir, held: tuple[int, int] | None) -> None:
    """A folder `lock` made, refused or stopped before anything was written
    in it (bad input, a Ctrl-C): no trace is left. A folder replaced
    meanwhile is another run's: its .lock is not ours to remove."""
    names = [p.name for p in run.path.iterdir()] if run.path.is_dir() else None
    if held is not None and held == _identity(run.path) and names == [LOCK]:
        (run.path / LOCK).unlink(missing_ok=True)
    elif not (held is None and names == []):  # no lock taken: only an empty folder is removed
        return
    with contextlib.suppress(OSError):
        run.path.rmdir()


def _take_lock(run: RunDir, key: str) -> int:
    """Open .lock, take the kernel's lock on it, write who holds it and record the folder as
    held: the open descriptor (closing it lets the lock go). A RunDirError, with nothing held,
    when another process holds it or .lock cannot be opened."""
    # O_NOFOLLOW: a .lock planted as a symlink (a shared folder) is refused, never followed
    try:
        fd = os.open(run.path / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        raise RunDirError(
            f"cannot open the lock {run.path / LOCK} ({e.strerror}); if it is a symlink, remove it"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise RunDirError(
            f"run folder {run.path} is in use by {holder}; wait for it to finish or stop it, "
            "or use another run folder"
        ) from None
    os.ftruncate(fd, 0)
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()} (since {since})\n".encode(), 0)
    with _HELD_LOCK:
        _HELD[key] = _identity(run.path)  # type: ignore[assignment]
    return fd


@contextlib.contextmanager
def undo_if_first_try_fails(run: RunDir, marker: str) -> Iterator[None]:
    """Around a run's start: when `marker` (run.json, finetune.json) did not exist before and
    the block raises before it adds a checkpoint, everything the block added to the folder is
    removed, so a failed first try (bad data, no such device, a bad value) leaves no run.json,
    tokenizer or base/ that a corrected try would pick up. A run that has a marker or a new
    checkpoint keeps all it has."""
    first = not (run.path / marker).exists()
    before = set(os.listdir(run.path)) if first and run.path.is_dir() else set()
    # a folder's own (e.g. a finetuning run's) are not ours
    steps = set(run.checkpoints.glob("step_*"))
    try:
        yield
    except BaseException:
        if (
            first
            and run.path.is_dir()
            and not set(run.checkpoints.glob("step_*")) - steps
            and _identity(run.path) == _HELD.get(os.path.abspath(run.path), _identity(run.path))
        ):
            for name in set(os.listdir(run.path)) - before - {LOCK}:
                p = run.path / name
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        p.unlink()
        raise
