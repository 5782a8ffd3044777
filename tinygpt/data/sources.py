"""Text sources: the built-in corpus, local files and folders, Hugging Face data sets.

Documents come out in a fixed order, each long file cut into pieces of about CHUNK_CHARS, and every
k-th document is held out for validation. `source_fingerprint` changes when a source's content may
have; the token cache (`tinygpt.data.shards`) names its folders with it. This module imports no
torch: the tokenizing process starts without it.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import socket
import stat
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Iterator

from tinygpt.core.config import DataConfig
from tinygpt.core.paths import hub_spec, is_hub, is_sample, sample_path
from tinygpt.data.token_files import DataError, detect_token_folder  # noqa: F401  (DataError: handed on)

_SKIP_WORDS = {
    "latin-1": "not UTF-8, read as latin-1",
    "binary": "binary (NUL bytes), skipped",
    "unreadable": "unreadable, skipped",
}
# the source warnings this process gave; shards.say_once gives none of them again
SAID: set[str] = set()
TEXT_SUFFIXES = {
    f".{s}"
    for s in "txt md py rst json jsonl csv html c h js ts java go rs cpp tex yaml yml toml cfg ini sh".split()
}
_SKIP_DIRS = set(
    "site-packages dist-packages __pycache__ test tests idlelib lib2to3 turtledemo .git".split()
)
CHUNK_CHARS = 4_096  # long files become documents of about this size, so the split has many parts


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
    """The train/validation split, by document: every `1/val_fraction`-th document, from the second
    on. The one rule for the token cache and for the held-out text evaluation reads."""
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
        out += [
            Path(dirpath) / f for f in sorted(filenames) if Path(f).suffix.lower() in TEXT_SUFFIXES
        ]
    return out


def _cut(text: str, start: int, size: int) -> int:
    """Where the piece of `text` that begins at `start` ends (`_chunks`): at the first line end
    `size` or more characters on, unless that is over 4 * size away (or there is none): then at a
    space in the second half of the next `size` characters, or after `size` characters."""
    end = text.find("\n", start + size)
    if end == -1 or end - start > 4 * size:
        end = start + size
        if end < len(text):
            space = text.rfind(" ", start + size // 2, end)
            end = space + 1 if space != -1 else end
        return min(end, len(text))
    return end + 1


def _chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """Split at line ends into pieces of about `size` characters. A line much longer than that (a
    minified file, a 50 MB one-line dump) is cut at a space, or anywhere, so that it still makes
    many documents and the train/validation split has some of it on both sides."""
    start = 0
    while start < len(text):
        end = _cut(text, start, size)
        yield text[start:end]
        start = end


def _chunks_streamed(parts: Iterator[str], size: int = CHUNK_CHARS) -> Iterator[str]:
    """`_chunks` of the text `parts` make when joined, holding only a few pieces of it at a time: a
    piece is cut once more than 4 * size characters past its start are known (all `_cut` ever looks
    at) or the text ended, so the pieces are the same as `_chunks("".join(parts))`'s."""
    buf, start = "", 0
    for part in parts:
        buf = buf[start:] + part
        start = 0
        while len(buf) - start > 4 * size:
            end = _cut(buf, start, size)
            yield buf[start:end]
            start = end
    buf = buf[start:]
    yield from _chunks(buf, size)


# a local text file is read this much at a time: never whole (a 10 GB file is 10 GB of RAM)
READ_BYTES = 1 << 20
_SNIFF_BYTES = 8192  # a file with a NUL byte among its first bytes is binary
# the encoding is decided on a file's first MB: a run's first step waits for the first shard, not
# for a pass over a 10 GB file (issue 37; tests/test_first_shard.py counts the bytes read)
UTF8_CHECK_BYTES = READ_BYTES


def _count(skipped: dict[str, int] | None, what: str) -> None:
    if skipped is not None:
        skipped[what] = skipped.get(what, 0) + 1


def _utf8_upto(f, limit: float) -> bool:
    """Whether the first `limit` bytes of the open binary file `f` are UTF-8 (read in pieces, kept
    nowhere); a character cut at `limit` counts as UTF-8."""
    decoder, seen = codecs.getincrementaldecoder("utf-8")(), 0
    while seen < limit and (block := f.read(int(min(READ_BYTES, limit - seen)))):
        seen += len(block)
        try:
            decoder.decode(block)
        except UnicodeDecodeError:
            return False
    if seen < limit:  # the whole file: a character cut at its end is not UTF-8
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return False
    return True


