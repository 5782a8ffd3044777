"""Google Drive, or any folder, as a mirror of a run folder.

Training writes each checkpoint to the local disk first (fast, atomic) and hands it to a `Mirror`,
whose background thread copies it to the mirror: data files into a temporary folder, each checked
against the local manifest (size and sha256), manifest.json last, then renamed into place, so a
`step_*` folder on the mirror is complete by construction. Drive errors (a dropped FUSE mount says
ENOTCONN, a full quota ENOSPC) are retried with exponential backoff and only reported in
`Mirror.status`: the training thread never waits for Drive and never sees its errors.
On a new VM `restore_latest` brings back the newest valid checkpoint, local or mirrored.
This module knows files and folders, never models.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from tinygpt.core.callback import Callback
from tinygpt.core.checkpoint import MANIFEST, list_checkpoints, verify_checkpoint, write_manifest
from tinygpt.core.files import (
    UnsafePathError,
    clean_leftovers,
    fresh_tmp_dir,
    link_problem,
    replace_dir,
    safe_name,
    sha256_file,
    try_fsync,
    write_bytes_atomic,
)
from tinygpt.core.rundir import (  # noqa: F401  (RUN_FILES: what a mirror keeps)
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    BEST,
    CHECKPOINTS,
    IDENTITY,
    METRICS,
    RUN_FILES,
    TOKENIZER_JSON,
    RunDir,
    RunDirError,
    parse_jsonl,
)

CopyFile = Callable[[Path, Path], Any]


class SyncError(OSError):
    """A copy that does not match its source's manifest."""


class SyncRefused(SyncError):
    """A name that leaves its folder or a link: refused for good, never retried."""


class SyncAborted(Exception):
    """The mirror was told to give up (its time after training ran out): no more retries."""


class MirrorTaken(ValueError):
    """The mirror folder belongs to another run (its identity.json says so): refused before any write."""


