"""Training windows from token shards, and the fixed evaluation batches.

The data order is a function of (seed, seq_len, the shards' content) only: shards are visited in
index order, the windows of shard s in epoch e in the permutation seeded by (seed, e, s). The
position (epoch, shard, index) is the sampler's whole state, stored in every checkpoint, so a run
resumes with the same order however fast tokenization ran before or after the interruption.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from tinygpt.data.shards import TokenShards
from tinygpt.data.sources import DataError
from tinygpt.model.losses import IGNORE_INDEX
from tinygpt.model.masks import document_ids


class WindowSampler:
    """Windows of seq_len + 1 tokens at multiples of seq_len inside each shard. Each call takes the
    next batch_size * world_size windows of the global order and returns one rank's share, so a
    checkpoint resumes with the same data order at any world size with the same global batch.
    Asking for a shard that is still being tokenized waits for it. With `eot_id` (document masking,
    `TrainConfig.doc_mask`) a batch also carries each token's document id (`document_ids`).

    A first shard too short for one window is refused here when it is written already, else at the
    first batch: made before the first shard of a stream is written, the sampler does not wait for
    it, so that the model can compile meanwhile (`TrainStep.compile_ahead`)."""

    def __init__(
        self, tokens: TokenShards | np.ndarray, seq_len: int, seed: int, eot_id: int | None = None
    ):
        self.shards = TokenShards.from_array(tokens) if isinstance(tokens, np.ndarray) else tokens
        self.seq_len, self.seed, self.eot_id = seq_len, seed, eot_id
        self._first_checked = False
        if self.shards.written(0):
            self.check_first_shard()
        self.epoch, self.shard, self.index = 0, 0, 0
        self._perm_key: tuple[int, int] | None = None
        self._perm = np.empty(0, dtype=np.int64)

    def check_first_shard(self) -> None:
        """Refuse a first shard too short for one window (waiting for it); once."""
        if self._first_checked:
            return
        first = self.shards.shard(0)  # waits for the first shard of a stream
        if first is None or self._n_windows(first) < 1:
            n = 0 if first is None else len(first)
            raise DataError(
                f"the training split has {n} tokens, fewer than one window of {self.seq_len + 1}: "
                "use more text or a shorter seq_len"
            )
        self._first_checked = True

    def _n_windows(self, arr: np.ndarray) -> int:
        return (len(arr) - 1) // self.seq_len

    def _order(self, n_windows: int) -> np.ndarray:
        # Each (epoch, shard) has its own generator, seeded by (seed, epoch, shard), instead of one
        # RNG that runs on through the run: the order of a shard never depends on what was drawn
        # before it, so the position (epoch, shard, index) alone brings the order back on resume (no
        # RNG state to save), and a shard the tokenizer writes later is ordered the same as if it
        # had been there from the start.
        if self._perm_key != (self.epoch, self.shard):
            rng = np.random.default_rng([self.seed, self.epoch, self.shard])
            self._perm, self._perm_key = rng.permutation(n_windows), (self.epoch, self.shard)
        return self._perm

    def _take(self, n: int) -> list[tuple[np.ndarray, int]]:
        """The next n windows of the global order, as (shard array, first token)."""
        self.check_first_shard()
        out: list[tuple[np.ndarray, int]] = []
        while len(out) < n:
            arr = self.shards.shard(self.shard)
            if arr is None:  # past the last shard: the next epoch
                self.epoch, self.shard, self.index = self.epoch + 1, 0, 0
                continue
            n_windows = self._n_windows(arr)
            if self.index >= n_windows:
                self.shard, self.index = self.shard + 1, 0
                continue
            k = min(n - len(out), n_windows - self.index)
            out += [
                (arr, int(w) * self.seq_len)
                for w in self._order(n_windows)[self.index : self.index + k]
            ]
            self.index += k
        return out

    def next_batch(
        self, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, ...]:
        # every rank takes the whole global batch's windows and keeps its slice: all ranks stay at
        # the same position, which is why one saved position resumes at any world size
        windows = self._take(batch_size * world_size)[rank * batch_size : (rank + 1) * batch_size]
        x, y = _inputs_targets([a[s : s + self.seq_len + 1] for a, s in windows])
        return (x, y) if self.eot_id is None else (x, y, document_ids(x, self.eot_id))

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "shard": self.shard,
            "index": self.index,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "data": self.shards.fingerprint,
        }

    def load_state_dict(self, s: dict) -> None:
        if "shard" not in s:
            raise DataError(
                "this checkpoint's data position was written by an older tinygpt (one token file, "
                "not shards) and cannot continue the same data order: start a new run folder"
            )
        mine = (self.seq_len, self.seed, self.shards.fingerprint)
        if (s["seq_len"], s["seed"], s["data"]) != mine:
            raise DataError(
                f"sampler state is for seq_len={s['seq_len']}, seed {s['seed']}, data {s['data']}; "
                f"this run has seq_len={mine[0]}, seed {mine[1]}, data {mine[2]}: resume with the "
                "same data and recipe, or start a new run"
            )
        self.epoch, self.shard, self.index = s["epoch"], s["shard"], s["index"]


def _inputs_targets(windows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of seq_len + 1 tokens as inputs and targets, each a copy with the plain strides of
    its shape: views would be pinned and copied strided, and a one-row view counts as contiguous
    with its window's row stride (seq_len + 1), which a compiled graph guards on (a batch of zeros
    made ahead, `TrainStep.compile_ahead`, would not match it)."""
    w = torch.from_numpy(np.stack([np.asarray(a, dtype=np.int64) for a in windows]))
    plain = torch.contiguous_format
    return w[:, :-1].clone(memory_format=plain), w[:, 1:].clone(memory_format=plain)


