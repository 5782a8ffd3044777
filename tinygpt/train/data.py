"""Text sources, the token cache, and the sampler of training windows.

Text is tokenized once, in parallel batches, into flat numpy files (``train.bin``, ``val.bin``)
that are memory-mapped for training. The cache folder is named by a fingerprint of the source,
the tokenizer and the split, so a second run (or a new Colab VM with the cache on Drive) skips
tokenizing. The sampler's position is a few integers stored in every checkpoint: resuming
continues the exact data order.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from tinygpt.core.config import DataConfig
from tinygpt.core.files import atomic_output, write_json_atomic
from tinygpt.model.tokenizer import Tokenizer

CACHE_FORMAT = 2  # 2: latin-1 fallback and long lines cut (caches of format 1 hold other documents)
_SKIP_WORDS = {"latin-1": "not UTF-8, read as latin-1", "binary": "binary (NUL bytes), skipped",
               "unreadable": "unreadable, skipped"}
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".csv", ".html", ".c", ".h", ".js", ".ts",
                 ".java", ".go", ".rs", ".cpp", ".tex", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".sh"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "lib2to3",
              "turtledemo", ".git"}
CHUNK_CHARS = 4_096  # long files become documents of about this size, so the split has many parts


class DataError(ValueError):
    """Data that cannot be used; the message says what to do."""


def builtin_files() -> list[Path]:
    """The built-in offline corpus: the Python standard library's own .py files (tests excluded),
    found through sysconfig so it exists on every machine, Colab included."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return files


def is_validation_document(index: int, val_fraction: float) -> bool:
    """The train/validation split, by document: every `1/val_fraction`-th document, from the second on.
    The one rule for the token cache and for the held-out text evaluation reads."""
    return index % max(2, round(1 / val_fraction)) == 1


def validation_text(cfg: DataConfig, max_chars: int | None = None) -> str:
    """The documents of a source that training never sees (its validation split), joined: the
    evaluation text of a run's own data, e.g. `tinygpt eval --task perplexity --data builtin`."""
    out, n = [], 0
    for i, doc in enumerate(iter_documents(cfg)):
        if is_validation_document(i, cfg.val_fraction):
            out.append(doc)
            n += len(doc)
            if max_chars is not None and n >= max_chars:
                break
    text = "".join(out)
    return text[:max_chars] if max_chars is not None else text


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [Path(dirpath) / f for f in sorted(filenames) if Path(f).suffix.lower() in TEXT_SUFFIXES]
    return out


