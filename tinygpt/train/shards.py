"""Streamed token shards: tokenization in a background process, training from the first shard.

The source's documents are cut into groups of about SHARD_TOKENS training tokens. Group i becomes
``train_{i:06d}.bin`` and ``val_{i:06d}.bin`` (its validation documents), and ``manifest.json``
lists the complete groups in order, each file with its size and sha256: a group is in the
manifest only once both its files are whole, so a process killed at any moment leaves a prefix of
complete shards, and the next writer tokenizes on from the first group missing (it skips the
documents of the complete ones without tokenizing them).

Invariants the sampler relies on: shard i's content depends only on the source, the tokenizer and
the split, never on timing; shards are visited in index order; a reader that needs shard i waits
until it is in the manifest (or the manifest says the source ended before it).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tinygpt.core.checkpoint import MANIFEST  # a shard folder lists its files as a checkpoint does
from tinygpt.core.config import DataConfig
from tinygpt.core.files import (
    UnsafePathError,
    clean_leftovers,
    inside,
    open_nofollow,
    refuse_link,
    write_bytes_atomic,
    write_json_atomic,
)
from tinygpt.core.rundir import read_json
from tinygpt.model.tokenizer import Tokenizer
from tinygpt.train.data import DataError, is_validation_document, iter_documents, source_fingerprint

SHARD_FORMAT = 3
CACHE_FORMAT = 3  # in the cache's folder name; 3: shards (2: one file, latin-1 fallback and long lines cut)
SHARD_TOKENS = 1 << 21  # ~2M training tokens (4 MB as uint16) per shard: the first one is ready in seconds
WRITER_LOCK = ".writer.lock"
CHECKED = ".vocab-checked.json"  # local only, never mirrored: {file name: [sha256, highest id]} checked here
BATCH_DOCS = 256  # documents per encode_batch call (the tokenizer runs them in parallel)


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and memory), else uint32."""
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise DataError(f"vocabulary of {vocab_size} does not fit the token cache (at most 2**32 ids)")


def cache_key(cfg: DataConfig, tokenizer: Tokenizer) -> str:
    """The token cache's folder name: source content, tokenizer and split all in one hash."""
    return hashlib.sha256(f"{CACHE_FORMAT}|{source_fingerprint(cfg)}|{tokenizer.fingerprint()}|"
                          f"{cfg.val_fraction}".encode()).hexdigest()[:20]


# ---- reading --------------------------------------------------------------------------------------

class TokenShards:
    """Token shards held in memory or mapped from files: `shard(i)` is the i-th training shard (None
    past the last), `validation(n)` at least n validation tokens (all there are, if fewer)."""

    def __init__(self, train: list[np.ndarray], val: np.ndarray, fingerprint: str, meta: dict | None = None,
                 check: Callable[[int, np.ndarray], None] | None = None):
        self._train, self._val = train, val
        self.fingerprint, self.meta = fingerprint, meta or {}
        self._check, self._checked = check, set()

    @classmethod
    def from_array(cls, tokens: np.ndarray, val: np.ndarray | None = None) -> "TokenShards":
        """One flat array as a single shard (tests, benchmarks, a finetuning set)."""
        digest = hashlib.sha256(np.ascontiguousarray(tokens[:4096]).tobytes()).hexdigest()[:12]
        return cls([tokens], val if val is not None else tokens[:0], f"array-{len(tokens)}-{digest}")

    def shard(self, i: int) -> np.ndarray | None:
        if i >= len(self._train):
            return None
        if self._check is not None and i not in self._checked:  # e.g. ids < vocabulary, on first use
            self._check(i, self._train[i])
            self._checked.add(i)
        return self._train[i]

    def validation(self, min_tokens: int) -> np.ndarray:
        return self._val

    @property
    def complete(self) -> bool:
        return True


