"""One optimizer step (`TrainStep`) and what it needs: the model compiled (whole, or block by
block), the batch source, the learning-rate schedule. The probe and the benchmarks time it; the
Trainer (`tinygpt.train.trainer`) runs it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from tinygpt.core.batch_schedule import batch_rows
from tinygpt.core.config import ConfigError, TrainConfig
from tinygpt.core.precision import choose_precision, compiles, enable_tf32, resolve_device
from tinygpt.data.sampler import batch_to_device
from tinygpt.model.fast_options import apply_fast_options
from tinygpt.model.gpt import GPT, cross_entropy
from tinygpt.model.losses import IGNORE_INDEX, resolve_loss
from tinygpt.model.masks import training_mask
from tinygpt.train import distributed as dist_
from tinygpt.train.budget import decay_start
from tinygpt.train.distributed import Ranks
from tinygpt.train.optim import build_optimizer


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of transformer blocks: a tinygpt GPT's `blocks()`, or in a Hugging Face
    model (under `FinetuneLoss` and PEFT's wrappers too) the `nn.ModuleList` of the layer classes
    its `_no_split_modules` names. None if the model declares none."""
    for module in model.modules():
        if isinstance(module, GPT):
            return module.blocks()
        declared = set(getattr(module, "_no_split_modules", None) or ())
        if declared:
            for sub in module.modules():
                if (
                    isinstance(sub, torch.nn.ModuleList)
                    and len(sub) > 0
                    and all(type(m).__name__ in declared for m in sub)
                ):
                    return sub
    return None


def regional(model: torch.nn.Module, mode: str) -> bool:
    """Whether `compiled` compiles `model` by regions: asked ("regional"), or the default ("auto")
    for a tinygpt GPT, as torchtitan compiles (each block, then the head and the loss), and for a
    model whose transformer blocks are found (a finetuning base: each decoder layer; transformers'
    mask is then built outside the graphs, where unpacked rows get none and packed ones a
    FlexAttention block mask on a GPU)."""
    return mode == "regional" or (
        mode == "auto" and (isinstance(model, GPT) or transformer_blocks(model) is not None)
    )


