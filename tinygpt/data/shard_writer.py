"""Writing the token cache: the source tokenized into shards, in a background process.

The source's documents are cut into groups of about SHARD_TOKENS training tokens. Group i becomes
``train_{i:06d}.bin`` and ``val_{i:06d}.bin`` (its validation documents), and ``manifest.json``
lists the complete groups in order, each file with its size and sha256: a group is in the
manifest only once both its files are whole, so a process killed at any moment leaves a prefix of
complete shards, and the next writer tokenizes on from the first group missing (it skips the
documents of the complete ones without tokenizing them). Shard i's content depends only on the
source, the tokenizer and the split, never on timing (the readers: `tinygpt.data.shards`).
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
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tinygpt.core.config import DataConfig
from tinygpt.core.files import (
    MANIFEST,
    clean_leftovers,
    open_nofollow,
    write_bytes_atomic,
    write_json_atomic,
)
from tinygpt.core.rundir import read_json
from tinygpt.data.sources import DataError, is_validation_document, iter_documents
from tinygpt.model.tokenizer import TiktokenGPT2, Tokenizer

SHARD_FORMAT = 3
# ~2M training tokens (4 MB as uint16) per shard: the first one is ready in seconds
SHARD_TOKENS = 1 << 21
# the first shard is an eighth of that (about 1 MB of text): a run's first step waits for it alone
# (manifests written before it have no "first_shard_tokens": their first shard is SHARD_TOKENS)
FIRST_SHARD_TOKENS = 1 << 18
WRITER_LOCK = ".writer.lock"
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


@dataclass
class _Group:
    """The group being tokenized: its tokens so far and where in the document stream it ends."""

    train: list[np.ndarray] = field(default_factory=list)
    val: list[np.ndarray] = field(default_factory=list)
    n_train: int = 0
    chars: int = 0


@contextlib.contextmanager
def writer_lock(folder: Path) -> Iterator[None]:
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
        entry[split] = dict(name=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest["shards"].append(entry)
    write_json_atomic(folder / MANIFEST, manifest)


def new_manifest(cfg: DataConfig, tokenizer: Tokenizer, shard_tokens: int) -> dict:
    return {
        "format": SHARD_FORMAT,
        "source": cfg.source,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.fingerprint(),
        "shard_tokens": shard_tokens,
        "first_shard_tokens": min(shard_tokens, FIRST_SHARD_TOKENS),
        "val_fraction": cfg.val_fraction,
        "shards": [],
        "done": False,
        "error": None,
    }


def write_shards(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    folder: str | Path,
    shard_tokens: int = SHARD_TOKENS,
    should_stop: Callable[[], bool] = lambda: False,
    max_shards: int | None = None,
    warnings_to_manifest: bool = False,
) -> dict:
    """Tokenize the source into `folder`, going on from the shards already there; returns the
    manifest. Stops early (the manifest not done) when `should_stop()` or once there are
    `max_shards`. One writer per folder at a time (a file lock: a second one waits for the
    first). warnings_to_manifest: the source's warnings go into the manifest's "warnings" (the
    writer process's parent says them, once, as its own), not to this process's stderr."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with writer_lock(folder):
        clean_leftovers(folder)  # half-written files of a writer that was killed
        manifest = (
            read_json(folder / MANIFEST)
            if (folder / MANIFEST).is_file()
            else new_manifest(cfg, tokenizer, shard_tokens)
        )
        if manifest.get("done"):
            return manifest

        def stop() -> bool:
            return should_stop() or (
                max_shards is not None and len(manifest["shards"]) >= max_shards
            )

        try:
            with _warnings_into(manifest) if warnings_to_manifest else contextlib.nullcontext():
                _tokenize_on(cfg, tokenizer, folder, manifest, stop)
        except Exception as e:  # a DataError says what is wrong itself; others, where
            manifest["error"] = (
                str(e) if isinstance(e, DataError) else f"tokenizing {cfg.source} failed: {e}"
            )
            write_json_atomic(folder / MANIFEST, manifest)
            raise
    return manifest


@contextlib.contextmanager
def _warnings_into(manifest: dict) -> Iterator[None]:
    """Each warning given inside the block, once, in manifest["warnings"] (written with it)."""
    said = manifest.setdefault("warnings", [])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *_, **__: (
            None if str(message) in said else said.append(str(message))
        )
        yield


def encode_documents(
    tokenizer: Tokenizer, texts: list[str], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """The ids of each text followed by end-of-text, all in one array of `dtype` (one conversion per
    batch, none per document), and where each text's ids end in it."""
    eot = tokenizer.eot_id
    ids = tokenizer.encode_batch(texts)
    ends = np.cumsum(np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1)
    flat = np.empty(int(ends[-1]) if len(ids) else 0, dtype=dtype)
    flat[ends - 1] = eot
    body = np.ones(len(flat), dtype=bool)
    body[ends - 1] = False
    flat[body] = np.fromiter(
        itertools.chain.from_iterable(ids), dtype=dtype, count=len(flat) - len(ids)
    )
    return flat, ends


def _add_documents(
    group: _Group, flat: np.ndarray, ends: np.ndarray, val: np.ndarray, k: int, end: int
) -> None:
    """Documents k .. end-1 of a batch into the group: each run of consecutive training (or
    validation) documents as one slice of the batch's array."""
    cuts = [k, *(k + 1 + np.flatnonzero(val[k + 1 : end] != val[k : end - 1])).tolist(), end]
    for a, b in zip(cuts, cuts[1:]):
        part = flat[(ends[a - 1] if a else 0) : ends[b - 1]]
        if val[a]:
            group.val.append(part)
        else:
            group.train.append(part)
            group.n_train += len(part)


def _validation_mask(first: int, n: int, val_fraction: float) -> np.ndarray:
    """Which of documents first .. first + n - 1 are validation documents."""
    return np.fromiter(
        (is_validation_document(first + k, val_fraction) for k in range(n)), dtype=bool, count=n
    )


def _finish(folder: Path, manifest: dict, n_docs: int) -> None:
    """The manifest of a source tokenized to its end: done, with its totals, written; a source
    that yielded no document is refused."""
    if n_docs == 0:
        raise DataError(
            f"data source {manifest['source']!r} holds no text: it is empty, or holds only "
            "binary (NUL) bytes; give a file or folder of text"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    manifest["done"] = True
    manifest["documents"] = n_docs
    manifest["chars"] = sum(s["chars"] for s in manifest["shards"])
    for split in ("train", "val"):
        manifest[f"{split}_tokens"] = sum(s[split]["bytes"] for s in manifest["shards"]) // itemsize
    manifest["chars_per_token"] = manifest["chars"] / max(
        1, manifest["train_tokens"] + manifest["val_tokens"]
    )
    write_json_atomic(folder / MANIFEST, manifest)


def _tokenize_on(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    folder: Path,
    manifest: dict,
    should_stop: Callable[[], bool],
) -> None:
    dtype = np.dtype(manifest["dtype"])
    first_tokens = manifest.get("first_shard_tokens", manifest["shard_tokens"])

    def target() -> int:  # the training tokens of the group being filled
        return manifest["shard_tokens"] if manifest["shards"] else first_tokens

    skip = manifest["shards"][-1]["documents_end"] if manifest["shards"] else 0
    group, batch, n_docs = _Group(), [], 0

    def flush() -> bool:
        """Tokenize the batch into the group(s); True to stop now (checked after each shard written:
        documents after the last shard's end are read again by the next writer)."""
        nonlocal group
        first = n_docs - len(batch)
        flat, ends = encode_documents(tokenizer, batch, dtype)
        lengths = np.diff(ends, prepend=0)
        val = _validation_mask(first, len(batch), cfg.val_fraction)
        train_lengths = np.where(val, 0, lengths)
        chars = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
        k = 0
        # documents k, k+1, ... into the group until its training tokens reach a shard's
        while k < len(batch):
            reached = np.cumsum(train_lengths[k:]) >= target() - group.n_train
            j = int(np.argmax(reached)) if reached.any() else None
            # the group ends with document end - 1 if j is not None
            end = len(batch) if j is None else k + j + 1
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
    _finish(folder, manifest, n_docs)


def _writer_main() -> None:
    """The background process (`python -m tinygpt.data.shard_writer`, its request as JSON on
    stdin): tokenizes until done, or until its parent is gone (a killed run)."""
    req = json.loads(sys.stdin.read())
    parent = req["parent"]
    # training comes first: on a CPU its threads would otherwise fight this process's
    with contextlib.suppress(OSError):
        os.nice(10)
    # SIGTERM (ShardWriter.stop, a killed run) unwinds like Ctrl-C: no half-written .tmp-* file
    # stays behind
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if req.get("gpt2"):  # its parent chose tiktoken for it: no tokenizer.json to parse
            tokenizer = TiktokenGPT2(req["fingerprint"])
        else:
            tokenizer = Tokenizer.from_json(req["tokenizer"])
        write_shards(
            DataConfig.from_dict(req["data"]),
            tokenizer,
            req["folder"],
            req["shard_tokens"],
            should_stop=lambda: os.getppid() != parent,
            max_shards=req["max_shards"],
            warnings_to_manifest=True,
        )
    except KeyboardInterrupt:
        sys.exit(0)
    except OSError as e:  # a full disk may not even let the manifest say so: the exit status does
        sys.exit(WRITER_DISK_FULL if e.errno == errno.ENOSPC else 1)
    except Exception:
        sys.exit(1)  # the manifest carries the error for the reader
    finally:
        # tokenizing is over: a stop that comes now has nothing to unwind, and as a
        # KeyboardInterrupt inside the interpreter's exit (torch's atexit finalizers) it would print
        # a traceback into the run's stderr
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


WRITER_DISK_FULL = 28  # the writer's exit status when the disk filled up (errno ENOSPC)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


class ShardWriter:
    """`write_shards` in a child process, so tokenizing never holds the training loop's interpreter
    lock. A fresh interpreter (not multiprocessing: its spawn re-runs the user's script, its fork
    copies torch's threads), which stops by itself when its parent dies."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        folder: Path,
        shard_tokens: int = SHARD_TOKENS,
        max_shards: int | None = None,
    ):
        # GPT-2 on tiktoken (decided here once): the writer needs only the fingerprint
        gpt2 = tokenizer.tiktoken() is not None
        req = {
            "data": cfg.to_dict(),
            "folder": str(folder),
            "shard_tokens": shard_tokens,
            "parent": os.getpid(),
            "max_shards": max_shards,
            "gpt2": gpt2,
            **(
                {"fingerprint": tokenizer.fingerprint()}
                if gpt2
                else {"tokenizer": tokenizer.to_json()}
            ),
        }
        # no Rust backtrace from `tokenizers` reaches the run's output (RUST_BACKTRACE is set on
        # some machines)
        env = {k: v for k, v in os.environ.items() if k != "RUST_BACKTRACE"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tinygpt.data.shard_writer"], stdin=subprocess.PIPE, env=env
        )
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


if __name__ == "__main__":
    _writer_main()
