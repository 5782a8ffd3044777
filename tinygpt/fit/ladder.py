"""The ladder of sizes the planner (`tinygpt.fit.plan`) chooses from, and the scaling law that
predicts each rung's final loss. A rung is the recipe with only the ladder's fields and lr / min_lr
changed. The law is L(N, D) = E + A/N^alpha + B/D^beta, with N the non-embedding parameters and D
the tokens seen (fewer where the source would be read again: Muennighoff et al. 2023's effective
data); it speaks for a rung within MAX_EPOCHS and the tokens per parameter of its own runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from typing import Callable

from tinygpt.core.config import ConfigError
from tinygpt.core.files import read_json_safe
from tinygpt.core.recipes import Recipe
from tinygpt.data.sources import DataError, source_chars

HEAD_DIM = 64  # each rung's width is depth * HEAD_DIM (nanochat's aspect ratio), in heads of 64 ...
# ... but never fewer than MIN_HEADS (Pythia-14M's 4 heads of 32 at width 128): on the built-in corpus, 2,235
# equal steps of d3 in 4 heads of 48 ended 1.5% below 3 of 64 (1.212 bits per byte against 1.231; 6 of 32:
# 1.238; docs/BENCHMARKS.md section 13), and the ladder's d3 is then cpu-fast itself
MIN_HEADS = 4
LADDER_DEPTHS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
# what a rung changes in a model
LADDER_FIELDS = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff")
PLANNED_FIELDS = frozenset(LADDER_FIELDS) | {"lr", "min_lr"}  # what a plan changes in a recipe

# R*_D of Muennighoff et al. (2023): how fast repeated epochs lose their value
REPEAT_HALF_LIFE = 15.4
# a rung that would read its source more often than this is not chosen while another is left: past
# ~4 epochs repeats stop paying (Muennighoff et al.), and on the CPU ladder they cost: d2 on ~12
# epochs of WikiText-2 memorised it (training loss 1.97, validation 4.35, rising in the decay;
# docs/BENCHMARKS.md section 13), a loss R*_D = 15.4 does not predict
MAX_EPOCHS = 4.0


def rung(recipe: Recipe, depth: int, min_heads: int = MIN_HEADS) -> Recipe:
    """The recipe at ladder depth `depth`: width depth*HEAD_DIM, heads of HEAD_DIM but at least
    MIN_HEADS (grouped as the recipe groups them), an MLP of 8/3 the width (a multiple of 64), and
    the learning rates scaled inversely with width (GPT-3's table: 6e-4 at 768, 3e-4 at 1536).
    `min_heads` 1: the ladder as it was before MIN_HEADS."""
    m, t = recipe.model, recipe.train
    d_model = depth * HEAD_DIM
    n_head = max(min_heads, d_model // HEAD_DIM)
    group = (m.n_head // m.n_kv_head) if m.n_kv_head else 1
    n_kv = n_head // group if group > 1 and n_head % group == 0 else None
    d_ff = 64 * max(1, round(8 * d_model / 3 / 64))
    scale = m.d_model / d_model
    return recipe.replace(
        model=dict(n_layer=depth, d_model=d_model, n_head=n_head, n_kv_head=n_kv, d_ff=d_ff),
        train=dict(lr=t.lr * scale, min_lr=t.min_lr * scale),
    )


def rung_name(depth: int) -> str:
    return f"d{depth}"


@dataclass(frozen=True)
class ScalingLaw:
    """L(N, D) = E + A / N**alpha + B / D**beta (nats per token), with where its constants came from and
    the fewest tokens per parameter among the runs they were fitted on (below it the law extrapolates)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str
    min_tokens_per_param: float = 0.0

    def loss(self, n_params: float, tokens: float) -> float:
        return self.E + self.A / n_params**self.alpha + self.B / tokens**self.beta


# The prior: Chinchilla's parametric fit (Hoffmann et al. 2022, approach 3) as re-fitted
# on its own data by Besiroglu et al. (2024, "Chinchilla Scaling: A replication
# attempt"), whose optimum agrees with Chinchilla's approaches 1 and 2 (~20 tokens per
# parameter); the constants as published (E 1.69, A 406.4, B 410.7, 0.34, 0.28) put it
# at 3-10 here. Fitted on 70M to 16B parameters: the law for GPU-scale rungs.
CHINCHILLA = ScalingLaw(
    1.8172,
    482.01,
    2085.43,
    0.3478,
    0.3658,
    "Chinchilla's fit (Hoffmann et al. 2022, as re-fitted by Besiroglu et al. 2024)",
    # its runs: 70M to 16B parameters on 5B to 500B tokens, so none saw fewer than 5B/16B per parameter
    5e9 / 16e9,
)
LAWS_FILE = "scaling_laws.json"  # beside this module, written by benchmarks/fit_scaling.py


def fitted_laws() -> dict[str, ScalingLaw]:
    """The laws benchmarks/fit_scaling.py fitted on tinygpt's runs, by the recipe they ladder."""
    with resources.as_file(resources.files("tinygpt.fit") / LAWS_FILE) as path:
        if not path.is_file():
            return {}
        laws = read_json_safe(path, limit=1 << 20)["laws"]
    return {
        name: ScalingLaw(
            **{k: law[k] for k in ("E", "A", "B", "alpha", "beta", "source")},
            min_tokens_per_param=min(r["tokens"] / r["params"] for r in law["runs"]),
        )
        for name, law in laws.items()
    }


def law_for(recipe: Recipe) -> ScalingLaw:
    """This recipe's fitted law (its corpus and tokenizer) where there is one, else Chinchilla's."""
    return fitted_laws().get(recipe.name, CHINCHILLA)


def effective_tokens(tokens: float, unique: float | None) -> float:
    """Tokens seen as Muennighoff et al.'s effective data when a source of `unique` tokens is read
    more than once: each repeat is worth less, and never more than REPEAT_HALF_LIFE epochs of it."""
    if unique is None or tokens <= unique:
        return tokens
    repeats = tokens / unique - 1
    return unique * (1 + REPEAT_HALF_LIFE * (1 - math.exp(-repeats / REPEAT_HALF_LIFE)))


def ladder(recipe: Recipe, fits: Callable[[Recipe], bool]) -> list[tuple[int, Recipe]]:
    """The rungs of the recipe's family that `fits` (this device's memory), smallest first."""
    return [(d, r) for d in LADDER_DEPTHS if fits(r := rung(recipe, d))]


def within_law(epochs: float | None, tokens_per_param: float, min_tokens_per_param: float) -> bool:
    """Whether the law's prediction for a rung may choose it: it reads the source at most MAX_EPOCHS
    times (`epochs`; past that, repeats cost more than the law discounts) and sees at least the tokens
    per parameter of the law's own runs (fewer is extrapolation: a 12M-token text on an A100 for an
    hour would otherwise train 1.6B parameters on 0.02 tokens each)."""
    return (epochs is None or epochs <= MAX_EPOCHS) and tokens_per_param >= min_tokens_per_param


def apply_plan(recipe: Recipe, plan) -> Recipe:
    """The recipe at the plan's chosen size (a `SizePlan`, or the dict run.json keeps)."""
    size = plan["size"] if isinstance(plan, dict) else plan.size
    return rung(recipe, depth_of(size))


def resumed_at(recipe: Recipe, plan: dict, began: dict | None) -> Recipe:
    """The plan's rung as a resumed run trains it: the rung of the ladder the run `began` on
    (run.json's recipe), this one or the one before its small rungs kept MIN_HEADS. Only those
    two: a run.json (a mirror's too) may not choose the model."""
    depth = depth_of(plan["size"])
    before = rung(recipe, depth, min_heads=1)
    try:
        if began and ladder_fields(Recipe.from_dict(began)) == ladder_fields(before):
            return before
    except (ConfigError, KeyError, TypeError, ValueError):
        pass  # the run folder's check says what is wrong with it
    return rung(recipe, depth)


def ladder_fields(recipe: Recipe) -> dict:
    return {k: getattr(recipe.model, k) for k in LADDER_FIELDS}


def depth_of(size: str) -> int:
    """A rung's depth from its name ("d6"), refusing any name that is not on the ladder (run.json's
    plan comes back from a mirror: it may choose only among the ladder's rungs)."""
    depths = {rung_name(d): d for d in LADDER_DEPTHS}
    if not isinstance(size, str) or size not in depths:
        raise ConfigError(f"size {size!r} is not on the ladder ({', '.join(depths)})")
    return depths[size]


# Characters per token of a source, before its tokenizer exists (the plan comes first): a 4096-token
# BPE trained on the source (the CPU recipes') reads 3.61 on the built-in corpus and 3.66 on
# WikiText-2's test file (their token caches: 4.00M characters, 1.109M tokens; 1.255M, 343k); GPT-2's
# on English text. An estimate: the planner says "epochs ~"; only data-limited sources depend on it.
CHARS_PER_TOKEN = {"gpt2": 4.2, "train": 3.6}


def unique_tokens(recipe: Recipe) -> float | None:
    """About how many tokens training reads from the source before it repeats: its characters
    (`source_chars`: the files' sizes, at most `data.max_chars`) at CHARS_PER_TOKEN, less the
    validation split (`data.val_fraction`); None for a Hub corpus with no cap (more than any budget
    here reads)."""
    try:
        chars = source_chars(recipe.data)
    except DataError:
        chars = recipe.data.max_chars  # the source is refused later, with its own message
    if chars is None:
        return None
    per_token = CHARS_PER_TOKEN.get(recipe.data.tokenizer, CHARS_PER_TOKEN["train"])
    return chars * (1 - recipe.data.val_fraction) / per_token
