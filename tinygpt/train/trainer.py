"""The AMP training loop with exact resume, around `TrainStep` (`tinygpt.train.step`). The loss is
read back from the device only on logging steps: everything else queues on the GPU without a
host-device sync. Progress, the start-up record, a time budget and the mirror are `Callback`s
(tinygpt.core.callback); the loop knows none of them.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tinygpt.core import checkpoint as ckpt
from tinygpt.core.batch_schedule import tokens_through
from tinygpt.core.callback import Callback
from tinygpt.core.config import TrainConfig
from tinygpt.core.files import clean_leftovers
from tinygpt.core.rundir import BEST, RunDir
from tinygpt.model.losses import IGNORE_INDEX
from tinygpt.train import distributed as dist_
from tinygpt.train.budget import expected_final_loss
from tinygpt.train.distributed import Ranks
from tinygpt.train.exact_resume import load_train_state, resume_refusal, train_state_of
from tinygpt.train.step import BatchSource, ModelIO, StepResult, TrainStep, eager
from tinygpt.train.stopping import StopOnSignal, closing

# how torch.save (zip writer) and safetensors say "the disk is full"
_DISK_FULL = ("unexpected pos", "No space left on device", "os error 28")


class TrainingError(RuntimeError):
    """Training cannot go on; the last good checkpoint is kept and named in the message."""


@dataclass
class TrainData:
    """What a run trains on: an endless, resumable batch source and fixed validation batches, or a
    function that makes them, called once before the first step (a pretraining run's wait for its
    first shard: the model compiles first, `TrainStep.compile_ahead`)."""

    train: BatchSource
    val: list[tuple[torch.Tensor, ...]] | Callable[[], list] = field(default_factory=list)


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


class Throughput:
    """Tokens per second over the steps since the last log (not the first, with its compile)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.t0, self.tokens = time.perf_counter(), 0

    def rate(self) -> float | None:
        dt = time.perf_counter() - self.t0
        return self.tokens / dt if dt > 0 and self.tokens else None


