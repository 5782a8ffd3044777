"""A finetuning run end to end, LoRA, QLoRA or full: what `tinygpt finetune` and the 02_finetune
notebook call.

`finetune` holds the run folder and reads top to bottom: the data read first (a missing or bad file
fails in seconds, before anything of the base is read), the settings decided once (`_settle`:
hardware class, train settings, the plan from the memory estimate, every refusal), the base exported
and its tokenizer loaded (`_base_folder`), the records tokenized (a bad record fails before a 5 GB
download), the model made trainable (`_trainable_model`), the shared `Trainer` inside `mirrored`,
then the result written out (`_write_result`).

A finetuning run folder holds ``finetune.json``, ``adapter_config.json`` and
``tinygpt_finetune.json`` (what any checkpoint needs to become an adapter), ``base/`` (tinygpt bases
only), ``checkpoints/`` (adapter weights + optimizer + data position: small, so saved often),
``metrics.jsonl`` and, at the end, ``adapter/`` (adapter_config.json + adapter_model.safetensors +
tokenizer). With a mirror (Drive) all of it but ``base/`` is copied there, the adapter last, checked
file by file.

Full finetuning (recipe ``full``, `FinetuneRecipe.lora` None) trains the base itself in fp32 through
the same `FinetuneLoss` and Trainer (`finetune.full`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tinygpt.core.checkpoint import list_checkpoints
from tinygpt.core.config import TrainConfig
from tinygpt.core.files import refuse_links_in, write_json_atomic
from tinygpt.core.folders import refuse_other_kind
from tinygpt.core.precision import choose_precision, resolve_device
from tinygpt.core.rundir import ADAPTER_INFO, BASE_DIR, FINETUNE_JSON, RunDir
from tinygpt.core.runlock import lock, undo_if_first_try_fails
from tinygpt.core.same_settings import check_same_settings
from tinygpt.finetune.full import export_full, full_state, load_full_state, prepare_full
from tinygpt.finetune.instruct import DataReport, build_instruct_data
from tinygpt.finetune.lora import (
    adapter_state,
    attach_lora,
    base_signature,
    check_signature,
    export_adapter,
    export_tinygpt_base,
    load_adapter_state,
    load_base,
    load_tokenizer,
)
from tinygpt.finetune.loss import FinetuneLoss, module_loss
from tinygpt.finetune.memory_plan import (
    FinetunePlan,
    base_config,
    base_config_dict,
    is_tinygpt_run,
    memory_gb_of,
    memory_table,
    plan_finetune,
    resumed_plan,
)
from tinygpt.finetune.presets import (
    FinetuneError,
    FinetuneRecipe,
    check_qlora,
    detect_hardware,
    get_finetune_recipe,
    qlora_compile,
)
from tinygpt.finetune.records import load_records
from tinygpt.fit.hardware import check_device
from tinygpt.sync.copy import mirror_adapter
from tinygpt.sync.mirrored import mirrored
from tinygpt.train.callbacks import Progress
from tinygpt.train.decisions import FINETUNE_DOMAIN, own_signature, sign
from tinygpt.train.step import ModelIO
from tinygpt.train.trainer import TrainData, Trainer


@dataclass
class FinetuneResult:
    run_dir: Path
    adapter_dir: Path | None  # None when training was interrupted by a signal
    train: Any  # trainer.TrainResult
    data: DataReport
    hardware: str
    trainable_params: int
    total_params: int
    memory: list[dict[str, Any]] = field(default_factory=list)
    model: Any = field(default=None, repr=False)  # the PeftModel, ready for generate_response
    tokenizer: Any = field(default=None, repr=False)
    mirrored_adapter: Path | None = None  # the adapter's verified copy on the mirror
    plan: FinetunePlan | None = None  # checkpointing, logits and packing as this run trained
    # full finetuning: the finished model folder (None for LoRA, or when interrupted)
    model_dir: Path | None = None
    base_path: str | None = None  # the base as it was loaded (a Hub id or a folder)


def _holding_the_run_folder(run):
    """`run` with the run folder held: a link in it (.lock, metrics.jsonl, checkpoints/) is never
    followed, a pretraining run or an export is left untouched, one writer at a time, and a failed
    first try (bad data, no device) leaves no base/ nor finetune.json."""

    @functools.wraps(run)
    def held(recipe, base, data, run_dir, *args, **kwargs):
        refuse_links_in(run_dir)
        refuse_other_kind(run_dir, "finetuning run", "finetune")
        folder = RunDir(run_dir)
        with lock(folder), undo_if_first_try_fails(folder, FINETUNE_JSON):
            return run(recipe, base, data, run_dir, *args, **kwargs)

    return held


@_holding_the_run_folder
def finetune(
    recipe: str | FinetuneRecipe,
    base: str,
    data: str,
    run_dir: str | Path,
    max_steps: int | None = None,
    hardware: str | None = None,
    resume: str = "auto",
    callbacks=(),
    *,
    train: dict | None = None,
    device: str | None = None,
    progress: bool = True,
    mirror: str | Path | None = None,
) -> FinetuneResult:
    """LoRA / QLoRA / full finetune `base` (tinygpt run folder, model folder or Hub id) on
    instruction `data` into `run_dir`, resuming from its newest valid checkpoint; the adapter lands
    in run_dir/adapter (recipe full: the whole model in run_dir/model). With `mirror` (a folder on
    Drive) checkpoints are copied there as they are written, the run resumes from there on a new VM,
    and the final adapter is copied to mirror/adapter."""
    rec = get_finetune_recipe(recipe) if isinstance(recipe, str) else recipe
    if resume not in ("auto", "never"):
        raise FinetuneError(f"resume must be 'auto' or 'never', got {resume!r}")
    run_dir = Path(run_dir)
    check_device(dev := resolve_device(device or "auto"))
    # --data is read (and a missing or unreadable one refused) before anything of the base is: its
    # config, tokenizer and weights
    records = load_records(data) if isinstance(data, str) else data
    base_id = str(Path(base).resolve()) if is_tinygpt_run(base) else base
    overrides = {**(train or {}), **({"max_steps": max_steps} if max_steps is not None else {})}
    # the mirror's newest valid checkpoint and run files (finetune.json among them) come home before
    # anything is decided: a resumed run on a new VM keeps its own settings
    identity = {"recipe": rec.name, "data": data, "base": base_id}
    with mirrored(run_dir, mirror, identity) as run_mirror:
        run = _settle(rec, base, base_id, data, run_dir, dev, hardware, overrides, resume)
        base_path = _base_folder(run, base, run_dir)
        tok = load_tokenizer(base_path)
        dataset = _tokenized(records, tok, run, rec.template)
        model, pm, io = _trainable_model(run, base_path, dev, run_dir)
        callbacks = [*([Progress()] if progress else []), *callbacks]
        # The Trainer compiles the loss module whole (compile "auto": on CUDA): forward and loss in
        # one graph.
        trainer = Trainer(
            FinetuneLoss(pm, full_logits=run.plan.full_logits),
            dataclasses.replace(run.cfg, device=str(dev)),
            TrainData(dataset.train, dataset.val_batches),
            run_dir,
            run_info=run.info,
            io=io,
            callbacks=[*callbacks, run_mirror],
        )  # the mirror acts, closes last
        result = trainer.fit(resume)
    written = _write_result(run, run_dir, result, tok, mirror)
    return _result(run, run_dir, result, dataset, (model, pm, tok), written, base_path)


def _tokenized(records, tok, run: _Settled, template: str):
    """The records tokenized in the run's prompt format, at its context, packed where planned."""
    c = run.cfg
    kw = dict(template=template, pack=run.plan.pack, seed=c.seed, eval_batches=c.eval_batches)
    return build_instruct_data(records, tok, c.seq_len, val_batch_size=c.micro_batch_size, **kw)


