"""The token cache on the mirror: complete shards copied there as they are written (`ShardMirror`),
and back to a new VM (`restore_shards`), which then tokenizes on from the first shard it lacks.

A shard folder's manifest.json lists its complete shards in order, each as
{"train": {"name", "bytes", "sha256"}, "val": {...}}; "done" says the source
is all there. A copy holds a prefix of those shards and a manifest that
lists exactly that prefix (written after the files), so it is always usable.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

from tinygpt.core.checkpoint import MANIFEST
from tinygpt.core.files import (
    UnsafePathError,
    clean_leftovers,
    read_bytes_safe,
    safe_name,
    write_bytes_atomic,
)
from tinygpt.core.rundir import TOKEN_CACHE
from tinygpt.sync.copy import (
    Backoff,
    CopyFile,
    SyncError,
    SyncRefused,
    check_copy,
    check_not_link,
    is_permanent,
    new_tag,
    plain_copy,
)
from tinygpt.sync.mirror import mirror_wait_s
from tinygpt.sync.watch import unmounted_drive


def _shard_manifest(folder: Path) -> dict | None:
    try:
        # no link, bounded: a mirror's list is anyone's
        m = json.loads(read_bytes_safe(folder / MANIFEST))
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("shards"), list) else None


def _copy_shards(
    src: Path, dst: Path, manifest: dict, start: int, copy_file: CopyFile, tag: str
) -> int:
    """Copy shards [start:] of `manifest` from src to dst, each file checked (size, sha256) before
    it is renamed into place; then dst's manifest, listing every shard copied. The count copied."""
    shards = manifest["shards"]
    for p in (src, dst, *(d.parent for d in (src, dst) if d.parent.name == TOKEN_CACHE)):
        check_not_link(p)  # a linked shard folder would be read from, or written to, somewhere else
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
                check_not_link(src / info["name"])
                tmp = dst / f".tmp-{tag}-{info['name']}"
                copy_file(src / info["name"], tmp)
                check_copy(tmp, {"size": info["bytes"], "sha256": info["sha256"]})
                os.replace(tmp, dst / info["name"])
            n += 1
    finally:  # a failure keeps what was copied whole: the manifest lists that prefix
        if n > start:
            out = {
                **manifest,
                "shards": shards[:n],
                "done": bool(manifest.get("done")) and n == len(shards),
            }
            write_bytes_atomic(dst / MANIFEST, json.dumps(out, indent=1).encode(), tag=tag)
    # only the end of the source is news
    if n == start and manifest.get("done") and n == len(shards):
        write_bytes_atomic(dst / MANIFEST, json.dumps(manifest, indent=1).encode(), tag=tag)
    return n - start


def sync_shards(
    local_dir: str | Path,
    mirror_dir: str | Path,
    *,
    backoff: Backoff | None = None,
    copy_file: CopyFile = plain_copy,
) -> int:
    """Copy the complete shards the mirror lacks; the number copied (0 when Drive failed, with a
    warning: the shards are only a cache, and the next call tries again; -1 when waiting would not
    help: the mirror's parent is a file, a read-only file system, ...)."""
    local, mirror = Path(local_dir), Path(mirror_dir)
    manifest = _shard_manifest(local)
    if manifest is None:
        return 0
    tag = new_tag()

    def attempt() -> int:
        there = _shard_manifest(mirror)
        start = len(there["shards"]) if there else 0
        if start >= len(manifest["shards"]) and (there or {}).get("done") == manifest.get("done"):
            return 0
        return _copy_shards(local, mirror, manifest, start, copy_file, tag)

    try:
        # a link or a bad name stays so (SyncRefused); so does an error waiting cannot cure
        return (backoff or Backoff()).run(
            attempt, fatal=(SyncRefused,), permanent=lambda e: is_permanent(e, mirror)
        )
    except OSError as e:
        warnings.warn(f"could not copy token shards to {mirror}: {e}", stacklevel=2)
        return -1 if is_permanent(e, mirror) else 0


