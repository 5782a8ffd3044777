"""Reading the token cache: its folder name, shards in memory or mapped from a folder that a writer
(`tinygpt.data.shard_writer`, in a background process) may still be filling, and the check of
every shard before it is used.

Invariants the sampler relies on: shard i's content depends only on the source, the tokenizer and
the split, never on timing; shards are visited in index order; a reader that needs shard i waits
until it is in the manifest (or the manifest says the source ended before it).
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from tinygpt.core.config import DataConfig
from tinygpt.core.files import MANIFEST, UnsafePathError, inside, refuse_link, write_json_atomic
from tinygpt.core.rundir import read_json
from tinygpt.data.shard_writer import (
    SHARD_TOKENS,
    WRITER_DISK_FULL,
    ShardWriter,
    token_dtype,
    write_shards,
    writer_lock,
)
from tinygpt.data.sources import SAID, DataError, source_fingerprint
from tinygpt.model.tokenizer import Tokenizer

# in the cache's folder name; 3: shards (2: one file, latin-1 fallback and long lines cut)
CACHE_FORMAT = 3
# local only, never mirrored: {file name: [sha256, highest id]} checked here
CHECKED = ".vocab-checked.json"


def cache_key(cfg: DataConfig, tokenizer: Tokenizer) -> str:
    """The token cache's folder name: source content, tokenizer and split all in one hash."""
    return hashlib.sha256(
        f"{CACHE_FORMAT}|{source_fingerprint(cfg)}|{tokenizer.fingerprint()}|"
        f"{cfg.val_fraction}".encode()
    ).hexdigest()[:20]


class TokenShards:
    """Token shards held in memory or mapped from files: `shard(i)` is the i-th training shard (None
    past the last), `validation(n)` at least n validation tokens (all there are, if fewer)."""

    def __init__(
        self,
        train: list[np.ndarray],
        val: np.ndarray,
        fingerprint: str,
        meta: dict | None = None,
        check: Callable[[int, np.ndarray], None] | None = None,
    ):
        self._train, self._val = train, val
        self.fingerprint, self.meta = fingerprint, meta or {}
        self._check, self._checked = check, set()

    @classmethod
    def from_array(cls, tokens: np.ndarray, val: np.ndarray | None = None) -> "TokenShards":
        """One flat array as a single shard (tests, benchmarks, a finetuning set)."""
        digest = hashlib.sha256(np.ascontiguousarray(tokens[:4096]).tobytes()).hexdigest()[:12]
        return cls(
            [tokens], val if val is not None else tokens[:0], f"array-{len(tokens)}-{digest}"
        )

    def shard(self, i: int) -> np.ndarray | None:
        if i >= len(self._train):
            return None
        # e.g. ids < vocabulary, on first use
        if self._check is not None and i not in self._checked:
            self._check(i, self._train[i])
            self._checked.add(i)
        return self._train[i]

    def validation(self, min_tokens: int) -> np.ndarray:
        return self._val

    def written(self, i: int) -> bool:
        """Whether `shard(i)` answers without waiting (it may answer None: past the last)."""
        return True

    @property
    def complete(self) -> bool:
        return True


def say_once(texts: object) -> None:
    """The warnings the writer process kept in a manifest (it cannot say them as this process's own
    one line), each once in this process, however often the manifest is read. A manifest may come
    from a mirror: a few lines of printable text only."""
    for text in texts[:8] if isinstance(texts, list) else ():
        text = "".join(c for c in text[:1000] if c.isprintable()) if isinstance(text, str) else ""
        if text and text not in SAID:
            SAID.add(text)
            warnings.warn(text, stacklevel=2)


class StreamedShards(TokenShards):
    """The shards of a folder that a writer may still be filling. `shard(i)` waits for shard i while
    the writer is alive; `alive` says whether one is (a dead writer with an unfinished manifest is
    an error, not an endless wait)."""

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
            say_once(self._manifest.get("warnings"))

    @property
    def complete(self) -> bool:
        return bool(self._manifest.get("done"))

    @property
    def n_shards(self) -> int:
        return len(self._manifest.get("shards", []))

    def written(self, i: int) -> bool:
        self._reload()
        return i < self.n_shards or self.complete or bool(self._manifest.get("error"))

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
                raise DataError(
                    f"tokenization into {self.folder} stopped before shard {i}; run "
                    "the same command again: the complete shards are kept and it "
                    "tokenizes on from the first missing one"
                )
            time.sleep(self.poll_s)
            self._reload()

    def _map(self, split: str, i: int) -> np.ndarray:
        if (split, i) not in self._maps:
            info = self._manifest["shards"][i][split]
            dtype = np.dtype(self._manifest["dtype"])
            n = info["bytes"] // dtype.itemsize
            path = inside(self.folder, info["name"], self.folder / MANIFEST, plain=True)
            refuse_link(path)
            self._maps[(split, i)] = (
                np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
            )
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
        if not parts:
            return np.zeros(0, np.dtype(self._manifest.get("dtype", "uint16")))
        return np.concatenate(parts)

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


