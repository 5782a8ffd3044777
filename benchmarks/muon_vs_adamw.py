"""Validation loss of AdamW vs Muon (+AdamW) at an equal token budget, on Tiny Shakespeare.

    python benchmarks/muon_vs_adamw.py --size cpu --steps 300 --lr 2e-3 --muon-lr-scales 0.5 1 2 4

Every run sees the same batches in the same order from the same initial weights; only the
optimizer differs. The schedule is the trainer's (`lr_at`: warmup, then cosine to min_lr). The rows go to a
dated file in benchmarks/results/ (`--results`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import results_file
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinygpt.core.config import TrainConfig  # noqa: E402
from tinygpt.core.recipes import model_config  # noqa: E402
from tinygpt.data.sampler import fixed_batches  # noqa: E402
from tinygpt.model.gpt import GPT  # noqa: E402
from tinygpt.model.tokenizer import train_bpe  # noqa: E402
from tinygpt.train.optim import build_optimizer  # noqa: E402
from tinygpt.train.step import lr_at  # noqa: E402

DATA = Path(
    os.environ.get("TINYGPT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)


def tokens(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    text = (DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")
    tok = train_bpe([text], vocab_size)
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    split = int(0.9 * len(ids))
    return ids[:split], ids[split:]


@torch.no_grad()
def evaluate(model: GPT, batches) -> float:
    model.eval()
    total = sum(model(x, y, reduction="sum").item() for x, y in batches)
    model.train()
    return total / sum(y.numel() for _, y in batches)


def run(args, optimizer: str, lr_scale: float, train: np.ndarray, val_batches) -> dict:
    torch.manual_seed(0)
    model = GPT(model_config(args.size, vocab_size=args.vocab_size, max_seq_len=args.seq_len))
    cfg = TrainConfig(
        micro_batch_size=args.batch,
        seq_len=args.seq_len,
        max_steps=args.steps,
        lr=args.lr,
        min_lr=args.lr / 10,
        warmup_steps=args.steps // 10,
        optimizer=optimizer,
    )
    opt = build_optimizer(model, cfg, "cpu", muon_lr_scale=lr_scale)
    gen = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg) * g.get("lr_scale", 1.0)
        starts = torch.randint(
            0, len(train) - args.seq_len - 1, (args.batch,), generator=gen
        ).numpy()
        w = torch.from_numpy(np.stack([train[s : s + args.seq_len + 1] for s in starts]))
        loss = model(w[:, :-1], w[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "optimizer": optimizer,
        "muon_lr_scale": lr_scale if optimizer == "muon" else None,
        "train_loss_last": round(loss.item(), 4),
        "val_loss": round(evaluate(model, val_batches), 4),
        "time_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="tiny")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--muon-lr-scales", type=float, nargs="+", default=[1.0])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", help="also write the rows here")
    results_file.add_option(p)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    train, val = tokens(args.vocab_size)
    val_batches = fixed_batches(val, args.seq_len, args.batch, 8)
    rows = [run(args, "adamw", 1.0, train, val_batches)]
    rows += [run(args, "muon", s, train, val_batches) for s in args.muon_lr_scales]
    setting = f"{args.size} model, {args.steps} steps x {args.batch} x {args.seq_len} tokens, lr {args.lr}"
    print(setting)
    print(
        f"{'optimizer':<10} {'muon lr_scale':>13} {'train loss':>10} {'val loss':>9} {'time s':>7}"
    )
    for r in rows:
        scale = "-" if r["muon_lr_scale"] is None else f"{r['muon_lr_scale']:g}"
        print(
            f"{r['optimizer']:<10} {scale:>13} {r['train_loss_last']:>10.4f} {r['val_loss']:>9.4f} {r['time_s']:>7.1f}"
        )
    results_file.write(
        args.results,
        __file__,
        "muon-vs-adamw",
        f"Muon against AdamW at an equal token budget: {setting}",
        f"Tiny Shakespeare, vocabulary {args.vocab_size}.\n\n" + results_file.table(rows),
        reference="AdamW on the same batches from the same weights (the adamw row)",
    )
    if args.json:
        doc = {"args": vars(args), "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    main()