def restore_shards(
    mirror_dir: str | Path,
    local_dir: str | Path,
    *,
    backoff: Backoff | None = None,
    copy_file: CopyFile = plain_copy,
) -> int:
    """Bring the mirror's complete shards that this VM lacks (a new VM then tokenizes on from the
    first missing one); the number copied. A shard that fails its check ends the copy there."""
    mirror, local = Path(mirror_dir), Path(local_dir)
    there, here = _shard_manifest(mirror), _shard_manifest(local)
    start = len(here["shards"]) if here else 0
    if there is None or len(there["shards"]) <= start:
        return 0
    if here is not None and here["shards"] != there["shards"][:start]:
        return 0  # not the same source: the local folder is the truth
    tag = new_tag()
    try:
        return (backoff or Backoff()).run(
            lambda: _copy_shards(mirror, local, there, start, copy_file, tag), fatal=(SyncError,)
        )
    except OSError as e:
        warnings.warn(
            f"cannot restore token shards from {mirror}: {e}; they will be tokenized again",
            stacklevel=2,
        )
        return 0
    finally:
        clean_leftovers(local, tag)


class ShardMirror:
    """Copies token shards to the mirror as they are written, in a background thread, until the
    source is all there and copied, or `close`."""

    def __init__(
        self,
        local_dir: Path,
        mirror_dir: Path,
        every_s: float = 20.0,
        copy_file: CopyFile = plain_copy,
    ):
        self.local, self.mirror = local_dir, mirror_dir
        self.every_s, self.copy_file = every_s, copy_file
        self._stop = threading.Event()
        self._home: int | None = None  # the device of the folder holding the token cache, once made
        self._thread = threading.Thread(target=self._run, name="tinygpt-shard-mirror", daemon=True)
        self._thread.start()

    def _sync(self) -> int:
        backoff = Backoff(max_attempts=3)
        return sync_shards(self.local, self.mirror, backoff=backoff, copy_file=self.copy_file)

    def _run(self) -> None:
        while True:
            if self._gone() or self._sync() < 0:
                return  # a permanent error: said once; the shards are only a cache
            there = _shard_manifest(self.mirror)
            if there is not None and there.get("done"):
                return
            if self._stop.wait(self.every_s):
                if not self._gone():
                    self._sync()
                return

    def _gone(self) -> bool:
        """Whether the folder that holds the mirror's token cache (the runs' folder
        on Drive) has gone since the first copy (Drive unmounted, the folder
        deleted), said once; it is made at the first copy only, and never under an
        unmounted Drive mount point: nothing is copied onto the VM's own disk."""
        home = self.mirror.parent
        if home.name == TOKEN_CACHE:
            home = home.parent
        why = None
        if self._home is None:
            if (drive := unmounted_drive(home)) is not None:
                why = f"nothing is mounted at {drive}"
            else:
                home.mkdir(parents=True, exist_ok=True)
                self._home = os.stat(home).st_dev
        else:
            try:
                if os.stat(home).st_dev != self._home:
                    why = "it now lies on another file system"
            except FileNotFoundError:
                why = "the folder no longer exists"
        if why is not None:
            warnings.warn(
                f"token shards are not copied to {self.mirror}: {home} is gone ({why}; Drive "
                "unmounted?); they are only a cache, kept on this VM",
                stacklevel=2,
            )
        return why is not None

    def close(self, timeout: float | None = None) -> bool:
        """One last copy (within `timeout`, default `mirror_wait_s()`);
        True if everything local is on the mirror."""
        timeout = mirror_wait_s() if timeout is None else timeout
        self._stop.set()
        self._thread.join(timeout)
        here, there = _shard_manifest(self.local), _shard_manifest(self.mirror)
        return here is None or (there is not None and len(there["shards"]) == len(here["shards"]))
