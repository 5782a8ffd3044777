"""Pretraining end to end: validate, tokenizer, token cache, model, trainer, sample.

This is what `tinygpt pretrain` and the 01_pretrain notebook call. Everything that can be checked
is checked before the first token is encoded, and a run folder that holds a different
configuration is refused rather than overwritten. Under torchrun every process calls it; rank 0
prepares the tokenizer, the token cache and the run folder while the others wait.
"""
from __future__ import annotations

import platform
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from tinygpt import __version__
from tinygpt.core import checkpoint as ckpt
from tinygpt.core.config import ConfigError, Recipe, get_recipe
from tinygpt.core.paths import cache_root
from tinygpt.core.precision import choose_precision, resolve_device
from tinygpt.core.rundir import RunDir
from tinygpt.model.generate import generate_text
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import Tokenizer, load_gpt2, train_bpe
from tinygpt.sync.drive import (
    Mirror,
    restore_latest,
    restore_token_cache,
    sync_token_cache,
)
from tinygpt.train.data import (
    WindowSampler,
    build_token_cache,
    cache_key,
    fixed_batches,
    iter_documents,
    resolve_source,
)
from tinygpt.train.distributed import (
    check_parallel,
    main_process_first,
    process_group,
    rank_device,
    split_global_batch,
    torchrun_env,
)
from tinygpt.train.probe import apply_probe
from tinygpt.train.probe import peak_tflops as _peak
from tinygpt.train.probe import probe as run_probe
from tinygpt.train.trainer import Trainer, TrainResult, config_differences

TOKENIZER_TRAIN_CHARS = 3_000_000  # BPE merges settle long before this; training on more only costs time


def default_cache_dir() -> Path:
    return cache_root("tokens")


def versions() -> dict[str, str]:
    return {"tinygpt": __version__, "torch": torch.__version__, "python": platform.python_version()}


def check_run_dir(run_dir: Path, recipe: Recipe, resume: str) -> None:
    """Refuse a run folder that holds another configuration, or checkpoints when resume is 'never'."""
    run = RunDir(run_dir)
    if run.is_pretrain_run():
        old = run.recipe_dict()
        new = recipe.to_dict()
        diffs = config_differences({k: old[k] for k in ("model", "train", "data")},
                                   {k: new[k] for k in ("model", "train", "data")})
        if diffs:
            raise ConfigError(f"run folder {run_dir} holds a different configuration:\n  " + "\n  ".join(diffs)
                              + "\nuse another run folder (a new --run-dir or RUN_NAME), or the same settings to resume")
    if resume == "never" and ckpt.list_checkpoints(run_dir / "checkpoints"):
        raise ConfigError(f"run folder {run_dir} already has checkpoints and --resume never would overwrite "
                          "them: use --resume auto to continue, or another run folder (a new --run-dir or RUN_NAME)")


def get_tokenizer(recipe: Recipe, run_dir: Path) -> Tokenizer:
    """The run's tokenizer.json if the run has one (resume), else trained or loaded as the recipe says."""
    saved = run_dir / "tokenizer.json"
    if saved.is_file():
        return Tokenizer.load(saved)
    d = recipe.data
    if d.tokenizer == "train":
        budget = TOKENIZER_TRAIN_CHARS if d.max_chars is None else min(d.max_chars, TOKENIZER_TRAIN_CHARS)
        sample = iter_documents(type(d)(**{**d.to_dict(), "max_chars": budget}))
        tok = train_bpe(sample, d.vocab_size)
    elif d.tokenizer == "gpt2":
        tok = load_gpt2()
    else:
        tok = Tokenizer.load(d.tokenizer)
    if tok.vocab_size > recipe.model.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but the model only {recipe.model.vocab_size}: "
                          "raise the model's vocab_size")
    return tok


PROBED_TRAIN_FIELDS = ("micro_batch_size", "grad_accum_steps", "seq_len", "precision")


def fit_to_device(recipe: Recipe, run_dir: Path, dev: torch.device, world_size: int = 1) -> tuple[Recipe, dict | None]:
    """The probe decides micro-batch, accumulation, context, precision and activation checkpointing on a
    GPU; returns the recipe and the probe's result. A run being resumed keeps the decisions it started
    with (they are part of its configuration); on a CPU the recipe stands as written."""
    run = RunDir(run_dir)
    if run.is_pretrain_run():
        old = run.info()
        if old.get("probe"):
            r = old["recipe"]
            return recipe.replace(train={k: r["train"][k] for k in PROBED_TRAIN_FIELDS},
                                  model={"activation_checkpointing": r["model"]["activation_checkpointing"]}), old["probe"]
        return recipe, None
    if dev.type != "cuda" or world_size > 1:
        return recipe, None

    result = run_probe(recipe, device=dev)
    return apply_probe(recipe, result), result.to_dict()


