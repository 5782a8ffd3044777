"""The batch-size warm-up (`TrainConfig.batch_warmup`, `batch_start`): the sequences of each
optimizer step (`batch_rows`) and the tokens a run has trained on after some steps
(`tokens_through`), the one place the schedule lives (the trainer's step, its logged tokens, a
recipe's token budget and the ladder read it)."""

from __future__ import annotations

from tinygpt.core.config import TrainConfig


def _ramp(cfg: TrainConfig, max_steps: int | None) -> int:
    """The warm-up's steps: `batch_warmup` of `max_steps` (the recipe's while None)."""
    return round(cfg.batch_warmup * (max_steps or cfg.max_steps))


def batch_rows(cfg: TrainConfig, step: int, max_steps: int | None = None) -> list[int]:
    """The sequences of each micro-batch of optimizer step `step` (global: all ranks together): the
    full batch, or during the warm-up (`batch_warmup` of `max_steps`, the recipe's while None)
    batch_start of it growing linearly, rounded to whole micro-batches where the recipe accumulates
    (fewer accumulation steps, the same shapes) and else to whole rows."""
    full, ramp = [cfg.micro_batch_size] * cfg.grad_accum_steps, _ramp(cfg, max_steps)
    if step >= ramp:
        return full
    fraction = cfg.batch_start + (1 - cfg.batch_start) * step / ramp
    if cfg.grad_accum_steps > 1:
        return full[: max(1, round(cfg.grad_accum_steps * fraction))]
    return [max(1, round(cfg.micro_batch_size * fraction))]


def tokens_through(cfg: TrainConfig, steps: int, max_steps: int | None = None) -> int:
    """Tokens trained on in the first `steps` optimizer steps (`batch_rows`)."""
    ramp = min(steps, _ramp(cfg, max_steps))
    rows = sum(sum(batch_rows(cfg, s, max_steps)) for s in range(ramp))
    return rows * cfg.seq_len + (steps - ramp) * cfg.tokens_per_step
