"""Full finetuning (recipe ``full``, `FinetuneRecipe.lora` None): every weight of the base trained in
fp32 through the same `FinetuneLoss` and Trainer as LoRA. Its checkpoints hold the whole model under
transformers' names (`full_state`), and the result is ``model/``, a folder `from_pretrained` loads
(`export_full`), instead of an adapter."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tinygpt.core.checkpoint import MODEL_FILE, find_run_checkpoint
from tinygpt.core.files import atomic_output, write_json_atomic
from tinygpt.core.rundir import ADAPTER_INFO, BASE_DIR, FULL_MODEL_DIR, RunDir
from tinygpt.finetune.lora import checkpoint_activations, export_tinygpt_base, load_tokenizer
from tinygpt.finetune.loss import inner_model
from tinygpt.finetune.memory_plan import base_config, is_tinygpt_run
from tinygpt.finetune.presets import FinetuneError


def prepare_full(
    model: torch.nn.Module, *, activation_checkpointing: bool = False
) -> torch.nn.Module:
    """Every weight of `model` trainable, in fp32: the optimizer's master copy (autocast computes in
    half precision on a GPU, and the fp16 GradScaler needs fp32 parameters)."""
    model = model.float()
    for p in model.parameters():
        p.requires_grad_(True)
    if activation_checkpointing:
        checkpoint_activations(model)
        model.config.use_cache = False
    return model


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights under transformers' names (what `from_pretrained` reads); of tied
    weights (one tensor under two names, e.g. embeddings and head) only the first name, as
    `save_pretrained` does."""
    out, seen = {}, set()
    for k, v in inner_model(model).state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        out[k] = v.detach().to("cpu").contiguous()
    return out


def load_full_state(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    hf = inner_model(model)
    res = hf.load_state_dict(sd, strict=False)
    # tied names come back tied
    missing = set(res.missing_keys) - (set(hf.state_dict()) - set(full_state(hf)))
    if res.unexpected_keys or missing:
        raise FinetuneError(
            f"checkpoint does not fit the model: missing {sorted(missing)[:4]}, "
            f"unexpected {list(res.unexpected_keys)[:4]}"
        )


def is_full_finetune(run_dir: str | Path) -> bool:
    """Whether a folder is a full finetuning run's (finetune.json's recipe has no LoRA settings)."""
    recipe = (RunDir(run_dir).finetune_info() or {}).get("recipe") or {}
    return "lora" in recipe and recipe["lora"] is None


def export_full(
    run_dir: str | Path, which: str = "latest", out_dir: str | Path | None = None
) -> Path:
    """A full finetuning run's checkpoint ("latest", "best" or a folder) as a standalone
    transformers model folder (config.json, model.safetensors, tokenizer; run_dir/model by default):
    the checkpoint's weights already carry transformers' names, so they are copied as they are. An
    existing folder is replaced whole."""
    run_dir = Path(run_dir)
    info = RunDir(run_dir).adapter_info()
    if not is_full_finetune(run_dir) or not info:
        raise FinetuneError(
            f"{run_dir} is not a full finetuning run folder (finetune.json with recipe full)"
        )
    ckpt = find_run_checkpoint(run_dir, which)
    base = info["base_path"]
    # a Hub id; or a new VM, where a tinygpt base is exported again
    if not (Path(base) / "config.json").is_file():
        base = (
            str(export_tinygpt_base(info["base"], run_dir / BASE_DIR))
            if is_tinygpt_run(info["base"])
            else info["base"]
        )
    config = base_config(base)  # checked: no code of its own, a model type tinygpt loads
    config.torch_dtype = torch.float32
    out = Path(out_dir) if out_dir is not None else run_dir / FULL_MODEL_DIR
    with atomic_output(out, folder=True) as tmp:
        config.save_pretrained(tmp)
        # named as transformers reads it
        shutil.copyfile(ckpt / MODEL_FILE, tmp / "model.safetensors")
        load_tokenizer(base).save_pretrained(tmp)
        write_json_atomic(tmp / ADAPTER_INFO, {**info, "checkpoint": str(ckpt)})
    return out