class Trainer(TrainStep):
    """Trains `model` on `data` into `run_dir`, resuming exactly where a checkpoint left off.
    Everything beside the loop is a `Callback` in `callbacks`, after the Trainer's own
    `StopOnSignal`; `fit` closes every callback when it ends, however it ends, in that order."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainConfig,
        data: TrainData,
        run_dir: str | Path,
        *,
        callbacks: tuple | list = (),
        io: ModelIO | None = None,
        ranks: Ranks | None = None,
        run_info: dict | None = None,
    ):
        super().__init__(model, cfg, data.train, io, ranks)
        io = io or ModelIO()
        self.val_batches = data.val
        self.run_dir = Path(run_dir)
        self.state_fn = io.state_fn or ckpt.model_state
        self.load_state_fn = io.load_state_fn or ckpt.load_model_state
        self.signals = StopOnSignal()
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(
                    f"{cb!r} is not a trainer callback: subclass tinygpt.core.callback.Callback"
                )
        self.callbacks: list[Callback] = [self.signals, *callbacks]
        self.run_info = run_info or {}
        self.is_main = self.rank == 0
        self.best_val_loss: float | None = None
        self.throughput = Throughput()
        # what the loop knows between steps (the Result is made of it)
        self.history: list[dict] = []
        self.last_saved: Path | None = None
        # the same on every rank (only rank 0 gets a path back from save)
        self.saved_step: int | None = None
        self.last_loss: float | None = None
        self.val_loss: float | None = None
        self.tokens_per_s: float | None = None
        # seconds per step, evaluations and saves included (a time budget's)
        self.step_s: float | None = None

    @property
    def ckpt_root(self) -> Path:
        return RunDir(self.run_dir).checkpoints

    # ----- the loop ------------------------------------------------------------------------------
    def fit(self, resume: str = "auto") -> TrainResult:
        """Train to max_steps after restoring (`resume` "auto", "never" or a checkpoint folder).
        Ends with a checkpoint of the last step; a signal (Ctrl-C, SIGTERM) ends it early the same
        way. Every callback is then closed, even when one before it fails, without hiding an error
        that ended the run."""
        with closing(self.callbacks):  # StopOnSignal first: the handlers are given back first
            resumed_from = self.restore(resume)
            stopping = False
            try:
                for cb in self.callbacks:
                    cb.on_start(self, resumed_from)  # the compile cache is loaded here
                self.model.train()
                self.compile_ahead()  # while the first shard is still being tokenized
                if callable(self.val_batches):
                    self.val_batches = self.val_batches()
                self.throughput.restart()
                while (self.max_steps is None or self.step < self.max_steps) and not stopping:
                    stopping = self._train_step()
                if self.step > 0 and self.saved_step != self.step:
                    self.save()  # training always ends with a checkpoint
            except OSError as e:  # metrics.jsonl or samples on a full disk: the same one-line story
                # unless the folder itself went: then that is the story
                RunDir(self.run_dir).check_held()
                raise self._write_failed(str(self.run_dir), e) from e
            except Exception as e:
                # e.g. TensorBoard's writer, its folder deleted under it
                if not isinstance(e, TrainingError):
                    RunDir(self.run_dir).check_held()
                self._raise_peer_failure(e)
                raise
        return TrainResult(
            self.run_dir,
            self.step,
            self.last_loss,
            self.val_loss,
            self.best_val_loss,
            self.last_saved,
            self.tokens_per_s,
            resumed_from,
            stopping,
            self.history,
        )

    def _train_step(self) -> bool:
        """One turn of the loop; whether to stop, agreed by every rank (a stopping step is saved).
        Every rank takes the same branches (the flags depend on the step and the agreed stop only),
        so collectives (the loss sum, evaluation, gathering for a save) stay matched."""
        step = self.optimizer_step()
        self.throughput.tokens += step.tokens  # the global batch
        # e.g. the start-up record, a time budget's measurement
        for cb in self.callbacks:
            cb.on_step(self)
        stopping = self._agree_to_stop()
        last = self.step == self.max_steps
        log = self.step % self.cfg.log_every == 0 or last
        evaluate = bool(self.cfg.eval_every) and (self.step % self.cfg.eval_every == 0 or last)
        save = (
            bool(self.cfg.save_every and self.step % self.cfg.save_every == 0) or last or stopping
        )
        # the global sum: logged, and checked alike on all ranks
        if self.world_size > 1 and (log or save):
            dist_.all_reduce_sum_(step.loss_sum)
        if log:
            self._log_step(step, evaluate)  # evaluates too, when due
        elif evaluate:
            self.val_loss = self.evaluate()
            self._log({"step": self.step, "val_loss": self.val_loss})
        if evaluate:
            self._keep_best()
        if save:
            # never write a checkpoint from weights that a NaN may have reached
            self._check_finite(float(step.loss_sum))
            self._check_finite(float(step.grad_norm), what="gradient norm")
            self.save()
        return stopping

    def _keep_best(self) -> None:
        """Save best/ when the validation loss just measured is the lowest yet."""
        best = self.best_val_loss
        if self.val_loss is not None and (best is None or self.val_loss < best):
            self.best_val_loss = self.val_loss
            self.save(best=True)

    def restore(self, resume: str) -> int | None:
        """Exact resume from the newest valid checkpoint (or the one named): the run goes on as if
        it had never stopped. The step restored from, or None."""
        if resume == "auto":
            # hashes it: no second check on load
            self.last_saved = ckpt.latest_valid(self.ckpt_root)
            if self.last_saved is not None:
                self.resume(self.last_saved, verified=True)
            elif self.is_main and ckpt.list_checkpoints(self.ckpt_root):
                warnings.warn(
                    f"no checkpoint in {self.ckpt_root} passes verification: training "
                    "starts from step 0 (the folders are kept)",
                    stacklevel=3,
                )
        elif resume != "never":
            self.last_saved = Path(resume)
            self.resume(self.last_saved)
        resumed_from = self.saved_step = self.step if self.last_saved is not None else None
        # metrics.jsonl is cut back to the checkpoint's step: a run killed at step 130 whose newest
        # checkpoint is step 100 logged 101..130 already, and will log them again (the same values:
        # same weights, data position and RNGs), so the file reads as if the run had never stopped.
        # Rank 0 rewrites it: the other ranks must not read it meanwhile.
        self.history = RunDir(self.run_dir).keep_metrics_through(self.step) if self.is_main else []
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            # e.g. .tmp-best-<pid>/ of a process killed while writing best/
            clean_leftovers(self.run_dir)
        return resumed_from

    def say(self, text: str) -> None:
        """A line for the person watching (the progress callback prints it)."""
        for cb in self.callbacks:
            cb.on_message(text)

    # ----- evaluation ----------------------------------------------------------------------------
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
        count = sum(
            int((self.val_batches[i][1] != IGNORE_INDEX).sum())
            for i in range(self.rank, min(end, n), W)
        )
        self.model.train()
        if W > 1:
            counted = torch.tensor(float(count), device=self.device, dtype=torch.float64)
            both = dist_.all_reduce_sum_(torch.stack([total, counted]))
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

    # ----- checkpoints -------------------------------------------------------------------------
    def train_state(self, optimizer_state: dict | None = None) -> dict[str, Any]:
        if optimizer_state is None:
            optimizer_state = self.optimizer.state_dict()
        return train_state_of(self, optimizer_state, self.best_val_loss, self.run_info)

    def save(self, best: bool = False) -> Path | None:
        """A checkpoint written on rank 0 (every rank calls this: FSDP2 gathers collectively)."""
        model_sd, optimizer_sd = dist_.gather_state(
            self.model, self.optimizer, self.state_fn, self.rank
        )
        if not best:
            self.saved_step = self.step
        if not self.is_main:
            return None
        # never into a folder that replaced the one this run locked
        RunDir(self.run_dir).check_held()
        path = RunDir(self.run_dir).best if best else self.ckpt_root / ckpt.step_name(self.step)
        meta = {"kind": BEST if best else "step", "val_loss": self.best_val_loss}
        try:
            ckpt.save_checkpoint(path, model_sd, self.train_state(optimizer_sd), meta)
        # torch.save and safetensors report a full disk as their own errors, not OSError
        except Exception as e:
            # a full disk or a lost mount: the half-written folder is gone already (atomic_output)
            raise self._write_failed(f"checkpoint {path}", e) from e
        if not best:
            ckpt.prune(self.ckpt_root, self.cfg.keep_last)
            self.last_saved = path
        for cb in self.callbacks:
            cb.on_checkpoint(path, self.step)
        return path

    def resume(self, path: Path, verified: bool = False) -> None:
        sd, state, _ = ckpt.load_checkpoint(path, verify=not verified)
        if (refusal := resume_refusal(path, state, self.cfg)) is not None:
            raise TrainingError(refusal)
        load_train_state(self, sd, state, self.load_state_fn)
        self.best_val_loss = state.get("best_val_loss")

    # ----- logging -----------------------------------------------------------------------------
    def _log_step(self, step: StepResult, evaluated: bool) -> None:
        """A metrics.jsonl record of this step (the one host-device sync per log interval)."""
        self.last_loss = step.loss_sum.item() / max(step.n_targets, 1)
        self._check_finite(self.last_loss)
        self.tokens_per_s = self.throughput.rate()
        m = {
            "step": self.step,
            "loss": round(self.last_loss, 6),
            "lr": step.lr,
            "grad_norm": float(step.grad_norm),
            "tokens": tokens_through(self.cfg, self.step, self.max_steps),
            "tokens_per_s": round(self.tokens_per_s, 1) if self.tokens_per_s else None,
        }
        if self.device.type == "cuda":
            m["memory_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 1e9, 3)
        if evaluated:
            self.val_loss = m["val_loss"] = self.evaluate()
        if self.max_steps is not None:
            expected = expected_final_loss(
                self.history + [m], self.max_steps, self.cfg.warmup_steps
            )
            if expected is not None:
                m["expected_final_loss"] = round(expected, 4)
        for cb in self.callbacks:
            cb.on_metrics(m)
        self.throughput.restart()
        self._log(m)

    def _log(self, m: dict) -> None:
        self.history.append(m)
        if self.is_main:
            RunDir(self.run_dir).append_metrics(m)
        for cb in self.callbacks:
            try:
                cb.on_log(m)
            except Exception as e:  # a broken plot must never stop training
                warnings.warn(f"callback {cb!r} failed in on_log: {e}", stacklevel=2)

    # ----- failures ----------------------------------------------------------------------------
    def _agree_to_stop(self) -> bool:
        """Every rank must stop at the same step, however the signals reached them."""
        stopping = self.signals.received is not None
        if self.world_size > 1:
            stopping = dist_.agree_sum([int(stopping)])[0] > 0
        return stopping

    def _raise_peer_failure(self, e: Exception) -> None:
        """Under torchrun, a dead or hung peer becomes one message that says how to resume."""
        if self.world_size > 1 and not isinstance(e, TrainingError) and dist_.is_peer_failure(e):
            raise TrainingError(
                f"process {self.rank} of {self.world_size} lost its peers at step {self.step} "
                f"({type(e).__name__}: {str(e)[:160]}...): another process of this job died or "
                "hung (torchrun's report names it). "
                + self._where_to_resume("run the same command again, with any number of processes")
            ) from e

    def _write_failed(self, what: str, e: BaseException) -> TrainingError:
        text = str(e)
        why = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
        if getattr(e, "errno", None) == errno.ENOSPC or any(m in text for m in _DISK_FULL):
            why = f"the disk is full ({os.strerror(errno.ENOSPC)})"
        return TrainingError(
            f"could not write {what} at step {self.step}: {why}. "
            + self._where_to_resume("free some disk space and run the same command again")
        )

    def _where_to_resume(self, then: str) -> str:
        """The end of a failure's message: `then` (what to do) resumes from the last good
        checkpoint, or, with none saved yet, starts the run again from step 0."""
        last = self.last_saved or ckpt.latest_valid(self.ckpt_root)
        if last is None:
            return f"No checkpoint was saved yet: {then} to start again from step 0"
        return f"The last good checkpoint is {last}: {then} to resume from it"

    def _check_finite(self, value: float, what: str = "loss") -> None:
        if math.isfinite(value):
            return
        if what == "gradient norm" and self.precision.use_scaler:
            # fp16: the scaler skipped this step and lowered its scale; the weights are intact
            return
        last = self.last_saved or ckpt.latest_valid(self.ckpt_root)
        change = "a lower learning rate (--set train.lr=...)" + (
            " or precision bf16/fp32 instead of fp16" if self.precision.use_scaler else ""
        )
        # a first try that saved nothing leaves nothing behind: the same folder takes new settings
        if last is None:
            raise TrainingError(
                f"the {what} became {value} at step {self.step}, before any checkpoint was saved: "
                f"run again with {change}; it starts from step 0"
            )
        # the rate and the precision are part of a run's configuration: a run folder with
        # checkpoints keeps its own
        raise TrainingError(
            f"the {what} became {value} at step {self.step}; nothing was saved after it. The last "
            f"good checkpoint is {last}. Train with {change} in a new run folder (--run-dir): this "
            "one keeps the settings it began with"
        )
