"""Build a model and its tokenizer from a tinygpt run folder (storage knows files; this knows models)."""
from __future__ import annotations

from pathlib import Path

import torch

from tinygpt.core.checkpoint import (
    find_run_checkpoint,
    load_checkpoint,
    load_model_state,
)
from tinygpt.core.config import Recipe
from tinygpt.core.rundir import TOKENIZER_JSON, RunDir
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import Tokenizer


def load_run(run_dir: str | Path, which: str = "latest", device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer, recipe, checkpoint folder) of a tinygpt run folder;
    `which` is "latest" (newest valid step), "best", or a checkpoint folder."""
    run = RunDir(run_dir)
    recipe = Recipe.from_dict(run.recipe_dict())
    ckpt = find_run_checkpoint(run.path, which)
    sd, _, _ = load_checkpoint(ckpt, verify=True, with_state=False)  # the weights only: safetensors
    model = GPT(recipe.model)
    load_model_state(model, sd)
    tokenizer = Tokenizer.load(run / TOKENIZER_JSON)
    return model.to(device).eval(), tokenizer, recipe, ckpt