def _result(run, run_dir, result, dataset, models, written, base_path) -> FinetuneResult:
    """What a finetuning run returns: its figures, its memory estimate, the model ready to use.
    models: (the model, the trained module, the tokenizer); written: `_write_result`'s."""
    (model, pm, tok), (adapter_dir, mirrored_adapter, model_dir) = models, written
    mem = memory_table(
        run.planned,
        run.hardware,
        model.config.to_dict(),
        activation_checkpointing=run.plan.activation_checkpointing,
        full_logits=run.plan.full_logits,
    )
    n_train = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    return FinetuneResult(
        run_dir,
        adapter_dir,
        result,
        dataset.report,
        run.hardware,
        n_train,
        sum(p.numel() for p in pm.parameters()),
        mem,
        pm.eval(),
        tok,
        mirrored_adapter,
        run.plan,
        model_dir,
        base_path,
    )


@dataclass
class _Settled:
    """A finetuning run's settings, decided once before anything is written (`_settle`)."""

    rec: FinetuneRecipe
    hardware: str  # the hardware class whose settings the run trains with
    cfg: TrainConfig  # the recipe's train settings for it, with the caller's overrides
    overrides: dict
    planned: FinetuneRecipe  # the recipe as the memory estimate sees it (the overrides included)
    plan: FinetunePlan  # checkpointing, full logits, packing
    info: dict  # finetune.json
    resuming: bool  # the run folder has checkpoints


