"""Batches reach a GPU through pinned memory as whole blocks: every tensor a batch source serves is contiguous
(a pinned strided view would still be copied through a pageable temporary, which does not overlap compute)."""

from __future__ import annotations

import numpy as np
import torch

from tinygpt.data.sampler import WindowSampler, batch_to_device, fixed_batches, pinned_batch
from tinygpt.finetune.instruct import build_instruct_data
from tinygpt.finetune.stdlib_instructions import stdlib_instructions
from tinygpt.model.tokenizer import train_bpe


def test_training_and_evaluation_batches_are_contiguous(shakespeare):
    tok = train_bpe([shakespeare[:50_000]], 300)
    ids = np.asarray(tok.encode(shakespeare[:50_000]), dtype=np.int64)
    x, y = WindowSampler(ids, 32, seed=0).next_batch(4)
    assert x.is_contiguous() and y.is_contiguous() and torch.equal(x[:, 1:], y[:, :-1])
    for xb, yb in fixed_batches(ids, 32, 3, 2):
        assert xb.is_contiguous() and yb.is_contiguous()
    records = stdlib_instructions(40)
    for pack in (False, True):
        data = build_instruct_data(records, tok, 512, pack=pack, val_fraction=0.1)
        assert all(t.is_contiguous() for t in data.train.next_batch(2))


def test_a_strided_view_is_pinned_as_a_contiguous_copy():
    w = torch.arange(40).view(4, 10)
    x, y = w[:, :-1], w[:, 1:]
    assert not x.is_contiguous()
    px, py = pinned_batch((x, y))
    assert px.is_contiguous() and py.is_contiguous()
    assert torch.equal(px, x) and torch.equal(py, y)
    if torch.cuda.is_available():
        assert px.is_pinned() and py.is_pinned()
        gx, gy = batch_to_device((x, y), torch.device("cuda"))
        assert torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y)
    cx, cy = batch_to_device((x, y), torch.device("cpu"))
    assert torch.equal(cx, x) and torch.equal(cy, y)
