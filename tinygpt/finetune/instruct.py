"""Instruction data as training batches: records (`finetune.records`) tokenized, with the loss on
the response only, packed or padded, and batched.

Every example becomes token ids plus a flag per token saying whether it carries loss: prompt tokens
and padding get the target IGNORE_INDEX (-100), response tokens and the closing end-of-text get
their id. `InstructSource` serves batches in a seeded order whose position is part of every
checkpoint.

Packing puts several whole examples in one training row. Each row then comes with position ids that
start again at 0 at every example: a transformers model (4.53 and later) reads those restarts as
record boundaries and keeps each example's attention inside itself, so a packed row gives the same
loss as its examples run one by one, without the padding."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch

from tinygpt.data.sources import DataError
from tinygpt.finetune.records import load_records, record_segments
from tinygpt.model.losses import IGNORE_INDEX
from tinygpt.model.prompts import Codec

# unpacked batches are padded to a length bucket: a power of two from this up to seq_len
SHORTEST_BUCKET = 64


def bucket_length(n: int, seq_len: int) -> int:
    """The padded width of a batch whose longest row has n tokens: the smallest power of two >= n
    (at least SHORTEST_BUCKET), or seq_len. A few widths only, so a compiled step compiles once per
    bucket, not per length."""
    width = max(SHORTEST_BUCKET, 1 << max(0, n - 1).bit_length())
    return min(width, seq_len)


# ----- tokens ------------------------------------------------------------------------------------
@dataclass
class DataReport:
    """What happened to the records on their way to batches."""

    format: str
    records: int
    excluded: int  # MBPP evaluation ids left out
    train_examples: int
    val_examples: int
    # longer than seq_len + 1 tokens: the end of the response was cut (dropped ones included)
    truncated: int
    dropped: int  # nothing of the response left after truncation
    sequences: int  # training rows after packing (= train_examples without packing)
    longest: int
    mean_tokens: float
    response_fraction: float  # of non-padding target tokens, the share that carries loss

    def to_dict(self) -> dict:
        return asdict(self)


Row = tuple[np.ndarray, np.ndarray]  # (x, y) of one training sequence
Example = tuple[list[int], list[bool]]  # (token ids, whether each carries loss)


def _to_rows(
    examples: list[Example], seq_len: int, pack: bool
) -> tuple[list[Row], list[np.ndarray]]:
    """(x, y) rows of at most seq_len positions, and each row's example lengths (in tokens); packing
    concatenates whole examples greedily."""
    groups: list[list[Example]] = []
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
    """Position ids of a packed row `width` wide: 0, 1, ... within each example, and the padding
    after the last one counted as one more (it starts at 0 too, so it is a record of its own)."""
    # x drops the last token
    pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])[:width]
    used = min(len(pos), int(lengths.sum()) - 1)
    return np.concatenate([pos[:used], np.arange(width - used, dtype=np.int64)])


def _collate(
    rows: Sequence[Row], pad_id: int, seq_len: int, lengths: Sequence[np.ndarray] | None = None
) -> tuple[torch.Tensor, ...]:
    """Right padding (pad id in x, IGNORE_INDEX in y): causal attention never looks right, so
    padding changes nothing for the real tokens and needs no mask. Packed rows (`lengths` given) are
    padded to seq_len, one shape for every batch (one compiled graph), with their position ids;
    other rows to their length bucket (`bucket_length`: a graph per bucket)."""
    T = seq_len if lengths is not None else bucket_length(max(len(x) for x, _ in rows), seq_len)
    x = np.full((len(rows), T), pad_id, dtype=np.int64)
    y = np.full((len(rows), T), IGNORE_INDEX, dtype=np.int64)
    for i, (a, b) in enumerate(rows):
        x[i, : len(a)], y[i, : len(b)] = a, b
    if lengths is None:
        return torch.from_numpy(x), torch.from_numpy(y)
    pos = np.stack([record_positions(n, T) for n in lengths])
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(pos)


class InstructSource:
    """Training rows in a fresh seeded permutation each epoch; (epoch, index) is the whole state.
    Each call takes the next batch_size * world_size rows of the global order and returns one rank's
    share, so the order is the same at any world size with the same global batch. With `lengths`
    (packed rows: each row's example lengths) a batch is (x, y, position ids), else (x, y)."""

    def __init__(
        self,
        rows: list[Row],
        seq_len: int,
        pad_id: int,
        seed: int,
        lengths: list[np.ndarray] | None = None,
    ):
        if not rows:
            raise DataError("no training examples are left")
        self.rows, self.seq_len, self.pad_id, self.seed = rows, seq_len, pad_id, seed
        self.lengths = lengths
        # real (not padding) input tokens of the batches served: a statistic, not state
        self.served_tokens = 0
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
                rng = np.random.default_rng([self.seed, self.epoch])
                self._perm = rng.permutation(len(self.rows))
                self._perm_epoch = self.epoch
            k = min(n - len(out), len(self.rows) - self.index)
            out += self._perm[self.index : self.index + k].tolist()
            self.index += k
            if self.index == len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    @property
    def packed(self) -> bool:
        return self.lengths is not None

    def next_batch(
        self, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, ...]:
        picked = self._take(batch_size * world_size)[rank * batch_size : (rank + 1) * batch_size]
        lengths = [self.lengths[i] for i in picked] if self.lengths is not None else None
        self.served_tokens += sum(len(self.rows[i][0]) for i in picked)
        return _collate([self.rows[i] for i in picked], self.pad_id, self.seq_len, lengths)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "rows": len(self.rows),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, s: dict) -> None:
        mine = self.state_dict()
        if any(s[k] != mine[k] for k in ("seed", "rows", "fingerprint")):
            raise DataError(
                f"the checkpoint's data position is for {s['rows']} rows (fingerprint "
                f"{s['fingerprint']}, seed {s['seed']}), this data gives {len(self.rows)} rows "
                f"({self.fingerprint}, seed {self.seed}): resume with the same data, tokenizer and "
                "recipe, or start a new run folder"
            )
        self.epoch, self.index = s["epoch"], s["index"]