class StreamedShards(TokenShards):
    """The shards of a folder that a writer may still be filling. `shard(i)` waits for shard i while
    the writer is alive; `alive` says whether one is (a dead writer with an unfinished manifest is an
    error, not an endless wait)."""

    def __init__(self, folder: Path, alive: Callable[[], bool] | None = None, poll_s: float = 0.05):
        self.folder, self.alive, self.poll_s = Path(folder), alive, poll_s
        self._maps: dict[tuple[str, int], np.ndarray] = {}
        self._manifest: dict = {}
        self._reload()
        super().__init__([], np.zeros(0, np.uint16), self.folder.name, self._manifest)

    def _reload(self) -> None:
        path = self.folder / MANIFEST
        if path.is_file():
            self._manifest = read_json(path)
            self.meta = self._manifest

    @property
    def complete(self) -> bool:
        return bool(self._manifest.get("done"))

    @property
    def n_shards(self) -> int:
        return len(self._manifest.get("shards", []))

    def _wait_for(self, i: int) -> bool:
        """True once shard i is listed; False if the source ended before it."""
        while True:
            if i < self.n_shards:
                return True
            if self.complete:
                return False
            if self._manifest.get("error"):
                raise DataError(self._manifest["error"])
            if self.alive is not None and not self.alive():
                self._reload()
                if i < self.n_shards or self.complete or self._manifest.get("error"):
                    continue
                raise DataError(f"tokenization into {self.folder} stopped before shard {i}; run the same command "
                                "again: the complete shards are kept and it tokenizes on from the first missing one")
            time.sleep(self.poll_s)
            self._reload()

    def _map(self, split: str, i: int) -> np.ndarray:
        if (split, i) not in self._maps:
            info = self._manifest["shards"][i][split]
            dtype = np.dtype(self._manifest["dtype"])
            n = info["bytes"] // dtype.itemsize
            path = inside(self.folder, info["name"], self.folder / MANIFEST, plain=True)
            refuse_link(path)
            self._maps[(split, i)] = (np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype))
        return self._maps[(split, i)]

    def shard(self, i: int) -> np.ndarray | None:
        return self._map("train", i) if self._wait_for(i) else None

    def validation(self, min_tokens: int) -> np.ndarray:
        """The validation parts of shards 0, 1, ... until there are min_tokens (all, when the source
        has fewer): the same tokens whenever it is asked, however fast tokenization ran."""
        parts, n, i = [], 0, 0
        while n < min_tokens and self._wait_for(i):
            parts.append(self._map("val", i))
            n += len(parts[-1])
            i += 1
        return np.concatenate(parts) if parts else np.zeros(0, np.dtype(self._manifest.get("dtype", "uint16")))

    @property
    def path(self) -> Path:
        return self.folder

    @property
    def train(self) -> np.ndarray:
        """Every training token in one array (a copy: for small sets, tests and benchmarks)."""
        parts, i = [], 0
        while (a := self.shard(i)) is not None:
            parts.append(a)
            i += 1
        return np.concatenate(parts)

    @property
    def val(self) -> np.ndarray:
        """Every validation token (waits for the source's end)."""
        return self.validation(2**63)


# ---- writing --------------------------------------------------------------------------------------

@dataclass
class _Group:
    """The group being tokenized: its tokens so far and where in the document stream it ends."""
    train: list[np.ndarray] = field(default_factory=list)
    val: list[np.ndarray] = field(default_factory=list)
    n_train: int = 0
    chars: int = 0


