"""Continued pretraining: a run whose weights and tokenizer start from a model people have.

The base (`ModelConfig.init`, `tinygpt pretrain --init`) is ``hf:NAME[@REVISION]`` (a Hub model,
fetched into the Hugging Face cache by `huggingface_hub`), a local Hugging Face folder of the Llama
or Qwen3 family (config.json, safetensors, tokenizer.json), or another tinygpt run folder (its
newest valid checkpoint). `continued_recipe` sizes a recipe for it: the base's architecture is the
model, the base's own tokenizer tokenizes the corpus, the learning rate is lower and warms up, and
the context is the base's (up to what the hardware trains at). A base the GPT cannot represent is
refused by `read_base` before anything else happens, naming what differs.

The base is read once per start, when the run needs it (`starting_base`, in pretraining's plan: at
the run's first start, for its weights and tokenizer); run.json records the base, and a resumed run
loads its own checkpoint and tokenizer without reading the base again (it may be gone from the cache
by then)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tinygpt.core.checkpoint import latest_valid, load_checkpoint
from tinygpt.core.config import INIT_TOKENIZER, ConfigError, ModelConfig
from tinygpt.core.files import read_json_safe
from tinygpt.core.gpu_classes import size_auto_recipe
from tinygpt.core.paths import is_hub
from tinygpt.core.recipes import RECIPES, Recipe, get_recipe
from tinygpt.core.rundir import RUN_JSON, TOKENIZER_JSON, RunDir, recipe_name_of
from tinygpt.core.same_settings import config_differences
from tinygpt.fit.hardware import hardware_report
from tinygpt.model.gpt import GPT
from tinygpt.model.hf import hf_file
from tinygpt.model.hf_import import (
    SAFETENSORS_INDEX,
    gpt_from_state,
    hub_model_folder,
    import_tokenizer,
    read_hf_state_dict,
    representation_gaps,
)
from tinygpt.model.tokenizer import Tokenizer

# The base is trained already: a from-scratch learning rate would undo much of what it knows. At
# most this peak rate, a tenth of it at the end, and a warmup over at least 5% of the steps.
CONTINUE_MAX_LR = 3e-4
CONTINUE_WARMUP_FRACTION = 0.05
# The longest context a GPU recipe trains a base at (its own when shorter); on a GPU the probe
# shortens it further where memory says so. A CPU recipe keeps its own (short) context.
GPU_CONTEXT = 2048


@dataclass
class Base:
    """A base to continue from, as far as it can be known without reading its weights."""

    spec: str  # as recorded in ModelConfig.init: hf:NAME[@REVISION], or an absolute folder
    kind: str  # "hub", "folder" (a Hugging Face model folder) or "run" (a tinygpt run folder)
    path: Path  # the local folder (for the Hub: config and tokenizer in the Hugging Face cache)
    model: ModelConfig  # its architecture, with init = spec
    tokenizer: Tokenizer


def normalise_init(spec: str) -> str:
    """A base as run.json records it: a Hub name as written, a folder as an absolute path (a
    relative one would name another folder from another working directory)."""
    spec = spec.strip()
    if not spec:
        raise ConfigError(
            "--init is empty: give hf:NAME (a Hub model), a model folder or a tinygpt run folder"
        )
    return spec if is_hub(spec) else str(Path(spec).expanduser().resolve())


def read_base(spec: str) -> Base:
    """The base's architecture and tokenizer, checked; nothing but its config and tokenizer is read
    (or, from the Hub, downloaded). A base the GPT cannot represent, or that lacks what continued
    pretraining needs, fails here in one line that says what differs or what to do."""
    spec = normalise_init(spec)
    kind, path = _base_kind(spec)
    if kind == "run":
        run = RunDir(path)
        if latest_valid(run.checkpoints) is None:
            raise ConfigError(
                f"--init {spec}: the run has no valid checkpoint to start from; train it first"
            )
        model = Recipe.from_dict(run.recipe_dict()).model
        tokenizer = Tokenizer.load(path / TOKENIZER_JSON)
    else:
        model, tokenizer = _read_hf_base(spec, kind, path)
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"--init {spec}: its tokenizer has {tokenizer.vocab_size} tokens, its model only "
            f"{model.vocab_size}"
        )
    model = dataclasses.replace(model, init=spec, activation_checkpointing=False)
    return Base(spec, kind, path, model, tokenizer)


def _base_kind(spec: str) -> tuple[str, Path]:
    """("hub" | "run" | "folder", its folder) of a normalised --init, or the one line that says why none."""
    if is_hub(spec):
        try:
            return "hub", hub_model_folder(spec, weights=False)
        except ValueError as e:
            raise ConfigError(f"--init {spec}: {e}") from None
    path = Path(spec)
    if (path / RUN_JSON).is_file():
        return "run", path
    if (path / "config.json").is_file():
        return "folder", path
    raise ConfigError(
        f"--init {spec}: "
        + (
            "the folder has neither run.json (a tinygpt run) nor config.json (a Hugging Face model)"
            if path.exists()
            else "no such folder; give hf:NAME for a Hub model (e.g. "
            "hf:HuggingFaceTB/SmolLM2-135M), a model folder or a run folder"
        )
    )


def _read_hf_base(spec: str, kind: str, path: Path) -> tuple[ModelConfig, Tokenizer]:
    """A Hugging Face model's architecture and tokenizer (from the Hub's cache or a folder), checked."""
    # bounded, never through a link (but the Hub cache's)
    cfg = read_json_safe(hf_file(path, "config.json"))
    if not isinstance(cfg, dict):
        raise ConfigError(f"--init {spec}: its config.json is not a model config (a JSON object)")
    gaps = representation_gaps(cfg)
    if gaps:
        raise ConfigError(
            f"--init {spec}: tinygpt's GPT cannot represent this model: {'; '.join(gaps)}"
        )
    try:
        model = ModelConfig.from_hf_llama(cfg)
    except (ConfigError, KeyError) as e:
        raise ConfigError(
            f"--init {spec}: its config.json does not describe a model tinygpt can build ({e})"
        ) from None
    # its regexes checked: a crafted one is refused, never run
    tokenizer = import_tokenizer(path)
    if tokenizer is None:
        raise ConfigError(
            f"--init {spec}: no tokenizer.json with an end-of-text token beside the model (the "
            "corpus is tokenized with the base's own tokenizer); save it there with "
            "tokenizer.save_pretrained"
        )
    if kind == "folder" and not (
        (path / "model.safetensors").is_file() or (path / SAFETENSORS_INDEX).is_file()
    ):
        raise ConfigError(
            f"--init {spec}: no model.safetensors; load the model with transformers and "
            "save_pretrained() it again (safetensors is the default)"
        )
    return model, tokenizer


def continued_recipe(template: Recipe | str, init: str) -> Recipe:
    """`template` (a recipe or its name: batch, steps, precision, data) continuing the base `init`:
    the base's architecture and tokenizer, at most CONTINUE_MAX_LR with warmup, AdamW (Muon's rates
    are for a network trained from scratch), the base's context up to GPU_CONTEXT (a CPU recipe
    keeps its own), and the same tokens per step."""
    template = get_recipe(template) if isinstance(template, str) else template
    base = read_base(init)
    t = template.train
    seq_len = min(
        base.model.max_seq_len,
        t.seq_len if template.hardware == "cpu" else max(t.seq_len, GPU_CONTEXT),
    )
    lr = min(t.lr, CONTINUE_MAX_LR)
    train = dataclasses.replace(
        t,
        seq_len=seq_len,
        micro_batch_size=max(1, t.micro_batch_size * t.seq_len // seq_len),
        lr=lr,
        min_lr=lr / 10,
        warmup_steps=max(t.warmup_steps, round(CONTINUE_WARMUP_FRACTION * t.max_steps)),
        optimizer="adamw",
    )
    data = dataclasses.replace(
        template.data, tokenizer=INIT_TOKENIZER, vocab_size=base.tokenizer.vocab_size
    )
    description = f"{template.description} Continued from {base.spec}."
    return Recipe(template.name, description, template.hardware, base.model, train, data)


def run_init(run_dir: str | Path | None) -> str | None:
    """The base the local run folder `run_dir` continues, if it is a pretraining run; None when it
    started from scratch or there is none. Never a mirror's: a shared folder's run.json could name
    any folder of this VM."""
    if run_dir is not None and RunDir(run_dir).is_pretrain_run():
        return RunDir(run_dir).recipe_dict().get("model", {}).get("init")
    return None


def pretrain_recipe(name: str, init: str | None, run_dir: str | Path | None = None) -> Recipe:
    """The recipe `tinygpt pretrain` and 01_pretrain train: the named one, or with a base (`init`,
    else the one the local run folder continues) that recipe sized for it. A local run folder that
    already continues the same base with the same recipe keeps the recipe it recorded: a resume
    reads nothing of the base. Only the run folder the user made is read, never the mirror: a shared
    folder's run.json is evidence to compare against (`pretrain.mirror_trust.check_mirror_run`), it
    never chooses the base, the data or the tokenizer."""
    run = RunDir(run_dir) if run_dir is not None else None
    old = Recipe.from_dict(run.recipe_dict()) if run is not None and run.is_pretrain_run() else None
    same_name = old is not None and old.name == name
    init = normalise_init(init) if init else (old.model.init if same_name else None)
    if init is None:
        return get_recipe(name)
    if same_name and old.model.init == init:
        return old
    return continued_recipe(name, init)


def default_recipe(run_dir: str | Path, sized: bool = False) -> tuple[str, str]:
    """The recipe `tinygpt pretrain` trains without --recipe, and why: the run folder's own (a
    resume), else this hardware's default (the probe's choice), or with `sized` (--size auto) the
    recipe whose ladder the planner climbs here."""
    name = recipe_name_of(run_dir)
    if name in RECIPES:
        return name, f"the recipe of the run in {run_dir}"
    report = hardware_report()
    if sized:
        name = size_auto_recipe(report.hardware_class, report.default_recipe)
        return name, f"the ladder --size auto plans on this {report.hardware_class} machine"
    return report.default_recipe, f"the default for this {report.hardware_class} machine"


def starting_base(recipe: Recipe, run_dir: str | Path, resume: str = "auto") -> Base | None:
    """The base a continued run needs, read once and checked against the recipe's network (another
    network is refused, naming the differences): at its first start, for its weights and tokenizer.
    A run that resumes from its own checkpoint, with its own tokenizer.json, reads nothing of the
    base (it may be gone from the cache by then): None, as for a run from scratch."""
    if recipe.model.init is None:
        return None
    run = RunDir(run_dir)
    resumes = resume == "auto" and latest_valid(run.checkpoints) is not None
    if resumes and (
        recipe.data.tokenizer != INIT_TOKENIZER or (run.path / TOKENIZER_JSON).is_file()
    ):
        return None
    base = read_base(recipe.model.init)
    network = ModelConfig.network_fields()
    diffs = config_differences(
        {k: getattr(base.model, k) for k in network}, {k: getattr(recipe.model, k) for k in network}
    )
    if diffs:
        raise ConfigError(
            f"the base {base.spec} is another network than the recipe's model (base first): "
            + "; ".join(
                d.replace("in the run", "in the base").replace(" now", " in the recipe")
                for d in diffs
            )
            + "; use continued_recipe (tinygpt pretrain --init) to size it"
        )
    return base


def initial_model(model: ModelConfig, base: Base | None = None) -> GPT:
    """The model a run starts from: the base's weights (`starting_base`), else a seeded random one
    (the trainer then loads the run's checkpoint over it when it resumes)."""
    if base is None:
        return GPT(model)
    weights = base_weights(base)
    return gpt_from_state(model, weights, "cpu", f"the model of {base.spec}").train()


def base_weights(base: Base) -> dict:
    """The base's state dict: a run's newest valid checkpoint, or a Hugging Face model's safetensors
    (from the Hub they are downloaded now, once, into its cache)."""
    if base.kind == "run":
        newest = latest_valid(RunDir(base.path).checkpoints)
        return load_checkpoint(newest, with_state=False)[0]
    folder = hub_model_folder(base.spec) if base.kind == "hub" else base.path
    return read_hf_state_dict(folder)