def _fuse_mount(path: Path) -> bool:
    """Whether `path` lies on a FUSE mount (Colab's Drive), where EACCES/EPERM can pass; elsewhere they do not."""
    try:
        mounts = [ln.split()[1:3] for ln in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return False
    target = os.path.abspath(path)
    best = max((m for m in mounts if target == m[0] or target.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best is not None and best[1].startswith("fuse")


def is_permanent(e: BaseException, path: str | Path) -> bool:
    """An error that waiting will not cure: the mirror (or a parent) is not a folder, the file system is
    read-only, or permission is denied off FUSE; or the mirror belongs to another run. ENOSPC, EIO,
    ENOTCONN and the rest are transient (a full quota is freed, a dropped mount comes back)."""
    if isinstance(e, (MirrorTaken, RunDirError)):
        return True
    if not isinstance(e, OSError):
        return False
    if e.errno in (errno.ENOTDIR, errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP):
        return True
    if isinstance(e, FileExistsError) and not Path(path).is_dir():  # the mirror is a file
        return True
    return e.errno in (errno.EACCES, errno.EPERM) and not _fuse_mount(Path(path))

CLOSE_TIMEOUT_S = 120.0  # after training, how long the mirror may finish its copies before we return


def mirror_wait_s() -> float:
    """How long the mirror may finish its copies after training: $TINYGPT_MIRROR_WAIT_S, else 120 s."""
    raw = os.environ.get("TINYGPT_MIRROR_WAIT_S")
    try:
        value = float(raw) if raw is not None else CLOSE_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not (value >= 0 and value != float("inf")):
        raise ValueError(f"TINYGPT_MIRROR_WAIT_S must be a number of seconds, 0 or more; got {raw!r}")
    return value


def _copy_file(src: Path, dst: Path) -> None:
    # copyfile, not copy2: Drive's FUSE mount refuses some chmod/xattr calls that copystat makes
    shutil.copyfile(src, dst)


@dataclass
class Backoff:
    """Retry policy for Drive operations; `sleep` is injectable so tests never wait."""
    max_attempts: int = 8
    base_delay_s: float = 2.0
    max_delay_s: float = 60.0
    sleep: Callable[[float], Any] = time.sleep

    def run(self, fn: Callable[[], Any], on_error: Callable[[OSError], Any] | None = None,
            fatal: tuple[type[BaseException], ...] = (), permanent: Callable[[OSError], bool] | None = None) -> Any:
        """fn(), retried on OSError with delays base, 2*base, ... (capped); `fatal` ones, and those that
        `permanent` says waiting cannot cure, are raised at once."""
        delay = self.base_delay_s
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except OSError as e:
                if on_error is not None:
                    on_error(e)
                if attempt >= self.max_attempts or isinstance(e, fatal) or (permanent is not None and permanent(e)):
                    raise
                self.sleep(min(delay, self.max_delay_s))
                delay *= 2


# ---- folder copies -------------------------------------------------------------------------------

def _check(path: Path, info: dict[str, Any]) -> None:
    size = path.stat().st_size
    if size != info["size"]:
        raise SyncError(f"{path} has {size} bytes, manifest says {info['size']}")
    if sha256_file(path) != info["sha256"]:
        raise SyncError(f"{path} fails its sha256 check")


def _files_of(manifest_bytes: bytes, where: Path) -> dict[str, dict[str, Any]]:
    """The files a checkpoint manifest lists, each a plain file name (a manifest on a shared mirror is
    anyone's: a name like ../../x would write outside the folder)."""
    try:
        files = json.loads(manifest_bytes)["files"]
        for name in files:
            safe_name(name, Path(where) / MANIFEST, plain=True)
        return files
    except UnsafePathError as e:
        raise SyncRefused(str(e)) from None
    except (ValueError, KeyError, TypeError) as e:
        raise SyncError(f"unreadable manifest in {where}: {e}") from None


def _no_link(path: Path) -> None:
    """A SyncError (not retried) when `path` is a symbolic link: a copy never follows one."""
    if (why := link_problem(path)) is not None:
        raise SyncRefused(f"{why}: not followed")


def _copy_folder(src: Path, dst: Path, files: dict[str, dict[str, Any]], last: dict[str, bytes],
                 copy_file: CopyFile, tag: str) -> None:
    """Copy `files` (name -> size, sha256) into a temp folder, verifying each, then write `last`
    (name -> bytes) in order and rename the folder into place."""
    for p in (src, *(d for d in (src.parent, dst.parent) if d.name == "checkpoints")):
        _no_link(p)  # a linked checkpoints/ or step folder would copy from or to somewhere else (the
        # mirror's own path is the user's choice: a link there is theirs)
    tmp = fresh_tmp_dir(dst, tag)
    try:
        for name, info in files.items():
            _no_link(src / name)
            copy_file(src / name, tmp / name)
            _check(tmp / name, info)
            try_fsync(tmp / name)
        for name, data in last.items():
            (tmp / name).write_bytes(data)
            try_fsync(tmp / name)
        replace_dir(tmp, dst, tag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_checkpoint(src: str | Path, dst: str | Path, copy_file: CopyFile = _copy_file, tag: str = "") -> None:
    """Copy a checkpoint folder, data files verified against src's manifest, the manifest last. The
    manifest's names must be plain file names and no file, nor either folder, may be a link."""
    _no_link(Path(src) / MANIFEST)
    raw = (Path(src) / MANIFEST).read_bytes()  # read once: a best/ replaced meanwhile fails the checks
    _copy_folder(Path(src), Path(dst), _files_of(raw, src), {MANIFEST: raw}, copy_file, tag or _new_tag())


def _read_whole_lines(path: Path) -> bytes:
    data = path.read_bytes()
    # metrics.jsonl may be mid-append: keep whole lines only, the rest comes with the next sync
    return data[: data.rfind(b"\n") + 1] if path.suffix == ".jsonl" else data


def _new_tag() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def prune_mirror(ckpt_root: str | Path, keep_last: int, known_valid: set[str] | None = None) -> list[Path]:
    """Keep the newest `keep_last` checkpoints that pass the FULL check (sha256 of every file) and
    delete older step folders; never delete the newest verified one, and with none verified delete
    nothing. A size check is not enough: a corrupt folder of the right size at a higher step would
    push every good one out. `known_valid` holds names verified already (by the copy that wrote them,
    or an earlier prune); names verified here are added to it, so each folder is hashed once."""
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


# ---- the background mirror -----------------------------------------------------------------------

@dataclass
class MirrorStatus:
    """What a notebook shows about the mirror (a snapshot; times come from the mirror's clock)."""
    last_synced_step: int | None = None
    last_synced_at: float | None = None
    best_step: int | None = None
    pending: int = 0
    errors: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    superseded: int = 0

    def __str__(self) -> str:
        s = (f"mirror: step {self.last_synced_step} synced" if self.last_synced_step is not None
             else "mirror: no checkpoint synced yet") + f", {self.pending} pending"
        if self.last_error:
            s += f", {self.errors} errors, last: {self.last_error}"
        return s


class Mirror(Callback):
    """Mirrors a local run folder to `mirror_run_dir` in a background thread.

    The trainer's callback: `on_checkpoint(path, step)` after each complete checkpoint (steps and
    best/), `on_log(metrics)` after each logged step, `close()` at the end. None of them blocks on
    Drive or raises."""

    def __init__(self, local_run_dir: str | Path, mirror_run_dir: str | Path, keep_last: int = 2, *,
                 files_every_s: float = 30.0, backoff: Backoff | None = None,
                 copy_file: CopyFile = _copy_file, clock: Callable[[], float] = time.time,
                 close_timeout_s: float | None = None, identity: dict | None = None, catch_up: bool = True):
        self.local, self.mirror = Path(local_run_dir), Path(mirror_run_dir)
        if os.path.abspath(self.mirror) == os.path.abspath(self.local):  # no stat: Drive may hang
            raise ValueError(f"the mirror {self.mirror} is the run folder itself; pick another folder")
        self.keep_last, self.files_every_s = keep_last, files_every_s
        self._give_up = threading.Event()
        # retries wait on the give-up event: close() can cut a backoff short instead of waiting it out
        self.backoff = replace(backoff or Backoff(), sleep=self._sleep)
        self.copy_file, self.clock = copy_file, clock
        self.close_timeout_s = mirror_wait_s() if close_timeout_s is None else close_timeout_s
        self._sleep_fn = (backoff or Backoff()).sleep
        self.not_synced: list[str] = []  # after close(): what is not on the mirror, in words
        self._current: tuple[str, Path] | None = None  # the checkpoint being copied (key, local path)
        self._tag = _new_tag()
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[Path, int]] = {}  # key (path in the run folder) -> (local path, step)
        self._busy = False
        self._closing = False
        self._files_dirty = True  # run.json and tokenizer.json go over before the first checkpoint
        self._files_synced_at = float("-inf")
        self._file_sigs: dict[str, tuple[int, int]] = {}  # (size, mtime_ns) of each file when last copied
        self._verified: set[str] = set()
        self._status = MirrorStatus()
        self._last_exc: BaseException | None = None
        # identity: written into the mirror before anything else, refused when the mirror holds another run's
        self.identity, self._claimed, self._catch_up = identity, identity is None, catch_up
        self._dead: BaseException | None = None  # a permanent error: the mirror is off for this run
        self._thread = threading.Thread(target=self._run, name="tinygpt-mirror", daemon=True)
        self._thread.start()

    # -- called from the training thread: quick, never raises
    def on_checkpoint(self, path: str | Path, step: int) -> None:
        try:
            key = self._key(Path(path))
            with self._cond:
                if self._closing or self._dead is not None:
                    return
                group = key.split("/")[0]
                for k in [k for k in self._pending if k.split("/")[0] == group]:
                    del self._pending[k]  # a newer checkpoint supersedes a pending older one
                    self._status.superseded += 1
                self._pending[key] = (Path(path), int(step))
                self._cond.notify_all()
        except Exception as e:  # a bad argument must not stop training
            self._note_error(e)

    def on_log(self, metrics: dict[str, Any] | None = None) -> None:
        with self._cond:
            if not self._files_dirty:
                self._files_dirty = True
                self._cond.notify_all()

    @property
    def status(self) -> MirrorStatus:
        with self._cond:
            return replace(self._status, pending=len(self._pending) + self._busy)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every checkpoint handed over so far is synced (or given up); False on timeout."""
        with self._cond:
            done = self._cond.wait_for(lambda: (not self._pending and not self._busy) or self._dead is not None,
                                       timeout)
            return done and self._dead is None  # a mirror turned off by a permanent error synced nothing more

    def close(self, timeout: float | None = None) -> bool:
        """Finish pending copies and the run files within `timeout` (default `close_timeout_s`), then
        stop. When the time runs out the mirror gives up, `not_synced` says what is missing on the
        mirror (also as a warning), and False is returned: a dead Drive never blocks the cell."""
        with self._cond:
            self._closing = True
            self._files_dirty = True
            self._cond.notify_all()
        self._thread.join(self.close_timeout_s if timeout is None else timeout)
        if not self._thread.is_alive() and self._dead is None:
            return True
        self._give_up.set()
        self._thread.join(2.0)  # a copy stuck inside a hung mount is left to its daemon thread
        with self._cond:
            pending = sorted(self._pending, key=lambda k: self._pending[k][1])
            st = self._status
            self.not_synced = [f"checkpoint {k} (step {self._pending[k][1]})" for k in pending]
            if self._current is not None:
                self.not_synced.append(f"checkpoint {self._current[0]} (being copied when time ran out)")
            if self._files_dirty:
                self.not_synced.append("the latest run files (metrics.jsonl, samples.txt, ...)")
        last = f"step {st.last_synced_step}" if st.last_synced_step is not None else "no checkpoint"
        how = "after the wait" if self._dead is None else \
            f"at once ({type(self._dead).__name__}: {self._dead}: waiting would not help)"
        warnings.warn(f"Drive mirror {self.mirror}: gave up {how}; on the mirror: {last}; not on it: "
                      f"{'; '.join(self.not_synced) or 'nothing'}; last error: {st.last_error}. The local run "
                      f"folder {self.local} has everything", stacklevel=2)
        return False

    def _sleep(self, seconds: float) -> None:
        """A retry's wait, cut short (SyncAborted) once close() gives up."""
        if self._sleep_fn is time.sleep:
            if self._give_up.wait(seconds):
                raise SyncAborted()
        else:  # an injected sleep (tests)
            if self._give_up.is_set():
                raise SyncAborted()
            self._sleep_fn(seconds)

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the background thread
    def _key(self, path: Path) -> str:
        try:
            return path.resolve().relative_to(self.local.resolve()).as_posix()
        except ValueError:  # not under the run folder: place it by name
            return f"checkpoints/{path.name}" if path.name.startswith("step_") else path.name

    def _permanent(self, e: BaseException) -> bool:
        return is_permanent(e, self.mirror)

    def _note_error(self, e: BaseException) -> None:
        if self._permanent(e):
            return  # said once by _guarded, which turns the mirror off
        with self._cond:
            first = self._status.errors == 0
            self._last_exc = e
            self._status.errors += 1
            self._status.last_error = f"{type(e).__name__}: {e}"
            self._status.last_error_at = self.clock()
        if first:  # say so at once; the retries go on behind training
            warnings.warn(f"Drive mirror {self.mirror}: {type(e).__name__}: {e}; training goes on and the copy is "
                          "retried", stacklevel=2)

    def _catch_up_items(self) -> None:
        """What the local run holds that the mirror may lack (its newest checkpoint, best/, the adapter):
        queued at the start, so a mirror left behind by an earlier run (full, offline) catches up now.
        A copy the mirror has already is recognised by its manifest and skipped."""
        items: dict[str, tuple[Path, int]] = {}
        for s, p in reversed(list_checkpoints(self.local / CHECKPOINTS)):
            if verify_checkpoint(p, deep=False)[0]:
                items[f"{CHECKPOINTS}/{p.name}"] = (p, s)
                break
        for name in (BEST, ADAPTER_DIR):
            if (self.local / name / MANIFEST).is_file():
                items[name] = (self.local / name, _step_of(self.local / name))
        with self._cond:
            for key, item in items.items():
                if not any(k.split("/")[0] == key.split("/")[0] for k in self._pending):
                    self._pending[key] = item

    def _run(self) -> None:
        self._guarded(lambda: [clean_leftovers(d, self._tag) for d in (self.mirror, self.mirror / "checkpoints")
                               if d.is_dir()])
        if self._catch_up:
            self._guarded(self._catch_up_items)
        while True:
            if self._dead is not None:
                with self._cond:
                    self._cond.notify_all()
                return
            item = None
            with self._cond:
                while True:
                    if self._pending:  # newest step first, then best/
                        key = max(self._pending, key=lambda k: (k.startswith("checkpoints/"), self._pending[k][1]))
                        item = (key, *self._pending.pop(key))
                        break
                    wait_s = self._files_synced_at + self.files_every_s - self.clock()
                    if self._files_dirty and (self._closing or wait_s <= 0):
                        break
                    if self._closing:
                        self._cond.notify_all()
                        return
                    self._cond.wait(wait_s if self._files_dirty else None)
                self._busy = item is not None
            try:
                # run files first: a restored checkpoint is useless without the run's tokenizer.json
                self._guarded(lambda: self.backoff.run(self._sync_files, self._note_error, permanent=self._permanent))
                if item is not None and self._dead is None:
                    self._current = item[:2]
                    if self._guarded(lambda: self._sync_checkpoint(*item)):
                        self._current = None
                elif item is not None:  # the mirror is off: the item stays listed as not synced
                    with self._cond:
                        self._pending.setdefault(item[0], item[1:])
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _guarded(self, fn: Callable[[], Any]) -> bool:
        try:
            fn()
            return True
        except SyncAborted:
            return False
        except Exception as e:  # the thread must survive anything; the error goes to status
            if self._permanent(e):
                with self._cond:
                    self._dead = e
                    self._status.errors += 1
                    self._status.last_error = f"{type(e).__name__}: {e}"
                    self._status.last_error_at = self.clock()
                warnings.warn(f"Drive mirror {self.mirror}: {type(e).__name__}: {e}; waiting would not help, so the "
                              "mirror is off for this run (training goes on; the local run folder has everything, "
                              "and the next run copies what the mirror lacks once this is fixed)", stacklevel=2)
                return False
            if e is not self._last_exc:  # a retried one is counted already
                self._note_error(e)
            warnings.warn(f"Drive mirror: {type(e).__name__}: {e}; training goes on, "
                          f"the next checkpoint tries again", stacklevel=2)
            return False

    def _sync_files(self) -> None:
        RunDir(self.local).check_held()  # the run folder replaced under this run: copy nothing of another run's
        with self._cond:
            self._files_dirty = False
            self._files_synced_at = self.clock()
        if self.mirror.exists() and not self.mirror.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "the mirror is a file, not a folder", str(self.mirror))
        self.mirror.mkdir(parents=True, exist_ok=True)
        if not self._claimed:  # before the first file: the mirror is this run's, or nothing is written
            claim_mirror(self.mirror, self.identity, self._tag)
            self._claimed = True
        for name in RUN_FILES:
            src = self.local / name
            if not src.is_file() or src.is_symlink():  # a link is never followed (to the shared folder least of all)
                continue
            st = src.stat()
            if self._file_sigs.get(name) == (st.st_size, st.st_mtime_ns):
                continue
            write_bytes_atomic(self.mirror / name, _read_whole_lines(src), st.st_mtime_ns, self._tag)
            self._file_sigs[name] = (st.st_size, st.st_mtime_ns)

    def _sync_checkpoint(self, key: str, src: Path, step: int) -> None:
        dst = self.mirror / key
        group = key.split("/")[0]

        def attempt() -> bool:
            with self._cond:
                if any(k.split("/")[0] == group for k in self._pending):
                    self._status.superseded += 1
                    return False
            if not (src / MANIFEST).is_file():
                return False  # pruned or being replaced locally: the next checkpoint will come
            raw = (src / MANIFEST).read_bytes()
            if (dst / MANIFEST).is_file() and (dst / MANIFEST).read_bytes() == raw \
                    and verify_checkpoint(dst, deep=False)[0]:
                return True  # already there (e.g. the checkpoint a restore came from)
            try:
                copy_checkpoint(src, dst, self.copy_file, self._tag)
            except FileNotFoundError:
                if not (src / MANIFEST).is_file():
                    return False  # the trainer pruned it while we copied: not a Drive error
                raise
            return True

        # a link on the mirror stays one (SyncRefused), like any error waiting cannot cure
        if not self.backoff.run(attempt, self._note_error, fatal=(SyncRefused,), permanent=self._permanent):
            return
        with self._cond:
            if group == "checkpoints":
                self._status.last_synced_step = max(step, self._status.last_synced_step or step)
                self._status.last_synced_at = self.clock()
            elif group == BEST:
                self._status.best_step = step
        if dst.name.startswith("step_"):
            self._verified.add(dst.name)
            prune_mirror(dst.parent, self.keep_last, self._verified)


# ---- one run per mirror, and what the mirror lacks --------------------------------------------------

def _read_identity(folder: Path) -> dict | None:
    p = folder / IDENTITY
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_bytes())
    except ValueError:
        d = None
    if not (isinstance(d, dict) and isinstance(d.get("run_id"), str) and isinstance(d.get("config"), str)):
        raise RunDirError(f"{p} is not a run identity (run_id, config); delete it only if {folder} holds one run")
    return d


def run_identity(local: str | Path, mirror: str | Path | None, config: dict) -> dict:
    """This run's identity ({run_id, config hash}) from the run folder's identity.json, else the mirror's
    (a new VM resuming it), else a new one. Refuses, before anything is written (MirrorTaken), a mirror
    that another run owns: another configuration, or another run id than the run folder's. A mirror that
    cannot be read is left to the mirror's own retries: it never stops a run here."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    mine = _read_identity(Path(local))
    theirs = None
    if mirror is not None:
        try:
            theirs = _read_identity(Path(mirror))
        except OSError:
            theirs = None
    if theirs is not None:
        if theirs["config"] != digest:
            raise MirrorTaken(f"the mirror {mirror} belongs to another run (run {theirs['run_id']}, with another "
                              "configuration or data): this run would mix its files with that run's; nothing was "
                              "written. Use another --mirror folder (one per run), or the same settings as that run")
        if mine is not None and mine["run_id"] != theirs["run_id"]:
            raise MirrorTaken(f"the mirror {mirror} belongs to run {theirs['run_id']} and run folder {local} is run "
                              f"{mine['run_id']}: two runs would mix their checkpoints; nothing was written. Use "
                              "another --mirror folder (one per run)")
        return theirs
    return mine if mine is not None else {"run_id": uuid.uuid4().hex[:12], "config": digest}


def write_identity(folder: str | Path, identity: dict) -> None:
    """The run folder's identity.json (kept once written)."""
    if not (Path(folder) / IDENTITY).is_file():
        write_bytes_atomic(Path(folder) / IDENTITY, json.dumps(identity).encode())


def claim_mirror(mirror: Path, identity: dict, tag: str = "") -> None:
    """Write the identity into the mirror, or check the one there (a second VM may have claimed it since)."""
    theirs = _read_identity(mirror)
    if theirs is None:
        write_bytes_atomic(mirror / IDENTITY, json.dumps(identity).encode(), tag=tag or _new_tag())
    elif theirs["run_id"] != identity["run_id"]:
        raise MirrorTaken(f"the mirror {mirror} was claimed by run {theirs['run_id']} (another VM or tab) while this "
                          f"run ({identity['run_id']}) started: this run does not write there; use another --mirror")


def _same_folder(local: Path, there: Path) -> bool:
    try:
        return (there / MANIFEST).read_bytes() == (local / MANIFEST).read_bytes() and verify_checkpoint(
            there, deep=False)[0]
    except OSError:
        return False


def mirror_lag(local_run_dir: str | Path, mirror_run_dir: str | Path) -> list[str]:
    """What the local run holds and the mirror lacks, in words ([] when the mirror has it all): the newest
    checkpoint, best/, the adapter, metrics.jsonl's logged steps."""
    local, mirror = Path(local_run_dir), Path(mirror_run_dir)
    out: list[str] = []
    try:
        newest = next((p for _, p in reversed(list_checkpoints(local / CHECKPOINTS))
                       if verify_checkpoint(p, deep=False)[0]), None)
        if newest is not None and not _same_folder(newest, mirror / CHECKPOINTS / newest.name):
            there = [s for s, p in list_checkpoints(mirror / CHECKPOINTS) if verify_checkpoint(p, deep=False)[0]]
            out.append(f"checkpoint step {_step_of(newest)} (the mirror's newest: "
                       f"{f'step {max(there)}' if there else 'none'})")
        for name in (BEST, ADAPTER_DIR):
            if (local / name / MANIFEST).is_file() and not _same_folder(local / name, mirror / name):
                out.append(f"{name}/")
        if (local / METRICS).is_file():
            ours = _read_whole_lines(local / METRICS)
            theirs = (mirror / METRICS).read_bytes() if (mirror / METRICS).is_file() else b""
            if not theirs.startswith(ours):
                out.append(METRICS)
    except OSError as e:
        return [f"everything (the mirror cannot be read: {e})"]
    return out


def catch_up(local_run_dir: str | Path, mirror_run_dir: str | Path, *, identity: dict | None = None,
             timeout: float | None = None, backoff: Backoff | None = None) -> list[str]:
    """Copy to the mirror what the local run holds and it lacks (a run that ended with the mirror full or
    offline), within `timeout`; what it still lacks afterwards ([] when nothing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the answer is the list returned: one line, said by the caller
        m = Mirror(local_run_dir, mirror_run_dir, identity=identity, backoff=backoff, close_timeout_s=timeout)
        m.close()
    return mirror_lag(local_run_dir, mirror_run_dir)


# ---- restore -------------------------------------------------------------------------------------

def _step_of(ckpt: Path) -> int:
    try:
        return int(json.loads((ckpt / MANIFEST).read_text()).get("step", -1))
    except (OSError, ValueError, AttributeError, TypeError):
        return -1


def restore_latest(local_run_dir: str | Path, mirror_run_dir: str | Path | None, *,
                   backoff: Backoff | None = None, copy_file: CopyFile = _copy_file) -> Path | None:
    """The newest valid checkpoint among local and mirror, copied locally when it is on the mirror
    (with best/ and the run files the local folder lacks or has older). None if there is none.
    Corrupt or truncated ones are skipped with a warning; ties go to the local one."""
    local = Path(local_run_dir)
    backoff, tag = backoff or Backoff(), _new_tag()
    candidates = [(s, 1, p) for s, p in list_checkpoints(local / "checkpoints")]
    mirror = Path(mirror_run_dir) if mirror_run_dir is not None else None
    if mirror is not None:
        _check_defining_files(local, mirror)  # another run's tokenizer: refused before anything is copied
    if mirror is not None:
        try:
            listed = backoff.run(lambda: list_checkpoints(mirror / "checkpoints"),  # no wait where it cannot help
                                 permanent=lambda e: is_permanent(e, mirror))
            candidates += [(s, 0, p) for s, p in listed]
        except OSError as e:
            warnings.warn(f"cannot read the mirror {mirror} ({e}); resuming from local checkpoints only", stacklevel=2)
            mirror = None
    chosen = None
    for _, is_local, p in sorted(candidates, key=lambda c: c[:2], reverse=True):
        if is_local:
            ok, why = verify_checkpoint(p)
            if ok:
                chosen = p
                break
        elif mirror is not None:
            dst = local / "checkpoints" / p.name

            def fetch(p: Path = p, dst: Path = dst) -> None:
                ok, why = verify_checkpoint(p, deep=False)  # cheap; the sha256 is checked on the copy
                if not ok:
                    raise SyncError(why)
                copy_checkpoint(p, dst, copy_file, tag)
            try:
                backoff.run(fetch, fatal=(SyncError,))
                chosen = dst
                break
            except SyncError as e:
                why = str(e)
            except OSError as e:
                why, mirror = f"{e}; not using the mirror", None
        else:
            continue  # the mirror went away during this restore
        warnings.warn(f"skipping checkpoint {p}: {why}", stacklevel=2)
    if chosen is None and candidates:
        warnings.warn(f"none of the {len(candidates)} checkpoints here or on the mirror passed verification: "
                      "training starts from step 0 (the failing folders are kept; see the warnings above)",
                      stacklevel=2)
    if mirror is not None:
        try:
            ahead = chosen is not None and not any(p == chosen for _, _, p in candidates)  # came from the mirror
            _restore_run_files(local, mirror, backoff, copy_file, tag, ahead)
        except OSError as e:
            warnings.warn(f"could not restore best/ or run files from {mirror}: {e}", stacklevel=2)
    return chosen


DEFINING_FILES = (TOKENIZER_JSON, ADAPTER_CONFIG)  # written once: a different one is another run's


def _check_defining_files(local: Path, mirror: Path) -> None:
    for name in DEFINING_FILES:
        try:
            if not ((local / name).is_file() and (mirror / name).is_file()):
                continue
            same = (local / name).read_bytes() == (mirror / name).read_bytes()
        except OSError:
            continue  # an unreadable mirror: the restore below says so
        if not same:
            raise MirrorTaken(f"{name} on the mirror {mirror} differs from {local / name}: the mirror holds another "
                              "run's files; nothing was copied or overwritten. Use another --mirror folder (one per "
                              "run), or another run folder to continue the mirror's run")


def _restore_run_files(local: Path, mirror: Path, backoff: Backoff, copy_file: CopyFile, tag: str,
                       mirror_ahead: bool = True) -> None:
    """best/ when the mirror's is newer; a run file the local folder lacks, or holds a shorter copy of
    (metrics.jsonl the mirror has more of); when the mirror's checkpoint was newer than every local one
    (`mirror_ahead`), its newer files too. A local file that differs is never overwritten otherwise. A link
    on the mirror is never followed (it could point at any file of this VM, which the next sync would carry
    to the shared folder)."""
    if verify_checkpoint(mirror / "best", deep=False)[0] and (
            not verify_checkpoint(local / "best")[0] or _step_of(local / "best") < _step_of(mirror / "best")):
        try:
            backoff.run(lambda: copy_checkpoint(mirror / "best", local / "best", copy_file, tag), fatal=(SyncError,))
        except SyncError as e:
            warnings.warn(f"skipping {mirror / 'best'}: {e}", stacklevel=3)
    local.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        src, dst = mirror / name, local / name
        if (why := link_problem(src)) is not None:
            warnings.warn(f"{why}: not followed, {name} is not restored from the mirror", stacklevel=3)
            continue
        if not src.is_file():
            continue
        if dst.is_file():
            if name in DEFINING_FILES:
                continue  # equal (checked before the restore)
            theirs, ours = src.read_bytes(), dst.read_bytes()
            newer = src.stat().st_mtime > dst.stat().st_mtime
            if theirs == ours or not newer or not (mirror_ahead or theirs.startswith(ours)):
                continue
        mtime_ns = src.stat().st_mtime_ns
        backoff.run(lambda: write_bytes_atomic(dst, src.read_bytes(), mtime_ns, tag))


# ---- token shards ---------------------------------------------------------------------------------
# A shard folder's manifest.json lists its complete shards in order, each as {"train": {"name", "bytes",
# "sha256"}, "val": {...}}; "done" says the source is all there. A copy holds a prefix of those shards
# and a manifest that lists exactly that prefix (written after the files), so it is always usable.

def _shard_manifest(folder: Path) -> dict | None:
    try:
        m = json.loads((folder / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("shards"), list) else None


def _copy_shards(src: Path, dst: Path, manifest: dict, start: int, copy_file: CopyFile, tag: str) -> int:
    """Copy shards [start:] of `manifest` from src to dst, each file checked (size, sha256) before it
    is renamed into place; then dst's manifest, listing every shard copied. The count copied."""
    shards = manifest["shards"]
    for p in (src, dst, *(d.parent for d in (src, dst) if d.parent.name == "_token_cache")):
        _no_link(p)  # a linked shard folder would be read from, or written to, somewhere else
    dst.mkdir(parents=True, exist_ok=True)
    n = start
    try:
        for entry in shards[start:]:
            for split in ("train", "val"):
                try:
                    info = entry[split]
                    safe_name(info["name"], src / MANIFEST, plain=True)
                except UnsafePathError as e:
                    raise SyncRefused(str(e)) from None
                except (KeyError, TypeError) as e:
                    raise SyncError(f"unreadable shard list in {src / MANIFEST}: {e}") from None
                _no_link(src / info["name"])
                tmp = dst / f".tmp-{tag}-{info['name']}"
                copy_file(src / info["name"], tmp)
                _check(tmp, {"size": info["bytes"], "sha256": info["sha256"]})
                os.replace(tmp, dst / info["name"])
            n += 1
    finally:  # a failure keeps what was copied whole: the manifest lists that prefix
        if n > start:
            out = {**manifest, "shards": shards[:n], "done": bool(manifest.get("done")) and n == len(shards)}
            write_bytes_atomic(dst / MANIFEST, json.dumps(out, indent=1).encode(), tag=tag)
    if n == start and manifest.get("done") and n == len(shards):  # only the end of the source is news
        write_bytes_atomic(dst / MANIFEST, json.dumps(manifest, indent=1).encode(), tag=tag)
    return n - start


def sync_shards(local_dir: str | Path, mirror_dir: str | Path, *, backoff: Backoff | None = None,
                copy_file: CopyFile = _copy_file) -> int:
    """Copy the complete shards the mirror lacks; the number copied (0 when Drive failed, with a
    warning: the shards are only a cache, and the next call tries again; -1 when waiting would not help:
    the mirror's parent is a file, a read-only file system, ...)."""
    local, mirror = Path(local_dir), Path(mirror_dir)
    manifest = _shard_manifest(local)
    if manifest is None:
        return 0
    tag = _new_tag()

    def attempt() -> int:
        there = _shard_manifest(mirror)
        start = len(there["shards"]) if there else 0
        if start >= len(manifest["shards"]) and (there or {}).get("done") == manifest.get("done"):
            return 0
        return _copy_shards(local, mirror, manifest, start, copy_file, tag)

    try:
        # a link or a bad name stays so (SyncRefused); so does an error waiting cannot cure
        return (backoff or Backoff()).run(attempt, fatal=(SyncRefused,),
                                          permanent=lambda e: is_permanent(e, mirror))
    except OSError as e:
        warnings.warn(f"could not copy token shards to {mirror}: {e}", stacklevel=2)
        return -1 if is_permanent(e, mirror) else 0


def restore_shards(mirror_dir: str | Path, local_dir: str | Path, *, backoff: Backoff | None = None,
                   copy_file: CopyFile = _copy_file) -> int:
    """Bring the mirror's complete shards that this VM lacks (a new VM then tokenizes on from the
    first missing one); the number copied. A shard that fails its check ends the copy there."""
    mirror, local = Path(mirror_dir), Path(local_dir)
    there, here = _shard_manifest(mirror), _shard_manifest(local)
    start = len(here["shards"]) if here else 0
    if there is None or len(there["shards"]) <= start:
        return 0
    if here is not None and here["shards"] != there["shards"][:start]:
        return 0  # not the same source: the local folder is the truth
    tag = _new_tag()
    try:
        return (backoff or Backoff()).run(lambda: _copy_shards(mirror, local, there, start, copy_file, tag),
                                          fatal=(SyncError,))
    except OSError as e:
        warnings.warn(f"cannot restore token shards from {mirror}: {e}; they will be tokenized again", stacklevel=2)
        return 0
    finally:
        clean_leftovers(local, tag)


class ShardMirror:
    """Copies token shards to the mirror as they are written, in a background thread, until the
    source is all there and copied, or `close`."""

    def __init__(self, local_dir: Path, mirror_dir: Path, every_s: float = 20.0, copy_file: CopyFile = _copy_file):
        self.local, self.mirror, self.every_s, self.copy_file = local_dir, mirror_dir, every_s, copy_file
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tinygpt-shard-mirror", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            if sync_shards(self.local, self.mirror, backoff=Backoff(max_attempts=3), copy_file=self.copy_file) < 0:
                return  # a permanent error: said once; the shards are only a cache
            there = _shard_manifest(self.mirror)
            if there is not None and there.get("done"):
                return
            if self._stop.wait(self.every_s):
                sync_shards(self.local, self.mirror, backoff=Backoff(max_attempts=3), copy_file=self.copy_file)
                return

    def close(self, timeout: float | None = None) -> bool:
        """One last copy (within `timeout`, default `mirror_wait_s()`); True if everything local is on the mirror."""
        timeout = mirror_wait_s() if timeout is None else timeout
        self._stop.set()
        self._thread.join(timeout)
        here, there = _shard_manifest(self.local), _shard_manifest(self.mirror)
        return here is None or (there is not None and len(there["shards"]) == len(here["shards"]))


# ---- one-off folders (a finetuning run's adapter) --------------------------------------------------

def _mirror_copy(what: str, fn, where: Path) -> bool:
    """Run a copy to or from the mirror with a few retries (none for a permanent error); a Drive failure
    warns, it never stops a run."""
    try:
        Backoff(max_attempts=4).run(fn, permanent=lambda e: is_permanent(e, where))
        return True
    except OSError as e:
        warnings.warn(f"Drive mirror: could not copy {what} ({type(e).__name__}: {e}); the local run folder "
                      "has it", stacklevel=3)
        return False


def mirror_adapter(adapter_dir: Path, mirror: Path, step: int) -> Path | None:
    """Copy an adapter folder to mirror/adapter, each file checked against a manifest written here first."""
    write_manifest(adapter_dir, {"step": int(step), "kind": "adapter"})
    dst = mirror / ADAPTER_DIR
    return dst if _mirror_copy(f"the adapter to {dst}", lambda: copy_checkpoint(adapter_dir, dst), mirror) else None
