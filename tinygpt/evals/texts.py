"""Reading a text to evaluate on: a UTF-8 file (.txt, .gz, .bz2) read in bounded pieces, or a
Hugging Face data set, with a Hub error said as what works offline."""

from __future__ import annotations

import contextlib
from pathlib import Path

from tinygpt.core.config import DataConfig
from tinygpt.core.datafiles import DataFile, DataFormatError
from tinygpt.core.paths import is_hub
from tinygpt.data.sources import iter_documents

EVAL_TEXT_CHARS = 64 << 20  # the most characters of an evaluation text read without --max-chars


def read_text(path: str | Path, max_chars: int | None = None) -> str:
    """A UTF-8 text file (.txt, .gz or .bz2), at most `max_chars` characters of it, read a piece at
    a time (never more than that in memory; `DataFile`: a line over 16 MB, bytes that are not
    UTF-8 or a damaged archive are one line naming the file). Without `max_chars` a text over
    EVAL_TEXT_CHARS characters (a small archive can hold gigabytes) is refused in one line naming
    the file."""
    with DataFile(path) as f:
        if max_chars:
            return f.read(max_chars)
        text = f.read(EVAL_TEXT_CHARS + 1)
    if len(text) > EVAL_TEXT_CHARS:
        raise DataFormatError(
            f"{path} holds more than {EVAL_TEXT_CHARS:,} characters of text: refused, the rest was "
            f"not read; pass --max-chars N to score its first N characters"
        )
    return text


def load_eval_text(
    data: str | Path, max_chars: int | None = None, offline: str = "a text file"
) -> str:
    """A text to score: a file (.txt, .gz, .bz2), or a Hugging Face dataset
    (hf:NAME[:CONFIG][@SPLIT], or a save_to_disk folder) whose records are joined as they are
    (WikiText's records are its lines). `offline`: what to pass instead, said when the Hub cannot be
    reached."""
    if is_hub(data) or Path(data).is_dir():
        with from_hub(str(data), offline):
            return "".join(iter_documents(DataConfig(source=str(data), max_chars=max_chars)))
    return read_text(data, max_chars)


@contextlib.contextmanager
def from_hub(spec: str, offline: str):
    """Reading `spec` from the Hub: a network error becomes one line saying what works offline."""
    try:
        yield
    except OSError as e:  # ConnectionError and the Hub client's HTTP errors: say what works offline
        if not is_hub(spec):
            raise
        raise RuntimeError(
            f"could not read {spec} from the Hugging Face Hub ({e}); with no network, "
            f"pass a local file instead: {offline}"
        ) from e
