"""Pretraining end to end: validate, tokenizer, token cache, model, trainer, sample.

This is what `tinygpt pretrain` and the 01_pretrain notebook call. Everything that can be checked is
checked before the first token is encoded, and a run folder that holds a different configuration is
refused rather than overwritten. Under torchrun every process calls it; rank 0 prepares the
tokenizer, the token cache and the run folder while the others wait."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tinygpt import __version__
from tinygpt.core import checkpoint as ckpt
from tinygpt.core.callback import Callback
from tinygpt.core.config import ConfigError, TrainConfig
from tinygpt.core.files import read_json_safe, refuse_links_in
from tinygpt.core.folders import refuse_other_kind
from tinygpt.core.precision import Precision, choose_precision
from tinygpt.core.recipes import Recipe, get_recipe
from tinygpt.core.rundir import RUN_JSON, TENSORBOARD, TOKENIZER_JSON, RunDir
from tinygpt.core.runlock import lock, undo_if_first_try_fails
from tinygpt.core.same_settings import check_same_settings
from tinygpt.data.sampler import WindowSampler, fixed_batches
from tinygpt.data.sources import check_source, same_path_source
from tinygpt.data.tokens import RunData, open_tokens
from tinygpt.fit.hardware import check_device, check_fits, gpu_peak_tflops
from tinygpt.fit.ladder import PLANNED_FIELDS
from tinygpt.fit.plan import SizePlan, planned_here
from tinygpt.fit.probe import fit_to_device
from tinygpt.fit.report import PlanReport
from tinygpt.model.fast_options import check_fast_options
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import Tokenizer
from tinygpt.pretrain.init import Base, initial_model, starting_base
from tinygpt.pretrain.mirror_trust import MIRROR_MAY_DIFFER, check_mirror_run
from tinygpt.pretrain.pretrain_options import PretrainOptions
from tinygpt.pretrain.run_tokenizer import check_tokenizer, get_tokenizer
from tinygpt.sync.mirrored import RunMirror, mirrored
from tinygpt.train.callbacks import (
    MFU,
    Progress,
    Samples,
    StartupReport,
    TensorBoardLogger,
    sample_prompt,
)
from tinygpt.train.compile_cache import CompileCache, describe, signing_key
from tinygpt.train.decisions import own_signature, sign
from tinygpt.train.distributed import (
    Ranks,
    check_parallel,
    joined,
    main_process_first,
    split_global_batch,
)
from tinygpt.train.startup import StartupClock
from tinygpt.train.time_budget import TimeBudget
from tinygpt.train.trainer import TrainData, Trainer, TrainResult


def versions() -> dict[str, str]:
    return {"tinygpt": __version__, "torch": torch.__version__, "python": platform.python_version()}


def check_run_dir(run_dir: Path, recipe: Recipe, resume: str, sized: bool = False) -> None:
    """Refuse a run folder that holds another configuration, or checkpoints when resume is 'never'.
    What this machine decides may differ from run.json, which is then rewritten: the probe's fields
    (the trainer compares a checkpoint's own), and under --size auto with no checkpoint the size
    (`plan_run`; with one, the checkpoint's size and run.json's model must agree)."""
    run = RunDir(run_dir)
    saved = ckpt.list_checkpoints(run.checkpoints)
    if run.is_pretrain_run():
        info = run.info()
        # read back through Recipe: a field added since the run began compares as its default
        old, new = Recipe.from_dict(info["recipe"]).to_dict(), recipe.to_dict()
        check_same_settings(
            f"run folder {run_dir} (its {RUN_JSON})",
            {k: old.get(k) for k in ("model", "train", "data")},
            {k: new[k] for k in ("model", "train", "data")},
            what="a different configuration"
            + (
                " (its size was planned by --size auto: add --size auto to resume it)"
                if "plan" in info and not sized
                else ""
            ),
            allowed=MIRROR_MAY_DIFFER | (PLANNED_FIELDS if sized and not saved else set()),
        )
    if resume == "never" and saved:
        raise ConfigError(
            f"run folder {run_dir} already has checkpoints and --resume never would overwrite "
            "them: use --resume auto to continue, or another run folder (a new --run-dir or "
            "RUN_NAME)"
        )


def pretrain(
    recipe: Recipe | str = "cpu",
    run_dir: str | Path = "runs/default",
    options: PretrainOptions | None = None,
    **option_fields: Any,
) -> TrainResult:
    """Train a recipe into `run_dir`, resuming from its newest valid checkpoint (or the mirror's).
    Pass a `PretrainOptions`, or its fields as keywords (`pretrain("cpu", "runs/x",
    max_steps=100)`). Started by torchrun with several processes, each joins the process group
    (`distributed.joined`) and trains its share of the recipe's global batch.

    The recipe flows down once: resolved here (overrides, then this process's device), checked
    before any work (`check_recipe`), fitted to the machine by `plan_run` once the run folder is
    held (by rank 0 alone: one writer per folder; a failed first try leaves nothing behind) and
    restored from the mirror, and from then on read from the `Plan`. The restore comes before the
    plan: on a new VM, a run that the probe fitted to its GPU finds its choices in the restored
    run.json and keeps them (probed again, it could choose otherwise and be refused as another
    configuration). Rank 0 prepares first (the other ranks then find run.json, tokenizer and token
    cache made). The trainer closes its callbacks when training ends (the mirror last: it finishes
    its copies); then the token shards and the lock are let go, whatever ended the run (`mirrored`
    closes a mirror that training never reached)."""
    opts = options or PretrainOptions(run_dir=run_dir, **option_fields)
    given = get_recipe(recipe) if isinstance(recipe, str) else recipe
    recipe = source_as_the_run_spells_it(opts.apply(given), opts.run_dir, opts.mirror)
    with joined(recipe.train.device, opts.parallel) as (dev, ranks), contextlib.ExitStack() as held:
        clock = StartupClock()
        clock.notes += [note] if (note := opts.budget_note(given)) else []
        token_ids = check_recipe(recipe, opts, dev, ranks)
        # a link in the run folder (.lock, metrics.jsonl, checkpoints/) is never followed
        refuse_links_in(opts.run_dir)
        # a finetuning run, an export: untouched
        refuse_other_kind(opts.run_dir, "pretraining run", "pretrain")
        # another run's mirror: refused before any copy
        check_mirror_run(recipe, opts.mirror if ranks.is_main else None, sized=opts.size == "auto")
        if ranks.is_main:
            folder = RunDir(opts.run_dir)
            held.enter_context(lock(folder))
            held.enter_context(undo_if_first_try_fails(folder, RUN_JSON))
        with main_process_first(ranks.rank, ranks.world_size):
            # a mirror that another run owns is refused here, before anything is copied or written;
            # the identity leaves out what the probe chooses, so it is known before the probe runs
            mirror = held.enter_context(
                mirrored(opts.run_dir, opts.mirror if ranks.is_main else None, recipe.identity())
            )
            clock.mark("restore")
            plan = plan_run(recipe, opts, dev, ranks, clock, token_ids)
            # held before anything else can fail: a failed
            # write below still stops the tokenizing process
            data = held.enter_context(prepare_run(plan, opts))
            if ranks.is_main:
                _write_run_files(opts.run_dir, plan, data.tokenizer, data.meta)
        return train(plan, opts, data, mirror)


def source_as_the_run_spells_it(recipe: Recipe, *folders: str | Path | None) -> Recipe:
    """The recipe with data.source as the run being resumed recorded it (the first of `folders`
    with a run.json: the run folder, then its mirror), where both name the same file or folder
    (`same_path_source`): `--data ../wiki.txt` resumes a run begun with `--data /work/wiki.txt`
    instead of being refused as another configuration. Anything else is left to the checks."""
    for folder in folders:
        path = Path(folder) / RUN_JSON if folder is not None else None
        if path is None or not os.path.lexists(path):
            continue
        try:
            theirs = read_json_safe(path)["recipe"]["data"]["source"]
        except (OSError, ValueError, KeyError, TypeError):
            return recipe  # unreadable: the run folder's and the mirror's checks say so
        if (
            isinstance(theirs, str)
            and theirs != recipe.data.source
            and same_path_source(recipe.data.source, theirs)
        ):
            return recipe.replace(data={"source": theirs})
        return recipe
    return recipe


def check_recipe(recipe: Recipe, opts: PretrainOptions, dev: torch.device, ranks: Ranks) -> bool:
    """What can be checked before any work, before a byte is copied from the mirror: the data source
    and the tokenizer that reads it, the parallel mode (and samples under FSDP), the device, and
    that the model fits its memory. Returns whether the source holds token ids (nothing to
    tokenize), as resolved here."""
    # an unknown or unreachable source fails here
    token_ids = check_source(recipe.data.source) == "tokens"
    check_tokenizer(recipe, token_ids)
    t = recipe.train
    check_parallel(opts.parallel, t.optimizer, ranks.world_size, sample_every=t.sample_every)
    check_device(dev)
    # the probe may lower a GPU's micro-batch to 1 (and checkpoint activations): only that must fit
    micro = 1 if dev.type == "cuda" else t.micro_batch_size
    precision = choose_precision(dev, t.precision).name
    check_fits(recipe.model, micro, t.seq_len, precision, dev, t.loss, what=f"recipe {recipe.name}")
    check_fast_options(recipe.model, t, dev, precision)  # a speed option's package or GPU
    return token_ids


@dataclass(frozen=True)
class Plan:
    """A recipe as this process trains it, decided once before anything is written (`plan_run`)."""

    recipe: Recipe  # with the probe's choices (or the run's own, when it resumes)
    device: torch.device
    precision: Precision
    ranks: Ranks
    probe: dict | None  # the probe's result, kept in run.json; None where it did not run
    # --size auto: the plan (a dict when kept from run.json); else None
    size: SizePlan | dict | None
    # the data source is a folder of token ids (nanoGPT's, llm.c's): nothing to tokenize
    token_ids: bool
    # a continued run's base where this start needs it (`starting_base`), read once
    base: Base | None
    # where the start-up time goes, from the moment the process joined the job
    clock: StartupClock

    @property
    def is_main(self) -> bool:
        return self.ranks.is_main

    def train_config(self) -> TrainConfig:
        """The trainer's settings: the recipe's, on this process's device."""
        return replace(self.recipe.train, device=str(self.device))


def plan_run(
    recipe: Recipe,
    opts: PretrainOptions,
    dev: torch.device,
    ranks: Ranks,
    clock: StartupClock,
    token_ids: bool,
) -> Plan:
    """Read a continued run's base (at its first start: another network is refused here, before any
    work), size it (`--size auto`), let the probe fit the recipe to the GPU, then split the global
    batch over the ranks and settle the precision. A resumed run keeps the size and the probe's
    choices it began with where its run.json is this user's (`decisions.own_signature`); any other
    (a shared mirror's) is state only, and this machine decides them again."""
    base = starting_base(recipe, opts.run_dir, opts.resume)
    size = None
    run = RunDir(opts.run_dir)
    info = run.info_or_empty()
    # this user's run.json, or the one rank 0 wrote for this job: its decisions stand
    own = not ranks.is_main or own_signature(info)
    if opts.size == "auto":  # a kept plan applies only here
        where = f"{run.path / RUN_JSON}" + (
            f" (from the mirror {opts.mirror})" if opts.mirror else ""
        )
        recipe, size = planned_here(recipe, opts.hours, dev, info, own, run.checkpoints, where)
        clock.mark("plan")
    probe_info = None
    if opts.probe == "auto":
        recipe, probe_info = fit_to_device(recipe, opts.run_dir, dev, ranks.world_size, own)
    clock.mark("probe")
    split_global_batch(
        recipe.train.micro_batch_size, recipe.train.grad_accum_steps, ranks.world_size
    )
    precision = choose_precision(dev, recipe.train.precision)
    return Plan(recipe, dev, precision, ranks, probe_info, size, token_ids, base, clock)


def prepare_run(plan: Plan, opts: PretrainOptions) -> RunData:
    """Check the run folder (on rank 0), get the tokenizer, open the tokens (on rank 0, a background
    process starts tokenizing: the caller closes what this returns)."""
    run = RunDir(opts.run_dir)
    kept = (
        not plan.is_main
        or bool(ckpt.list_checkpoints(run.checkpoints))
        or own_signature(run.info_or_empty())
    )
    if plan.is_main:
        check_run_dir(opts.run_dir, plan.recipe, opts.resume, sized=opts.size == "auto")
    tokenizer = get_tokenizer(plan.recipe, opts.run_dir, plan.base, kept)
    plan.clock.mark("tokenizer")
    where = dict(writer=plan.is_main, cache_dir=opts.cache_dir, mirror=opts.mirror)
    return open_tokens(plan.recipe, tokenizer, plan.token_ids, **where)


def train(plan: Plan, opts: PretrainOptions, data: RunData, mirror: RunMirror) -> TrainResult:
    """The model, the sampler, the validation batches, the model's callbacks (the mirror last), the
    trainer, which closes them all when it ends. Nothing here waits for the first shard: the trainer
    compiles its step while the shard is being tokenized (`TrainStep.compile_ahead`), then takes the
    validation batches and the first batch, which wait for it."""
    t = plan.recipe.train
    torch.manual_seed(t.seed)
    model = initial_model(plan.recipe.model, plan.base)  # random, or a base's weights (model.init)
    plan.clock.mark("model")
    sampler = WindowSampler(
        data.tokens, t.seq_len, t.seed, eot_id=data.tokenizer.eot_id if t.doc_mask else None
    )

    def val() -> list:  # a training split too short is said before a validation split too short
        sampler.check_first_shard()
        held_out = data.tokens.validation(t.eval_batches * t.micro_batch_size * t.seq_len + 1)
        return fixed_batches(held_out, t.seq_len, t.micro_batch_size, t.eval_batches)

    # a checkpoint alone can be decoded: it carries the recipe (its train part once, as the
    # trainer's train_config) and the tokenizer
    run_info = {
        "recipe": {k: v for k, v in plan.recipe.to_dict().items() if k != "train"},
        "tokenizer": data.tokenizer.to_json(),
    }
    callbacks = [*run_callbacks(plan, opts, model, data), *([mirror] if plan.is_main else [])]
    kw = dict(ranks=plan.ranks, callbacks=callbacks, run_info=run_info)
    trainer = Trainer(model, plan.train_config(), TrainData(sampler, val), opts.run_dir, **kw)
    plan.clock.mark("data")
    return trainer.fit(opts.resume)


def compile_cache_for(plan: Plan, opts: PretrainOptions, model: GPT) -> CompileCache:
    """The run's compile cache, signed with this user's key (never kept on the mirror)."""
    t = plan.recipe.train
    key, note = signing_key()
    return CompileCache(
        opts.run_dir,
        key,
        describe(model, plan.device, plan.precision.name, t.micro_batch_size, t.seq_len, t.compile),
        note,
    )


def run_callbacks(plan: Plan, opts: PretrainOptions, model: GPT, data: RunData) -> list[Callback]:
    """A pretraining run's side concerns, in the order they act: the start-up record and compile
    cache, the time budget (which fixes the step count the bar shows), MFU, the bar, the samples;
    the caller's callbacks; then, on rank 0, TensorBoard (when wanted and installed). The mirror
    comes after all of them."""
    cache = compile_cache_for(plan, opts, model) if plan.ranks.world_size == 1 else None
    peak = opts.peak_tflops or gpu_peak_tflops(plan.device, plan.precision.name)
    out: list[Callback] = [StartupReport(plan.clock, cache)]
    if opts.hours is not None:
        out.append(TimeBudget(opts.hours))
    out.append(MFU(peak))
    if opts.progress:
        out.append(Progress())
    if plan.size is not None:  # after the bar: it prints what is said
        out.append(PlanReport(plan.size))
    # rank 0 alone cannot run the model
    sharded = plan.ranks.world_size > 1 and plan.ranks.parallel == "fsdp"
    prompt = functools.partial(
        sample_prompt, opts.sample_prompt, plan.recipe.data.source, data.tokenizer, data.tokens
    )
    every, whole = plan.recipe.train.sample_every, plan.recipe.model if sharded else None
    out.append(Samples(data.tokenizer, opts.run_dir, every, prompt, whole=whole))
    out += list(opts.callbacks)
    if plan.is_main and opts.tensorboard is not False:
        tb = TensorBoardLogger.create(opts.run_dir / TENSORBOARD, required=bool(opts.tensorboard))
        if tb is not None:
            out.append(tb)
    return out


def _write_run_files(run_dir: Path, plan: Plan, tokenizer: Tokenizer, data_meta: dict) -> None:
    """tokenizer.json (kept once written: a resumed run must use the same one) and run.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / TOKENIZER_JSON).is_file():
        tokenizer.save(run_dir / TOKENIZER_JSON)
    info = {
        "recipe": plan.recipe.to_dict(),
        "precision": plan.precision.to_dict(),
        "device": str(plan.device),
        "data": data_meta,
        "probe": plan.probe,
        **(
            {"plan": plan.size if isinstance(plan.size, dict) else plan.size.to_dict()}
            if plan.size
            else {}
        ),
        "versions": versions(),
        "command": " ".join(sys.argv),
    }
    RunDir(run_dir).write_info(sign(info))  # this user's decisions (`decisions`)
