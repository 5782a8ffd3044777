"""Instruction data for finetuning: records, a prompt template, loss on the response only.

Three record formats are read: Alpaca (``instruction``, ``input``, ``output``), MBPP (``text``,
``code``, ``test_list``) and chat (``messages``: a list of ``{role, content}``). Every example
becomes token ids plus a flag per token saying whether it carries loss: prompt tokens and padding
get the target IGNORE_INDEX (-100), response tokens and the closing end-of-text get their id.
`InstructSource` serves batches in a seeded order whose position is part of every checkpoint.

Packing puts several whole examples in one training row. Each row then comes with position ids that
start again at 0 at every example: a transformers model (4.53 and later) reads those restarts as
record boundaries and keeps each example's attention inside itself, so a packed row gives the same
loss as its examples run one by one, without the padding.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from tinygpt.core.datafiles import DataFile, DataFormatError
from tinygpt.model.losses import IGNORE_INDEX
from tinygpt.train.data import DataError, hub_dataset

TEMPLATES: dict[str, tuple[str, str]] = {
    # (with input, without input); the response follows the template directly.
    "alpaca": (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"),
    "short": ("### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
              "### Instruction:\n{instruction}\n\n### Response:\n"),
}
FORMATS = {"alpaca": ("instruction", "output"), "mbpp": ("code", "test_list"), "chat": ("messages",)}
# Names a notebook dropdown can offer; MBPP's training ids are 1-10 (prompt) and 511-1000 (validation, train).
DATASETS = {"code-alpaca-20k": "hf:sahil2801/CodeAlpaca-20k",
            "mbpp": "hf:google-research-datasets/mbpp:full@train+validation+prompt"}
MBPP_TEST_IDS = range(11, 511)  # MBPP's evaluation split: never trained on, so evaluation stays clean
SHORTEST_BUCKET = 64  # unpacked batches are padded to a length bucket: a power of two from this up to seq_len


def bucket_length(n: int, seq_len: int) -> int:
    """The padded width of a batch whose longest row has n tokens: the smallest power of two >= n (at least
    SHORTEST_BUCKET), or seq_len. A few widths only, so a compiled step compiles once per bucket, not per length."""
    width = max(SHORTEST_BUCKET, 1 << max(0, n - 1).bit_length())
    return min(width, seq_len)


def length_buckets(seq_len: int) -> list[int]:
    """Every width `bucket_length` can give for this seq_len."""
    return sorted({bucket_length(n, seq_len) for n in [1, seq_len] + [2**k for k in range(seq_len.bit_length())]})


def format_prompt(instruction: str, input: str = "", template: str = "alpaca") -> str:
    """The prompt text for one instruction; the model's answer is expected right after it."""
    if template not in TEMPLATES:
        raise DataError(f"unknown prompt template {template!r}; choose one of {', '.join(TEMPLATES)}")
    with_input, without = TEMPLATES[template]
    if input and input.strip():
        return with_input.format(instruction=instruction.strip(), input=input.strip())
    return without.format(instruction=instruction.strip())


def mbpp_instruction(text: str, tests: Sequence[str]) -> str:
    """MBPP's usual prompt: the task and the asserts the code must pass."""
    return text.strip() + "\nYour code should pass these tests:\n" + "\n".join(tests)


# ----- records -----------------------------------------------------------------------------------
JSON_FILE_LIMIT = 1 << 30  # the largest .json file of records read whole (a .jsonl file is read a line at a time)


class Records(list):
    """Records read from a local file, knowing where each came from (the file, and the line of a .jsonl
    file), so that an error about one names them."""

    def __init__(self, items: Sequence[dict], source: str | Path, lines: Sequence[int] | None = None):
        super().__init__(items)
        self.source, self.lines = str(source), list(lines) if lines is not None else None

    def where(self, i: int) -> str:
        line = f" line {self.lines[i]}" if self.lines is not None and i < len(self.lines) else ""
        return f"{self.source}{line}: record {i}"


