"""Instruction records: read from a file, a saved data set or the Hub, checked one by one, and
turned into segments of text that do or do not carry loss (`record_segments`).

Three record formats are read: Alpaca (``instruction``, ``input``, ``output``), MBPP (``text``,
``code``, ``test_list``) and chat (``messages``: a list of ``{role, content}``). The prompt of an
Alpaca or MBPP record is `model.prompts.format_prompt`'s; a chat turns every assistant message into
loss. An error about a record names it: its index, and for a local file the file and line.
`finetune.instruct` tokenizes the segments into training rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tinygpt.core.datafiles import DataFile, DataFormatError
from tinygpt.core.files import parse_json
from tinygpt.core.paths import cache_root, is_sample, sample_path
from tinygpt.data.sources import DataError, hub_dataset
from tinygpt.finetune.stdlib_instructions import write_stdlib_instructions
from tinygpt.model.prompts import TEMPLATES, Segments, format_prompt

FORMATS = {
    "alpaca": ("instruction", "output"),
    "mbpp": ("code", "test_list"),
    "chat": ("messages",),
}
# Names a dropdown can offer; MBPP's training ids are 1-10 (prompt) and 511-1000 (validation, train)
DATASETS = {
    "code-alpaca-20k": "hf:sahil2801/CodeAlpaca-20k",
    "mbpp": "hf:google-research-datasets/mbpp:full@train+validation+prompt",
}
# MBPP's evaluation split: never trained on, so evaluation stays clean
MBPP_TEST_IDS = range(11, 511)
# the largest .json file of records read whole (a .jsonl file is read a line at a time)
JSON_FILE_LIMIT = 1 << 30


def mbpp_instruction(text: str, tests: Sequence[str]) -> str:
    """MBPP's usual prompt: the task and the asserts the code must pass."""
    return text.strip() + "\nYour code should pass these tests:\n" + "\n".join(tests)


# ----- reading ------------------------------------------------------------------------------------
class Records(list):
    """Records read from a local file, knowing where each came from (the file, and the line of a
    .jsonl file), so that an error about one names them."""

    def __init__(
        self, items: Sequence[dict], source: str | Path, lines: Sequence[int] | None = None
    ):
        super().__init__(items)
        self.source, self.lines = str(source), list(lines) if lines is not None else None

    def where(self, i: int) -> str:
        line = f" line {self.lines[i]}" if self.lines is not None and i < len(self.lines) else ""
        return f"{self.source}{line}: record {i}"


def _where(records: Sequence[Any], i: int) -> str:
    """How an error names record i: its file and line when known (`Records`), else its index."""
    return records.where(i) if isinstance(records, Records) else f"record {i}"


def _read_jsonl_records(p: Path) -> Records:
    """A .jsonl file's records, a line at a time (`core.datafiles.DataFile`: lines of at most 16 MB,
    UTF-8); any bad line is a DataError naming the file and the line."""
    items, lines = [], []
    try:
        with DataFile(p) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    items.append(json.loads(line))
                except ValueError as e:
                    raise DataError(f"{p} is not valid JSON lines: line {i}: {e}") from None
                except RecursionError:
                    raise DataError(
                        f"{p} is not valid JSON lines: line {i} nests too deep to read"
                    ) from None
                lines.append(i)
    except DataFormatError as e:
        raise DataError(str(e)) from None
    return Records(items, p, lines)


def _read_json_records(p: Path) -> Records:
    """A .json file of one list of records, read whole (at most JSON_FILE_LIMIT bytes); a file that
    is not UTF-8 JSON, nests too deep or holds something else is a DataError naming it."""
    size = p.stat().st_size
    if size > JSON_FILE_LIMIT:
        raise DataError(
            f"{p} holds {size:,} bytes, more than the {JSON_FILE_LIMIT:,} read of a .json file: "
            "write the records one per line as a .jsonl file, which is read a line at a time"
        )
    # outside run folders: the data file the user named, its size checked above
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{p} is not UTF-8 text (line {line}, byte {e.start}): is it a JSON file of records?"
        ) from None
    data = parse_json(text, str(p), ": is it a JSON file of records?", DataError)
    if not isinstance(data, list):
        raise DataError(f"{p} must hold a JSON list of records, got {type(data).__name__}")
    return Records(data, p)


def load_records(source: str, split: str = "train") -> list[dict]:
    """Records from a local .json / .jsonl file, a folder written by
    `datasets.save_to_disk`, or the Hugging Face Hub as ``hf:NAME[:CONFIG][@SPLIT]`` (a
    bare ``org/name`` that is not a path works too). A local file's records come as
    `Records`, so that every error about one names the file (and line). ``sample:mbpp``
    is the MBPP sample that ships with the package; ``builtin`` the standard library's
    short functions as instructions (`stdlib_instructions`: every machine has them)."""
    if source in ("builtin", "stdlib"):
        path = cache_root("data") / "stdlib_instructions.json"
        source = str(path if path.is_file() else write_stdlib_instructions(path))
    if is_sample(source):
        try:
            source = str(sample_path(source))
        except ValueError as e:
            raise DataError(str(e)) from None
    p = Path(source).expanduser()
    if not p.exists() and source in DATASETS:
        source = DATASETS[source]
    if p.is_file():
        return _read_jsonl_records(p) if p.suffix == ".jsonl" else _read_json_records(p)
    if p.is_dir() or source.startswith(("/", ".", "~")) or p.suffix in (".json", ".jsonl"):
        if not p.is_dir():
            raise DataError(f"data file {source!r} does not exist")
        return _hf_records(str(p), None, split, local=True)
    name, config, split = hub_dataset(source, split)
    return _hf_records(name, config, split or "train", local=False)


