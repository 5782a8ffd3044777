"""Token shards that people already have: nanoGPT's ``train.bin``/``val.bin`` and llm.c's ``*.bin``.

- nanoGPT (``data/*/prepare.py``): ``train.bin`` and
  ``val.bin``, raw little-endian uint16 GPT-2 tokens, no header.
- llm.c / modded-nanogpt (``dev/data/data_common.py``, ``write_datafile``): any number of ``*.bin``
  shards, each a header of 256 little-endian int32 (``[0]`` magic, ``[1]`` version, ``[2]`` token
  count) followed by exactly that many tokens. llm.c writes two kinds (its ``HEADERS_INFO``): GPT-2
  shards, magic 20240520, version 1, uint16 ids; Llama-3 shards, magic 20240801, version 7, uint32
  ids. One folder holds one kind. Shards whose name contains "val" are the validation split.

Every shard is opened as a read-only memory map, so a 10B-token folder costs no memory and no read
up front. `open_token_folder` checks everything that is cheap to check (headers, sizes, the ids of
the validation tokens and of the first train shard) before it returns, so a bad folder fails before
any training; the ids of the other train shards are checked by the caller with `check_shard_ids` as
each is first used, because scanning every token up front would take minutes.

`DataError` is defined here, the lowest data module (sources.py hands it on).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinygpt.core.config import GPT2_VOCAB, GPT2_VOCAB_PADDED
from tinygpt.core.files import atomic_output

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
LLAMA3_VOCAB = 128256  # Llama 3's tokenizer: what llm.c's Llama-3 shards hold
NANOGPT_NAMES = ("train.bin", "val.bin")
# little-endian uint16 on every machine, as nanoGPT and llm.c's GPT-2 shards are written
TOKEN = np.dtype("<u2")


@dataclass(frozen=True)
class LlmcFormat:
    """One kind of llm.c shard, as llm.c's ``dev/data/data_common.py`` (``HEADERS_INFO``) writes it."""

    name: str
    magic: int
    version: int
    dtype: np.dtype  # the token type after the header, little-endian
    vocab: int  # the tokenizer's vocabulary these ids come from


LLMC_GPT2 = LlmcFormat("gpt-2", 20240520, 1, np.dtype("<u2"), GPT2_VOCAB)
LLMC_LLAMA3 = LlmcFormat("llama-3", 20240801, 7, np.dtype("<u4"), LLAMA3_VOCAB)
LLMC_FORMATS = {f.magic: f for f in (LLMC_GPT2, LLMC_LLAMA3)}


class DataError(ValueError):
    """Data that cannot be used; the message says what to do."""


@dataclass
class TokenFiles:
    """An opened token folder. Invariant: every array has one dtype (uint16, or uint32 for llm.c's
    Llama-3 shards), is read-only, and its ids were checked against the vocabulary for `val` and
    `train[0]`; `train` is in sorted file-name order."""

    train: list[np.ndarray]  # one read-only memmap per train shard
    val: np.ndarray  # the validation tokens
    kind: str  # "nanogpt" or "llmc"
    files: list[Path]  # every file read: the train shards in order, then the validation file(s)
    vocab_hint: int = GPT2_VOCAB  # the vocabulary the ids come from: GPT-2's, or Llama 3's

    @property
    def train_tokens(self) -> int:
        return sum(len(a) for a in self.train)