def _where(records: Sequence[Any], i: int) -> str:
    """How an error names record i: its file and line when known (`Records`), else its index."""
    return records.where(i) if isinstance(records, Records) else f"record {i}"


def _read_jsonl_records(p: Path) -> Records:
    """A .jsonl file's records, a line at a time (`core.datafiles.DataFile`: lines of at most 16 MB, UTF-8); any
    bad line is a DataError naming the file and the line."""
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
                    raise DataError(f"{p} is not valid JSON lines: line {i} nests too deep to read") from None
                lines.append(i)
    except DataFormatError as e:
        raise DataError(str(e)) from None
    return Records(items, p, lines)


def _read_json_records(p: Path) -> Records:
    """A .json file of one list of records, read whole (at most JSON_FILE_LIMIT bytes); a file that is not
    UTF-8 JSON, nests too deep or holds something else is a DataError naming it."""
    size = p.stat().st_size
    if size > JSON_FILE_LIMIT:
        raise DataError(f"{p} holds {size:,} bytes, more than the {JSON_FILE_LIMIT:,} read of a .json file: write "
                        "the records one per line as a .jsonl file, which is read a line at a time")
    data = p.read_bytes()  # outside run folders: the data file the user named, its size checked above
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{p} is not UTF-8 text (line {line}, byte {e.start}): is it a JSON file of records?") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise DataError(f"{p} is not valid JSON: {e}") from None
    except RecursionError:
        raise DataError(f"{p} nests JSON too deep to read: is it a JSON file of records?") from None
    if not isinstance(data, list):
        raise DataError(f"{p} must hold a JSON list of records, got {type(data).__name__}")
    return Records(data, p)


def load_records(source: str, split: str = "train") -> list[dict]:
    """Records from a local .json / .jsonl file, a folder written by `datasets.save_to_disk`, or the
    Hugging Face Hub as ``hf:NAME[:CONFIG][@SPLIT]`` (a bare ``org/name`` that is not a path works too).
    A local file's records come as `Records`, so that every error about one names the file (and line)."""
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
        ds = datasets.load_from_disk(name) if local else datasets.load_dataset(name, config, split=split)
    except Exception as e:  # network, unknown name, wrong split: all are the user's to fix
        where = "folder" if local else "Hub dataset"
        raise DataError(f"could not load {where} {name!r}: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{name} has no split {split!r}; it has {', '.join(ds)}")
        ds = ds[split]
    return [dict(r) for r in ds]


def detect_format(records: Sequence[dict]) -> str:
    """"alpaca", "mbpp" or "chat", from the fields of the first record."""
    if not records:
        raise DataError("the data set has no records")
    first = records[0]
    if not isinstance(first, dict):
        raise DataError(f"{_where(records, 0)} is a {type(first).__name__}, not an object with fields")
    for fmt, needed in (("chat", ("messages",)), ("mbpp", ("text", "code")), ("mbpp", ("prompt", "code")),
                        ("alpaca", ("instruction",))):
        if all(k in first for k in needed):
            return fmt
    raise DataError(f"{_where(records, 0)} has fields {sorted(first)}; expected Alpaca (instruction, input, output), "
                    "MBPP (text, code, test_list) or chat (messages: [{role, content}])")


Segments = list[tuple[str | None, bool]]  # (text, carries loss); text None: the eos token


