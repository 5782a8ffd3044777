"""The background mirror: a run folder's checkpoints and run files copied to another folder (Google
Drive in Colab, any folder elsewhere) while training goes on.

Training writes each checkpoint to the local disk first (fast, atomic) and hands it to a `Mirror`,
whose background thread copies it with `sync.copy` (verified, complete by construction). Errors are
retried with backoff and only reported in `Mirror.status`: the training thread never waits for Drive
and never sees its errors. After training, `close` gives the copies `mirror_wait_s()` to finish.
Whether the mirror folder is still this run's is watch.py's to say; what it lacks, catchup.py's.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from tinygpt.core.callback import Callback
from tinygpt.core.checkpoint import MANIFEST, newest_complete, step_name, step_of, verify_checkpoint
from tinygpt.core.files import clean_leftovers, read_bytes_safe, write_bytes_atomic
from tinygpt.core.rundir import ADAPTER_DIR, BEST, CHECKPOINTS, RUN_FILES, RunDir
from tinygpt.sync.copy import (
    Backoff,
    CopyFile,
    SyncAborted,
    SyncRefused,
    copy_checkpoint,
    is_permanent,
    manifest_step,
    new_tag,
    plain_copy,
    prune_mirror,
    said,
    whole_lines,
)
from tinygpt.sync.identity import claim_mirror
from tinygpt.sync.watch import check_root, first_contact

# after training, how long the mirror may finish its copies before we return
CLOSE_TIMEOUT_S = 120.0


def mirror_wait_s() -> float:
    """How long the mirror may finish its copies after training: $TINYGPT_MIRROR_WAIT_S, else
    120 s."""
    raw = os.environ.get("TINYGPT_MIRROR_WAIT_S")
    try:
        value = float(raw) if raw is not None else CLOSE_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not (value >= 0 and value != float("inf")):
        raise ValueError(
            f"TINYGPT_MIRROR_WAIT_S must be a number of seconds, 0 or more; got {raw!r}"
        )
    return value


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
        s = "mirror: no checkpoint synced yet"
        if self.last_synced_step is not None:
            s = f"mirror: step {self.last_synced_step} synced"
        s += f", {self.pending} pending"
        if self.last_error:
            s += f", {self.errors} errors, last: {self.last_error}"
        return s


class Mirror(Callback):
    """Mirrors a local run folder to `mirror_run_dir` in a background thread.

    The trainer's callback: `on_checkpoint(path, step)` after each complete checkpoint (steps and
    best/), `on_log(metrics)` after each logged step, `close()` at the end. None of them blocks on
    Drive or raises."""

    def __init__(
        self,
        local_run_dir: str | Path,
        mirror_run_dir: str | Path,
        keep_last: int = 2,
        *,
        files_every_s: float = 30.0,
        backoff: Backoff | None = None,
        copy_file: CopyFile = plain_copy,
        clock: Callable[[], float] = time.time,
        close_timeout_s: float | None = None,
        identity: dict | None = None,
        catch_up: bool = True,
    ):
        self.local, self.mirror = Path(local_run_dir), Path(mirror_run_dir)
        if os.path.abspath(self.mirror) == os.path.abspath(self.local):  # no stat: Drive may hang
            raise ValueError(
                f"the mirror {self.mirror} is the run folder itself; pick another folder"
            )
        self.keep_last, self.files_every_s = keep_last, files_every_s
        self._give_up = threading.Event()
        # retries stop on the give-up event: close() cuts a backoff's wait short instead of
        # waiting it out
        self.backoff = replace(backoff or Backoff(), stop=self._give_up)
        self.copy_file, self.clock = copy_file, clock
        self.close_timeout_s = mirror_wait_s() if close_timeout_s is None else close_timeout_s
        self.not_synced: list[str] = []  # after close(): what is not on the mirror, in words
        # the checkpoint being copied (key, local path)
        self._current: tuple[str, Path] | None = None
        self._tag = new_tag()
        self._cond = threading.Condition()
        # key (path in the run folder) -> (local path, step)
        self._pending: dict[str, tuple[Path, int]] = {}
        self._busy = self._closing = False
        self._files_dirty = True  # run.json and tokenizer.json go over before the first checkpoint
        self._files_synced_at = float("-inf")
        # (size, mtime_ns) of each file when last copied
        self._file_sigs: dict[str, tuple[int, int]] = {}
        self._verified: set[str] = set()
        self._status = MirrorStatus()
        self._last_exc: BaseException | None = None
        # identity: written into the mirror before anything else, refused when the mirror holds
        # another run's
        self.identity, self._claimed, self._catch_up = identity, identity is None, catch_up
        self._dead: BaseException | None = None  # a permanent error: the mirror is off for this run
        # the device the mirror folder lies on, from this run's first copy
        self._root: int | None = None
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
        """Wait until every checkpoint handed over so far is synced (or given up); False on
        timeout."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: (not self._pending and not self._busy) or self._dead is not None, timeout
            )
            # a mirror turned off by a permanent error synced nothing more
            return done and self._dead is None

    def close(self, timeout: float | None = None) -> bool:
        """Finish pending copies and the run files within `timeout` (default `close_timeout_s`),
        then stop. When the time runs out the mirror gives up, `not_synced` says what is missing on
        the mirror (also as a warning), and False is returned: a dead Drive never blocks the
        cell."""
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
                self.not_synced.append(
                    f"checkpoint {self._current[0]} (being copied when time ran out)"
                )
            if self._files_dirty:
                self.not_synced.append("the latest run files (metrics.jsonl, samples.txt, ...)")
        last = self._holds(st.last_synced_step)
        how = "after the wait"
        if self._dead is not None:
            how = f"at once ({self._dead}: waiting would not help)"
        warnings.warn(
            f"Drive mirror {self.mirror}: gave up {how}; on the mirror: {last}; not on "
            f"it: {'; '.join(self.not_synced) or 'nothing'}; last error: "
            f"{st.last_error}. The local run folder {self.local} has everything",
            stacklevel=2,
        )
        return False

    def _holds(self, step: int | None) -> str:
        """What the mirror holds now, looked at (it may have been deleted since the copy)."""
        try:
            if not self.mirror.is_dir():
                return "nothing (the folder is gone)"
            if step is not None and (self.mirror / CHECKPOINTS / step_name(step)).is_dir():
                return f"step {step}"
        except OSError:
            return "unknown (the folder cannot be read)"
        return "no checkpoint"

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the background thread
    def _key(self, path: Path) -> str:
        try:
            return path.resolve().relative_to(self.local.resolve()).as_posix()
        except ValueError:  # not under the run folder: place it by name
            return f"{CHECKPOINTS}/{path.name}" if path.name.startswith("step_") else path.name

    def _permanent(self, e: BaseException) -> bool:
        return is_permanent(e, self.mirror)

    def _note_error(self, e: BaseException) -> None:
        if self._permanent(e):
            return  # said once by _guarded, which turns the mirror off
        with self._cond:
            first = self._status.errors == 0
            self._last_exc = e
            self._count_error(e)
        if first:  # say so at once; the retries go on behind training
            warnings.warn(
                f"Drive mirror {self.mirror}: {said(e)}; training goes on and the copy is retried",
                stacklevel=2,
            )

    def _count_error(self, e: BaseException) -> None:  # under self._cond
        self._status.errors += 1
        self._status.last_error, self._status.last_error_at = said(e), self.clock()

    def _catch_up_items(self) -> None:
        """What the local run holds that the mirror may lack (its newest checkpoint, best/, the
        adapter): queued at the start, so a mirror left behind by an earlier run (full, offline)
        catches up now. A copy the mirror has already is recognised by its manifest and skipped."""
        items: dict[str, tuple[Path, int]] = {}
        if (p := newest_complete(self.local / CHECKPOINTS)) is not None:
            items[f"{CHECKPOINTS}/{p.name}"] = (p, step_of(p))
        for name in (BEST, ADAPTER_DIR):
            if (self.local / name / MANIFEST).is_file():
                items[name] = (self.local / name, manifest_step(self.local / name))
        with self._cond:
            for key, item in items.items():
                if not any(k.split("/")[0] == key.split("/")[0] for k in self._pending):
                    self._pending[key] = item

    def _run(self) -> None:
        self._guarded(
            lambda: [
                clean_leftovers(d, self._tag)
                for d in (self.mirror, self.mirror / CHECKPOINTS)
                if d.is_dir()
            ]
        )
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
                        key = max(
                            self._pending,
                            key=lambda k: (k.startswith(CHECKPOINTS + "/"), self._pending[k][1]),
                        )
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
                self._guarded(
                    lambda: self.backoff.run(
                        self._sync_files, self._note_error, permanent=self._permanent
                    )
                )
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
                    self._count_error(e)
                warnings.warn(
                    f"Drive mirror {self.mirror}: {said(e)}; waiting would "
                    "not help, so the mirror is off for this run (training goes on; the "
                    "local run folder has everything, and the next run copies what the "
                    "mirror lacks once this is fixed)",
                    stacklevel=2,
                )
                return False
            if e is not self._last_exc:  # a retried one is counted already
                self._note_error(e)
            warnings.warn(
                f"Drive mirror: {said(e)}; training goes on, the next checkpoint tries again",
                stacklevel=2,
            )
            return False

    def _sync_files(self) -> None:
        # the run folder replaced under this run: copy nothing of another run's
        RunDir(self.local).check_held()
        with self._cond:
            self._files_dirty = False
            self._files_synced_at = self.clock()
        if self._root is None:
            self._root = first_contact(self.mirror, self.local)
        self._check_root()
        # before the first file: the mirror is this run's, or nothing is written
        if not self._claimed:
            claim_mirror(self.mirror, self.identity, self._tag)
            self._claimed = True
        for name in RUN_FILES:
            src = self.local / name
            # a link is never followed (to the shared folder least of all)
            if not src.is_file() or src.is_symlink():
                continue
            st = src.stat()
            if self._file_sigs.get(name) == (st.st_size, st.st_mtime_ns):
                continue
            write_bytes_atomic(self.mirror / name, whole_lines(src), st.st_mtime_ns, self._tag)
            self._file_sigs[name] = (st.st_size, st.st_mtime_ns)

    def _check_root(self) -> None:
        check_root(self.mirror, self.local, self._root, self.identity if self._claimed else None)

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
            self._check_root()  # a vanished Drive: nothing is made in its place
            raw = read_bytes_safe(src / MANIFEST)
            if (
                (dst / MANIFEST).is_file()
                and read_bytes_safe(dst / MANIFEST) == raw
                and verify_checkpoint(dst, deep=False)[0]
            ):
                return True  # already there (e.g. the checkpoint a restore came from)
            try:
                copy_checkpoint(src, dst, self.copy_file, self._tag)
            except FileNotFoundError:
                if not (src / MANIFEST).is_file():
                    return False  # the trainer pruned it while we copied: not a Drive error
                raise
            return True

        # a link on the mirror stays one (SyncRefused), like any error waiting cannot cure
        if not self.backoff.run(
            attempt, self._note_error, fatal=(SyncRefused,), permanent=self._permanent
        ):
            return
        with self._cond:
            if group == CHECKPOINTS:
                self._status.last_synced_step = max(step, self._status.last_synced_step or step)
                self._status.last_synced_at = self.clock()
            elif group == BEST:
                self._status.best_step = step
        if dst.name.startswith("step_"):
            self._verified.add(dst.name)
            prune_mirror(dst.parent, self.keep_last, self._verified)