def _chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """Split at line ends into pieces of about `size` characters. A line much longer than that (a
    minified file, a 50 MB one-line dump) is cut at a space, or anywhere, so that it still makes many
    documents and the train/validation split has some of it on both sides."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + size)
        if end == -1 or end - start > 4 * size:
            end = start + size
            if end < len(text):
                space = text.rfind(" ", start + size // 2, end)
                end = space + 1 if space != -1 else end
            end = min(end, len(text))
        else:
            end += 1
        yield text[start:end]
        start = end


def read_text_file(path: Path, skipped: dict[str, int] | None = None) -> str | None:
    """A local text file as str: UTF-8, else latin-1 (which reads any byte: the stated fallback for
    the old encodings of Western text); None for a binary file (NUL bytes) or an unreadable one.
    `skipped` counts what happened, for one warning at the end."""
    try:
        data = path.read_bytes()
    except OSError:
        if skipped is not None:
            skipped["unreadable"] = skipped.get("unreadable", 0) + 1
        return None
    if b"\0" in data[:8192]:
        if skipped is not None:
            skipped["binary"] = skipped.get("binary", 0) + 1
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        if skipped is not None:
            skipped["latin-1"] = skipped.get("latin-1", 0) + 1
        return data.decode("latin-1")


def resolve_source(source: str) -> tuple[str, object]:
    """("builtin", None) | ("local", Path) | ("hf", (name, config, split)); a clear error otherwise."""
    if source in ("builtin", "stdlib"):
        return "builtin", None
    if source.startswith("hf:"):
        spec = source[3:]
        split = "train"
        if "@" in spec:
            spec, split = spec.split("@", 1)
        name, _, config = spec.partition(":")
        if not name:
            raise DataError(f"empty dataset name in {source!r}; write hf:NAME[:CONFIG][@SPLIT]")
        return "hf", (name, config or None, split)
    p = Path(source).expanduser()
    if p.exists():
        if p.is_dir() and not _local_files(p) and not (p / "dataset_info.json").exists() \
                and not (p / "dataset_dict.json").exists():
            raise DataError(f"folder {p} holds no text files ({', '.join(sorted(TEXT_SUFFIXES)[:6])}, ...)")
        if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
            return "hf", (str(p), None, "train")  # a dataset saved with save_to_disk
        return "local", p
    raise DataError(f"data source {source!r} is neither 'builtin', an existing file or folder, nor a Hugging "
                    "Face dataset written as hf:NAME[:CONFIG][@SPLIT] (e.g. hf:roneneldan/TinyStories)")


HUB_HOST = ("huggingface.co", 443)


def check_hub_reachable(source: str, timeout_s: float = 5.0) -> None:
    """For a Hub dataset, one quick connection to the Hub before any work: offline, a one-line error
    at once instead of the datasets library's retries ending in a ConnectionError minutes later."""
    kind, spec = resolve_source(source)
    if kind != "hf" or Path(spec[0]).exists() or os.environ.get("HF_HUB_OFFLINE") == "1":
        return  # a local save_to_disk folder, or the Hub cache only
    try:
        socket.create_connection(HUB_HOST, timeout=timeout_s).close()
    except OSError as e:
        raise DataError(f"cannot reach the Hugging Face Hub to read {source} ({e.strerror or e}); with no network use "
                        "a local file or folder (--data PATH) or --data builtin") from None


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """The documents of a source, in a fixed order, up to cfg.max_chars characters in total."""
    kind, arg = resolve_source(cfg.source)
    budget = cfg.max_chars if cfg.max_chars is not None else float("inf")

    def raw() -> Iterator[str]:
        if kind == "builtin":  # our own corpus: the stdlib's UTF-8 sources, as they are
            for f in builtin_files():
                try:
                    text = f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                yield from _chunks(text)
        elif kind == "local":
            skipped: dict[str, int] = {}
            for f in _local_files(arg):  # type: ignore[arg-type]
                text = read_text_file(f, skipped)
                if text is not None:
                    yield from _chunks(text)
            if skipped:
                warnings.warn(f"{cfg.source}: " + ", ".join(
                    f"{n} {'file' if n == 1 else 'files'} {_SKIP_WORDS[k]}" for k, n in sorted(skipped.items())),
                    stacklevel=2)
        else:
            yield from _hf_texts(*arg, text_field=cfg.text_field)  # type: ignore[misc]

    for text in raw():
        if budget <= 0:
            return
        if len(text) > budget:
            text = text[: int(budget)]
        budget -= len(text)
        if text:
            yield text


