"""Crash-safe file writes, and the checks that keep every read and write inside its folder.

Invariant: a reader (or a process restarted after `kill -9`) sees either the old file or folder or
the new one, whole, never a mix. Every module that persists something goes through these.

Invariant: a run folder, a mirror (a shared Drive folder anyone with access may write) and a token
cache are never trusted to name places. Every name read from a manifest, run.json, a shard list or
a folder listing goes through `safe_name`/`inside` before it is read, written or deleted, and no
write, append, copy or delete here follows a symbolic link or writes through a hard link
(`O_NOFOLLOW`, `lstat` first, a new file made with `O_EXCL` after the old name is removed).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Iterator

TMP_PREFIX, OLD_PREFIX = ".tmp-", ".old-"  # leftovers of an interrupted write carry these
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once, at import: os.umask is process-wide, so never again from a thread
# what open() gives a new file; some writers (safetensors) make 0600 files
FILE_MODE = 0o666 & ~_UMASK


def _usual_mode(path: Path) -> None:
    """Give a finished file the mode any other new file gets (rw-r--r-- under the usual umask)."""
    with contextlib.suppress(OSError):
        os.chmod(path, FILE_MODE)


class UnsafePathError(ValueError):
    """A name that would leave its folder, or a link
    tinygpt will not follow; the message names it."""


def safe_name(name: Any, where: str | Path, plain: bool = False) -> str:
    """`name` when it is a relative path that stays inside its folder: a non-empty string, not
    absolute, no `..` part, no NUL or backslash (and with `plain`, no `/` either: one file name).
    Else an UnsafePathError naming `where` (the file or folder the name was read from)."""
    bad = None
    if not isinstance(name, str) or not name or name in (".",):
        bad = "is not a file name"
    elif "\0" in name or "\\" in name:
        bad = "holds a NUL or a backslash"
    elif os.path.isabs(name) or name.startswith("/"):
        bad = "is an absolute path"
    elif ".." in name.split("/"):
        bad = "climbs out of its folder with '..'"
    elif plain and "/" in name:
        bad = "is a path where a plain file name belongs"
    if bad:
        raise UnsafePathError(
            f"{where} names {name!r}, which {bad}: refused (nothing was read or written there); "
            "the file was not written by tinygpt: delete it or restore it from a copy you trust"
        )
    return name


def inside(
    folder: str | Path, name: Any, where: str | Path | None = None, plain: bool = False
) -> Path:
    """folder/name after `safe_name`, checked to resolve
    inside `folder` (no link on the way leads out)."""
    folder = Path(folder)
    p = folder / safe_name(name, where if where is not None else folder, plain)
    root = os.path.realpath(folder)
    if os.path.commonpath([root, os.path.realpath(p)]) != root:
        raise UnsafePathError(
            f"{p} leads outside {folder} through a symbolic link: refused; tinygpt never follows "
            "links in a run folder or a mirror: remove the link"
        )
    return p


def link_problem(path: str | Path, writes: bool = False) -> str | None:
    """Why `path` must not be followed or written through, in words (None when it is a plain file or
    folder, or absent): a symbolic link, or (`writes`: a file written in place) a file with other
    hard links, whose other names lie outside the folder."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link (to {os.readlink(path)})"
    if writes and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        return f"{path} has {st.st_nlink - 1} other hard link(s), names outside this folder"
    return None


def refuse_link(path: str | Path, writes: bool = False) -> None:
    """UnsafePathError (one line, naming it) when `link_problem` finds one."""
    if (why := link_problem(path, writes)) is not None:
        raise UnsafePathError(
            f"{why}: tinygpt never follows or writes through links in a run folder or a mirror; "
            "replace it by a plain file (or delete it), or use another folder"
        )


