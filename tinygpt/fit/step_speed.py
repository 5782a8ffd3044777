"""The trainer's own optimizer step, timed: what the probe ranks micro-batches by and the size
planner ranks rungs by. Run eagerly (nothing compiled) on random tokens, writing nothing."""

from __future__ import annotations

import dataclasses
import gc
import time

import torch

from tinygpt.core.precision import resolve_device
from tinygpt.core.recipes import Recipe
from tinygpt.fit.trials import sync
from tinygpt.model.gpt import GPT
from tinygpt.train.step import TrainStep

# optimizer steps timed (median) after warm-up ones
SPEED_STEPS, SPEED_WARMUP = 8, 4


class RandomBatches:
    """Batches of full rows of random tokens for a `TrainStep` to time (nothing resumes it); its own
    generator leaves the caller's random state alone. `served_tokens` counts what it served."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0):
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.served_tokens = 0

    def next_batch(
        self, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(self.vocab_size, (batch_size, self.seq_len + 1), generator=self.generator)
        self.served_tokens += batch_size * self.seq_len
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def trainer_speed(
    recipe: Recipe,
    device: str | torch.device = "auto",
    steps: int = SPEED_STEPS,
    warmup: int = SPEED_WARMUP,
) -> float:
    """Tokens/s of the trainer's own optimizer step for this recipe, the median of `steps` after
    `warmup`, eagerly (a compile per timing cost more than the timings). Nothing is written: the
    trainer is stepped, never fitted."""
    dev = resolve_device(str(device))
    t = dataclasses.replace(recipe.train, device=str(dev), compile="off")
    times = []
    try:
        # the caller's RNG stays as it was
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(0)
            batches = RandomBatches(recipe.model.vocab_size, t.seq_len)
            step = TrainStep(GPT(dataclasses.replace(recipe.model)), t, batches)
            for _ in range(warmup + steps):
                sync(dev)
                t0 = time.perf_counter()
                step.optimizer_step()
                sync(dev)
                times.append(time.perf_counter() - t0)
            del step
    finally:  # an out-of-memory error included: the memory goes
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return t.tokens_per_step / sorted(times[warmup:])[len(times[warmup:]) // 2]