def compiled(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """The model to run steps with. By regions (`regional`): each transformer block compiled in
    place (identical blocks share one graph, so compile time does not grow with depth), the head and
    the loss a second region (`regional_loss`); otherwise the whole model, as one graph."""
    blocks = transformer_blocks(model) if regional(model, mode) else None
    if blocks is not None:
        # a tinygpt GPT's blocks as whole graphs of static shapes: a graph break is an error
        strict = {"fullgraph": True, "dynamic": False} if isinstance(model, GPT) else {}
        for block in blocks:
            block.compile(**strict)
        return model
    return torch.compile(model)


@functools.cache
def _head_and_loss() -> Callable:
    return torch.compile(cross_entropy, fullgraph=True, dynamic=False)


def regional_loss(
    model: GPT,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: str = "auto",
    reduction: str = "sum",
    mask=None,
) -> torch.Tensor:
    """`default_loss` with the head and the loss compiled as one region of their own."""
    hidden, cap = model.hidden_states(x, mask=mask), model.config.logit_softcap
    return _head_and_loss()(model.lm_head, hidden, y, reduction, loss, cap)


def eager():
    """Run compiled code eagerly inside this block (no compile, no recompile), where torch can.
    A process that has not imported the compiler has no compiled code (and is spared its import)."""
    if "torch._dynamo" in sys.modules and hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


class BatchSource(Protocol):
    """Batches are (x, y, *extra): extra tensors (packed records' position ids) go to `loss_fn`."""

    def next_batch(
        self, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, ...]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class ModelIO:
    """How the trainer takes a model's loss and saves it, where that is not a tinygpt GPT's way:
    `loss_fn(model, x, y, *extra)` returns the summed token loss; `state_fn` / `load_state_fn`
    choose what a checkpoint holds (only the adapters, for LoRA)."""

    loss_fn: Callable | None = None
    state_fn: Callable | None = None
    load_state_fn: Callable | None = None


@dataclass
class StepResult:
    """What one optimizer step leaves on the device for the actions after it (not read back yet)."""

    lr: float
    loss_sum: torch.Tensor  # summed token loss of the step (this rank's, until reduced)
    n_targets: int  # target tokens of the whole global step
    grad_norm: torch.Tensor
    tokens: int  # tokens of the whole global step (fewer during a batch warm-up)


class TrainStep:
    """The optimizer step of `model` on batches from `source`, and nothing else: no run folder, no
    logging. With `ranks.world_size` > 1 (an initialised process group) `cfg` is the global batch
    and this rank trains its share with DDP or FSDP2."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainConfig,
        source: BatchSource,
        io: ModelIO | None = None,
        ranks: Ranks | None = None,
    ):
        io, ranks = io or ModelIO(), ranks or Ranks()
        self.cfg, self.train_source, self.ranks = cfg, source, ranks
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.device = resolve_device(cfg.device)
        self.precision = choose_precision(self.device, cfg.precision)
        # the speed options: refused here where they cannot run, the FP8 head swapped in
        model = apply_fast_options(model, cfg, self.device, self.precision.name)
        self.model = model.to(self.device)
        # training-time attention masks (`model.masks`): a tinygpt GPT's pretraining only
        self.masked = cfg.doc_mask or cfg.window_start > 0
        if self.masked and io.loss_fn is not None:
            raise ConfigError(
                "train.doc_mask and train.window_start are for pretraining a tinygpt "
                "model: set them to false and 0 here"
            )
        if cfg.batch_warmup and ranks.world_size > 1:
            raise ConfigError(
                "train.batch_warmup trains in one process: set it to 0 to train under torchrun"
            )
        # this rank's share of the global batch; cfg (compared at resume) stays the recipe's
        self.micro_batch_size, self.grad_accum_steps = dist_.split_global_batch(
            cfg.micro_batch_size, cfg.grad_accum_steps, ranks.world_size
        )
        # on a GPU, "auto" is the full logits where they fit this micro-batch in the free memory
        self.loss_mode = resolve_loss(
            cfg.loss,
            self.micro_batch_size * cfg.seq_len,
            getattr(getattr(model, "config", None), "vocab_size", 0),
            self.device,
        )
        self.step = 0
        self.max_steps: int | None = cfg.max_steps  # None while a time budget has not decided it
        if self.device.type == "cuda":
            enable_tf32()
        self._compile_or_wrap(model, io, ranks)
        self.optimizer = build_optimizer(
            self.model, cfg, self.device.type, compiled=self.use_compile
        )
        self.scaler = dist_.grad_scaler(self.precision, self.model)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._loss_sum = torch.zeros((), device=self.device)

    def _compile_or_wrap(self, model: torch.nn.Module, io: ModelIO, ranks: Ranks) -> None:
        """The loss function and the model that runs the steps (compiled, whole or by regions, or
        wrapped for several ranks) and the one evaluation runs (eager)."""
        cfg = self.cfg
        self.use_compile = compiles(cfg.compile, self.device.type)
        plain = io.loss_fn is None and ranks.world_size == 1 and isinstance(model, GPT)
        # one batch shape per step: `compile_ahead` can make its graphs
        self.ahead = plain and self.use_compile
        by_region = plain and self.use_compile and regional(model, cfg.compile)
        self.loss_fn = io.loss_fn or functools.partial(
            regional_loss if by_region else default_loss, loss=self.loss_mode
        )
        # The compiled wrapper runs the steps; self.model (uncompiled, same parameters) is what
        # is saved, so checkpoint keys never carry `_orig_mod.`.
        if ranks.world_size > 1:  # before the optimizer: FSDP2 replaces the parameters by shards
            dist_.check_parallel(
                ranks.parallel,
                cfg.optimizer,
                ranks.world_size,
                custom_state=io.state_fn is not None,
            )
            self.forward_model, self.eval_model = dist_.wrap_model(
                self.model, ranks.parallel, self.device, self.use_compile
            )
        else:
            self.forward_model = (
                compiled(self.model, cfg.compile) if self.use_compile else self.model
            )
            # Evaluation runs eagerly: a no-grad graph would be a second compile (75 s for 124M on
            # an H100) for a few forward passes per eval_every steps, and under "regional" a
            # recompile.
            self.eval_model = self.model

    def compile_ahead(self) -> bool:
        """Compile the step's graphs now, on a batch of its shape whose tokens are not data (zeros,
        one document), so that a run compiles while its first shard is being tokenized and its first
        step finds the graphs made (`tests/test_startup.py` counts 0 compiled after). Nothing else
        moves: no parameter, optimizer state or random state (the gradients are dropped, the
        generators put back). Only a tinygpt GPT's pretraining step (one shape for every batch);
        elsewhere nothing. Whether it compiled anything."""
        if not self.ahead:
            return False
        B, T = self._rows()[0], self.cfg.seq_len  # the first step's (fewer in a batch warm-up)
        batch = [torch.zeros(B, T, dtype=torch.long) for _ in range(2)]  # two tensors, as a batch's
        if self.masked and self.cfg.doc_mask:
            batch.append(torch.zeros(B, T, dtype=torch.int32))  # `document_ids`: one document
        window = window_at(self.step, self.cfg, self.max_steps)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            with self.precision.autocast():
                self._micro_loss(batch, window).backward()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _rows(self) -> list[int]:
        """This step's sequences, each micro-batch's: this rank's share of the global batch, or the
        batch warm-up's (`batch_rows`; one process only)."""
        if self.cfg.batch_warmup:
            return batch_rows(self.cfg, self.step, self.max_steps)
        return [self.micro_batch_size] * self.grad_accum_steps

    def _micro_loss(self, batch: tuple | list, window: int | None) -> torch.Tensor:
        """One micro-batch's summed loss: the batch moved to the device, the training mask made
        (`window`, and the sampler's document ids, which are for the mask only)."""
        x, y, *extra = batch_to_device(batch, self.device)
        kw = {}
        if self.masked:
            docs = extra.pop(0) if self.cfg.doc_mask and extra else None
            kw["mask"] = training_mask(docs, window, *x.shape, self.device)
        return self.loss_fn(self.forward_model, x, y, *extra, **kw)

    def optimizer_step(self) -> StepResult:
        """One optimizer step over `grad_accum_steps` micro-batches; nothing is read back."""
        lr = lr_at(self.step, self.cfg, self.max_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        rows = self._rows()
        micro = [self.train_source.next_batch(n, self.rank, self.world_size) for n in rows]
        # The loss normalisation: each micro-batch's loss is a sum over its tokens, and the step
        # divides by the target tokens of the whole (global) step, counted on the host before any
        # forward (no sync). A mean per micro-batch would weigh a short or heavily masked
        # micro-batch (prompt tokens are IGNORE_INDEX in finetuning) as much as a full one; this way
        # accumulation, or W ranks, give the gradient of one big batch. DDP / FSDP2 average
        # gradients over ranks, hence the factor W:
        #   grad = sum over ranks r and micro-batches m of d(loss_sum[r, m]) * W / n_global / W
        #        = d(sum of every target token's loss) / n_global, the mean over the global batch.
        n_targets = sum(int((batch[1] != IGNORE_INDEX).sum()) for batch in micro)
        n_global = dist_.agree_sum([n_targets])[0] if self.world_size > 1 else n_targets
        # The logged loss is this step's own (not an average since the last log), so a run
        # resumed between two logs writes the same numbers as one never stopped.
        self._loss_sum.zero_()
        window = window_at(self.step, self.cfg, self.max_steps)
        for i, batch in enumerate(micro):
            with (
                dist_.gradient_sync(self.forward_model, self.model, i == len(micro) - 1),
                self.precision.autocast(),
            ):
                loss_sum = self._micro_loss(batch, window)
                self.scaler.scale(loss_sum * (self.world_size / max(n_global, 1))).backward()
            self._loss_sum += loss_sum.detach().float()
        self.scaler.unscale_(self.optimizer)
        grad_norm = dist_.local_value(
            torch.nn.utils.clip_grad_norm_(self._params, self.cfg.grad_clip)
        )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        tokens = sum(rows) * self.cfg.seq_len * self.world_size
        return StepResult(lr, self._loss_sum, n_global, grad_norm, tokens)


def lr_at(step: int, cfg: TrainConfig, max_steps: int | None | str = "recipe") -> float:
    """Linear warmup over warmup_steps, then down to min_lr, reached at the last step run
    (max_steps - 1): "cosine" a half cosine from the end of the warmup, "wsd" lr held until the
    last decay_fraction of the steps, then a straight line. `max_steps`: the run's length where a
    time budget decides it, None while undecided (until the decay, wsd's rate does not need it)."""
    n = cfg.max_steps if max_steps == "recipe" else max_steps
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    start = cfg.warmup_steps
    if cfg.schedule == "wsd":
        start = decay_start(n, cfg.decay_fraction) if n is not None else None
        if start is None or step < start:
            return cfg.lr
    progress = 1.0 if step >= n - 1 else (step - start) / (n - 1 - start)
    if cfg.schedule == "wsd":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def window_at(step: int, cfg: TrainConfig, max_steps: int | None | str = "recipe") -> int | None:
    """The attention window at `step` (`TrainConfig.window_start`): window_start tokens at step 0,
    growing linearly to seq_len at the decay's first step (wsd; cosine: the last step) and seq_len
    from there on, so that the run ends attending as the saved model does. None: no window.
    `max_steps` as `lr_at` takes it (None: undecided, the recipe's count meanwhile)."""
    if not cfg.window_start:
        return None
    n = cfg.max_steps if max_steps in ("recipe", None) else int(max_steps)
    full = decay_start(n, cfg.decay_fraction) if cfg.schedule == "wsd" else n - 1
    if step >= full:
        return cfg.seq_len
    grown = cfg.window_start + (cfg.seq_len - cfg.window_start) * step / max(1, full)
    return min(cfg.seq_len, math.ceil(grown))


def default_loss(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str = "auto", mask=None
) -> torch.Tensor:
    """A tinygpt GPT's token loss, summed so that the step can divide by the target tokens of all
    its micro-batches together; `mask`, a training-time attention mask, passed only if given."""
    if mask is None:
        return model(x, y, reduction="sum", loss=loss)
    return model(x, y, reduction="sum", loss=loss, mask=mask)
