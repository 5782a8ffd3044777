"""Text from a run: a few samples from one of its
checkpoints, from a prompt that suits what it trained on."""

from __future__ import annotations

from pathlib import Path

from tinygpt.core.precision import resolve_device
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import RunDir
from tinygpt.data.sources import validation_text
from tinygpt.model.generate import generate_text
from tinygpt.model.loading import load_run


def sample_prompt(run_dir: str | Path) -> str:
    """A prompt that suits what the run trained on: `def ` for the built-in Python corpus, else how
    one of its held-out documents begins (a story for TinyStories, a sentence for FineWeb-Edu)."""
    recipe = Recipe.from_dict(RunDir(run_dir).recipe_dict())
    if recipe.data.source in ("builtin", "stdlib"):
        return "def "
    text = validation_text(recipe.data, max_chars=400)
    words = text.split()
    return " ".join(words[:6]) + " " if words else "The "


def samples(
    run_dir: str | Path,
    n: int = 3,
    which: str = "latest",
    prompt: str | None = None,
    max_new_tokens: int = 150,
    device: str = "auto",
) -> list[str]:
    """`n` samples (seeds 0..n-1) from a run's checkpoint, from `prompt` or one suiting its data."""
    model, tokenizer, _, _ = load_run(run_dir, which, resolve_device(device))
    prompt = prompt or sample_prompt(run_dir)
    return [
        generate_text(model, tokenizer, prompt, max_new_tokens=max_new_tokens, seed=seed)
        for seed in range(n)
    ]