def record_segments(records: Sequence[dict], fmt: str | None = None, template: str = "alpaca",
                    chat_template: Any = None) -> tuple[list[Segments], str, int]:
    """(segments per kept record, format, records excluded). Each record is checked: a missing or
    mistyped field fails naming the record's index and the field. MBPP evaluation ids are excluded."""
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
                raise DataError(f"{at} has no field {k!r} (its fields: {sorted(r)}); every {fmt} "
                                f"record needs {', '.join(FORMATS[fmt])}")
        if fmt == "alpaca":
            _need_str(r, at, "instruction", "output", "input")
            out.append([(format_prompt(r["instruction"], r.get("input") or "", template), False), (r["output"], True),
                        (None, True)])
        elif fmt == "mbpp":
            if r.get("task_id") in MBPP_TEST_IDS:
                excluded += 1
                continue
            text = r.get("text", r.get("prompt"))  # "prompt" in MBPP's sanitized config
            if text is None:
                raise DataError(f"{at} has no field 'text' (its fields: {sorted(r)}); MBPP records need "
                                "text (or prompt), code, test_list")
            _need_str(r, at, "text", "prompt", "code")
            if not isinstance(r["test_list"], list) or not all(isinstance(t, str) for t in r["test_list"]):
                raise DataError(f"{at}: field 'test_list' must be a list of assert lines")
            code = r["code"].replace("\r\n", "\n").strip()
            out.append([(format_prompt(mbpp_instruction(text, r["test_list"]), "", template), False), (code, True),
                        (None, True)])
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
            raise DataError(f"{at}: message {j}'s role and content must be text, got {type(m['role']).__name__} "
                            f"and {type(m['content']).__name__}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{at}: no message has role 'assistant', so nothing would be learned")
    segs: Segments = []
    if chat_template is not None:
        done = ""
        for j, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = chat_template(messages[:j], add_generation_prompt=True, tokenize=False)
            full = chat_template(messages[:j + 1], tokenize=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise DataError(f"{at}: the tokenizer's chat template does not render turns as prefixes "
                                "of the conversation, so prompts cannot be masked; use a plain tokenizer")
            segs += [(prompt[len(done):], False), (full[len(prompt):], True)]
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


# ----- tokens ------------------------------------------------------------------------------------
class Codec:
    """What this module needs of a tokenizer: a tinygpt `Tokenizer` or a transformers tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        if hasattr(tokenizer, "eot_id"):  # tinygpt: documents end with end-of-text, so it also starts one
            self.bos_id, self.eos_id = tokenizer.eot_id, tokenizer.eot_id
            self.encode_batch, self.chat_template = tokenizer.encode_batch, None
        else:
            self.bos_id, self.eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
            if self.eos_id is None:
                raise DataError("the tokenizer has no eos token, so a response cannot be ended")
            # verbose=False: no "sequence length is longer than the maximum" warning; the caller truncates
            # to its seq_len and reports the truncated examples itself
            self.encode_batch = lambda texts: tokenizer(list(texts), add_special_tokens=False,
                                                        verbose=False)["input_ids"]
            self.chat_template = tokenizer.apply_chat_template if getattr(tokenizer, "chat_template", None) else None
        self.pad_id = self.eos_id

    def encode_examples(self, segments: list[Segments]) -> list[tuple[list[int], list[bool]]]:
        """(ids, trained flags) per example: [bos] + segments, a None segment being the eos token."""
        flat = [t for segs in segments for t, _ in segs if t is not None]
        enc = iter(self.encode_batch(flat) if flat else [])
        out = []
        for segs in segments:
            ids, flags = ([self.bos_id], [False]) if self.bos_id is not None else ([], [])
            for text, trained in segs:
                piece = [self.eos_id] if text is None else next(enc)
                ids += piece
                flags += [trained] * len(piece)
            out.append((ids, flags))
        return out


@dataclass
class DataReport:
    """What happened to the records on their way to batches."""

    format: str
    records: int
    excluded: int  # MBPP evaluation ids left out
    train_examples: int
    val_examples: int
    truncated: int  # longer than seq_len + 1 tokens: the end of the response was cut (dropped ones included)
    dropped: int  # nothing of the response left after truncation
    sequences: int  # training rows after packing (= train_examples without packing)
    longest: int
    mean_tokens: float
    response_fraction: float  # of non-padding target tokens, the share that carries loss

    def to_dict(self) -> dict:
        return asdict(self)


Row = tuple[np.ndarray, np.ndarray]  # (x, y) of one training sequence


def _to_rows(examples: list[tuple[list[int], list[bool]]], seq_len: int,
             pack: bool) -> tuple[list[Row], list[np.ndarray]]:
    """(x, y) rows of at most seq_len positions, and each row's example lengths (in tokens); packing
    concatenates whole examples greedily."""
    groups: list[list[tuple[list[int], list[bool]]]] = []
    size = 0
    for ex in examples:
        if pack and groups and size + len(ex[0]) <= seq_len + 1:
            groups[-1].append(ex)
            size += len(ex[0])
        else:
            groups.append([ex])
            size = len(ex[0])
    rows, lengths = [], []
    for g in groups:
        ids = np.array([t for e in g for t in e[0]], dtype=np.int64)
        flags = np.array([f for e in g for f in e[1]], dtype=bool)
        rows.append((ids[:-1], np.where(flags[1:], ids[1:], IGNORE_INDEX)))
        lengths.append(np.array([len(e[0]) for e in g], dtype=np.int64))
    return rows, lengths


def record_positions(lengths: np.ndarray, width: int) -> np.ndarray:
    """Position ids of a packed row `width` wide: 0, 1, ... within each example, and the padding after
    the last one counted as one more (it starts at 0 too, so it is a record of its own)."""
    pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])[:width]  # x drops the last token
    used = min(len(pos), int(lengths.sum()) - 1)
    return np.concatenate([pos[:used], np.arange(width - used, dtype=np.int64)])


def _collate(rows: Sequence[Row], pad_id: int, seq_len: int,
             lengths: Sequence[np.ndarray] | None = None) -> tuple[torch.Tensor, ...]:
    """Right padding (pad id in x, IGNORE_INDEX in y): causal attention never looks right, so padding
    changes nothing for the real tokens and needs no attention mask. Packed rows (`lengths` given) are
    padded to seq_len, one shape for every batch (one compiled graph), and come with their position ids;
    other rows to their length bucket (`bucket_length`: one compiled graph per bucket)."""
    T = seq_len if lengths is not None else bucket_length(max(len(x) for x, _ in rows), seq_len)
    x = np.full((len(rows), T), pad_id, dtype=np.int64)
    y = np.full((len(rows), T), IGNORE_INDEX, dtype=np.int64)
    for i, (a, b) in enumerate(rows):
        x[i, :len(a)], y[i, :len(b)] = a, b
    if lengths is None:
        return torch.from_numpy(x), torch.from_numpy(y)
    pos = np.stack([record_positions(n, T) for n in lengths])
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(pos)


class InstructSource:
    """Training rows in a fresh seeded permutation each epoch; (epoch, index) is the whole state.
    Each call takes the next batch_size * world_size rows of the global order and returns one rank's
    share, so the order is the same at any world size with the same global batch. With `lengths`
    (packed rows: each row's example lengths) a batch is (x, y, position ids), else (x, y)."""

    def __init__(self, rows: list[Row], seq_len: int, pad_id: int, seed: int,
                 lengths: list[np.ndarray] | None = None):
        if not rows:
            raise DataError("no training examples are left")
        self.rows, self.seq_len, self.pad_id, self.seed = rows, seq_len, pad_id, seed
        self.lengths = lengths
        self.served_tokens = 0  # real (not padding) input tokens of the batches served: a statistic, not state
        h = hashlib.sha256()
        for x, y in rows:
            h.update(x.tobytes() + y.tobytes())
        self.fingerprint = h.hexdigest()[:16]
        self.epoch, self.index = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def _take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self._perm_epoch != self.epoch:
                self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))
                self._perm_epoch = self.epoch
            k = min(n - len(out), len(self.rows) - self.index)
            out += self._perm[self.index:self.index + k].tolist()
            self.index += k
            if self.index == len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    @property
    def packed(self) -> bool:
        return self.lengths is not None

    def next_batch(self, batch_size: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, ...]:
        picked = self._take(batch_size * world_size)[rank * batch_size:(rank + 1) * batch_size]
        lengths = [self.lengths[i] for i in picked] if self.lengths is not None else None
        self.served_tokens += sum(len(self.rows[i][0]) for i in picked)
        return _collate([self.rows[i] for i in picked], self.pad_id, self.seq_len, lengths)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "rows": len(self.rows),
                "fingerprint": self.fingerprint}

    def load_state_dict(self, s: dict) -> None:
        if (s["seed"], s["rows"], s["fingerprint"]) != (self.seed, len(self.rows), self.fingerprint):
            raise DataError(f"the checkpoint's data position is for {s['rows']} rows (fingerprint "
                            f"{s['fingerprint']}, seed {s['seed']}), this data gives {len(self.rows)} rows "
                            f"({self.fingerprint}, seed {self.seed}): resume with the same data, tokenizer and "
                            "recipe, or start a new run folder")
        self.epoch, self.index = s["epoch"], s["index"]


