"""Memory trials (one model and optimizer stepped at a micro-batch and context, the peak measured),
the search for the largest micro-batch that fits, and the batch geometry; the probe runs them."""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tinygpt.core.precision import Precision
from tinygpt.core.recipes import Recipe
from tinygpt.fit.memory import GB, TensorMemoryTracker
from tinygpt.model.gpt import GPT
from tinygpt.model.losses import resolve_loss
from tinygpt.train.optim import build_optimizer


@dataclass
class Trial:
    micro_batch: int
    seq_len: int
    checkpointing: bool
    peak_gb: float | None  # None after a real out-of-memory
    ok: bool  # ran, and peak <= (1 - margin) * limit
    oom: bool
    tokens_per_s: float | None


# How an allocation failure reads when it does not arrive as torch.OutOfMemoryError: cuBLAS, cuDNN
# and a CUDA launch report theirs as a plain RuntimeError (inside a compiled graph too).
_ALLOCATION_FAILURES = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
)


def is_allocation_failure(e: BaseException) -> bool:
    """An out-of-memory error in any of the forms torch, cuBLAS and cuDNN raise it."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in _ALLOCATION_FAILURES)
    )


class TrialRunner:
    """One model and optimizer for every trial: rebuilding a 760M model per trial would dominate."""

    def __init__(
        self,
        recipe: Recipe,
        device: torch.device,
        precision: Precision,
        limit_gb: float,
        margin: float,
        measure: Callable[[int, int, bool], float] | None,
    ):
        self.device, self.precision, self.measure = device, precision, measure
        self.limit_gb, self.margin = limit_gb, margin
        self.loss = recipe.train.loss  # what each trial's loss does: the trainer's own choice
        torch.manual_seed(0)
        with torch.device(device):
            # own config: checkpointing is toggled per trial
            self.model = GPT(dataclasses.replace(recipe.model))
        self.opt = build_optimizer(self.model, recipe.train, device.type)
        self.scaler = precision.grad_scaler()
        # Training holds gradients (accumulation) and AdamW states through every forward: allocate
        # both now so that every trial, the first included, has them in its peak.
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.opt.step()
        held = list(self.model.parameters()) + [p.grad for p in self.model.parameters()]
        held += [t for s in self.opt.state.values() for t in s.values()]
        storages = {t.untyped_storage() for t in held if isinstance(t, torch.Tensor)}
        self.held_bytes = sum(s.nbytes() for s in storages)

    def _step(self, b: int, t: int) -> float:
        """One optimizer step at full length, then one evaluation forward; the step's seconds."""
        m, v = self.model, self.model.config.vocab_size
        x, y = (torch.randint(v, (b, t), device=self.device) for _ in range(2))
        loss_mode = resolve_loss(self.loss, b * t, v, self.device)
        m.train()
        sync(self.device)
        t0 = time.perf_counter()
        with self.precision.autocast():
            loss = m(x, y, loss=loss_mode)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=False)
        sync(self.device)
        seconds = time.perf_counter() - t0
        m.eval()
        with torch.no_grad(), self.precision.autocast():
            m(x, y, loss=loss_mode)
        return seconds

    def trial(self, b: int, t: int, ckpt: bool) -> Trial:
        self.model.config.activation_checkpointing = ckpt
        peak = seconds = None
        oom = False
        try:
            if self.measure is not None:
                seconds = self._step(b, t)
                peak = self.measure(b, t, ckpt)
            elif self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
                seconds = self._step(b, t)
                peak = torch.cuda.max_memory_allocated(self.device) / GB
            else:
                with TensorMemoryTracker() as tracker:
                    seconds = self._step(b, t)
                peak = (self.held_bytes + tracker.peak_bytes) / GB
            if peak > self.limit_gb:
                raise torch.OutOfMemoryError(
                    f"trial peak {peak:.2f} GB is over the limit {self.limit_gb:.2f} GB"
                )
        except Exception as e:
            if not is_allocation_failure(e):
                raise
            oom = True
        # outside the except block: the traceback, and the tensors its frames hold, are gone
        if oom:
            self.opt.zero_grad(set_to_none=False)
            # an OOM inside scaler.step leaves it half-way
            self.scaler = self.precision.grad_scaler()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        ok = not oom and peak <= (1 - self.margin) * self.limit_gb
        return Trial(b, t, ckpt, peak, ok, oom, None if oom else b * t / max(seconds, 1e-9))


def largest_fit(fits: Callable[[int], bool], cap: int, out_of_time: Callable[[], bool]) -> int:
    """Double from 1 until a failure (or cap), then bisect between the last fit and the failure."""
    ok, bad, b = 0, cap + 1, 1
    while ok < cap and not (ok and out_of_time()):
        if not fits(b):
            bad = b
            break
        ok, b = b, min(2 * b, cap)
    while bad - ok > 1 and not (ok and out_of_time()):
        mid = (ok + bad) // 2
        ok, bad = (mid, bad) if fits(mid) else (ok, mid)
    return ok


def batch_geometry(largest: int, seq_len: int, tokens_per_step: int) -> tuple[int, int, str | None]:
    """(micro_batch, grad_accum, note): a divisor of the recipe's sequences per step keeps its
    global batch exact; if the best divisor wastes over half the memory, keep the micro-batch."""
    if tokens_per_step % seq_len == 0:
        seqs = tokens_per_step // seq_len
        d = max(x for x in range(1, min(largest, seqs) + 1) if seqs % x == 0)
        if 2 * d >= largest:
            return d, seqs // d, None
    accum = math.ceil(tokens_per_step / (largest * seq_len))
    # the smallest overshoot with this many steps
    micro = math.ceil(tokens_per_step / (accum * seq_len))
    note = (
        f"the global batch is {micro * seq_len * accum} tokens per step instead of the recipe's "
        f"{tokens_per_step}: no micro-batch near {largest} divides it exactly"
    )
    return micro, accum, note


def sync(dev: torch.device) -> None:
    """Drain the device's queue: a timing must include the kernels it launched."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def speed_candidates(largest: int, seq_len: int, tokens_per_step: int) -> list[tuple[int, int]]:
    """The (micro-batch, accumulation) pairs worth timing: the geometries of the largest micro-batch
    that fits and of about a half and a quarter of it (the largest is not always the fastest)."""
    out: list[tuple[int, int]] = []
    for limit in (largest, largest // 2, largest // 4):
        if limit >= 1:
            micro, accum, _ = batch_geometry(limit, seq_len, tokens_per_step)
            if (micro, accum) not in out:
                out.append((micro, accum))
    return out