def stream_text_file(
    path: Path, skipped: dict[str, int] | None = None, max_chars: float = float("inf")
) -> Iterator[str]:
    """A local text file as str pieces, read READ_BYTES at a time (never whole): UTF-8, else latin-1
    (which reads any byte: the stated fallback for the old encodings of Western text); nothing for a
    binary file (a NUL byte among its first 8192 bytes, looked at before anything else is read), an
    unreadable one, or anything but a plain file (a FIFO). The encoding is decided on the bytes that
    can make the first `max_chars` characters, at most the first UTF8_CHECK_BYTES (past them a bad
    byte is replaced); the pieces stop once `max_chars` characters are given; `skipped` counts what
    happened, for one warning at the end."""
    try:  # non-blocking, then checked: a FIFO named like a text file is skipped, never waited on
        # outside run folders: a text file of the source the user named
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise IsADirectoryError(path)
        f = os.fdopen(fd, "rb")
    except OSError:
        _count(skipped, "unreadable")
        return
    with f:
        try:
            if b"\0" in f.read(_SNIFF_BYTES):
                _count(skipped, "binary")
                return
            f.seek(0)
            # a character is at most 4 bytes of UTF-8
            utf8 = _utf8_upto(f, min(4 * max_chars + 4, UTF8_CHECK_BYTES))
            f.seek(0)
        except OSError:
            _count(skipped, "unreadable")
            return
        if not utf8:
            _count(skipped, "latin-1")
        # past the checked bytes (only when max_chars stops
        # the reading) a bad byte is replaced, never raised
        decoder = codecs.getincrementaldecoder("utf-8" if utf8 else "latin-1")(errors="replace")
        given = 0
        while given < max_chars:
            try:
                block = f.read(READ_BYTES)
            # a disk error midway: what was read stays, the rest is skipped and counted
            except OSError:
                _count(skipped, "unreadable")
                return
            text = decoder.decode(block, final=not block)
            if text:
                given += len(text)
                yield text
            if not block:
                return


def hub_dataset(source: str, split: str) -> tuple[str, str | None, str | None]:
    """(name, config, split) of a Hub data set written ``hf:NAME[:CONFIG][@SPLIT]`` (the prefix
    optional), `split` when it names none; a DataError for an empty name."""
    try:
        return hub_spec(source, split)
    except ValueError as e:
        raise DataError(str(e)) from None


def resolve_source(source: str) -> tuple[str, object]:
    """("builtin", None) | ("local", Path) | ("tokens", Path) | ("hf", (name, config, split)); a
    clear error otherwise."""
    if source in ("builtin", "stdlib"):
        return "builtin", None
    if is_sample(source):  # a sample that ships with the package (sample:wikitext2)
        try:
            return "local", sample_path(source)
        except ValueError as e:
            raise DataError(str(e)) from None
    if is_hub(source):
        return "hf", hub_dataset(source, "train")
    p = Path(source).expanduser()
    if p.is_dir() and detect_token_folder(p):
        return "tokens", p  # token ids already (nanoGPT / llm.c): trained on as they are
    if p.exists():
        if p.is_dir() and any((p / n).exists() for n in ("dataset_info.json", "dataset_dict.json")):
            return "hf", (str(p), None, "train")  # a dataset saved with save_to_disk
        if p.is_dir() and not _local_files(p):
            raise DataError(
                f"folder {p} holds no text files ({', '.join(sorted(TEXT_SUFFIXES)[:6])}, ...)"
            )
        return "local", p
    raise DataError(
        f"data source {source!r} is neither 'builtin', an existing file or folder, nor a Hugging "
        "Face dataset written as hf:NAME[:CONFIG][@SPLIT] (e.g. hf:roneneldan/TinyStories)"
    )


def same_path_source(ours: str, theirs: str) -> bool:
    """Whether `theirs` (a run's recorded data.source) names the file or folder `ours` names, spelled
    otherwise: relative, absolute, with ~ or through a link on our side. `theirs` is compared as a
    string made absolute, never looked up (a run folder's words choose no path to read)."""
    try:
        kind, path = resolve_source(ours)
    except DataError:
        return False
    if kind not in ("local", "tokens") or is_sample(ours) or is_sample(theirs) or is_hub(theirs):
        return False
    spelled = os.path.abspath(os.path.expanduser(theirs))
    return spelled in (os.path.abspath(path), os.path.realpath(path))  # type: ignore[arg-type]


HUB_HOST = ("huggingface.co", 443)