def _hf_texts(name: str, config: str | None, split: str, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise DataError("Hugging Face datasets need `pip install datasets`") from e
    if Path(name).is_dir():
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:  # streaming: a large Hub set is read as it is tokenized, never downloaded whole
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    for i, rec in enumerate(ds):
        if text_field not in rec:
            raise DataError(f"record {i} of {name} has no field {text_field!r} (fields: {sorted(rec)}); "
                            "set DataConfig.text_field")
        yield from _chunks(rec[text_field])


def source_fingerprint(cfg: DataConfig) -> str:
    """Changes when the source's content may have changed (file sizes and times, or the name)."""
    kind, arg = resolve_source(cfg.source)
    h = hashlib.sha256(f"{kind}|{cfg.max_chars}|{cfg.text_field}".encode())
    if kind == "builtin":
        h.update(sys.version.encode())
        files = builtin_files()
    elif kind == "local":
        files = _local_files(arg)  # type: ignore[arg-type]
    else:
        files = []
        h.update(repr(arg).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and memory), else uint32."""
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise DataError(f"vocabulary of {vocab_size} does not fit the token cache (at most 2**32 ids)")


@dataclass
class TokenData:
    """The memory-mapped train and validation tokens and the cache's metadata."""

    train: np.ndarray
    val: np.ndarray
    meta: dict
    path: Path


def cache_key(cfg: DataConfig, tokenizer: Tokenizer) -> str:
    """The token cache's folder name: source content, tokenizer and split all in one hash."""
    return hashlib.sha256(f"{CACHE_FORMAT}|{source_fingerprint(cfg)}|{tokenizer.fingerprint()}|"
                          f"{cfg.val_fraction}".encode()).hexdigest()[:20]


def build_token_cache(cfg: DataConfig, tokenizer: Tokenizer, cache_root: str | Path,
                      batch_docs: int = 256, progress: bool = False, key: str | None = None) -> TokenData:
    """Tokenize the source once into cache_root/<fingerprint>/; reuse it when the fingerprint matches.
    Every k-th document goes to validation (k = 1 / val_fraction): deterministic, and spread over the source.
    `key`: cache_key(cfg, tokenizer) when the caller has it already (it stats every source file)."""
    folder = Path(cache_root) / (key or cache_key(cfg, tokenizer))
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        return _open(folder, meta)
    dtype = token_dtype(tokenizer.vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "val": 0}
    n_docs = n_chars = 0
    bar = tqdm(desc="tokenizing", unit=" docs") if progress else None
    # each file whole or not at all; meta.json, written last, says the cache is complete
    with atomic_output(folder / "train.bin") as train_tmp, atomic_output(folder / "val.bin") as val_tmp, \
            open(train_tmp, "wb") as ftrain, open(val_tmp, "wb") as fval:
        batch: list[str] = []

        def flush() -> None:
            nonlocal n_docs
            for ids in tokenizer.encode_batch(batch):
                arr = np.asarray(ids + [tokenizer.eot_id], dtype=dtype)
                split = "val" if is_validation_document(n_docs, cfg.val_fraction) else "train"
                (fval if split == "val" else ftrain).write(arr.tobytes())
                counts[split] += len(arr)
                n_docs += 1
            if bar is not None:
                bar.update(len(batch))
            batch.clear()

        for doc in iter_documents(cfg):
            batch.append(doc)
            n_chars += len(doc)
            if len(batch) >= batch_docs:
                flush()
        if batch:
            flush()
        if bar is not None:
            bar.close()
        if n_docs == 0:
            raise DataError(f"data source {cfg.source!r} yielded no text")
    meta = {"format": CACHE_FORMAT, "source": cfg.source, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size,
            "train_tokens": counts["train"], "val_tokens": counts["val"], "documents": n_docs, "chars": n_chars,
            "chars_per_token": n_chars / max(1, counts["train"] + counts["val"]),
            "tokenizer": tokenizer.fingerprint()}
    write_json_atomic(meta_path, meta)  # written last: its presence means the cache is complete
    return _open(folder, meta)


def _open(folder: Path, meta: dict) -> TokenData:
    dtype = np.dtype(meta["dtype"])

    def mm(name: str, n: int) -> np.ndarray:
        return np.memmap(folder / name, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)

    return TokenData(mm("train.bin", meta["train_tokens"]), mm("val.bin", meta["val_tokens"]), meta, folder)


class WindowSampler:
    """Training windows of seq_len + 1 tokens at multiples of seq_len, visited in a fresh permutation
    each epoch. The position (epoch, index) is the whole state. Each call takes the next
    batch_size * world_size windows of the global order and returns one rank's share, so a
    checkpoint resumes with the same data order at any world size with the same global batch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"the training split has {len(tokens)} tokens, fewer than one window of "
                            f"{seq_len + 1}: use more text or a shorter seq_len")
        self.epoch, self.index = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _order(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_windows)
            self._perm_epoch = self.epoch
        return self._perm

    def _take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            order = self._order()
            k = min(n - len(out), self.n_windows - self.index)
            out += order[self.index:self.index + k].tolist()
            self.index += k
            if self.index == self.n_windows:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def next_batch(self, batch_size: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._take(batch_size * world_size)[rank * batch_size:(rank + 1) * batch_size]
        T = self.seq_len
        w = np.stack([np.asarray(self.tokens[s * T:s * T + T + 1], dtype=np.int64) for s in starts])
        w = torch.from_numpy(w)
        return w[:, :-1], w[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "seq_len": self.seq_len,
                "n_windows": self.n_windows}

    def load_state_dict(self, s: dict) -> None:
        if (s["seq_len"], s["n_windows"], s["seed"]) != (self.seq_len, self.n_windows, self.seed):
            raise DataError(f"sampler state is for seq_len={s['seq_len']}, {s['n_windows']} windows, seed "
                            f"{s['seed']}; this data gives seq_len={self.seq_len}, {self.n_windows} windows, "
                            f"seed {self.seed}: resume with the same data and recipe, or start a new run")
        self.epoch, self.index = s["epoch"], s["index"]


def fixed_batches(tokens: np.ndarray, seq_len: int, batch_size: int,
                  n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evaluation batches: the same evenly spaced windows every time, so val losses compare."""
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise DataError(f"the validation split has {len(tokens)} tokens, fewer than one window of {seq_len + 1}: "
                        "use more text, a larger val_fraction or a shorter seq_len")
    total = min(n_windows, batch_size * n_batches)
    starts = np.linspace(0, n_windows - 1, total).astype(np.int64) * seq_len
    w = torch.from_numpy(np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts]))
    return [(w[i:i + batch_size, :-1], w[i:i + batch_size, 1:]) for i in range(0, total, batch_size)]