def fixed_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evaluation batches: the same evenly spaced windows every time, so val losses compare. Every
    batch has batch_size rows (one shape: a compiled model never recompiles for a short last
    batch); padding rows have IGNORE_INDEX targets, so they count for nothing."""
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise DataError(
            f"the validation split has {len(tokens)} tokens, fewer than one window of "
            f"{seq_len + 1}: use more text, a larger val_fraction or a shorter seq_len"
        )
    total = min(n_windows, batch_size * n_batches)
    starts = np.linspace(0, n_windows - 1, total).astype(np.int64) * seq_len
    x, y = _inputs_targets([tokens[s : s + seq_len + 1] for s in starts])
    pad = -total % batch_size
    if pad:
        x = torch.cat([x, torch.zeros(pad, seq_len, dtype=x.dtype)])
        y = torch.cat([y, torch.full((pad, seq_len), IGNORE_INDEX, dtype=y.dtype)])
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


def pinned_batch(
    tensors: tuple[torch.Tensor, ...] | list[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """A batch ready for an asynchronous copy to a GPU: each tensor contiguous, then in pinned
    memory (where CUDA exists). A pinned strided view (`w[:, :-1]`) would still go through a
    pageable temporary, and a copy from pageable memory does not overlap compute."""
    out = tuple(t.contiguous() for t in tensors)
    return tuple(t.pin_memory() for t in out) if torch.cuda.is_available() else out


def batch_to_device(
    tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """A batch on `device`; to a GPU through pinned memory, without waiting for
    the copy. Every dimension is marked static for the compiler: a batch of
    another shape (a finetuning length bucket, a probe's micro-batch) gets a graph
    of its own instead of turning the first graph into a dynamic-shape one."""
    if device.type == "cuda":
        out = tuple(t.to(device, non_blocking=True) for t in pinned_batch(tensors))
    else:
        out = tuple(t.to(device) for t in tensors)
    # torch.compile imports it: a process that never does needs no mark
    if "torch._dynamo" in sys.modules:
        for t in out:
            torch._dynamo.mark_static(t)
    return out