def check_source(source: str, timeout_s: float = 5.0) -> str:
    """The source's kind (`resolve_source`), checked before any work: an unknown
    source fails here, and for a Hub dataset one quick connection to the Hub is
    made, so that offline the error is one line at once instead of the datasets
    library's retries ending in a ConnectionError minutes later."""
    kind, spec = resolve_source(source)
    if kind != "hf" or Path(spec[0]).exists() or os.environ.get("HF_HUB_OFFLINE") == "1":
        return kind  # not the Hub, a local save_to_disk folder, or the Hub cache only
    try:
        socket.create_connection(HUB_HOST, timeout=timeout_s).close()
    except OSError as e:
        raise DataError(
            f"cannot reach the Hugging Face Hub to read {source} ({e.strerror or e}); with no "
            "network use a local file or folder (--data PATH) or --data builtin"
        ) from None
    return kind


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """The documents of a source, in a fixed order, up to cfg.max_chars characters in total."""
    kind, arg = resolve_source(cfg.source)
    budget = cfg.max_chars if cfg.max_chars is not None else float("inf")
    skipped: dict[str, int] = {}  # local files: what was skipped or read as latin-1

    def raw() -> Iterator[str]:
        if kind == "builtin":  # our own corpus: the stdlib's UTF-8 sources, as they are
            for f in builtin_files():
                try:
                    # outside run folders: the standard library's sources
                    text = f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                yield from _chunks(text)
        elif kind == "local":
            for f in _local_files(arg):  # type: ignore[arg-type]
                # streamed: a file is read a piece at a time, as far as the
                # budget left needs (and the look-ahead `_cut` takes past
                # it, so the documents are cut as from the whole file)
                yield from _chunks_streamed(
                    stream_text_file(f, skipped, budget + 4 * CHUNK_CHARS + 1)
                )
        elif kind == "tokens":
            raise DataError(
                f"{cfg.source} holds token ids, not text: there is nothing to train a tokenizer on "
                "or to read as text; use data.tokenizer=gpt2 (its tokens) and evaluate on a text "
                "source"
            )
        else:
            yield from _hf_texts(*arg, text_field=cfg.text_field)  # type: ignore[misc]

    given = False
    for text in raw():
        if budget <= 0:
            return
        if len(text) > budget:
            text = text[: int(budget)]
        budget -= len(text)
        if text:
            given = True
            yield text
    if not given and cfg.max_chars != 0:  # read to its end and nothing in it: say why
        why = _no_text(arg, skipped) if kind == "local" else "holds no text"
        raise DataError(f"data source {cfg.source} {why}; give text to train on")
    if skipped:  # read to its end: one warning for every file skipped
        said = f"{cfg.source}: " + ", ".join(
            f"{n} {'file' if n == 1 else 'files'} {_SKIP_WORDS[k]}"
            for k, n in sorted(skipped.items())
        )
        SAID.add(said)
        warnings.warn(said, stacklevel=2)


def _no_text(path: Path, skipped: dict[str, int]) -> str:
    """Why a local source that was read to its end gave no text, as words after its name."""
    if path.is_file():
        if skipped.get("binary"):
            size = path.stat().st_size
            # outside run folders: the file the user named, at most 1 MB of it
            only_nul = size <= 1 << 20 and not path.read_bytes().strip(b"\0")
            return "holds only NUL bytes" if only_nul else "is a binary file (it has NUL bytes)"
        if skipped.get("unreadable"):
            return "could not be read"
        return "is empty" if path.stat().st_size == 0 else "holds no text"
    if skipped.get("binary") and not skipped.get("unreadable"):
        return "holds only binary files (NUL bytes)"
    if skipped.get("binary") or skipped.get("unreadable"):
        return "holds only binary or unreadable files"
    return "holds only empty files"


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
            raise DataError(
                f"record {i} of {name} has no field {text_field!r} (fields: {sorted(rec)}); "
                "set DataConfig.text_field"
            )
        yield from _chunks(rec[text_field])


def source_chars(cfg: DataConfig) -> int | None:
    """About how many characters training can read from the source (file sizes, capped by
    cfg.max_chars), from the file system alone: nothing is read. None for a Hub data set or token
    ids (their size is not known before reading them); the cap itself where one is set."""
    kind, arg = resolve_source(cfg.source)
    if kind == "builtin":
        files = builtin_files()
    elif kind == "local":
        files = _local_files(arg)  # type: ignore[arg-type]
    else:
        return cfg.max_chars
    size = sum(f.stat().st_size for f in files)
    return size if cfg.max_chars is None else min(size, cfg.max_chars)


def source_fingerprint(cfg: DataConfig) -> str:
    """Changes when the source's content may have changed (file sizes and times, or the name)."""
    kind, arg = resolve_source(cfg.source)
    h = hashlib.sha256(f"{kind}|{cfg.max_chars}|{cfg.text_field}".encode())
    if kind == "builtin":
        h.update(sys.version.encode())
        files = builtin_files()
    elif kind == "local":
        files = _local_files(arg)  # type: ignore[arg-type]
    elif kind == "tokens":
        files = sorted(Path(arg).glob("*.bin"))  # type: ignore[arg-type]
    else:
        files = []
        h.update(repr(arg).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]