def links_in(folder: str | Path) -> list[str]:
    """Every symbolic link (file or folder) and hard-linked file below `folder`, in words, walked
    without following links; [] for a folder that holds none (or does not exist)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        for n in dirnames + filenames:
            if (why := link_problem(Path(dirpath) / n, writes=True)) is not None:
                out.append(why)
    return out


def refuse_links_in(folder: str | Path, what: str = "run folder") -> None:
    """UnsafePathError naming the first link in `folder`
    (a run folder is checked before it is written)."""
    if found := links_in(folder):
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise UnsafePathError(
            f"{found[0]}{more}: tinygpt never follows or writes through links in a {what}; "
            "replace it by a plain file or folder (or delete it), or use another folder"
        )


def open_nofollow(path: str | Path, flags: int, mode: int = 0o666) -> int:
    """os.open that refuses a symbolic link at `path` and (when writing) a hard-linked file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path)
        raise
    if flags & (os.O_WRONLY | os.O_RDWR) and os.fstat(fd).st_nlink > 1:
        os.close(fd)
        refuse_link(path, writes=True)
    return fd


# the largest run file read back (run.json, tokenizer.json, metrics.jsonl, ...): 64 MB
# the file a folder written here lists its files in, written last (checkpoints, token shards, adapters)
MANIFEST = "manifest.json"
RUN_FILE_LIMIT = 64 << 20


class FileTooLarge(ValueError):
    """A file over the size tinygpt reads of its kind; the message names it and the limit."""


def read_bytes_safe(path: str | Path, limit: int = RUN_FILE_LIMIT, what: str = "") -> bytes:
    """The bytes of a file in a run folder, a mirror or a base folder, read the one way every such
    file is read: never through a symbolic link, never a hard-linked file (its other names lie
    outside the folder), never a FIFO or device (opened non-blocking, then checked to be a plain
    file), and never more than `limit` bytes (FileTooLarge, naming the file, before anything is
    read). FileNotFoundError when absent; UnsafePathError for a link. `what` ("on the mirror", ...)
    is added after the file's name in every message."""
    path = Path(path)
    fd = open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(
                f"{path}{what} is not a plain file: refused; replace it by a plain file or delete "
                "it"
            )
        if st.st_nlink > 1:
            refuse_link(path, writes=True)
        if st.st_size > limit:
            raise FileTooLarge(
                f"{path}{what} holds {st.st_size:,} bytes, more than the {limit:,} tinygpt reads "
                "of such a file: refused, nothing was read; it was not written by tinygpt: delete "
                "it or restore it from a copy you trust"
            )
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while it was read
        raise FileTooLarge(f"{path}{what} grew past {limit:,} bytes while it was read: refused")
    return data


def read_text_safe(path: str | Path, limit: int = RUN_FILE_LIMIT, what: str = "") -> str:
    """`read_bytes_safe` decoded as UTF-8; a file that is not UTF-8 is a ValueError naming it."""
    try:
        return read_bytes_safe(path, limit, what).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}{what} is not UTF-8 text (byte {e.start}): it was not written by tinygpt; "
            "delete it or restore it from a copy you trust"
        ) from None


def read_json_safe(path: str | Path, limit: int = RUN_FILE_LIMIT, what: str = "") -> Any:
    """`read_text_safe` parsed as JSON; bad JSON is a ValueError naming the file."""
    advice = (
        ": it was not written by tinygpt, or was cut short; delete it or restore it from a copy "
        "you trust"
    )
    return parse_json(read_text_safe(path, limit, what), f"{path}{what}", advice)


def parse_json(text: str, where: str, advice: str, error: type[Exception] = ValueError) -> Any:
    """`json.loads`, its failures one line (`error`): `where` the text came from, then `advice`
    (with its own separator); nesting too deep for the parser is one of them."""
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{where} nests JSON too deep to read{advice}") from None
    except ValueError as e:
        raise error(f"{where} is not valid JSON ({e}){advice}") from None