@dataclass
class InstructData:
    train: InstructSource
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    report: DataReport
    template: str = "alpaca"


def _truncate_examples(examples: list[Example], seq_len: int) -> tuple[list[Example], int, int]:
    """The examples cut to seq_len + 1 tokens, in their order, the number cut and the number
    dropped. An example whose cut leaves no response token carrying loss (no flag after the first
    token) is dropped: it would train on nothing. Raises DataError when every example is too long."""
    lengths = [len(ids) for ids, _ in examples]
    too_long = [n > seq_len + 1 for n in lengths]
    if all(too_long):
        raise DataError(
            f"every one of the {len(examples)} examples is longer than seq_len {seq_len} "
            f"(the shortest has {min(lengths)} tokens, the longest {max(lengths)}): raise seq_len"
        )
    kept, dropped = [], 0
    for (ids, flags), long in zip(examples, too_long):
        if long:
            ids, flags = ids[: seq_len + 1], flags[: seq_len + 1]
            if not any(flags[1:]):
                dropped += 1
                continue
        kept.append((ids, flags))
    return kept, sum(too_long), dropped


def _split_validation(
    kept: list[Example], val_fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """(train, validation) examples by a shuffle seeded with (seed, 7). Validation gets
    round(len * val_fraction) examples, at least one when val_fraction > 0, and training keeps at
    least one; both keep the examples' original order."""
    order = np.random.default_rng([seed, 7]).permutation(len(kept))
    n_val = int(round(len(kept) * val_fraction)) if val_fraction > 0 else 0
    n_val = min(max(n_val, 1 if val_fraction > 0 else 0), len(kept) - 1)
    val_ex = [kept[i] for i in sorted(order[:n_val])]
    train_ex = [kept[i] for i in sorted(order[n_val:])]
    return train_ex, val_ex


def _val_batches(
    val_ex: list[Example], seq_len: int, pad_id: int, val_batch_size: int, eval_batches: int
) -> list[tuple[torch.Tensor, ...]]:
    """At most eval_batches padded, unpacked batches of val_batch_size rows: the same batches
    whether training packs or not, so validation losses compare across runs."""
    val_rows = _to_rows(val_ex, seq_len, False)[0][: val_batch_size * eval_batches]
    return [
        _collate(val_rows[i : i + val_batch_size], pad_id, seq_len)
        for i in range(0, len(val_rows), val_batch_size)
    ]


def build_instruct_data(
    records: Sequence[dict] | str,
    tokenizer: Any,
    seq_len: int,
    *,
    template: str = "alpaca",
    fmt: str | None = None,
    pack: bool = False,
    val_fraction: float = 0.05,
    seed: int = 1337,
    val_batch_size: int = 8,
    eval_batches: int = 8,
    split: str = "train",
) -> InstructData:
    """Records (or a source for `load_records`) to a training source and fixed validation batches,
    split off by a seeded shuffle. `pack` packs the training rows only: the validation batches are
    the same padded ones either way, so validation losses compare across runs."""
    if isinstance(records, str):
        records = load_records(records, split)
    if not 0 <= val_fraction < 0.5:
        raise DataError(f"val_fraction must be in [0, 0.5), got {val_fraction}")
    codec = Codec(tokenizer)
    segments, fmt, excluded = record_segments(records, fmt, template, codec.chat_template)
    if not segments:
        raise DataError(
            f"no records are left of {len(records)} ({excluded} were MBPP evaluation ids)"
        )
    examples = codec.encode_examples(segments)
    lengths = [len(ids) for ids, _ in examples]
    kept, truncated, dropped = _truncate_examples(examples, seq_len)
    train_ex, val_ex = _split_validation(kept, val_fraction, seed)
    train_rows, train_lengths = _to_rows(train_ex, seq_len, pack)
    val_batches = _val_batches(val_ex, seq_len, codec.pad_id, val_batch_size, eval_batches)
    n_target = sum(len(x) for x, _ in train_rows)
    n_loss = sum(int((y != IGNORE_INDEX).sum()) for _, y in train_rows)
    report = DataReport(
        fmt,
        len(records),
        excluded,
        len(train_ex),
        len(val_ex),
        truncated,
        dropped,
        len(train_rows),
        max(lengths),
        float(np.mean(lengths)),
        n_loss / max(n_target, 1),
    )
    return InstructData(
        InstructSource(train_rows, seq_len, codec.pad_id, seed, train_lengths if pack else None),
        val_batches,
        report,
        template,
    )