def check_token_cache(
    folder: str | Path, vocab_size: int, mirror: Path | None = None, restored: range = range(0)
) -> list[str]:
    """Check every shard listed in `folder` before it is used: a plain file named inside the folder,
    of the dtype this vocabulary needs, every id below `vocab_size` (a numpy max over the mapped
    file, done once per file: the result is kept in a local record, never taken from a manifest).
    The first bad shard and all after it are removed from the local cache (files and manifest
    entries), so the writer tokenizes them again; each is named in one warning line, saying whether
    it came from the mirror (shards `restored` from `mirror` by this start) or the local cache.
    Returns those lines."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return []
    with writer_lock(folder):  # no writer appends while shards are removed
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
            lines.append(
                f"{why}: removed from the local cache ({len(shards) - i} shard(s) from "
                "there on); they are tokenized again"
            )
            warnings.warn(lines[-1], stacklevel=2)
        names = {e[s]["name"] for e in kept for s in ("train", "val")}
        write_json_atomic(folder / CHECKED, {k: v for k, v in checked.items() if k in names})
    return lines


def _first_bad_shard(
    folder: Path,
    manifest,
    shards: list,
    vocab_size: int,
    checked: dict,
    mirror: Path | None,
    restored: range,
) -> tuple[int, str] | None:
    """(index, why) of the first shard this vocabulary cannot use, or None; `checked` gains each
    file's (sha256, highest id) as it is read (a file restored by this start is read again whatever
    the record says)."""
    want = token_dtype(vocab_size).name
    if isinstance(manifest, dict) and manifest.get("dtype") != want and shards:
        return 0, (
            f"the token cache {folder / MANIFEST} says dtype {manifest.get('dtype')!r}, "
            f"this vocabulary needs {want}"
        )
    for i, entry in enumerate(shards):
        where = "in the local cache"
        if i in restored and mirror is not None:
            where = f"from the mirror {mirror}"
        try:
            for split in ("train", "val"):
                info = entry[split]
                path = inside(folder, info["name"], folder / MANIFEST, plain=True)
                refuse_link(path)
                rec = checked.get(info["name"])
                if not (isinstance(rec, list) and rec[0] == info["sha256"] and i not in restored):
                    n = info["bytes"] // np.dtype(want).itemsize
                    top = (
                        int(np.max(np.memmap(path, dtype=want, mode="r", shape=(n,)))) if n else -1
                    )
                    checked[info["name"]] = rec = [info["sha256"], top]
                if rec[1] >= vocab_size:
                    return i, (
                        f"token shard {path} ({where}) holds token id {rec[1]}, beyond "
                        f"the vocabulary of {vocab_size}"
                    )
        except (UnsafePathError, KeyError, TypeError, ValueError, OSError) as e:
            return i, f"token shard {i} ({where}) is unusable: {e}"
    return None


def _drop_shards_from(folder: Path, manifest: dict, shards: list, i: int) -> list:
    """Remove shard `i` and all after it (files and manifest entries, the writer to go on from `i`);
    the shards kept."""
    for entry in shards[i:]:
        for split in ("train", "val"):
            try:
                inside(folder, entry[split]["name"], plain=True).unlink(missing_ok=True)
            except (UnsafePathError, KeyError, TypeError, OSError):
                pass  # an unsafe name is never deleted either: only the manifest forgets it
    kept = shards[:i]
    write_json_atomic(folder / MANIFEST, {**manifest, "shards": kept, "done": False, "error": None})
    return kept


def build_token_cache(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    cache_root: str | Path,
    key: str | None = None,
    shard_tokens: int = SHARD_TOKENS,
) -> StreamedShards:
    """Tokenize the whole source here and now (tests, benchmarks, evaluation); a training run
    streams instead (`stream_token_cache`). Reuses the shards already in cache_root/<key>/."""
    folder = Path(cache_root) / (key or cache_key(cfg, tokenizer))
    write_shards(cfg, tokenizer, folder, shard_tokens)
    return StreamedShards(folder)


class ShardStream(StreamedShards):
    """Shards written by a background process that tokenizes only as far as the run will read (its
    token budget and a margin), not a 25 GB source for a 1 GB budget. Asked for a shard beyond that
    (more steps on resume), it starts the process again with twice the limit."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        folder: Path,
        shard_tokens: int,
        limit: int | None,
    ):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.shard_tokens, self.limit = shard_tokens, limit
        self.writer = ShardWriter(cfg, tokenizer, folder, shard_tokens, limit)
        super().__init__(folder, alive=self._writing)

    def shard(self, i: int) -> np.ndarray | None:
        # asked for every batch: a writer that died of a full disk stops training now, not when the
        # shard it was writing would have been needed (thousands of steps later)
        if self.writer.process.poll() == WRITER_DISK_FULL:
            raise OSError(
                errno.ENOSPC,
                f"{os.strerror(errno.ENOSPC)} (tokenizing into {self.folder})",
                str(self.folder),
            )
        return super().shard(i)

    def _writing(self) -> bool:
        if self.writer.alive():
            return True
        self._reload()
        if (
            self.limit is not None
            and not self.complete
            and not self._manifest.get("error")
            and self.n_shards >= self.limit
        ):  # it paused at its limit: more is wanted
            self.limit *= 2
            self.writer = ShardWriter(
                self.cfg, self.tokenizer, self.folder, self.shard_tokens, self.limit
            )
            return True
        return False

    def stop(self) -> None:
        self.writer.stop()


def stream_token_cache(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    cache_root: str | Path,
    key: str | None = None,
    shard_tokens: int = SHARD_TOKENS,
    max_train_tokens: int | None = None,
) -> StreamedShards:
    """The shards of cache_root/<key>/ as a background process writes them (none is started when the
    folder is complete); reading a shard not yet written waits for it. `max_train_tokens`: what the
    run will read, so tokenizing stops about there (one shard of margin) until more is asked for."""
    folder = Path(cache_root) / (key or cache_key(cfg, tokenizer))
    done = StreamedShards(folder)
    if done.complete:
        return done
    limit = None if max_train_tokens is None else -(-max_train_tokens // shard_tokens) + 1
    return ShardStream(cfg, tokenizer, folder, shard_tokens, limit)