def append_text(path: str | Path, text: str) -> None:
    """Append to a file (made when absent), never through a link."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(text)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    # a checkpoint's file on a mirror: no link
    with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_fsync(path: str | Path) -> None:
    """fsync where the filesystem allows it. Best effort: some (Drive's FUSE mount among them)
    refuse fsync on folders or files; what matters there is verified by reading it back."""
    with contextlib.suppress(OSError):
        fsync(path)


def tmp_sibling(path: str | Path, tag: str | int | None = None) -> Path:
    """`.tmp-<name>-<tag>` beside `path` (tag: this
    process by default), where a write is prepared."""
    path = Path(path)
    return path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid() if tag is None else tag}"


def write_bytes_atomic(
    path: str | Path, data: bytes, mtime_ns: int | None = None, tag: str | int | None = None
) -> None:
    """Write `data` to `path` whole or not at all (temporary name, fsync, rename)."""
    path = Path(path)
    tmp = tmp_sibling(path, tag)
    try:
        # O_EXCL below: a link planted at the temporary name is never written through
        tmp.unlink(missing_ok=True)
        with os.fdopen(
            os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666), "wb"
        ) as f:
            f.write(data)
            f.flush()
            with contextlib.suppress(OSError):  # best effort: some FUSE mounts refuse fsync
                os.fsync(f.fileno())
        if mtime_ns is not None:
            # keeps "is the copy newer" meaningful where utime works
            with contextlib.suppress(OSError):
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
    if dst.is_symlink():
        dst.unlink()  # a link is replaced, never followed
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
    """Remove what interrupted writes left in `folder` (temporary files and
    folders of another process, e.g. one killed with -9); put back a folder
    moved aside by `replace_dir` when its new copy never arrived. Names ending
    with `keep_tag` (this process's own writes in progress) are left alone."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    keep = f"-{os.getpid() if keep_tag is None else keep_tag}"
    for p in folder.iterdir():
        if not p.name.startswith((TMP_PREFIX, OLD_PREFIX)) or p.name.endswith(keep):
            continue
        target = folder / p.name[len(TMP_PREFIX) :].split("-")[0]
        if p.name.startswith(OLD_PREFIX) and not target.exists() and not p.is_symlink():
            os.replace(p, target)  # killed between the two renames of replace_dir
        else:
            _remove(p)


def fresh_tmp_dir(tmp: Path) -> None:
    """Make `tmp` (a `tmp_sibling`) an empty folder, to be filled and then handed to `replace_dir`:
    a link or a leftover of an earlier try at that name is removed first."""
    if tmp.is_symlink():
        tmp.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _remove(p: Path) -> None:
    """Delete a file, a link or a folder (a link is removed, never followed)."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        pass
    return True


def clear_dead_tmps(dst: Path) -> None:
    """Remove the temporaries beside `dst` (`.tmp-<name>-<pid>...`) of processes that no longer run:
    a write killed with -9 leaves one, which nothing else would ever remove. Those of running
    processes (and this one) stay."""
    prefix = f"{TMP_PREFIX}{dst.name}-"
    with contextlib.suppress(OSError):
        for p in dst.parent.iterdir():
            pid = p.name[len(prefix) :].split("-")[0] if p.name.startswith(prefix) else ""
            if (
                not (pid.isascii() and pid.isdigit())
                or int(pid) == os.getpid()
                or _running(int(pid))
            ):
                continue
            _remove(p)


@contextlib.contextmanager
def atomic_output(
    dst: str | Path, folder: bool = False, tag: str | int | None = None
) -> Iterator[Path]:
    """Yield a temporary path beside `dst` to fill (a file, or with `folder` an empty folder). When
    the block ends normally it is fsynced and renamed to `dst` (an existing folder is replaced
    whole); when it raises, the temporary is removed and `dst` is as it was."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    clear_dead_tmps(dst)  # an earlier write of the same target killed with -9
    tmp = tmp_sibling(dst, tag)
    try:  # made inside the try: a Ctrl-C that lands just after the mkdir still removes it
        if folder:
            fresh_tmp_dir(tmp)
        else:
            # a link planted at the temporary name is not written through
            tmp.unlink(missing_ok=True)
        yield tmp
        if folder:
            for p in tmp.iterdir():
                if p.is_file() and not p.is_symlink():
                    _usual_mode(p)
                    try_fsync(p)
            replace_dir(tmp, dst, tag)
        else:
            _usual_mode(tmp)
            try_fsync(tmp)
            os.replace(tmp, dst)
            try_fsync(dst.parent)
    finally:
        _remove(tmp)
