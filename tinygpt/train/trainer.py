"""The AMP training loop with exact resume.

One optimizer step = `grad_accum_steps` micro-batches whose summed token losses are divided by
the number of target tokens in the whole step, so accumulation gives the same gradient as one
big batch (also when prompt tokens are masked). The loss is read back from the device only on
logging steps: everything else queues on the GPU without a host-device sync.
"""
from __future__ import annotations

import math
import os
import random
import shutil
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
from tinygpt.core.config import TrainConfig
from tinygpt.core.precision import (
    Precision,
    choose_precision,
    enable_tf32,
    resolve_device,
)
from tinygpt.core.rundir import RunDir
from tinygpt.train import distributed as dist_
from tinygpt.train.optim import build_optimizer

# Fields that may change between a run and its resumption; any other difference is refused.
RESUMABLE_CHANGES = {"max_steps", "eval_every", "save_every", "log_every", "keep_last", "sample_every",
                     "compile", "device", "eval_batches"}


class TrainingError(RuntimeError):
    """Training cannot go on; the last good checkpoint is kept and named in the message."""


class BatchSource(Protocol):
    def next_batch(self, batch_size: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]: ...
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
    """Linear warmup over warmup_steps, then cosine from lr to min_lr at max_steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def config_differences(old: dict, new: dict, allowed: set[str] = RESUMABLE_CHANGES, prefix: str = "") -> list[str]:
    """Human-readable differences between two config dicts, ignoring the allowed ones."""
    out = []
    for k in sorted(set(old) | set(new)):
        if k in allowed:
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, allowed, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} in the run, {b!r} now")
    return out


def default_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y, reduction="sum")


def rng_state() -> dict[str, Any]:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict[str, Any]) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


class Trainer:
    """Trains `model` on batches from `train_source`, evaluating on fixed `val_batches`.

    Checkpoints go to ``run_dir/checkpoints/step_XXXXXX`` (and ``run_dir/best``). Hooks: each
    callback may define ``on_log(metrics)``, ``on_checkpoint(path, step)``, ``close()``.
    `state_fn` / `load_state_fn` choose what is saved as the model (the whole model by default,
    only the adapters for LoRA); `loss_fn(model, x, y)` returns the summed token loss.
    With `world_size` > 1 (an initialised process group, see `tinygpt.train.distributed`) `cfg` is the
    global batch; this rank trains its share with DDP or, `parallel="fsdp"`, FSDP2.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, train_source: BatchSource,
                 val_batches: list[tuple[torch.Tensor, torch.Tensor]], run_dir: str | Path, *,
                 device: torch.device | str | None = None, precision: Precision | None = None,
                 loss_fn: Callable | None = None, state_fn: Callable | None = None,
                 load_state_fn: Callable | None = None, callbacks: tuple | list = (),
                 run_info: dict | None = None, flops_per_token: float | None = None,
                 peak_tflops: float | None = None, progress: bool = True, rank: int = 0, world_size: int = 1,
                 parallel: str = "ddp"):
        self.cfg = cfg
        self.device = torch.device(device) if device is not None else resolve_device(cfg.device)
        self.precision = precision or choose_precision(self.device, cfg.precision)
        self.model = model.to(self.device)
        self.train_source, self.val_batches = train_source, val_batches
        self.run_dir = Path(run_dir)
        self.loss_fn = loss_fn or default_loss
        self.state_fn = state_fn or ckpt.model_state
        self.load_state_fn = load_state_fn or ckpt.load_model_state
        self.callbacks = list(callbacks)
        self.run_info = run_info or {}
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.progress = progress
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
        use_compile = cfg.compile == "on" or (cfg.compile == "auto" and self.device.type == "cuda")
        # The compiled wrapper runs the steps; self.model (uncompiled, same parameters) is what
        # is saved, so checkpoint keys never carry `_orig_mod.`.
        if world_size > 1:  # before the optimizer: FSDP2 replaces the parameters by shards
            dist_.check_parallel(parallel, cfg.optimizer, world_size, custom_state=state_fn is not None)
            self.forward_model, self.eval_model = dist_.wrap_model(self.model, parallel, self.device, use_compile)
        else:
            self.forward_model = self.eval_model = torch.compile(self.model) if use_compile else self.model
        self.optimizer = build_optimizer(self.model, cfg, self.device.type)
        self.scaler = dist_.grad_scaler(self.precision, self.model)

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
        except OSError as e:  # a full disk or a lost mount: the half-written folder goes, the last good one stays
            shutil.rmtree(path.parent / f".tmp-{path.name}-{os.getpid()}", ignore_errors=True)
            raise TrainingError(f"could not write checkpoint {path}: {e}. The last good checkpoint is "
                                f"{ckpt.latest_valid(self.ckpt_root)}; free some disk space and run again to "
                                "resume from it") from e
        if not best:
            ckpt.prune(self.ckpt_root, self.cfg.keep_last)
        for cb in self.callbacks:
            if hasattr(cb, "on_checkpoint"):
                cb.on_checkpoint(path, self.step)
        return path

    def resume(self, path: Path, verified: bool = False) -> None:
        sd, state, _ = ckpt.load_checkpoint(path, verify=not verified)
        diffs = config_differences(state.get("train_config", {}), self.cfg.to_dict())
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
        count = 0
        for i in range(self.rank, end, W):
            x, y = self.val_batches[min(i, n - 1)]
            with self.precision.autocast():
                loss = self.loss_fn(self.eval_model, x.to(self.device), y.to(self.device)).double()
            if i < n:
                total += loss
                count += int((y != -100).sum())
        self.model.train()
        if W > 1:
            both = dist_.all_reduce_sum_(torch.stack([total, torch.tensor(float(count), device=self.device,
                                                                            dtype=torch.float64)]))
            total, count = both[0], int(both[1])
        return float(total) / max(count, 1)

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

    def _batch_to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap compute
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def _no_sync(self, last: bool):
        """DDP / FSDP2: skip the gradient reduction on all but the last micro-step."""
        return dist_.gradient_sync(self.forward_model, self.model, last)

    def fit(self, resume: str = "auto") -> TrainResult:
        cfg = self.cfg
        resumed_from = None
        last_saved: Path | None = None
        if resume == "auto":
            last_saved = ckpt.latest_valid(self.ckpt_root)  # hashes it: no second check on load
            if last_saved is not None:
                self.resume(last_saved, verified=True)
                resumed_from = self.step
        elif resume != "never":
            last_saved = Path(resume)
            self.resume(last_saved)
            resumed_from = self.step
        history = self._truncate_metrics()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        old_handlers = self._install_signal_handlers()
        bar = None
        if self.progress and self.is_main:
            from tqdm.auto import tqdm
            bar = tqdm(total=cfg.max_steps, initial=self.step, desc="training", unit="step", dynamic_ncols=True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        loss_acc = torch.zeros((), device=self.device)
        t0, tokens_since = time.perf_counter(), 0
        last_loss = val_loss = tok_s = None
        saved_step = resumed_from  # the same on every rank (only rank 0 gets a path back from save)
        stopping = False
        self.model.train()
        try:
            while self.step < cfg.max_steps and not stopping:
                lr = lr_at(self.step, cfg)
                for g in self.optimizer.param_groups:
                    g["lr"] = lr * g.get("lr_scale", 1.0)
                micro = [self.train_source.next_batch(self.micro_batch_size, self.rank, self.world_size)
                         for _ in range(self.grad_accum_steps)]
                n_targets = sum(int((y != -100).sum()) for _, y in micro)  # on the host: no sync
                # DDP / FSDP2 average gradients over ranks: scale by W over the global target count
                n_global = dist_.agree_sum([n_targets])[0] if self.world_size > 1 else n_targets
                # The logged loss is this step's own (not an average since the last log), so a run
                # resumed between two logs writes the same numbers as one never stopped.
                loss_acc.zero_()
                for i, (x, y) in enumerate(micro):
                    x, y = self._batch_to_device(x, y)
                    with self._no_sync(i == len(micro) - 1), self.precision.autocast():
                        loss_sum = self.loss_fn(self.forward_model, x, y)
                        self.scaler.scale(loss_sum * (self.world_size / max(n_global, 1))).backward()
                    loss_acc += loss_sum.detach().float()
                self.scaler.unscale_(self.optimizer)
                grad_norm = dist_.local_value(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                tokens_since += cfg.tokens_per_step  # the global batch
                # Every rank must stop at the same step, however the signals reached them.
                stopping = self._stop_signal is not None
                if self.world_size > 1:
                    stopping = dist_.agree_sum([int(stopping)])[0] > 0
                last_step = self.step == cfg.max_steps
                log_step = self.step % cfg.log_every == 0 or last_step
                will_save = bool((cfg.save_every and self.step % cfg.save_every == 0) or last_step or stopping)
                if self.world_size > 1 and (log_step or will_save):
                    dist_.all_reduce_sum_(loss_acc)  # the global sum: logged, and checked the same on all ranks
                if log_step:
                    last_loss = loss_acc.item() / max(n_global, 1)  # the one sync per log interval
                    self._check_finite(last_loss, last_saved)
                    dt = time.perf_counter() - t0
                    tok_s = tokens_since / dt if dt > 0 else None
                    m = {"step": self.step, "loss": round(last_loss, 6), "lr": lr, "grad_norm": float(grad_norm),
                         "tokens": self.step * cfg.tokens_per_step,
                         "tokens_per_s": round(tok_s, 1) if tok_s else None}
                    if tok_s and self.flops_per_token and self.peak_tflops:  # peak is one GPU's
                        m["mfu"] = round(tok_s * self.flops_per_token
                                         / (self.peak_tflops * 1e12 * self.world_size), 4)
                    if self.device.type == "cuda":
                        m["memory_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 1e9, 3)
                    if cfg.eval_every and (self.step % cfg.eval_every == 0 or last_step):
                        val_loss = m["val_loss"] = self.evaluate()
                    t0, tokens_since = time.perf_counter(), 0
                    self._log(m, history, bar)
                elif cfg.eval_every and self.step % cfg.eval_every == 0:
                    val_loss = self.evaluate()
                    self._log({"step": self.step, "val_loss": val_loss}, history, bar)
                if cfg.eval_every and val_loss is not None and (self.step % cfg.eval_every == 0 or last_step) \
                        and (self.best_val_loss is None or val_loss < self.best_val_loss):
                    self.best_val_loss = val_loss
                    self.save(best=True)
                if will_save:
                    # never write a checkpoint from weights that a NaN may have reached
                    self._check_finite(float(loss_acc), last_saved)
                    self._check_finite(float(grad_norm), last_saved, what="gradient norm")
                    last_saved, saved_step = self.save() or last_saved, self.step
                if bar is not None:
                    bar.update(1)
            if self.step > 0 and saved_step != self.step:
                last_saved = self.save() or last_saved  # training always ends with a checkpoint
        except Exception as e:
            if self.world_size > 1 and not isinstance(e, TrainingError) and dist_.is_peer_failure(e):
                raise TrainingError(f"process {self.rank} of {self.world_size} lost its peers at step {self.step} "
                                    f"({type(e).__name__}: {str(e)[:160]}...): another "
                                    "process of this job died or hung (torchrun's report names it). The last "
                                    f"good checkpoint is {last_saved or ckpt.latest_valid(self.ckpt_root)}; run "
                                    "the same command again, with any number of processes, to resume from it") from e
            raise
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            if bar is not None:
                bar.close()
        return TrainResult(self.run_dir, self.step, last_loss, val_loss, self.best_val_loss, last_saved, tok_s,
                           resumed_from, stopping, history)

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
            bar.set_postfix(post, refresh=False)
        for cb in self.callbacks:
            if hasattr(cb, "on_log"):
                try:
                    cb.on_log(m)
                except Exception as e:  # a broken plot must never stop training
                    warnings.warn(f"callback {cb!r} failed in on_log: {e}")