def _bins(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.bin") if p.is_file())


def _first_int32(path: Path) -> int | None:
    """The first little-endian int32 of a file, or None for a file shorter than 4 bytes."""
    with open(path, "rb") as f:  # outside run folders: a token file of the source the user named
        head = f.read(4)
    return int(np.frombuffer(head, dtype="<i4")[0]) if len(head) == 4 else None


def detect_token_folder(path: str | Path) -> str | None:
    """ "llmc" when any ``*.bin`` in the folder starts with an llm.c magic (a
    ``train.bin`` that does counts as llm.c too), else "nanogpt" when it holds
    ``train.bin`` or ``val.bin`` (raw tokens), else None: not a folder, or a
    folder of anything else (text files, model weights). Reads 4 bytes a file."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    bins = _bins(folder)
    if any(_first_int32(p) in LLMC_FORMATS for p in bins):
        return "llmc"
    if any(p.name in NANOGPT_NAMES for p in bins):
        return "nanogpt"
    return None


def check_shard_ids(
    arr: np.ndarray, vocab_size: int, name: str, vocab_hint: int = GPT2_VOCAB
) -> None:
    """Raise DataError when `arr` holds an id >= `vocab_size` (the embedding would index out of
    range, on a GPU as an opaque device-side assert). One pass over the array: seconds for 100M
    tokens, so `open_token_folder` checks the validation tokens and the first train shard, and a
    caller checks each later shard when it first opens it. `vocab_hint` is the vocabulary the
    format's ids come from (GPT-2's, or Llama 3's), named in the message as the likely fix."""
    if len(arr) == 0:
        return
    top = int(np.max(arr))
    if top >= vocab_size:
        likely = example = ""
        if vocab_hint == GPT2_VOCAB and top < GPT2_VOCAB:
            likely = " these are likely GPT-2 tokens (ids < 50257), so"
            example = f" (e.g. --set data.tokenizer=gpt2 model.vocab_size={GPT2_VOCAB_PADDED})"
        elif vocab_hint == LLAMA3_VOCAB and top < LLAMA3_VOCAB:
            likely = " these are llm.c's Llama-3 tokens (ids < 128256), so"
            example = (
                " (e.g. --set data.tokenizer=PATH/TO/llama-3/tokenizer.json "
                "model.vocab_size=128256)"
            )
        raise DataError(
            f"{name} holds token id {top}, beyond the vocabulary of {vocab_size};{likely} use a "
            f"tokenizer and model vocabulary of at least {top + 1}{example}"
        )


def _memmap(path: Path, offset: int, n: int, dtype: np.dtype = TOKEN) -> np.ndarray:
    # np.memmap cannot map zero bytes; an empty shard is an empty array
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,))


