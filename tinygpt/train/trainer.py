"""The AMP training loop with exact resume.

One optimizer step = `grad_accum_steps` micro-batches whose summed token losses are divided by
the number of target tokens in the whole step, so accumulation gives the same gradient as one
big batch (also when prompt tokens are masked). The loss is read back from the device only on
logging steps: everything else queues on the GPU without a host-device sync.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import math
import os
import random
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from tinygpt.core import checkpoint as ckpt
from tinygpt.core.config import TrainConfig, config_differences
from tinygpt.core.files import clean_leftovers
from tinygpt.core.precision import (
    Precision,
    choose_precision,
    enable_tf32,
    resolve_device,
)
from tinygpt.core.rundir import RunDir
from tinygpt.model.losses import IGNORE_INDEX
from tinygpt.train import distributed as dist_
from tinygpt.train.budget import MEASURE_STEPS, Budget, decay_start, end_time, expected_final_loss, extend, steps_for
from tinygpt.train.callbacks import progress_bar
from tinygpt.train.compile_cache import CompileCache
from tinygpt.train.optim import build_optimizer

# Fields that may change between a run and its resumption; any other difference is refused.
RESUMABLE_CHANGES = frozenset({"max_steps", "eval_every", "save_every", "log_every", "keep_last", "sample_every",
                     "compile", "device", "eval_batches", "loss"})


# how torch.save (zip writer) and safetensors say "the disk is full"
_DISK_FULL = ("unexpected pos", "No space left on device", "os error 28")


def compiled(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """The model to run steps with. "regional": each transformer block compiled in place (identical
    blocks share one compiled graph, so compile time does not grow with depth); otherwise the whole model."""
    blocks = getattr(model, "layers", None)
    if mode == "regional" and blocks is not None:
        for block in blocks:
            block.compile()
        return model
    return torch.compile(model)


def eager():
    """Run compiled code eagerly inside this block (no compile, no recompile), where torch can."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


class TrainingError(RuntimeError):
    """Training cannot go on; the last good checkpoint is kept and named in the message."""


class BatchSource(Protocol):
    """Batches are (x, y) or (x, y, *extra): extra tensors (e.g. position ids of packed records) go to
    `loss_fn` after y."""
    def next_batch(self, batch_size: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, ...]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    loss: float | None
    val_loss: float | None
    best_val_loss: float | None
    checkpoint: Path | None
    tokens_per_s: float | None
    resumed_from: int | None = None
    interrupted: bool = False
    metrics: list[dict] = field(default_factory=list)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine from lr to min_lr at max_steps; or, "wsd", lr held
    until the last decay_fraction of the steps, then a straight line to min_lr at the last step (until
    the decay, the rate does not depend on max_steps: a time budget may set it late)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        start = decay_start(cfg.max_steps, cfg.decay_fraction)
        if step < start:
            return cfg.lr
        progress = min(1.0, (step - start) / max(1, cfg.max_steps - 1 - start))
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def default_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str = "auto") -> torch.Tensor:
    return model(x, y, reduction="sum", loss=loss)


