"""A pretraining run's tokenizer: refused before any work where it cannot read the source, then the
run's own (resumed), trained on the source, GPT-2's, a file's, or a continued base's."""

from __future__ import annotations

from pathlib import Path

from tinygpt.core.config import GPT2_VOCAB_PADDED, INIT_TOKENIZER, ConfigError
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import TOKENIZER_JSON
from tinygpt.data.sources import iter_documents
from tinygpt.model.tokenizer import Tokenizer, load_gpt2, train_bpe
from tinygpt.pretrain.init import Base

# BPE merges settle long before this; training on more only costs time
TOKENIZER_TRAIN_CHARS = 3_000_000


def check_tokenizer(recipe: Recipe, token_ids: bool) -> None:
    """A source of token ids (`token_ids`, as `check_source` resolved it) comes
    with the tokenizer that made them: none can be trained on it, and a base's own
    would read them as other tokens. Before any work (the recipe itself refuses a
    tokenizer its model is too small for, or a base's without a base)."""
    d = recipe.data
    if token_ids and d.tokenizer == "train":
        raise ConfigError(
            f"{d.source} holds token ids, not text, so no tokenizer can be trained on it: for "
            "GPT-2's (nanoGPT's .bin, llm.c's GPT-2 shards) add --set data.tokenizer=gpt2 "
            f"model.vocab_size={GPT2_VOCAB_PADDED}, or use a recipe made for them (e.g. a100-124m)"
        )
    if token_ids and d.tokenizer == INIT_TOKENIZER:
        raise ConfigError(
            f"{d.source} holds token ids of another tokenizer, not the base's: continue a base on "
            "text (a file, a folder, builtin or hf:NAME), which its own tokenizer encodes"
        )


def get_tokenizer(
    recipe: Recipe, run_dir: Path, base: Base | None = None, kept: bool = True
) -> Tokenizer:
    """The run's tokenizer.json if the run has one (resume), else trained or loaded as the recipe
    says (`check_tokenizer` has refused one that cannot read the source; `base`: a continued run's
    base, whose tokenizer it takes). `kept` False (no checkpoint, and run.json not this user's: a
    mirror's tokenizer.json alone): it is made here and must be the one found, else refused."""
    saved = run_dir / TOKENIZER_JSON
    if saved.is_file() and kept:
        return Tokenizer.load(saved)
    tok = _new_tokenizer(recipe, base)
    if saved.is_file() and Tokenizer.load(saved).to_json() != tok.to_json():
        raise ConfigError(
            f"{saved} (from the mirror) is not the tokenizer this command makes and no checkpoint "
            "was trained with it: delete it, or use another --mirror folder"
        )
    return tok


def _new_tokenizer(recipe: Recipe, base: Base | None) -> Tokenizer:
    """The tokenizer trained or loaded as the recipe says."""
    d = recipe.data
    if d.tokenizer == "train":
        budget = (
            TOKENIZER_TRAIN_CHARS
            if d.max_chars is None
            else min(d.max_chars, TOKENIZER_TRAIN_CHARS)
        )
        sample = iter_documents(type(d)(**{**d.to_dict(), "max_chars": budget}))
        tok = train_bpe(sample, d.vocab_size)
    elif d.tokenizer == "gpt2":
        tok = load_gpt2()
    # continued pretraining: the base's own (read for a run without one)
    elif d.tokenizer == INIT_TOKENIZER:
        tok = base.tokenizer
    else:
        tok = Tokenizer.load(d.tokenizer)
    if tok.vocab_size > recipe.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tok.vocab_size} tokens but the model only "
            f"{recipe.model.vocab_size}: raise the model's vocab_size"
        )
    return tok