def _settle(
    rec: FinetuneRecipe,
    base: str,
    base_id: str,
    data: str,
    run_dir: Path,
    dev: torch.device,
    hardware: str | None,
    overrides: dict,
    resume: str,
) -> _Settled:
    """The hardware class (Colab may hand a resumed run another GPU: it keeps the settings it
    started with, so the same data rows), the train settings, QLoRA's compile, and the plan from the
    memory estimate against this device, once (a resumed run keeps its own, from finetune.json).
    Refuses, before anything is written, a base that cannot be loaded, a folder holding another run,
    and checkpoints that resume 'never' would overwrite."""
    old = RunDir(run_dir).finetune_info()
    kept = kept_decisions(run_dir, old)
    hardware = hardware or (kept or {}).get("hardware") or detect_hardware(dev)
    cfg = rec.train_config(hardware, **overrides)
    if rec.quantize == "nf4":
        check_qlora(dev)
        import bitsandbytes

        compile_, note = qlora_compile(
            cfg.compile, dev.type, bitsandbytes.__version__, torch.__version__
        )
        if note:
            warnings.warn(note, stacklevel=4)
            cfg = dataclasses.replace(cfg, compile=compile_)
    if not is_tinygpt_run(base):
        base_config(base)  # a missing or unloadable base fails here, before anything is written
    # the estimate sees the overrides
    planned = dataclasses.replace(rec, train={**rec.train, hardware: cfg})
    config_dict, memory_gb = base_config_dict(base), memory_gb_of(dev)
    plan = (
        resumed_plan(kept, planned, hardware, config_dict, memory_gb)
        if kept
        else plan_finetune(planned, hardware, config_dict, memory_gb)
    )
    info = {
        "recipe": rec.to_dict(),
        "base": base_id,
        "data": data,
        "hardware": hardware,
        "plan": plan.to_dict(),
    }
    check_same_run(run_dir, old, info)
    resuming = bool(list_checkpoints(RunDir(run_dir).checkpoints))
    if resume == "never" and resuming:
        raise FinetuneError(
            f"run folder {run_dir} already has checkpoints; resume='never' would overwrite them"
        )
    return _Settled(rec, hardware, cfg, overrides, planned, plan, info, resuming)


def kept_decisions(run_dir: Path, old: dict[str, Any] | None) -> dict[str, Any] | None:
    """finetune.json (`old`) where its hardware class and plan stand: this user wrote it
    (`decisions.own_signature`), or checkpoints trained with them are resumed. A shared mirror's
    alone decides nothing: None, and they are decided here."""
    if old is None:
        return None
    if own_signature(old, FINETUNE_DOMAIN) or list_checkpoints(RunDir(run_dir).checkpoints):
        return old
    return None


