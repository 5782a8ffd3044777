"""Exact resume: what a checkpoint keeps beside the weights (`train_state_of`), how it comes back
(`load_train_state`), and which training settings may differ when it does (`resume_refusal`).
Everything is stored in a weights-only form (`torch.load(weights_only=True)` never runs code).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tinygpt.core.config import TrainConfig
from tinygpt.core.same_settings import config_differences
from tinygpt.train import distributed as dist_
from tinygpt.train.step import TrainStep

# Fields that may change between a run and its resumption (how long it runs, what it logs,
# evaluates, saves and samples, and how its steps are run); any other difference is refused.
RESUMABLE_CHANGES = frozenset(
    {"max_steps", "eval_every", "save_every", "log_every", "keep_last", "sample_every"}
    | {"eval_batches", "compile", "device", "loss"}
)


def train_state_of(
    ts: TrainStep, optimizer_state: dict, best_val_loss: float | None, run_info: dict
) -> dict[str, Any]:
    """A checkpoint's state.pt: everything `load_train_state` needs to go on exactly, plus the
    training configuration and world size it was written with (`resume_refusal` reads them)."""
    return {
        "step": ts.step,
        "optimizer": optimizer_state,
        "scaler": ts.scaler.state_dict(),
        "sampler": ts.train_source.state_dict(),
        "rng": rng_state(),
        "best_val_loss": best_val_loss,
        "train_config": ts.cfg.to_dict(),
        "world_size": ts.world_size,
        "run_info": run_info,
    }


def resume_refusal(path: Path, state: dict, cfg: TrainConfig) -> str | None:
    """Why the checkpoint at `path` (its state.pt: `state`) cannot be resumed with `cfg`, or None:
    a weights-only download has no optimizer state, and a training setting outside
    RESUMABLE_CHANGES must be the same as when the checkpoint was written."""
    if "optimizer" not in state:
        return (
            f"checkpoint {path} holds the weights only (a download, without "
            "state.pt): training cannot resume from it; copy the whole "
            "checkpoint from Drive, or use a new run folder"
        )
    diffs = config_differences(state.get("train_config", {}), cfg.to_dict(), RESUMABLE_CHANGES)
    if diffs:
        return (
            f"checkpoint {path} was written with a different training configuration:\n  "
            + "\n  ".join(diffs)
            + "\nresume with the same settings, or use a new run folder"
        )
    return None


def load_train_state(ts: TrainStep, model_sd: dict, state: dict, load_state_fn: Callable) -> None:
    """Bring back a checkpoint `resume_refusal` accepted (weights, optimizer, sampler, RNGs...)."""
    # What exact resume needs, each for its reason: the weights and the optimizer's moments (the
    # next update), the fp16 scaler's scale (the next step's overflow check), the sampler's
    # position (the next batch: the order itself follows from the seed, see WindowSampler), and
    # every RNG (dropout, sampling). The learning rate needs nothing of its own: lr_at sets it
    # from the step before every update.
    dist_.load_state(ts.model, ts.optimizer, model_sd, state["optimizer"], load_state_fn)
    ts.scaler.load_state_dict(state["scaler"])
    ts.train_source.load_state_dict(state["sampler"])  # the sampler's order goes on from here
    set_rng_state(state["rng"])
    ts.step = state["step"]


def rng_state() -> dict[str, Any]:
    """Every RNG's state in a weights-only form (tensors, numbers, strings, lists), so a checkpoint
    loads with `torch.load(weights_only=True)` and can never run code."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    s = {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict[str, Any]) -> None:
    py, npy = s["python"], s["numpy"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached"]))
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
