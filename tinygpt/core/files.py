"""Crash-safe file writes: the one place that writes to a temporary name, fsyncs and renames.

Invariant: a reader (or a process restarted after `kill -9`) sees either the old file or folder or
the new one, whole, never a mix. Every module that persists something goes through these.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

TMP_PREFIX, OLD_PREFIX = ".tmp-", ".old-"  # leftovers of an interrupted write carry these
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once, at import: os.umask is process-wide, so never again from a thread
FILE_MODE = 0o666 & ~_UMASK  # what open() gives a new file; some writers (safetensors) make 0600 files


def _usual_mode(path: Path) -> None:
    """Give a finished file the mode any other new file gets (rw-r--r-- under the usual umask)."""
    with contextlib.suppress(OSError):
        os.chmod(path, FILE_MODE)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_fsync(path: str | Path) -> None:
    """fsync where the filesystem allows it. Best effort: some (Drive's FUSE mount among them) refuse
    fsync on folders or files; what matters there is verified by reading it back."""
    try:
        fsync(path)
    except OSError:
        pass


def tmp_sibling(path: str | Path, tag: str | int | None = None) -> Path:
    """`.tmp-<name>-<tag>` beside `path` (tag: this process by default), where a write is prepared."""
    path = Path(path)
    return path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid() if tag is None else tag}"


def write_bytes_atomic(path: str | Path, data: bytes, mtime_ns: int | None = None,
                       tag: str | int | None = None) -> None:
    """Write `data` to `path` whole or not at all (temporary name, fsync, rename)."""
    path = Path(path)
    tmp = tmp_sibling(path, tag)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            with contextlib.suppress(OSError):  # best effort: some FUSE mounts refuse fsync
                os.fsync(f.fileno())
        if mtime_ns is not None:
            with contextlib.suppress(OSError):  # keeps "is the copy newer" meaningful where utime works
                os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written file behind
        raise
    try_fsync(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_bytes_atomic(path, json.dumps(obj, indent=1).encode("utf-8"))


def replace_dir(tmp: Path, dst: Path, tag: str | int | None = None) -> None:
    """Rename a finished temporary folder to `dst`. An existing `dst` (e.g. best/) is moved aside
    first, so a crash at any moment leaves one complete folder of the two."""
    if dst.exists():
        old = dst.parent / f"{OLD_PREFIX}{dst.name}-{os.getpid() if tag is None else tag}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
    try_fsync(dst.parent)


def clean_leftovers(folder: str | Path, keep_tag: str | int | None = None) -> None:
    """Remove what interrupted writes left in `folder` (temporary files and folders of another process,
    e.g. one killed with -9); put back a folder moved aside by `replace_dir` when its new copy never
    arrived. Names ending with `keep_tag` (this process's own writes in progress) are left alone."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    keep = f"-{os.getpid() if keep_tag is None else keep_tag}"
    for p in folder.iterdir():
        if not p.name.startswith((TMP_PREFIX, OLD_PREFIX)) or p.name.endswith(keep):
            continue
        target = folder / p.name[len(TMP_PREFIX):].split("-")[0]
        if p.name.startswith(OLD_PREFIX) and not target.exists():
            os.replace(p, target)  # killed between the two renames of replace_dir
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def fresh_tmp_dir(dst: str | Path, tag: str | int | None = None) -> Path:
    """An empty temporary folder beside `dst`, to be filled and then handed to `replace_dir`."""
    tmp = tmp_sibling(dst, tag)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


@contextlib.contextmanager
def atomic_output(dst: str | Path, folder: bool = False, tag: str | int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `dst` to fill (a file, or with `folder` an empty folder). When the
    block ends normally it is fsynced and renamed to `dst` (an existing folder is replaced whole);
    when it raises, the temporary is removed and `dst` is as it was."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = fresh_tmp_dir(dst, tag) if folder else tmp_sibling(dst, tag)
    try:
        yield tmp
        if folder:
            for p in tmp.iterdir():
                if p.is_file():
                    _usual_mode(p)
                    try_fsync(p)
            replace_dir(tmp, dst, tag)
        else:
            _usual_mode(tmp)
            try_fsync(tmp)
            os.replace(tmp, dst)
            try_fsync(dst.parent)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