def check_same_run(run_dir: Path, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
    """Refuse a folder whose finetune.json is another run's (the Trainer checks the TrainConfig)."""

    def identity(i: dict) -> dict:  # packing is part of the run's plan, which a resumed run keeps
        return {k: i.get(k) for k in ("base", "data", "hardware")} | {
            k: i["recipe"].get(k) for k in ("lora", "quantize", "template")
        }

    check_same_settings(
        f"run folder {run_dir}",
        identity(old) if old is not None else None,
        identity(new),
        "another finetuning run",
    )


def _base_folder(run: _Settled, base: str, run_dir: Path) -> str:
    """Write finetune.json; the base to load: a tinygpt run exported once to run_dir/base, else the
    base as given. A recipe's context past the base's is cut (one asked for: refused)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / FINETUNE_JSON, sign(run.info, FINETUNE_DOMAIN))
    base_path = base
    if is_tinygpt_run(base):
        base_path = str((run_dir / BASE_DIR).resolve())
        if not (run_dir / BASE_DIR / "config.json").is_file():
            export_tinygpt_base(base, base_path)
    config = base_config(base_path)
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if max_pos and run.cfg.seq_len > max_pos:
        if "seq_len" in run.overrides:
            raise FinetuneError(
                f"seq_len {run.cfg.seq_len} is longer than the base's context of {max_pos} tokens"
            )
        # the recipe's default, cut to what the base knows
        run.cfg = dataclasses.replace(run.cfg, seq_len=max_pos)
    return base_path


def _trainable_model(run: _Settled, base_path: str, dev: torch.device, run_dir: Path):
    """(the base as loaded, the model that trains, how checkpoints hold it): LoRA adapters on a
    frozen base, or (recipe full) the base in fp32; then tinygpt_finetune.json (base signature)."""
    rec = run.rec
    old_adapter = RunDir(run_dir).adapter_info()
    # full finetuning keeps fp32 weights (updates would vanish in half precision); autocast computes
    dtype = (
        choose_precision(dev, run.cfg.precision).dtype
        if dev.type == "cuda" and rec.lora is not None
        else torch.float32
    )
    model = load_base(base_path, quantize=rec.quantize, dtype=dtype, device=dev)
    # e.g. a tinygpt base that trained on since, exported anew
    if run.resuming and "signature" in old_adapter:
        check_signature(old_adapter["signature"], model, f"the checkpoints in {run_dir}")
    ckpt = run.plan.activation_checkpointing
    if rec.lora is None:  # full finetuning: the base trains, and every checkpoint holds all of it
        pm = prepare_full(model, activation_checkpointing=ckpt)
        io = ModelIO(loss_fn=module_loss, state_fn=full_state, load_state_fn=load_full_state)
    else:
        pm = attach_lora(model, rec.lora, activation_checkpointing=ckpt, seed=run.cfg.seed)
        # as PEFT saves it
        peft_config = dataclasses.replace(pm.peft_config["default"], inference_mode=True)
        # adapter_config.json + any checkpoint = an adapter (export_adapter)
        peft_config.save_pretrained(str(run_dir))
        io = ModelIO(loss_fn=module_loss, state_fn=adapter_state, load_state_fn=load_adapter_state)
    write_json_atomic(
        run_dir / ADAPTER_INFO,
        {
            "base": run.info["base"],
            "base_path": base_path,
            "quantize": rec.quantize,
            "template": rec.template,
            "signature": base_signature(model),
        },
    )
    return model, pm, io


def _write_result(
    run: _Settled, run_dir: Path, result: Any, tok: Any, mirror: str | Path | None
) -> tuple[Path | None, Path | None, Path | None]:
    """(adapter folder, its copy on the mirror, whole-model folder) of a run that was not
    interrupted: the adapter with the tokenizer (copied to the mirror), or, recipe full, a whole
    model folder (the mirrored checkpoints hold it already); Nones for an interrupted one."""
    if result.interrupted:
        return None, None, None
    which = str(result.checkpoint or "latest")
    if run.rec.lora is None:
        return None, None, export_full(run_dir, which)
    adapter_dir = export_adapter(run_dir, which)
    tok.save_pretrained(adapter_dir)
    mirrored_adapter = (
        mirror_adapter(adapter_dir, Path(mirror), result.step) if mirror is not None else None
    )
    return adapter_dir, mirrored_adapter, None