def rng_state() -> dict[str, Any]:
    """Every RNG's state in a weights-only form (tensors, numbers, strings, lists), so a checkpoint
    loads with `torch.load(weights_only=True)` and can never run code."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    s = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
         "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached": float(cached)},
         "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict[str, Any]) -> None:
    py, npy = s["python"], s["numpy"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached"]))
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


@dataclass
class _Step:
    """What one optimizer step leaves on the device for the actions after it."""
    lr: float
    loss_sum: torch.Tensor   # summed token loss of the step (this rank's, until reduced)
    n_targets: int           # target tokens of the whole global step
    grad_norm: torch.Tensor


@dataclass
class _Due:
    """Which periodic actions fall on this step."""
    log: bool
    eval: bool
    save: bool


@dataclass
class _Loop:
    """What the loop carries from step to step."""
    history: list[dict]
    bar: Any
    old_handlers: dict
    last_saved: Path | None
    resumed_from: int | None
    saved_step: int | None
    t0: float
    tokens_since: int = 0
    last_loss: float | None = None
    val_loss: float | None = None
    tok_s: float | None = None
    stopping: bool = False
    first: bool = True  # no step of this process has run yet
    trained_from: float | None = None  # perf_counter after the first step: the budget counts from here
    steps_timed: int = 0


class Trainer:
    """Trains `model` on batches from `train_source`, evaluating on fixed `val_batches`.

    Checkpoints go to ``run_dir/checkpoints/step_XXXXXX`` (and ``run_dir/best``). Hooks: each
    callback may define ``on_log(metrics)``, ``on_checkpoint(path, step)``, ``close()``.
    `state_fn` / `load_state_fn` choose what is saved as the model (the whole model by default,
    only the adapters for LoRA); `loss_fn(model, x, y, *extra)` returns the summed token loss (extra: any
    tensors a batch carries after x and y).
    With `world_size` > 1 (an initialised process group, see `tinygpt.train.distributed`) `cfg` is the
    global batch; this rank trains its share with DDP or, `parallel="fsdp"`, FSDP2.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, train_source: BatchSource,
                 val_batches: list[tuple[torch.Tensor, ...]], run_dir: str | Path, *,
                 device: torch.device | str | None = None, precision: Precision | None = None,
                 loss_fn: Callable | None = None, state_fn: Callable | None = None,
                 load_state_fn: Callable | None = None, callbacks: tuple | list = (),
                 run_info: dict | None = None, flops_per_token: float | None = None,
                 peak_tflops: float | None = None, progress: bool = True, rank: int = 0, world_size: int = 1,
                 parallel: str = "ddp", startup: Any = None, compile_cache: CompileCache | None = None,
                 hours: float | None = None):
        self.cfg = cfg
        self.device = torch.device(device) if device is not None else resolve_device(cfg.device)
        self.precision = precision or choose_precision(self.device, cfg.precision)
        self.model = model.to(self.device)
        self.train_source, self.val_batches = train_source, val_batches
        self.run_dir = Path(run_dir)
        self.loss_fn = loss_fn or functools.partial(default_loss, loss=cfg.loss)
        self.state_fn = state_fn or ckpt.model_state
        self.load_state_fn = load_state_fn or ckpt.load_model_state
        self.callbacks = list(callbacks)
        self.run_info = run_info or {}
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.progress = progress
        self.startup = startup  # a StartupClock: its breakdown is printed and logged after the first step
        self.hours = hours  # a time budget: max_steps is measured and fixed once (budget.json)
        self.budget: Budget | None = None
        self.rank, self.world_size = rank, world_size
        self.is_main = rank == 0
        # this rank's share of the global batch; cfg (compared at resume) stays the recipe's
        self.micro_batch_size, self.grad_accum_steps = dist_.split_global_batch(
            cfg.micro_batch_size, cfg.grad_accum_steps, world_size)
        self.step = 0
        self.best_val_loss: float | None = None
        self._stop_signal: str | None = None
        if self.device.type == "cuda":
            enable_tf32()
        self.use_compile = cfg.compile in ("on", "regional") or (cfg.compile == "auto" and self.device.type == "cuda")
        self.compile_cache = compile_cache if self.use_compile and world_size == 1 else None
        # The compiled wrapper runs the steps; self.model (uncompiled, same parameters) is what
        # is saved, so checkpoint keys never carry `_orig_mod.`.
        if world_size > 1:  # before the optimizer: FSDP2 replaces the parameters by shards
            dist_.check_parallel(parallel, cfg.optimizer, world_size, custom_state=state_fn is not None)
            self.forward_model, self.eval_model = dist_.wrap_model(self.model, parallel, self.device,
                                                                   self.use_compile)
        else:
            self.forward_model = compiled(self.model, cfg.compile) if self.use_compile else self.model
            # Evaluation runs eagerly: a no-grad graph would be a second compile (75 s for 124M on an
            # H100) for a few forward passes per eval_every steps, and under "regional" a recompile.
            self.eval_model = self.model
        self.optimizer = build_optimizer(self.model, cfg, self.device.type)
        self.scaler = dist_.grad_scaler(self.precision, self.model)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._loss_sum = torch.zeros((), device=self.device)

    # ----- checkpoints -------------------------------------------------------------------------
    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def train_state(self, optimizer_state: dict | None = None) -> dict[str, Any]:
        optimizer_state = self.optimizer.state_dict() if optimizer_state is None else optimizer_state
        return {"step": self.step, "optimizer": optimizer_state, "scaler": self.scaler.state_dict(),
                "sampler": self.train_source.state_dict(), "rng": rng_state(), "best_val_loss": self.best_val_loss,
                "train_config": self.cfg.to_dict(), "world_size": self.world_size, "run_info": self.run_info}

    def save(self, best: bool = False) -> Path | None:
        """Write a checkpoint on rank 0 (every rank calls this: under FSDP2 gathering is collective)."""
        model_sd, optimizer_sd = dist_.gather_state(self.model, self.optimizer, self.state_fn, self.rank)
        if not self.is_main:
            return None
        path = self.run_dir / "best" if best else self.ckpt_root / ckpt.step_name(self.step)
        try:
            ckpt.save_checkpoint(path, model_sd, self.train_state(optimizer_sd),
                                 {"kind": "best" if best else "step", "val_loss": self.best_val_loss})
        except Exception as e:  # torch.save and safetensors report a full disk as their own errors, not OSError
            # a full disk or a lost mount: the half-written folder is gone already (atomic_output)
            raise self._write_failed(f"checkpoint {path}", e) from e
        if not best:
            ckpt.prune(self.ckpt_root, self.cfg.keep_last)
        for cb in self.callbacks:
            if hasattr(cb, "on_checkpoint"):
                cb.on_checkpoint(path, self.step)
        return path

    def resume(self, path: Path, verified: bool = False) -> None:
        sd, state, _ = ckpt.load_checkpoint(path, verify=not verified)
        if "optimizer" not in state:
            raise TrainingError(f"checkpoint {path} holds the weights only (a download, without state.pt): training "
                                "cannot resume from it; copy the whole checkpoint from Drive, or use a new run folder")
        diffs = config_differences(state.get("train_config", {}), self.cfg.to_dict(), RESUMABLE_CHANGES)
        if diffs:
            raise TrainingError(f"checkpoint {path} was written with a different training configuration:\n  "
                                + "\n  ".join(diffs) + "\nresume with the same settings, or use a new run folder")
        dist_.load_state(self.model, self.optimizer, sd, state["optimizer"], self.load_state_fn)
        self.scaler.load_state_dict(state["scaler"])
        self.train_source.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.best_val_loss = state.get("best_val_loss")

    # ----- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean token loss over the fixed validation batches. With several ranks each takes every
        W-th batch and the sums are added up, so all ranks return the same number."""
        if not self.val_batches:
            return None
        self.model.eval()
        n, W = len(self.val_batches), self.world_size
        # FSDP2 gathers weights inside each forward: every rank must run as many as the others,
        # so a rank short of batches runs a padding one that counts for nothing.
        end = math.ceil(n / W) * W if W > 1 and dist_.is_fsdp(self.model) else n
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        with eager() if self.use_compile else contextlib.nullcontext():
            self._evaluate_batches(range(self.rank, end, W), total)
        count = sum(int((self.val_batches[i][1] != IGNORE_INDEX).sum()) for i in range(self.rank, min(end, n), W))
        self.model.train()
        if W > 1:
            both = dist_.all_reduce_sum_(torch.stack([total, torch.tensor(float(count), device=self.device,
                                                                            dtype=torch.float64)]))
            total, count = both[0], int(both[1])
        return float(total) / max(count, 1)

    def _evaluate_batches(self, indices: range, total: torch.Tensor) -> None:
        n = len(self.val_batches)
        for i in indices:
            x, y, *extra = (t.to(self.device) for t in self.val_batches[min(i, n - 1)])
            with self.precision.autocast():
                loss = self.loss_fn(self.eval_model, x, y, *extra).double()
            if i < n:
                total += loss

    # ----- the loop ----------------------------------------------------------------------------
    def _truncate_metrics(self) -> list[dict]:
        """Keep the log entries up to the resumed step, so a resumed run's log equals an unbroken one."""
        if not self.is_main:  # rank 0 rewrites it: the others must not read it meanwhile
            return []
        return RunDir(self.run_dir).keep_metrics_through(self.step)

    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum, frame):
            self._stop_signal = signal.Signals(signum).name

        old = {}
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, handler)
        return old

    def _batch_to_device(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap compute
            return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in tensors)
        return tuple(t.to(self.device) for t in tensors)

    def _no_sync(self, last: bool):
        """DDP / FSDP2: skip the gradient reduction on all but the last micro-step."""
        return dist_.gradient_sync(self.forward_model, self.model, last)

    # ----- the loop: restore, then per step one optimizer step and the periodic actions after it ----
    def fit(self, resume: str = "auto") -> TrainResult:
        """Train to `cfg.max_steps`: restore (`resume` "auto", "never" or a checkpoint folder), then
        each step: one optimizer step; after it, as due: log, evaluate, keep the best, save. Ends with
        a checkpoint of the last step; a signal (Ctrl-C, SIGTERM) ends it early the same way."""
        loop = self._start(resume)
        try:
            while self.step < self.cfg.max_steps and not loop.stopping:
                step = self.optimizer_step()
                if loop.first:
                    self._after_first_step(loop)
                elif self.budget is not None and self.budget.max_steps is None:
                    self._measure_budget(loop)
                loop.tokens_since += self.cfg.tokens_per_step  # the global batch
                loop.stopping = self._agree_to_stop()
                due = self._due(loop.stopping)
                if self.world_size > 1 and (due.log or due.save):
                    dist_.all_reduce_sum_(step.loss_sum)  # the global sum: logged, and checked the same on all ranks
                if due.log:
                    self._log_step(loop, step, due)
                elif due.eval:
                    self._log_eval(loop)
                if due.eval:
                    self._keep_best(loop)
                if due.save:
                    self._save_step(loop, step)
                if loop.bar is not None:
                    loop.bar.update(1)
            if self.step > 0 and loop.saved_step != self.step:
                loop.last_saved = self.save() or loop.last_saved  # training always ends with a checkpoint
        except OSError as e:  # metrics.jsonl or samples on a full disk: the same one-line story
            raise self._write_failed(str(self.run_dir), e) from e
        except Exception as e:
            self._raise_peer_failure(e, loop)
            raise
        finally:
            self._finish(loop)
        return TrainResult(self.run_dir, self.step, loop.last_loss, loop.val_loss, self.best_val_loss,
                           loop.last_saved, loop.tok_s, loop.resumed_from, loop.stopping, loop.history)

    def _start(self, resume: str) -> _Loop:
        """Restore the newest valid checkpoint (or the one named), cut the log to it, install the
        signal handlers and the progress bar."""
        last_saved: Path | None = None
        if resume == "auto":
            last_saved = ckpt.latest_valid(self.ckpt_root)  # hashes it: no second check on load
            if last_saved is not None:
                self.resume(last_saved, verified=True)
            elif self.is_main and ckpt.list_checkpoints(self.ckpt_root):
                warnings.warn(f"no checkpoint in {self.ckpt_root} passes verification: training starts from step 0 "
                              "(the folders are kept)", stacklevel=2)
        elif resume != "never":
            last_saved = Path(resume)
            self.resume(last_saved)
        resumed_from = self.step if last_saved is not None else None
        if self.hours is not None:
            self._load_budget()
        history = self._truncate_metrics()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            clean_leftovers(self.run_dir)  # e.g. .tmp-best-<pid>/ of a process killed while writing best/
        for cb in self.callbacks:
            if hasattr(cb, "on_start"):
                cb.on_start(resumed_from)
        bar = None
        if self.progress and self.is_main:
            bar = progress_bar(total=self.cfg.max_steps, initial=self.step, desc="training", unit="step",
                               dynamic_ncols=True)
        self.model.train()
        if self.compile_cache is not None and self.is_main:
            note = self.compile_cache.load()
            if note and self.startup is not None:
                self.startup.notes.append(note)
        # saved_step is the same on every rank (only rank 0 gets a path back from save)
        return _Loop(history, bar, self._install_signal_handlers(), last_saved, resumed_from, resumed_from,
                     time.perf_counter())

    def optimizer_step(self) -> _Step:
        """One optimizer step over `grad_accum_steps` micro-batches, the loss divided by the target
        tokens of the whole (global) step. Nothing is read back from the device here."""
        lr = lr_at(self.step, self.cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        micro = [self.train_source.next_batch(self.micro_batch_size, self.rank, self.world_size)
                 for _ in range(self.grad_accum_steps)]
        n_targets = sum(int((batch[1] != IGNORE_INDEX).sum()) for batch in micro)  # on the host: no sync
        # DDP / FSDP2 average gradients over ranks: scale by W over the global target count
        n_global = dist_.agree_sum([n_targets])[0] if self.world_size > 1 else n_targets
        # The logged loss is this step's own (not an average since the last log), so a run
        # resumed between two logs writes the same numbers as one never stopped.
        self._loss_sum.zero_()
        for i, batch in enumerate(micro):
            x, y, *extra = self._batch_to_device(*batch)
            with self._no_sync(i == len(micro) - 1), self.precision.autocast():
                loss_sum = self.loss_fn(self.forward_model, x, y, *extra)
                self.scaler.scale(loss_sum * (self.world_size / max(n_global, 1))).backward()
            self._loss_sum += loss_sum.detach().float()
        self.scaler.unscale_(self.optimizer)
        grad_norm = dist_.local_value(torch.nn.utils.clip_grad_norm_(self._params, self.cfg.grad_clip))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return _Step(lr, self._loss_sum, n_global, grad_norm)

    def _after_first_step(self, loop: _Loop) -> None:
        """Once per process: keep the compiler's work for the next VM, report where start-up went."""
        loop.first = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the first step's time includes its kernels
        if self.startup is not None:
            self.startup.mark("first_step")
        if self.compile_cache is not None and self.is_main:
            self.compile_cache.save()
        if self.startup is not None and self.is_main:
            RunDir(self.run_dir).append_metrics({"step": self.step, "startup": self.startup.record()})
            # quiet runs only record it; a callback that shows it (a notebook's table) replaces the line
            if loop.bar is not None and not any(getattr(cb, "shows_startup", False) for cb in self.callbacks):
                loop.bar.write(self.startup.summary())
            for cb in self.callbacks:
                if hasattr(cb, "on_startup"):
                    cb.on_startup(self.startup.record())
        loop.t0, loop.tokens_since = time.perf_counter(), 0  # tokens/s counts steady steps, not the compile
        loop.trained_from = loop.t0

    # ----- a time budget ---------------------------------------------------------------------------
    def _load_budget(self) -> None:
        """The run's budget.json (a resume keeps its step count), or a budget still to be measured:
        until then the stable phase runs on (the schedule is wsd: its rate does not depend on max_steps)."""
        if self.cfg.schedule != "wsd":
            raise TrainingError("a time budget needs the warmup-stable-decay schedule (train.schedule=wsd)")
        budget = Budget.load(self.run_dir) if self.is_main else None
        if self.world_size > 1:  # rank 0 read it: the others take its step count
            steps = dist_.agree_sum([budget.max_steps or 0 if budget else 0])[0]
            budget = Budget(self.hours, steps or None)  # type: ignore[arg-type]
        if budget is not None and budget.max_steps is not None:
            budget, note = extend(budget, self.hours, self.step, self.cfg.decay_fraction)  # type: ignore[arg-type]
            if note:
                warnings.warn(note, stacklevel=3)
            if self.is_main:
                budget.save(self.run_dir)
            self.budget = budget
            self.cfg = dataclasses.replace(self.cfg, max_steps=budget.max_steps)
        else:
            self.budget = Budget(self.hours)  # type: ignore[arg-type]
            self.cfg = dataclasses.replace(self.cfg, max_steps=10**9)

    def _measure_budget(self, loop: _Loop) -> None:
        """After MEASURE_STEPS steady steps: time an evaluation and a checkpoint too, then fix max_steps
        so that training ends within the budget, and keep it in budget.json."""
        loop.steps_timed += 1
        if loop.steps_timed < MEASURE_STEPS or loop.trained_from is None:
            return
        step_s = (time.perf_counter() - loop.trained_from) / loop.steps_timed
        t = time.perf_counter()
        self.evaluate()
        eval_s = time.perf_counter() - t
        t = time.perf_counter()
        loop.last_saved, loop.saved_step = self.save() or loop.last_saved, self.step
        save_s = time.perf_counter() - t
        per_step = step_s + (eval_s / self.cfg.eval_every if self.cfg.eval_every else 0) + \
            (save_s / self.cfg.save_every if self.cfg.save_every else 0)
        spent = time.perf_counter() - loop.trained_from
        steps = steps_for(self.budget.hours, spent, self.step, per_step, eval_s + save_s)  # type: ignore[union-attr]
        if self.world_size > 1:
            steps = dist_.agree_sum([steps if self.is_main else 0])[0]
        self.budget = Budget(self.budget.hours, steps, self.step, per_step, time.time())  # type: ignore[union-attr]
        self.cfg = dataclasses.replace(self.cfg, max_steps=steps)
        if self.is_main:
            self.budget.save(self.run_dir)
        if loop.bar is not None:
            loop.bar.total = steps
            loop.bar.write(f"time budget {self.budget.hours:g} h: {steps} steps of {per_step:.3g} s (evaluations and "
                           f"checkpoints included); training ends about {end_time(self.step, steps, per_step)}")

    def _agree_to_stop(self) -> bool:
        """Every rank must stop at the same step, however the signals reached them."""
        stopping = self._stop_signal is not None
        if self.world_size > 1:
            stopping = dist_.agree_sum([int(stopping)])[0] > 0
        return stopping

    def _due(self, stopping: bool) -> _Due:
        cfg, step = self.cfg, self.step
        last = step == cfg.max_steps
        return _Due(log=step % cfg.log_every == 0 or last,
                    eval=bool(cfg.eval_every) and (step % cfg.eval_every == 0 or last),
                    save=bool((cfg.save_every and step % cfg.save_every == 0) or last or stopping))

    def _log_step(self, loop: _Loop, step: _Step, due: _Due) -> None:
        """A metrics.jsonl record of this step (the one host-device sync per log interval)."""
        loop.last_loss = step.loss_sum.item() / max(step.n_targets, 1)
        self._check_finite(loop.last_loss, loop.last_saved)
        dt = time.perf_counter() - loop.t0
        loop.tok_s = loop.tokens_since / dt if dt > 0 else None
        m = {"step": self.step, "loss": round(loop.last_loss, 6), "lr": step.lr, "grad_norm": float(step.grad_norm),
             "tokens": self.step * self.cfg.tokens_per_step,
             "tokens_per_s": round(loop.tok_s, 1) if loop.tok_s else None}
        if loop.tok_s and self.flops_per_token and self.peak_tflops:  # peak is one GPU's
            m["mfu"] = round(loop.tok_s * self.flops_per_token / (self.peak_tflops * 1e12 * self.world_size), 4)
        if self.device.type == "cuda":
            m["memory_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 1e9, 3)
        if due.eval:
            loop.val_loss = m["val_loss"] = self.evaluate()
        expected = expected_final_loss(loop.history + [m], self.cfg.max_steps, self.cfg.warmup_steps) \
            if self.cfg.max_steps < 10**9 else None
        if expected is not None:
            m["expected_final_loss"] = round(expected, 4)
        loop.t0, loop.tokens_since = time.perf_counter(), 0
        self._log(m, loop.history, loop.bar)

    def _log_eval(self, loop: _Loop) -> None:
        loop.val_loss = self.evaluate()
        self._log({"step": self.step, "val_loss": loop.val_loss}, loop.history, loop.bar)

    def _keep_best(self, loop: _Loop) -> None:
        if loop.val_loss is not None and (self.best_val_loss is None or loop.val_loss < self.best_val_loss):
            self.best_val_loss = loop.val_loss
            self.save(best=True)

    def _save_step(self, loop: _Loop, step: _Step) -> None:
        # never write a checkpoint from weights that a NaN may have reached
        self._check_finite(float(step.loss_sum), loop.last_saved)
        self._check_finite(float(step.grad_norm), loop.last_saved, what="gradient norm")
        loop.last_saved, loop.saved_step = self.save() or loop.last_saved, self.step

    def _raise_peer_failure(self, e: Exception, loop: _Loop) -> None:
        """Under torchrun, a dead or hung peer becomes one message that says how to resume."""
        if self.world_size > 1 and not isinstance(e, TrainingError) and dist_.is_peer_failure(e):
            raise TrainingError(f"process {self.rank} of {self.world_size} lost its peers at step {self.step} "
                                f"({type(e).__name__}: {str(e)[:160]}...): another "
                                "process of this job died or hung (torchrun's report names it). The last "
                                f"good checkpoint is {loop.last_saved or ckpt.latest_valid(self.ckpt_root)}; run "
                                "the same command again, with any number of processes, to resume from it") from e

    def _finish(self, loop: _Loop) -> None:
        for s, h in loop.old_handlers.items():
            signal.signal(s, h)
        if loop.bar is not None:
            loop.bar.close()

    def _write_failed(self, what: str, e: BaseException) -> TrainingError:
        why = f"the disk is full ({os.strerror(errno.ENOSPC)})" \
            if getattr(e, "errno", None) == errno.ENOSPC or any(m in str(e) for m in _DISK_FULL) \
            else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return TrainingError(f"could not write {what} at step {self.step}: {why}. The last good checkpoint is "
                             f"{ckpt.latest_valid(self.ckpt_root)}; free some disk space and run the same command "
                             "again to resume from it")

    def _check_finite(self, value: float, last_saved: Path | None, what: str = "loss") -> None:
        if math.isfinite(value):
            return
        if what == "gradient norm" and self.precision.use_scaler:
            return  # fp16: the scaler skipped this step and lowered its scale; the weights are intact
        raise TrainingError(f"the {what} became {value} at step {self.step}; nothing was saved after it. The last "
                            f"good checkpoint is {last_saved}. Lower the learning rate, or use precision bf16/fp32 "
                            "instead of fp16, then run again to resume from it")

    def _log(self, m: dict, history: list[dict], bar) -> None:
        history.append(m)
        if self.is_main:
            RunDir(self.run_dir).append_metrics(m)
        if bar is not None:
            post = {k: f"{m[k]:.4g}" for k in ("loss", "val_loss", "lr") if m.get(k) is not None}
            if m.get("tokens_per_s"):
                post["tok/s"] = f"{m['tokens_per_s']:.0f}"
            if m.get("expected_final_loss") is not None:
                post["final~"] = f"{m['expected_final_loss']:.4g}"
            if self.budget is not None and self.budget.step_s:
                post["ends"] = end_time(self.step, self.cfg.max_steps, self.budget.step_s)
            bar.set_postfix(post, refresh=False)
        for cb in self.callbacks:
            if hasattr(cb, "on_log"):
                try:
                    cb.on_log(m)
                except Exception as e:  # a broken plot must never stop training
                    warnings.warn(f"callback {cb!r} failed in on_log: {e}")