def _llmc_format(path: Path) -> LlmcFormat:
    """The kind of an llm.c shard from its header (magic
    and version), or a DataError that says why not."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(
            f"{path} is truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte llm.c "
            "header; download or write the shard again"
        )
    magic, version = (int(v) for v in np.fromfile(path, dtype="<i4", count=2))
    fmt = LLMC_FORMATS.get(magic)
    if fmt is None:
        known = " or ".join(f"{f.magic} ({f.name})" for f in LLMC_FORMATS.values())
        raise DataError(
            f"{path} is not an llm.c token shard: its magic number is {magic}, expected {known}; "
            "remove it from the folder or write it again with write_llmc_shard"
        )
    if version != fmt.version:
        raise DataError(
            f"{path} has llm.c magic {magic} ({fmt.name}) but version {version}; llm.c writes "
            f"version {fmt.version} ({fmt.dtype.itemsize * 8}-bit ids) for {fmt.name}: write the "
            "shard again"
        )
    return fmt


def _open_llmc_shard(path: Path, fmt: LlmcFormat) -> np.ndarray:
    """One llm.c shard of kind `fmt`, its header checked: that kind's magic and version, and exactly
    header[2] tokens after it."""
    size = path.stat().st_size
    if _llmc_format(path) != fmt:
        raise DataError(
            f"{path} is an llm.c {_llmc_format(path).name} shard among {fmt.name} shards; one "
            "folder holds shards of one tokenizer, so move it to a folder of its own"
        )
    n = int(np.fromfile(path, dtype="<i4", count=3)[2])
    expected = HEADER_BYTES + n * fmt.dtype.itemsize
    if n < 0 or size < expected:
        raise DataError(
            f"{path} is truncated: its header says {n} tokens ({expected} bytes) but the file "
            f"holds {size} bytes; download or write the shard again"
        )
    if size > expected:
        raise DataError(
            f"{path} holds {size} bytes but its header says {n} tokens ({expected} bytes); the "
            "file is not a well-formed llm.c shard, write it again"
        )
    return _memmap(path, HEADER_BYTES, n, fmt.dtype)


def _open_nanogpt_bin(path: Path) -> np.ndarray:
    size = path.stat().st_size
    if size % TOKEN.itemsize:
        raise DataError(
            f"{path} holds {size} bytes, an odd number, so it is not a file of uint16 tokens "
            "(nanoGPT's format); the file is truncated or of another kind, write it again"
        )
    return _memmap(path, 0, size // TOKEN.itemsize)


def _is_val(path: Path) -> bool:
    return "val" in path.name.lower()


def _split_files(folder: Path, kind: str) -> tuple[list[Path], list[Path]]:
    """(train files, validation files) of a detected folder,
    each in sorted name order; raises when either is empty."""
    if kind == "nanogpt":
        train = [p for p in [folder / "train.bin"] if p.is_file()]
        val = [p for p in [folder / "val.bin"] if p.is_file()]
        want_train, want_val = "train.bin", "val.bin"
    else:
        train = [p for p in _bins(folder) if not _is_val(p)]
        val = [p for p in _bins(folder) if _is_val(p)]
        want_train = "a *.bin shard without 'val' in its name"
        want_val = "a *.bin shard with 'val' in its name, e.g. fineweb_val_000000.bin"
    if not train:
        raise DataError(f"{folder} has no train tokens: add {want_train} ({kind} format)")
    if not val:
        raise DataError(
            f"{folder} has no validation tokens: add {want_val} ({kind} format), e.g. split a few "
            "million tokens off the train data"
        )
    return train, val


def open_token_folder(path: str | Path, vocab_size: int) -> TokenFiles:
    """Open a nanoGPT or llm.c token folder for training with a vocabulary of `vocab_size`.

    Before it returns, every file's size (and for llm.c its header) has been checked
    and the ids of the validation tokens and of the first train shard are <
    `vocab_size`; each other train shard must be checked with `check_shard_ids` when
    first used (a full scan of 10B tokens up front takes minutes). Raises DataError,
    with a one-line message naming the file and what to do, for anything wrong.
    """
    folder = Path(path)
    kind = detect_token_folder(folder)
    if kind is None:
        where = "does not exist" if not folder.exists() else "is not a folder"
        if folder.is_dir():
            where = (
                "holds neither nanoGPT's train.bin/val.bin nor llm.c shards (*.bin starting with "
                "magic 20240520 or 20240801)"
            )
        raise DataError(f"{folder} {where}; point data.source at a folder of token files")
    train_files, val_files = _split_files(folder, kind)
    if kind == "nanogpt":
        opener, vocab_hint = _open_nanogpt_bin, GPT2_VOCAB
    else:
        # the first shard sets the kind; the others must match it
        fmt = _llmc_format(train_files[0])
        opener, vocab_hint = (lambda p: _open_llmc_shard(p, fmt)), fmt.vocab
    train = [opener(p) for p in train_files]
    vals = [opener(p) for p in val_files]
    # several validation shards are joined in memory:
    # they are small (llm.c writes one of 100M tokens)
    val = vals[0] if len(vals) == 1 else np.concatenate(vals)
    if len(val) == 0:
        raise DataError(
            f"the validation tokens of {folder} ({', '.join(p.name for p in val_files)}) are "
            "empty; write them again"
        )
    if not any(len(a) for a in train):
        raise DataError(
            f"the train tokens of {folder} ({len(train)} files) are empty; write them again"
        )
    val_name = str(val_files[0]) if len(val_files) == 1 else f"the validation shards of {folder}"
    check_shard_ids(val, vocab_size, val_name, vocab_hint)
    check_shard_ids(train[0], vocab_size, str(train_files[0]), vocab_hint)
    return TokenFiles(
        train=train, val=val, kind=kind, files=train_files + val_files, vocab_hint=vocab_hint
    )


def _as_ids(tokens, dtype: np.dtype = TOKEN) -> np.ndarray:
    """`tokens` as little-endian `dtype` ids, refusing
    what does not fit rather than wrapping it silently."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"tokens must be a flat sequence, got an array of shape {arr.shape}")
    top = 2 ** (8 * dtype.itemsize)
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= top):
        raise DataError(
            f"{dtype.itemsize * 8}-bit token files hold integer ids in [0, {top - 1}]; got "
            f"{arr.dtype} ids in [{arr.min()}, {arr.max()}] (a larger vocabulary needs llm.c's "
            "llama-3 format)"
        )
    return arr.astype(dtype)


def write_llmc_shard(path: str | Path, tokens, kind: str = "gpt-2") -> Path:
    """Write `tokens` as one llm.c shard of `kind` ("gpt-2": magic 20240520, version 1, uint16 ids;
    "llama-3": magic 20240801, version 7, uint32 ids), after a header of 256 int32 (magic, version,
    count). The file appears whole or not at all."""
    fmt = {f.name: f for f in LLMC_FORMATS.values()}.get(kind)
    if fmt is None:
        raise DataError(f"unknown llm.c shard kind {kind!r}; choose gpt-2 or llama-3")
    arr = _as_ids(tokens, fmt.dtype)
    if len(arr) >= 2**31:
        raise DataError(
            f"an llm.c shard holds fewer than 2**31 tokens (its count is an int32); got {len(arr)}"
        )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = fmt.magic, fmt.version, len(arr)
    with atomic_output(path) as tmp, open(tmp, "wb") as f:  # outside run folders: a fresh temporary
        f.write(header.tobytes())
        f.write(arr.tobytes())
    return Path(path)