@dataclass
class InstructData:
    train: InstructSource
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    report: DataReport
    template: str = "alpaca"


def build_instruct_data(records: Sequence[dict] | str, tokenizer: Any, seq_len: int, *, template: str = "alpaca",
                        fmt: str | None = None, pack: bool = False, val_fraction: float = 0.05, seed: int = 1337,
                        val_batch_size: int = 8, eval_batches: int = 8, split: str = "train") -> InstructData:
    """Records (or a source for `load_records`) to a training source and fixed validation batches.
    A record is split off for validation by a seeded shuffle. `pack` packs the training rows only: the
    validation batches are the same padded ones either way, so validation losses compare across runs."""
    if isinstance(records, str):
        records = load_records(records, split)
    if not 0 <= val_fraction < 0.5:
        raise DataError(f"val_fraction must be in [0, 0.5), got {val_fraction}")
    codec = Codec(tokenizer)
    segments, fmt, excluded = record_segments(records, fmt, template, codec.chat_template)
    if not segments:
        raise DataError(f"no records are left of {len(records)} ({excluded} were MBPP evaluation ids)")
    examples = codec.encode_examples(segments)
    lengths = [len(ids) for ids, _ in examples]
    too_long = [n > seq_len + 1 for n in lengths]
    if all(too_long):
        raise DataError(f"every one of the {len(examples)} examples is longer than seq_len {seq_len} "
                        f"(the shortest has {min(lengths)} tokens, the longest {max(lengths)}): raise seq_len")
    kept, dropped = [], 0
    for (ids, flags), long in zip(examples, too_long):
        if long:
            ids, flags = ids[:seq_len + 1], flags[:seq_len + 1]
            if not any(flags[1:]):
                dropped += 1
                continue
        kept.append((ids, flags))
    order = np.random.default_rng([seed, 7]).permutation(len(kept))
    n_val = int(round(len(kept) * val_fraction)) if val_fraction > 0 else 0
    n_val = min(max(n_val, 1 if val_fraction > 0 else 0), len(kept) - 1)
    val_ex = [kept[i] for i in sorted(order[:n_val])]
    train_ex = [kept[i] for i in sorted(order[n_val:])]
    train_rows, train_lengths = _to_rows(train_ex, seq_len, pack)
    val_rows = _to_rows(val_ex, seq_len, False)[0][: val_batch_size * eval_batches]
    val_batches = [_collate(val_rows[i:i + val_batch_size], codec.pad_id, seq_len)
                   for i in range(0, len(val_rows), val_batch_size)]
    n_target = sum(len(x) for x, _ in train_rows)
    n_loss = sum(int((y != IGNORE_INDEX).sum()) for _, y in train_rows)
    report = DataReport(fmt, len(records), excluded, len(train_ex), len(val_ex), sum(too_long), dropped,
                        len(train_rows), max(lengths), float(np.mean(lengths)), n_loss / max(n_target, 1))
    return InstructData(InstructSource(train_rows, seq_len, codec.pad_id, seed, train_lengths if pack else None),
                        val_batches, report, template)