def pretrain(recipe: Recipe | str = "cpu", run_dir: str | Path = "runs/default", *, data: str | None = None,
             max_steps: int | None = None, save_every: int | None = None, eval_every: int | None = None,
             resume: str = "auto", mirror: str | Path | None = None, cache_dir: str | Path | None = None,
             device: str | None = None, callbacks: list | tuple = (), progress: bool = True,
             sample_prompt: str | None = None, peak_tflops: float | None = None,
             rank: int | None = None, world_size: int | None = None, parallel: str = "ddp",
             probe: str = "auto", tensorboard: bool | None = None) -> TrainResult:
    """Train a recipe into `run_dir`, resuming from its newest valid checkpoint (or the mirror's).
    Metrics also go to TensorBoard (run_dir/tensorboard) when it is installed, unless tensorboard=False.

    Started by torchrun (RANK and WORLD_SIZE set, world size > 1), it joins the process group
    itself and trains with `parallel` ("ddp" or "fsdp") on the recipe's global batch; passing
    rank and world_size means the caller has set up the process group."""
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if world_size is None:
        env = torchrun_env()
        if env is not None and env.world_size > 1:
            dev = rank_device(device or recipe.train.device, env.local_rank)
            with process_group(env, dev):
                return pretrain(recipe, run_dir, data=data, max_steps=max_steps, save_every=save_every,
                                eval_every=eval_every, resume=resume, mirror=mirror, cache_dir=cache_dir,
                                device=str(dev), callbacks=callbacks, progress=progress, sample_prompt=sample_prompt,
                                peak_tflops=peak_tflops, rank=env.rank, world_size=env.world_size, parallel=parallel,
                                probe=probe, tensorboard=tensorboard)
    rank, world_size = rank or 0, world_size or 1
    train_over: dict[str, Any] = {}
    if max_steps is not None:
        train_over["max_steps"] = max_steps
    if save_every is not None:
        train_over["save_every"] = save_every
    if eval_every is not None:
        train_over["eval_every"] = eval_every
    if device is not None:
        train_over["device"] = device
    recipe = recipe.replace(train=train_over, data={"source": data} if data else None)
    if resume not in ("auto", "never"):
        raise ConfigError(f"resume must be 'auto' or 'never', got {resume!r}")
    if probe not in ("auto", "off"):
        raise ConfigError(f"probe must be 'auto' or 'off', got {probe!r}")
    resolve_source(recipe.data.source)  # an unknown source fails here, before any work
    probe_info = None
    if probe == "auto":
        recipe, probe_info = fit_to_device(recipe, Path(run_dir), resolve_device(recipe.train.device), world_size)
    check_parallel(parallel, recipe.train.optimizer, world_size)
    split_global_batch(recipe.train.micro_batch_size, recipe.train.grad_accum_steps, world_size)
    run_dir = Path(run_dir)
    is_main = rank == 0
    sync = None
    dev = resolve_device(recipe.train.device)
    precision = choose_precision(dev, recipe.train.precision)
    cache_root = Path(cache_dir or default_cache_dir())
    with main_process_first(rank, world_size):  # the others find what rank 0 made
        if mirror is not None:
            if is_main:
                restore_latest(run_dir, Path(mirror))  # a new VM: the mirror's newest valid checkpoint comes home
        if is_main:
            check_run_dir(run_dir, recipe, resume)
        tokenizer = get_tokenizer(recipe, run_dir)
        key = cache_key(recipe.data, tokenizer)
        mirror_cache = Path(mirror).parent / "_token_cache" / key if mirror is not None else None
        if mirror_cache is not None and not (cache_root / key / "meta.json").is_file():
            restore_token_cache(mirror_cache, cache_root / key)  # a new VM skips tokenizing
        tokens = build_token_cache(recipe.data, tokenizer, cache_root, progress=progress and is_main, key=key)
        if is_main:
            _write_run_files(run_dir, recipe, tokenizer, precision, dev, tokens.meta, probe_info)
    cache_upload = None
    if mirror_cache is not None and rank == 0:  # copied once, beside training, never blocking it
        cache_upload = threading.Thread(target=sync_token_cache, args=(tokens.path, mirror_cache), daemon=True)
        cache_upload.start()
    sampler = WindowSampler(tokens.train, recipe.train.seq_len, recipe.train.seed)
    val = fixed_batches(tokens.val, recipe.train.seq_len, recipe.train.micro_batch_size, recipe.train.eval_batches)
    callbacks = list(callbacks)
    if rank == 0 and tensorboard is not False:
        tb = TensorBoardLogger.create(run_dir / "tensorboard", required=bool(tensorboard))
        if tb is not None:
            callbacks.append(tb)
    if mirror is not None and rank == 0:
        sync = Mirror(run_dir, Path(mirror), keep_last=recipe.train.keep_last)
        callbacks.append(sync)
    torch.manual_seed(recipe.train.seed)
    model = GPT(recipe.model)
    if peak_tflops is None and dev.type == "cuda":
        try:
            peak_tflops = _peak(torch.cuda.get_device_name(dev), precision.name)
        except Exception:  # the table is a nicety; training does not depend on it
            peak_tflops = None
    trainer = Trainer(model, recipe.train, sampler, val, run_dir, device=dev, precision=precision,
                      callbacks=callbacks, flops_per_token=model.flops_per_token(recipe.train.seq_len),
                      peak_tflops=peak_tflops, progress=progress, rank=rank, world_size=world_size, parallel=parallel,
                      run_info={"recipe": recipe.to_dict(), "tokenizer": tokenizer.to_json()})
    try:
        result = trainer.fit(resume)
        if rank == 0 and not result.interrupted:
            if world_size > 1 and parallel == "fsdp" and result.checkpoint is not None:
                # rank 0 alone cannot run the sharded model: it samples from the full checkpoint
                model = GPT(recipe.model)
                ckpt.load_model_state(model, ckpt.load_checkpoint(result.checkpoint)[0])
                model.to(dev)
            if sample_prompt is None and recipe.data.source not in ("builtin", "stdlib") and len(tokens.val) >= 8:
                sample_prompt = tokenizer.decode(tokens.val[:8].tolist())  # how a held-out document begins
            write_sample(model, tokenizer, run_dir, result.step, sample_prompt)
    finally:
        for cb in callbacks:
            if hasattr(cb, "close"):
                cb.close()
        if cache_upload is not None:
            cache_upload.join()
    return result


