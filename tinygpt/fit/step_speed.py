"""The trainer's own optimizer step, timed: what the probe ranks micro-batches by and the size
planner ranks rungs by. Run eagerly (nothing compiled) on random tokens, writing nothing; scaled by
one measured factor (`compiled_speedup`) where the run will compile."""

from __future__ import annotations

import dataclasses
import gc
import time

import torch

from tinygpt.core.precision import compiles, resolve_device
from tinygpt.core.recipes import Recipe
from tinygpt.fit.trials import sync
from tinygpt.model.gpt import GPT
from tinygpt.train.step import TrainStep

# optimizer steps timed (median) after warm-up ones
SPEED_STEPS, SPEED_WARMUP = 8, 4
# Compiled over eager tokens/s of the trainer's step, measured where users train: 124M, context 1024,
# bf16, micro-batch 16 on an H100 (docs/BENCHMARKS.md section 5: 395,433 against 166,130). The probe
# and the size planner time eagerly (a compile per timing cost more than the timings) and scale by
# this where the run compiles on a GPU: one factor for every candidate, so the rankings stay the
# eager ones; what it moves is the predicted tokens/s and the tokens a time budget buys. A compiled
# run on a CPU keeps the eager figure (no CPU ratio is measured).
COMPILED_OVER_EAGER = 395_433 / 166_130


def compiled_speedup(mode: str, dev: torch.device) -> float:
    """The factor from the eager step's tokens/s to the step the run takes under `train.compile`."""
    return COMPILED_OVER_EAGER if dev.type == "cuda" and compiles(mode, dev.type) else 1.0


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
