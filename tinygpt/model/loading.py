"""Build a model and its tokenizer from a tinygpt run
folder (storage knows files; this knows models)."""

from __future__ import annotations

from pathlib import Path

import torch

from tinygpt.core.checkpoint import find_run_checkpoint, load_checkpoint, load_model_state
from tinygpt.core.config import ModelConfig
from tinygpt.core.folders import not_a_run_message
from tinygpt.core.rundir import RUN_JSON, TOKENIZER_JSON, RunDir, RunDirError
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import Tokenizer


def load_run(run_dir: str | Path, which: str = "latest", device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer, recipe, checkpoint folder) of a tinygpt run folder;
    `which` is "latest" (newest valid step), "best", or a checkpoint folder."""
    run = RunDir(run_dir)
    # a finetuning run, an export: what opens it
    if run.path.is_dir() and not run.is_pretrain_run():
        raise RunDirError(not_a_run_message(run.path))
    recipe = run.recipe()  # every value checked before anything is built from it
    ckpt = find_run_checkpoint(run.path, which)
    sd, _, _ = load_checkpoint(ckpt, verify=True, with_state=False)  # the weights only: safetensors
    check_matches(recipe.model, sd, run / RUN_JSON, ckpt)
    model = GPT(recipe.model)
    load_model_state(model, sd)
    tokenizer = Tokenizer.load(run / TOKENIZER_JSON)
    return model.to(device).eval(), tokenizer, recipe, ckpt


def check_matches(cfg: ModelConfig, sd: dict[str, torch.Tensor], where: Path, ckpt: Path) -> None:
    """The configuration must describe the checkpoint's weights (layers, width, vocabulary) before a
    model is built from it: a run.json edited to a million layers would allocate for minutes."""
    layers = {k.split(".")[2] for k in sd if k.startswith("model.layers.")}
    emb = sd.get("model.embed_tokens.weight")
    have = (len(layers), *(tuple(emb.shape) if emb is not None else (None, None)))
    want = (cfg.n_layer, cfg.vocab_size, cfg.d_model)
    if have != want:
        raise RunDirError(
            f"{where} says n_layer {want[0]}, vocab_size {want[1]}, d_model {want[2]} but "
            f"checkpoint {ckpt} holds {have[0]} layers and embeddings of {have[1]} x {have[2]}: "
            "restore run.json from the mirror, or start a new run folder"
        )
