"""How a command chooses its recipe: `RecipeChoice` (the name, a base, `--set` overrides) and the
overrides themselves, each `SECTION.FIELD=VALUE` parsed against the section's field and checked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tinygpt.core.config import ConfigError
from tinygpt.core.options import option
from tinygpt.core.recipes import Recipe


def apply_overrides(recipe: Recipe, assignments: list[str]) -> Recipe:
    """The recipe with `train.lr=1e-3`-style overrides (`--set`): `parse_overrides`."""
    return recipe.replace(**parse_overrides(recipe, assignments))


def parse_overrides(recipe: Recipe, assignments: list[str]) -> dict[str, dict[str, Any]]:
    """`train.lr=1e-3`-style overrides (`--set`) as {section: {field: value}}, values parsed as JSON
    where they can be (numbers, true, null); a number field takes a number (a whole number where it
    is an int), a string field a string."""
    changes: dict[str, dict] = {"model": {}, "train": {}, "data": {}}
    for a in assignments:
        key, sep, raw = a.partition("=")
        section, _, name = key.partition(".")
        if not sep or section not in changes or not name:
            raise ConfigError(
                f"cannot read override {a!r}: write SECTION.FIELD=VALUE with SECTION "
                "model, train or data"
            )
        fields = getattr(recipe, section).to_dict()
        if name not in fields:
            raise ConfigError(f"{section} has no field {name!r}; fields: {', '.join(fields)}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        current = fields[name]
        if isinstance(current, (int, float)) and not isinstance(current, bool):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or (isinstance(current, int) and not isinstance(value, int))
            ):
                kind = "a whole number" if isinstance(current, int) else "a number"
                raise ConfigError(
                    f"--set {a}: {section}.{name} must be {kind} (it is {current!r} "
                    f"in recipe {recipe.name}), not {raw!r}"
                )
        elif isinstance(current, str) and not isinstance(value, str):
            value = raw
        changes[section][name] = value
    return changes


@dataclass
class RecipeChoice:
    """What `tinygpt pretrain` trains: a named recipe, maybe continued from a base, with fields
    changed. Each field is a command-line option (core/options.py)."""

    recipe: str | None = option(
        None,
        help="a name from `tinygpt recipes` (default: the run folder's own recipe when it "
        "has one, else the one this hardware suits, as `tinygpt probe` shows)",
    )
    init: str | None = option(
        None,
        metavar="BASE",
        help="continue pretraining a model: hf:NAME[@REVISION] (e.g. "
        "hf:HuggingFaceTB/SmolLM2-135M), a Llama/Qwen3 model folder, or a tinygpt run folder; its "
        "weights, tokenizer and architecture, with the recipe's batch and steps at a lower "
        "learning rate",
    )
    overrides: list[str] = option(
        default_factory=list,
        flag="--set",
        metavar="SECTION.FIELD=VALUE",
        help="override recipe fields, e.g. --set train.lr=1e-3 model.n_layer=6 "
        "data.max_chars=100000",
    )