@contextlib.contextmanager
def _writer_lock(folder: Path) -> Iterator[None]:
    """The folder's one-writer lock (the kernel's flock: released if this process dies)."""
    fd = open_nofollow(folder / WRITER_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_group(folder: Path, manifest: dict, group: _Group, documents_end: int) -> None:
    """Both files of the group, then the manifest that lists them (the manifest is the commit)."""
    i = len(manifest["shards"])
    entry: dict = {"documents_end": documents_end, "chars": group.chars}
    for split, parts in (("train", group.train), ("val", group.val)):
        data = np.concatenate(parts).tobytes() if parts else b""
        name = shard_name(split, i)
        write_bytes_atomic(folder / name, data)
        entry[split] = {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["shards"].append(entry)
    write_json_atomic(folder / MANIFEST, manifest)


def new_manifest(cfg: DataConfig, tokenizer: Tokenizer, shard_tokens: int) -> dict:
    return {"format": SHARD_FORMAT, "source": cfg.source, "dtype": token_dtype(tokenizer.vocab_size).name,
            "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.fingerprint(), "shard_tokens": shard_tokens,
            "val_fraction": cfg.val_fraction, "shards": [], "done": False, "error": None}


def write_shards(cfg: DataConfig, tokenizer: Tokenizer, folder: str | Path, shard_tokens: int = SHARD_TOKENS,
                 should_stop: Callable[[], bool] = lambda: False, max_shards: int | None = None) -> dict:
    """Tokenize the source into `folder`, going on from the shards already there; returns the manifest.
    Stops early (the manifest not done) when `should_stop()` or once there are `max_shards`. One writer
    per folder at a time (a file lock: a second one waits for the first)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with _writer_lock(folder):
        clean_leftovers(folder)  # half-written files of a writer that was killed
        manifest = (read_json(folder / MANIFEST) if (folder / MANIFEST).is_file()
                    else new_manifest(cfg, tokenizer, shard_tokens))
        if manifest.get("done"):
            return manifest
        try:
            _tokenize_on(cfg, tokenizer, folder, manifest,
                         lambda: should_stop() or (max_shards is not None and len(manifest["shards"]) >= max_shards))
        except Exception as e:
            manifest["error"] = f"tokenizing {cfg.source} failed: {type(e).__name__}: {e}"
            write_json_atomic(folder / MANIFEST, manifest)
            raise
    return manifest


def encode_documents(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The ids of each text followed by end-of-text, all in one array of `dtype` (one conversion per batch,
    none per document), and where each text's ids end in it."""
    eot = tokenizer.eot_id
    ids = tokenizer.encode_batch(texts)
    ends = np.cumsum(np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1)
    flat = np.empty(int(ends[-1]) if len(ids) else 0, dtype=dtype)
    flat[ends - 1] = eot
    body = np.ones(len(flat), dtype=bool)
    body[ends - 1] = False
    flat[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=len(flat) - len(ids))
    return flat, ends


def _add_documents(group: _Group, flat: np.ndarray, ends: np.ndarray, val: np.ndarray, k: int, end: int) -> None:
    """Documents k .. end-1 of a batch into the group: each run of consecutive training (or validation)
    documents as one slice of the batch's array."""
    cuts = [k, *(k + 1 + np.flatnonzero(val[k + 1:end] != val[k:end - 1])).tolist(), end]
    for a, b in zip(cuts, cuts[1:]):
        part = flat[(ends[a - 1] if a else 0):ends[b - 1]]
        if val[a]:
            group.val.append(part)
        else:
            group.train.append(part)
            group.n_train += len(part)


def _tokenize_on(cfg: DataConfig, tokenizer: Tokenizer, folder: Path, manifest: dict,
                 should_stop: Callable[[], bool]) -> None:
    dtype = np.dtype(manifest["dtype"])
    shard_tokens = manifest["shard_tokens"]
    skip = manifest["shards"][-1]["documents_end"] if manifest["shards"] else 0
    group, batch, n_docs = _Group(), [], 0

    def flush() -> bool:
        """Tokenize the batch into the group(s); True to stop now (checked after each shard written:
        documents after the last shard's end are read again by the next writer)."""
        nonlocal group
        first = n_docs - len(batch)
        flat, ends = encode_documents(tokenizer, batch, dtype)
        lengths = np.diff(ends, prepend=0)
        val = np.fromiter((is_validation_document(first + k, cfg.val_fraction) for k in range(len(batch))),
                          dtype=bool, count=len(batch))
        train_lengths = np.where(val, 0, lengths)
        chars = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
        k = 0
        while k < len(batch):  # documents k, k+1, ... into the group until its training tokens reach a shard's
            reached = np.cumsum(train_lengths[k:]) >= shard_tokens - group.n_train
            j = int(np.argmax(reached)) if reached.any() else None
            end = len(batch) if j is None else k + j + 1  # the group ends with document end - 1 if j is not None
            _add_documents(group, flat, ends, val, k, end)
            group.chars += int(chars[k:end].sum())
            k = end
            if j is not None:
                _write_group(folder, manifest, group, first + end)
                group = _Group()
                if should_stop():
                    return True
        batch.clear()
        return should_stop()

    for doc in iter_documents(cfg):
        n_docs += 1
        if n_docs <= skip:
            continue  # in a complete shard already: read, not tokenized
        batch.append(doc)
        if len(batch) >= BATCH_DOCS and flush():
            return
    if batch and flush():
        return
    if group.train or group.val:
        _write_group(folder, manifest, group, n_docs)
    if n_docs == 0:
        raise DataError(f"data source {cfg.source!r} yielded no text")
    manifest["done"] = True
    manifest["documents"] = n_docs
    manifest["chars"] = sum(s["chars"] for s in manifest["shards"])
    for split in ("train", "val"):
        manifest[f"{split}_tokens"] = sum(s[split]["bytes"] for s in manifest["shards"]) // dtype.itemsize
    manifest["chars_per_token"] = manifest["chars"] / max(1, manifest["train_tokens"] + manifest["val_tokens"])
    write_json_atomic(folder / MANIFEST, manifest)


def _writer_main() -> None:
    """The background process (`python -m tinygpt.train.shards`, its request as JSON on stdin):
    tokenizes until done, or until its parent is gone (a killed run)."""
    req = json.loads(sys.stdin.read())
    parent = req["parent"]
    try:
        os.nice(10)  # training comes first: on a CPU its threads would otherwise fight this process's
    except OSError:
        pass
    # SIGTERM (ShardWriter.stop, a killed run) unwinds like Ctrl-C: no half-written .tmp-* file stays behind
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        tokenizer = Tokenizer.from_json(req["tokenizer"])
        tokenizer.gpt2 = bool(req.get("gpt2"))
        write_shards(DataConfig.from_dict(req["data"]), tokenizer, req["folder"],
                     req["shard_tokens"], should_stop=lambda: os.getppid() != parent, max_shards=req["max_shards"])
    except KeyboardInterrupt:
        sys.exit(0)
    except OSError as e:  # a full disk may not even let the manifest say so: the exit status does
        sys.exit(WRITER_DISK_FULL if e.errno == errno.ENOSPC else 1)
    except Exception:
        sys.exit(1)  # the manifest carries the error for the reader
    finally:
        # tokenizing is over: a stop that comes now has nothing to unwind, and as a KeyboardInterrupt inside
        # the interpreter's exit (torch's atexit finalizers) it would print a traceback into the run's stderr
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


WRITER_DISK_FULL = 28  # the writer's exit status when the disk filled up (errno ENOSPC)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


class ShardWriter:
    """`write_shards` in a child process, so tokenizing never holds the training loop's interpreter
    lock. A fresh interpreter (not multiprocessing: its spawn re-runs the user's script, its fork
    copies torch's threads), which stops by itself when its parent dies."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, folder: Path, shard_tokens: int = SHARD_TOKENS,
                 max_shards: int | None = None):
        req = {"data": cfg.to_dict(), "tokenizer": tokenizer.to_json(), "folder": str(folder),
               "shard_tokens": shard_tokens, "parent": os.getpid(), "max_shards": max_shards,
               "gpt2": tokenizer.tiktoken() is not None}  # checked here once: the writer need not again
        # no Rust backtrace from `tokenizers` reaches the run's output (RUST_BACKTRACE is set on some machines)
        env = {k: v for k, v in os.environ.items() if k != "RUST_BACKTRACE"}
        self.process = subprocess.Popen([sys.executable, "-m", "tinygpt.train.shards"], stdin=subprocess.PIPE, env=env)
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(req).encode())
        self.process.stdin.close()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()


def check_token_cache(folder: str | Path, vocab_size: int, mirror: Path | None = None,
                      restored: range = range(0)) -> list[str]:
    """Check every shard listed in `folder` before it is used: a plain file named inside the folder,
    of the dtype this vocabulary needs, every id below `vocab_size` (a numpy max over the mapped file,
    done once per file: the result is kept in a local record, never taken from a manifest). The first
    bad shard and all after it are removed from the local cache (files and manifest entries), so the
    writer tokenizes them again; each is named in one warning line, saying whether it came from the
    mirror (shards `restored` from `mirror` by this start) or the local cache. Returns those lines."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return []
    with _writer_lock(folder):  # no writer appends while shards are removed
        manifest = read_json(folder / MANIFEST)
        try:
            checked = read_json(folder / CHECKED) if (folder / CHECKED).is_file() else {}
        except ValueError:
            checked = {}
        shards = manifest.get("shards", []) if isinstance(manifest, dict) else []
        bad = _first_bad_shard(folder, manifest, shards, vocab_size, checked, mirror, restored)
        lines, kept = [], shards
        if bad is not None:
            i, why = bad
            kept = _drop_shards_from(folder, manifest, shards, i)
            lines.append(f"{why}: removed from the local cache ({len(shards) - i} shard(s) from there on); they are "
                         "tokenized again")
            warnings.warn(lines[-1], stacklevel=2)
        names = {e[s]["name"] for e in kept for s in ("train", "val")}
        write_json_atomic(folder / CHECKED, {k: v for k, v in checked.items() if k in names})
    return lines


def _first_bad_shard(folder: Path, manifest, shards: list, vocab_size: int, checked: dict, mirror: Path | None,
                     restored: range) -> tuple[int, str] | None:
    """(index, why) of the first shard this vocabulary cannot use, or None; `checked` gains each file's
    (sha256, highest id) as it is read (a file restored by this start is read again whatever the record says)."""
    want = token_dtype(vocab_size).name
    if isinstance(manifest, dict) and manifest.get("dtype") != want and shards:
        return 0, (f"the token cache {folder / MANIFEST} says dtype {manifest.get('dtype')!r}, this vocabulary "
                   f"needs {want}")
    for i, entry in enumerate(shards):
        where = f"from the mirror {mirror}" if i in restored and mirror is not None else "in the local cache"
        try:
            for split in ("train", "val"):
                info = entry[split]
                path = inside(folder, info["name"], folder / MANIFEST, plain=True)
                refuse_link(path)
                rec = checked.get(info["name"])
                if not (isinstance(rec, list) and rec[0] == info["sha256"] and i not in restored):
                    n = info["bytes"] // np.dtype(want).itemsize
                    top = int(np.max(np.memmap(path, dtype=want, mode="r", shape=(n,)))) if n else -1
                    checked[info["name"]] = rec = [info["sha256"], top]
                if rec[1] >= vocab_size:
                    return i, (f"token shard {path} ({where}) holds token id {rec[1]}, beyond the vocabulary "
                               f"of {vocab_size}")
        except (UnsafePathError, KeyError, TypeError, ValueError, OSError) as e:
            return i, f"token shard {i} ({where}) is unusable: {e}"
    return None


def _drop_shards_from(folder: Path, manifest: dict, shards: list, i: int) -> list:
    """Remove shard `i` and all after it (files and manifest entries, the writer to go on from `i`); the shards kept."""
    for entry in shards[i:]:
        for split in ("train", "val"):
            try:
                inside(folder, entry[split]["name"], plain=True).unlink(missing_ok=True)
            except (UnsafePathError, KeyError, TypeError, OSError):
                pass  # an unsafe name is never deleted either: only the manifest forgets it
    kept = shards[:i]
    write_json_atomic(folder / MANIFEST, {**manifest, "shards": kept, "done": False, "error": None})
    return kept


def build_token_cache(cfg: DataConfig, tokenizer: Tokenizer, cache_root: str | Path, key: str | None = None,
                      shard_tokens: int = SHARD_TOKENS) -> StreamedShards:
    """Tokenize the whole source here and now (tests, benchmarks, evaluation); a training run streams
    instead (`stream_token_cache`). Reuses the shards already in cache_root/<key>/."""
    folder = Path(cache_root) / (key or cache_key(cfg, tokenizer))
    write_shards(cfg, tokenizer, folder, shard_tokens)
    return StreamedShards(folder)


class ShardStream(StreamedShards):
    """Shards written by a background process that tokenizes only as far as the run will read (its
    token budget and a margin), not a 25 GB source for a 1 GB budget. Asked for a shard beyond that
    (more steps on resume), it starts the process again with twice the limit."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, folder: Path, shard_tokens: int, limit: int | None):
        self.cfg, self.tokenizer, self.shard_tokens, self.limit = cfg, tokenizer, shard_tokens, limit
        self.writer = ShardWriter(cfg, tokenizer, folder, shard_tokens, limit)
        super().__init__(folder, alive=self._writing)

    def shard(self, i: int) -> np.ndarray | None:
        # asked for every batch: a writer that died of a full disk stops training now, not when the
        # shard it was writing would have been needed (thousands of steps later)
        if self.writer.process.poll() == WRITER_DISK_FULL:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (tokenizing into {self.folder})",
                          str(self.folder))
        return super().shard(i)

    def _writing(self) -> bool:
        if self.writer.alive():
            return True
        self._reload()
        if (self.limit is not None and not self.complete and not self._manifest.get("error")
                and self.n_shards >= self.limit):  # it paused at its limit: more is wanted
            self.limit *= 2
            self.writer = ShardWriter(self.cfg, self.tokenizer, self.folder, self.shard_tokens, self.limit)
            return True
        return False

    def stop(self) -> None:
        self.writer.stop()


def stream_token_cache(cfg: DataConfig, tokenizer: Tokenizer, cache_root: str | Path, key: str | None = None,
                       shard_tokens: int = SHARD_TOKENS, max_train_tokens: int | None = None) -> StreamedShards:
    """The shards of cache_root/<key>/ as a background process writes them (none is started when the
    folder is complete); reading a shard not yet written waits for it. `max_train_tokens`: what the
    run will read, so tokenizing stops about there (one shard of margin) until more is asked for."""
    folder = Path(cache_root) / (key or cache_key(cfg, tokenizer))
    done = StreamedShards(folder)
    if done.complete:
        return done
    limit = None if max_train_tokens is None else -(-max_train_tokens // shard_tokens) + 1
    return ShardStream(cfg, tokenizer, folder, shard_tokens, limit)

if __name__ == "__main__":
    _writer_main()
