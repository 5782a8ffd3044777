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
    clean_leftovers,
    fresh_tmp_dir,
    replace_dir,
    sha256_file,
    try_fsync,
    write_bytes_atomic,
)
from tinygpt.core.rundir import ADAPTER_DIR, RUN_FILES, parse_jsonl  # noqa: F401  (RUN_FILES: what a mirror keeps)

CopyFile = Callable[[Path, Path], Any]


class SyncError(OSError):
    """A copy that does not match its source's manifest."""


class SyncAborted(Exception):
    """The mirror was told to give up (its time after training ran out): no more retries."""

CLOSE_TIMEOUT_S = 120.0  # after training, how long the mirror may finish its copies before we return


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
            fatal: tuple[type[BaseException], ...] = ()) -> Any:
        """fn(), retried on OSError with delays base, 2*base, ... (capped); `fatal` ones are not retried."""
        delay = self.base_delay_s
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except OSError as e:
                if on_error is not None:
                    on_error(e)
                if attempt >= self.max_attempts or isinstance(e, fatal):
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
    try:
        return json.loads(manifest_bytes)["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise SyncError(f"unreadable manifest in {where}: {e}") from None


def _copy_folder(src: Path, dst: Path, files: dict[str, dict[str, Any]], last: dict[str, bytes],
                 copy_file: CopyFile, tag: str) -> None:
    """Copy `files` (name -> size, sha256) into a temp folder, verifying each, then write `last`
    (name -> bytes) in order and rename the folder into place."""
    tmp = fresh_tmp_dir(dst, tag)
    try:
        for name, info in files.items():
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
    """Copy a checkpoint folder, data files verified against src's manifest, the manifest last."""
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
                 close_timeout_s: float = CLOSE_TIMEOUT_S):
        self.local, self.mirror = Path(local_run_dir), Path(mirror_run_dir)
        if os.path.abspath(self.mirror) == os.path.abspath(self.local):  # no stat: Drive may hang
            raise ValueError(f"the mirror {self.mirror} is the run folder itself; pick another folder")
        self.keep_last, self.files_every_s = keep_last, files_every_s
        self._give_up = threading.Event()
        # retries wait on the give-up event: close() can cut a backoff short instead of waiting it out
        self.backoff = replace(backoff or Backoff(), sleep=self._sleep)
        self.copy_file, self.clock, self.close_timeout_s = copy_file, clock, close_timeout_s
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
        self._thread = threading.Thread(target=self._run, name="tinygpt-mirror", daemon=True)
        self._thread.start()

    # -- called from the training thread: quick, never raises
    def on_checkpoint(self, path: str | Path, step: int) -> None:
        try:
            key = self._key(Path(path))
            with self._cond:
                if self._closing:
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
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finish pending copies and the run files within `timeout` (default `close_timeout_s`), then
        stop. When the time runs out the mirror gives up, `not_synced` says what is missing on the
        mirror (also as a warning), and False is returned: a dead Drive never blocks the cell."""
        with self._cond:
            self._closing = True
            self._files_dirty = True
            self._cond.notify_all()
        self._thread.join(self.close_timeout_s if timeout is None else timeout)
        if not self._thread.is_alive():
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
        warnings.warn(f"Drive mirror {self.mirror}: gave up after the wait; on the mirror: {last}; not on it: "
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

    def _note_error(self, e: BaseException) -> None:
        with self._cond:
            first = self._status.errors == 0
            self._last_exc = e
            self._status.errors += 1
            self._status.last_error = f"{type(e).__name__}: {e}"
            self._status.last_error_at = self.clock()
        if first:  # say so at once; the retries go on behind training
            warnings.warn(f"Drive mirror {self.mirror}: {type(e).__name__}: {e}; training goes on and the copy is "
                          "retried", stacklevel=2)

    def _run(self) -> None:
        self._guarded(lambda: [clean_leftovers(d, self._tag) for d in (self.mirror, self.mirror / "checkpoints")])
        while True:
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
                self._guarded(lambda: self.backoff.run(self._sync_files, self._note_error))
                if item is not None:
                    self._current = item[:2]
                    if self._guarded(lambda: self._sync_checkpoint(*item)):
                        self._current = None
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
            if e is not self._last_exc:  # a retried one is counted already
                self._note_error(e)
            warnings.warn(f"Drive mirror: {type(e).__name__}: {e}; training goes on, "
                          f"the next checkpoint tries again", stacklevel=2)
            return False

    def _sync_files(self) -> None:
        with self._cond:
            self._files_dirty = False
            self._files_synced_at = self.clock()
        self.mirror.mkdir(parents=True, exist_ok=True)
        for name in RUN_FILES:
            src = self.local / name
            if not src.is_file():
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

        if not self.backoff.run(attempt, self._note_error):
            return
        with self._cond:
            if group == "checkpoints":
                self._status.last_synced_step = max(step, self._status.last_synced_step or step)
                self._status.last_synced_at = self.clock()
            else:
                self._status.best_step = step
        if dst.name.startswith("step_"):
            self._verified.add(dst.name)
            prune_mirror(dst.parent, self.keep_last, self._verified)


# ---- restore -------------------------------------------------------------------------------------

def _step_of(ckpt: Path) -> int:
    try:
        return int(json.loads((ckpt / MANIFEST).read_text()).get("step", -1))
    except (OSError, ValueError, AttributeError):
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
        try:
            candidates += [(s, 0, p) for s, p in backoff.run(lambda: list_checkpoints(mirror / "checkpoints"))]
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
            _restore_run_files(local, mirror, backoff, copy_file, tag)
        except OSError as e:
            warnings.warn(f"could not restore best/ or run files from {mirror}: {e}", stacklevel=2)
    return chosen


def _restore_run_files(local: Path, mirror: Path, backoff: Backoff, copy_file: CopyFile, tag: str) -> None:
    if verify_checkpoint(mirror / "best", deep=False)[0] and (
            not verify_checkpoint(local / "best")[0] or _step_of(local / "best") < _step_of(mirror / "best")):
        try:
            backoff.run(lambda: copy_checkpoint(mirror / "best", local / "best", copy_file, tag), fatal=(SyncError,))
        except SyncError as e:
            warnings.warn(f"skipping {mirror / 'best'}: {e}", stacklevel=3)
    local.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        src, dst = mirror / name, local / name
        if src.is_file() and (not dst.is_file() or src.stat().st_mtime > dst.stat().st_mtime):
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
    dst.mkdir(parents=True, exist_ok=True)
    n = start
    try:
        for entry in shards[start:]:
            for split in ("train", "val"):
                info = entry[split]
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
    warning: the shards are only a cache, and the next call tries again)."""
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
        return (backoff or Backoff()).run(attempt)
    except OSError as e:
        warnings.warn(f"could not copy token shards to {mirror}: {e}", stacklevel=2)
        return 0


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
            sync_shards(self.local, self.mirror, backoff=Backoff(max_attempts=3), copy_file=self.copy_file)
            there = _shard_manifest(self.mirror)
            if there is not None and there.get("done"):
                return
            if self._stop.wait(self.every_s):
                sync_shards(self.local, self.mirror, backoff=Backoff(max_attempts=3), copy_file=self.copy_file)
                return

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> bool:
        """One last copy; True if everything local is on the mirror."""
        self._stop.set()
        self._thread.join(timeout)
        here, there = _shard_manifest(self.local), _shard_manifest(self.mirror)
        return here is None or (there is not None and len(there["shards"]) == len(here["shards"]))


# ---- one-off folders (a finetuning run's adapter) --------------------------------------------------

def _mirror_copy(what: str, fn) -> bool:
    """Run a copy to or from the mirror with a few retries; a Drive failure warns, it never stops a run."""
    try:
        Backoff(max_attempts=4).run(fn)
        return True
    except OSError as e:
        warnings.warn(f"Drive mirror: could not copy {what} ({type(e).__name__}: {e}); the local run folder "
                      "has it", stacklevel=3)
        return False


def mirror_adapter(adapter_dir: Path, mirror: Path, step: int) -> Path | None:
    """Copy an adapter folder to mirror/adapter, each file checked against a manifest written here first."""
    write_manifest(adapter_dir, {"step": int(step), "kind": "adapter"})
    dst = mirror / ADAPTER_DIR
    return dst if _mirror_copy(f"the adapter to {dst}", lambda: copy_checkpoint(adapter_dir, dst)) else None
