"""Data files read in bounded pieces: UTF-8 text and JSON
lines, decompressed as read when they end in .gz or .bz2.

Every data task (finetuning records, HellaSwag, HumanEval, MBPP, perplexity text) reads its file
here, so that no file is read whole (a 2 MB archive of a 2 GB line is never 2 GB in memory) and
every bad line is one `DataFormatError` naming the file and the line.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import re
import zlib
from pathlib import Path
from typing import Any, Iterator

from tinygpt.core.files import parse_json


class DataFormatError(ValueError):
    """A data file that is not in the expected format; the message says what was expected."""


# the longest line of a data file read, in characters (a JSONL record is far shorter)
LINE_LIMIT = 16 << 20
READ_BYTES = 1 << 20  # a data file is read (and decompressed) this much at a time, never whole
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of a byte that is not UTF-8


class DataFile:
    """A data file read as UTF-8 text in bounded pieces, decompressed as it is read when it ends in
    .gz or .bz2 (a 2 MB archive of a 2 GB line is never 2 GB in memory): `read(n)` gives its first n
    characters, iterating gives its lines (ending with "\\n"; line ends as `open` gives them, \\r\\n
    and \\r read as \\n), each at most `line_limit` characters. A longer line, bytes that are not
    UTF-8 and a damaged archive are each a DataFormatError of one line naming the file and the line.
    Read one way per object: lines or `read`."""

    def __init__(self, path: str | Path, line_limit: int | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no data file at {self.path}")
        self.line_limit = LINE_LIMIT if line_limit is None else line_limit
        self.line = 0  # lines given so far
        self._f = {".gz": gzip.open, ".bz2": bz2.open}.get(self.path.suffix, open)(self.path, "rb")
        # bad bytes found per line
        decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self._text = io.IncrementalNewlineDecoder(decoder, translate=True)

    def __enter__(self) -> "DataFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def _piece(self) -> str | None:
        """The next piece of text (READ_BYTES of the
        file, decompressed, decoded); None at the end."""
        try:
            block = self._f.read(READ_BYTES)
        except (OSError, EOFError, zlib.error) as e:  # BadGzipFile, a cut-off or damaged archive
            raise DataFormatError(
                f"{self.path} could not be read after line {self.line} ({e}): a damaged or "
                f"cut-off {self.path.suffix or 'text'} file; download it again"
            ) from None
        text = self._text.decode(block, final=not block)
        return text if block or text else None

    def _check(self, text: str, first_line: int) -> str:
        if (bad := _NOT_UTF8.search(text)) is not None:
            line = first_line + text.count("\n", 0, bad.start())
            byte = ord(bad.group()) - 0xDC00
            raise DataFormatError(
                f"{self.path} line {line} is not UTF-8 text (a byte 0x{byte:02x}): is this a text "
                "or JSON-lines file? Data files are read as UTF-8"
            )
        return text

    def read(self, n: int | None = -1) -> str:
        """The first `n` characters (all of them for None
        or a negative n), read a piece at a time."""
        out, have = [], 0
        while n is None or n < 0 or have < n:
            if (piece := self._piece()) is None:
                break
            out.append(piece)
            have += len(piece)
        text = "".join(out)
        return self._check(text if n is None or n < 0 else text[:n], 1)

    def __iter__(self) -> Iterator[str]:
        buf, pos = "", 0  # buf[pos:]: text read and not yet given; never much more than one line
        while True:
            nl = buf.find("\n", pos)
            while nl == -1 and len(buf) - pos <= self.line_limit:
                if (piece := self._piece()) is None:
                    break
                buf, pos = buf[pos:] + piece, 0
                nl = buf.find("\n")
            end = len(buf) if nl == -1 else nl + 1
            if end - pos - (nl != -1) > self.line_limit:  # its characters, the line end not counted
                raise DataFormatError(
                    f"{self.path} line {self.line + 1} is longer than {self.line_limit:,} "
                    "characters: refused, nothing after it was read; is this a JSON-lines or "
                    "text file? (each line should hold one record)"
                )
            if end == pos:
                return
            line = self._check(buf[pos:end], self.line + 1)
            self.line, pos = self.line + 1, end
            yield line


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file (.gz and .bz2 too, decompressed as read: `DataFile`); a line
    that is not a JSON object (not JSON, nested too deep, not UTF-8, longer than LINE_LIMIT) is a
    `DataFormatError` naming the file and the line."""
    records = []
    with DataFile(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                records.append(json_object(line, path, i, "expected one JSON object per line"))
    return records


def json_object(line: str, path: Path | str, i: int, expected: str) -> dict:
    """The JSON object on line `i` of `path`; a DataFormatError naming them when the line is not
    JSON, nests too deep for the parser, or holds another kind of value."""
    rec = parse_json(line, f"{path} line {i}", f"; {expected}", DataFormatError)
    if not isinstance(rec, dict):
        raise DataFormatError(
            f"{path} line {i} is a JSON {type(rec).__name__}, not an object; {expected}"
        )
    return rec


def need_keys(rec: dict, keys: tuple[str, ...], path: Path, what: str) -> None:
    """Refuse a record that lacks one of `keys`, naming the file and the format it should be."""
    missing = [k for k in keys if k not in rec]
    if missing:
        raise DataFormatError(
            f"{path}: a record lacks {missing}; is this a {what} file? "
            f"Each line must be a JSON object with {', '.join(keys)}"
        )