def _write_run_files(run_dir: Path, recipe: Recipe, tokenizer: Tokenizer, precision, dev: torch.device,
                     data_meta: dict, probe_info: dict | None = None) -> None:
    """tokenizer.json (kept once written: a resumed run must use the same one) and run.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "tokenizer.json").is_file():
        tokenizer.save(run_dir / "tokenizer.json")
    info = {"recipe": recipe.to_dict(), "precision": precision.to_dict(), "device": str(dev),
            "data": data_meta, "probe": probe_info, "versions": versions(), "command": " ".join(sys.argv)}
    RunDir(run_dir).write_info(info)


class TensorBoardLogger:
    """Trainer callback: every logged metric as a TensorBoard scalar, x axis = step."""

    def __init__(self, writer):
        self.writer = writer

    @classmethod
    def create(cls, log_dir: Path, required: bool = False) -> "TensorBoardLogger | None":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: Colab has it; elsewhere `pip install tensorboard`
            if required:
                raise ConfigError("TensorBoard logging needs `pip install tensorboard`") from None
            return None
        return cls(SummaryWriter(str(log_dir)))

    def on_log(self, metrics: dict) -> None:
        step = metrics["step"]
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)) and v is not None:
                self.writer.add_scalar(f"train/{k}" if k != "val_loss" else "val/loss", v, step)

    def close(self) -> None:
        self.writer.close()


def write_sample(model: GPT, tokenizer: Tokenizer, run_dir: Path, step: int, prompt: str | None = None) -> str:
    """Append a generated sample to samples.txt and return it."""
    model.eval()
    text = generate_text(model, tokenizer, prompt or "def ", max_new_tokens=120, temperature=0.8, top_k=50, seed=0)
    with open(run_dir / "samples.txt", "a", encoding="utf-8") as f:
        f.write(f"=== step {step} ===\n{text}\n\n")
    model.train()
    return text