def _hf_records(name: str, config: str | None, split: str, local: bool) -> list[dict]:
    try:
        import datasets
    except ImportError as e:
        raise DataError("Hugging Face datasets need `pip install datasets`") from e
    try:
        ds = (
            datasets.load_from_disk(name)
            if local
            else datasets.load_dataset(name, config, split=split)
        )
    except Exception as e:  # network, unknown name, wrong split: all are the user's to fix
        where = "folder" if local else "Hub dataset"
        raise DataError(f"could not load {where} {name!r}: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{name} has no split {split!r}; it has {', '.join(ds)}")
        ds = ds[split]
    return [dict(r) for r in ds]


# ----- segments -----------------------------------------------------------------------------------
def detect_format(records: Sequence[dict]) -> str:
    """ "alpaca", "mbpp" or "chat", from the fields of the first record."""
    if not records:
        raise DataError("the data set has no records")
    first = records[0]
    if not isinstance(first, dict):
        raise DataError(
            f"{_where(records, 0)} is a {type(first).__name__}, not an object with fields"
        )
    for fmt, needed in (
        ("chat", ("messages",)),
        ("mbpp", ("text", "code")),
        ("mbpp", ("prompt", "code")),
        ("alpaca", ("instruction",)),
    ):
        if all(k in first for k in needed):
            return fmt
    raise DataError(
        f"{_where(records, 0)} has fields {sorted(first)}; expected Alpaca "
        "(instruction, input, output), MBPP (text, code, test_list) or chat (messages: "
        "[{role, content}])"
    )


def record_segments(
    records: Sequence[dict],
    fmt: str | None = None,
    template: str = "alpaca",
    chat_template: Any = None,
) -> tuple[list[Segments], str, int]:
    """(segments per kept record, format, records excluded: MBPP evaluation ids). Each record is
    checked: a missing or mistyped field fails naming the record's index and the field."""
    if template not in TEMPLATES:
        raise DataError(
            f"unknown prompt template {template!r}; choose one of {', '.join(TEMPLATES)}"
        )
    fmt = fmt or detect_format(records)
    if fmt not in FORMATS:
        raise DataError(f"unknown record format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out, excluded = [], 0
    for i, r in enumerate(records):
        at = _where(records, i)
        if not isinstance(r, dict):
            raise DataError(f"{at} is a {type(r).__name__}, not an object with fields")
        for k in FORMATS[fmt]:
            if r.get(k) is None:
                raise DataError(
                    f"{at} has no field {k!r} (its fields: {sorted(r)}); every {fmt} "
                    f"record needs {', '.join(FORMATS[fmt])}"
                )
        if fmt == "alpaca":
            _need_str(r, at, "instruction", "output", "input")
            prompt = format_prompt(r["instruction"], r.get("input") or "", template)
            out.append([(prompt, False), (r["output"], True), (None, True)])
        elif fmt == "mbpp":
            if r.get("task_id") in MBPP_TEST_IDS:
                excluded += 1
                continue
            text = r.get("text", r.get("prompt"))  # "prompt" in MBPP's sanitized config
            if text is None:
                raise DataError(
                    f"{at} has no field 'text' (its fields: {sorted(r)}); MBPP records "
                    "need text (or prompt), code, test_list"
                )
            _need_str(r, at, "text", "prompt", "code")
            tests = r["test_list"]
            if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
                raise DataError(f"{at}: field 'test_list' must be a list of assert lines")
            code = r["code"].replace("\r\n", "\n").strip()
            prompt = format_prompt(mbpp_instruction(text, r["test_list"]), "", template)
            out.append([(prompt, False), (code, True), (None, True)])
        else:
            out.append(_chat_segments(r["messages"], at, chat_template))
    return out, fmt, excluded


def _need_str(r: dict, at: str, *keys: str) -> None:
    for k in keys:
        if k in r and r[k] is not None and not isinstance(r[k], str):
            raise DataError(f"{at}: field {k!r} must be text, got {type(r[k]).__name__}")


def _chat_segments(messages: Any, at: str, chat_template: Any) -> Segments:
    """Loss on every assistant turn. With a tokenizer's chat template (e.g. Gemma's) the turns are
    cut out of renders of growing prefixes; otherwise a plain '### Role:' layout is used."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{at}: field 'messages' must be a non-empty list of {{role, content}}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{at}: message {j} needs the fields 'role' and 'content'")
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise DataError(
                f"{at}: message {j}'s role and content must be text, got "
                f"{type(m['role']).__name__} and {type(m['content']).__name__}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{at}: no message has role 'assistant', so nothing would be learned")
    segs: Segments = []
    if chat_template is not None:
        done = ""
        for j, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = chat_template(messages[:j], add_generation_prompt=True, tokenize=False)
            full = chat_template(messages[: j + 1], tokenize=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise DataError(
                    f"{at}: the tokenizer's chat template does not render turns as prefixes of "
                    "the conversation, so prompts cannot be masked; use a plain tokenizer"
                )
            segs += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
            done = full
        return segs + [(None, True)]
    pending = ""
    for m in messages:
        if m["role"] == "assistant":
            segs += [(pending + "### Assistant:\n", False), (m["content"], True), (None, True)]
            pending = "\n\n"
        else:
            pending += f"### {m['role'].capitalize()}:\n{m['content']}\n\n"
    return segs
