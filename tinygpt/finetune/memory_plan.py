"""What a recipe needs with a given base, read from the base's config alone: the memory estimate
(`memory_table`), the plan a run trains with (`plan_finetune`: activation checkpointing, full or
chunked logits, packed rows), and the recipe to start from (`default_finetune_recipe`). Nothing here
loads weights: a base's `config.json` (`base_config`, `base_config_dict`) is all it reads."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from tinygpt.core.files import FileTooLarge, UnsafePathError
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import RunDir, recipe_name_of
from tinygpt.finetune.presets import (
    FINETUNE_RECIPES,
    FinetuneError,
    FinetuneRecipe,
    finetune_device,
    get_finetune_recipe,
    require_package,
)
from tinygpt.fit.memory import overhead_gb
from tinygpt.model.attention import attention_kernel, torch_version
from tinygpt.model.hf import UntrustedModel, from_pretrained
from tinygpt.model.tokenizer import UnsafeTokenizer

# Families whose logits are exactly lm_head(hidden): their loss goes through the chunked
# `losses.linear_cross_entropy` (no full (tokens, vocab) logits).
PLAIN_HEAD_TYPES = {"llama", "qwen2", "qwen3", "mistral", "gemma", "phi3"}
# Families whose logits are cap * tanh(lm_head(hidden) / cap) (Gemma-2): chunked too, by
# `losses.softcapped_loss`.
SOFTCAP_HEAD_TYPES = {"gemma2"}
# Families whose transformers code builds its attention mask with `masking_utils`, which reads
# position ids that restart at 0 as record boundaries (attention stays inside each packed record).
PACKABLE_TYPES = PLAIN_HEAD_TYPES | SOFTCAP_HEAD_TYPES
# A plan must fit this share of device memory (the rest is headroom, as for the default recipe)
FIT_FRACTION = 0.9


def chunked_loss(config: dict[str, Any]) -> bool:
    """Whether finetuning's loss avoids the full (tokens, vocab) logits for a base so configured."""
    model_type = config.get("model_type")
    return model_type in PLAIN_HEAD_TYPES or model_type in SOFTCAP_HEAD_TYPES


# ----- the base -----------------------------------------------------------------------------------
def is_tinygpt_run(base: str | Path) -> bool:
    return RunDir(Path(base).expanduser()).is_pretrain_run()


def base_config(path: str):
    """The `transformers` config of a base (a local folder or a Hub id): the cheap check that it
    exists and (`model.hf.from_pretrained`) is a model tinygpt loads, with no code of its own."""
    require_package("transformers", "finetuning")

    p = Path(path).expanduser()
    if p.exists() and not (p / "config.json").is_file():
        raise FinetuneError(
            f"base {path!r} is a folder with neither run.json (a tinygpt run) nor "
            "config.json (a Hugging Face model)"
        )
    if not p.exists() and (path.startswith(("/", ".", "~")) or path.count("/") > 1):
        raise FinetuneError(
            f"base {path!r} does not exist: give a tinygpt run folder, a model "
            "folder or a Hub id such as google/gemma-2-2b"
        )
    try:
        return from_pretrained("AutoConfig", path)
    except (UntrustedModel, UnsafeTokenizer, UnsafePathError, FileTooLarge):
        raise  # one line that names the file already
    except Exception as e:
        raise FinetuneError(
            f"could not load base model {path!r}: {type(e).__name__}: {e}\nCheck "
            "the folder or the Hub id and the network; gated models (Gemma, Llama) "
            "need their licence accepted on the Hub and `hf auth login` (or HF_TOKEN set)"
        ) from e


def base_config_dict(base: str | Path) -> dict[str, Any]:
    """A base's `config.json` as a dict (what `memory_table` reads), no weights loaded; for a
    tinygpt run folder, that of the `LlamaForCausalLM` (or `Qwen3ForCausalLM`) it exports as."""
    if is_tinygpt_run(base):
        recipe = Recipe.from_dict(RunDir(Path(base).expanduser()).recipe_dict())
        return {"model_type": recipe.model.family.model_type, **recipe.model.to_hf_llama()}
    return base_config(str(base)).to_dict()


# ----- memory -------------------------------------------------------------------------------------
def checkpointing_rule(recipe: FinetuneRecipe, hardware: str) -> bool | None:
    """The recipe's activation checkpointing on this hardware: True, False, or None (by memory)."""
    rule = recipe.activation_checkpointing
    if isinstance(rule, str):
        if rule not in ("auto", "on", "off"):
            raise FinetuneError(f"activation_checkpointing must be auto, on or off, got {rule!r}")
        return None if rule == "auto" else rule == "on"
    return hardware in rule


def _shapes(c: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear of one Llama-like layer of a `config.json` dict."""
    h = c.get("hidden_size") or c["n_embd"]
    nh = c.get("num_attention_heads") or c["n_head"]
    hd = c.get("head_dim") or h // nh
    nkv = c.get("num_key_value_heads") or nh
    ff = c.get("intermediate_size") or c.get("n_inner") or 4 * h
    return {
        "q_proj": (h, nh * hd),
        "k_proj": (h, nkv * hd),
        "v_proj": (h, nkv * hd),
        "o_proj": (nh * hd, h),
        "gate_proj": (h, ff),
        "up_proj": (h, ff),
        "down_proj": (ff, h),
    }


def _layer_activations(
    c: dict[str, Any], hardware: str, tokens: int, seq_len: int, half: int
) -> int:
    """Bytes of activations one layer holds for backward: 2 x tokens x (17 d_model + 5 d_ff), and
    beyond flash attention (`model.attention`): GQA keys/values repeated to the query heads where no
    fused kernel takes them grouped (a T4), and an eager base's (Gemma-2's soft-capping) T x T
    scores: fp32 softmax + a copy."""
    shapes = _shapes(c)
    h, ff = shapes["q_proj"][0], shapes["up_proj"][1]
    nh = c.get("num_attention_heads") or c["n_head"]
    hd = shapes["q_proj"][1] // nh
    nkv = shapes["k_proj"][1] // hd
    layer_act = 2 * tokens * (17 * h + 5 * ff)
    kernel = (
        "math"
        if c.get("final_logit_softcapping")
        else attention_kernel(*finetune_device(hardware), torch_version(), hd)
    )
    if nkv < nh and kernel != "fused":
        layer_act += 2 * tokens * 2 * (nh - nkv) * hd
    if kernel == "math":
        layer_act += tokens * nh * seq_len * (4 + half)
    return layer_act


def _weight_counts(recipe: FinetuneRecipe, c: dict[str, Any]) -> tuple[int, int, int]:
    """(linear, embedding, trained) weight counts of a base with config dict c. Embeddings count
    twice when the head is untied. Trained is every weight for full finetuning (`recipe.lora` None),
    else r x (in + out) per targeted linear per layer (its LoRA A and B)."""
    h, L = c.get("hidden_size") or c["n_embd"], c.get("num_hidden_layers") or c["n_layer"]
    shapes = _shapes(c)
    linear = L * sum(a * b for a, b in shapes.values())
    emb = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings", True) else 2)
    if recipe.lora is None:  # full finetuning: every weight is trained
        return linear, emb, linear + emb
    targets = recipe.lora.target_modules or tuple(shapes)
    lora = L * sum(recipe.lora.r * sum(shapes[t]) for t in targets if t in shapes)
    return linear, emb, lora


def _uses_checkpointing(
    recipe: FinetuneRecipe, hardware: str, activation_checkpointing: bool | None
) -> bool:
    """Whether the estimate recomputes activations: the caller's choice when given, else the
    recipe's rule on this hardware, else (rule "auto") on any GPU and not on a CPU."""
    rule = checkpointing_rule(recipe, hardware)  # first: it rejects a bad rule even when overridden
    if activation_checkpointing is not None:
        return activation_checkpointing
    return rule if rule is not None else hardware != "cpu"


def _weight_rows(
    recipe: FinetuneRecipe, linear: int, emb: int, lora: int, half: int
) -> list[tuple[str, float, str]]:
    """The table's (part, GB, how) rows of the weights: the base, the adapters (0 without LoRA) and
    the trained weights' fp32 gradient + two AdamW moments (12 bytes each). half is the bytes of a
    base weight that is not NF4-quantized."""
    gb = 1e9
    nf4 = recipe.quantize == "nf4"
    adapted = recipe.lora is not None
    return [
        (
            "base weights",
            (linear * (0.516 if nf4 else half) + emb * half) / gb,
            "NF4: 4 bits + double-quantized scales (0.127 bits) per linear weight; embeddings stay 16-bit"
            if nf4
            else f"{half} bytes per weight",
        ),
        ("adapters", lora * 4 / gb, f"{lora / 1e6:.1f}M LoRA weights in fp32")
        if adapted
        else ("adapters", 0.0, "none: full finetuning trains the base weights themselves"),
        (
            "gradients + AdamW",
            lora * 12 / gb,
            "fp32 gradient and two moments per "
            + ("adapter weight" if adapted else f"weight ({lora / 1e6:.1f}M)"),
        ),
    ]


def memory_table(
    recipe: FinetuneRecipe | str,
    hardware: str,
    base_config: dict[str, Any],
    *,
    activation_checkpointing: bool | None = None,
    full_logits: bool | None = None,
) -> list[dict[str, Any]]:
    """Estimated GPU memory (GB) of finetuning a base with a Llama-like `config.json` dict.
    Activations: 2 bytes x tokens x (17 d_model + 5 d_ff) per layer (a layer with LoRA dropout and
    flash attention); with activation checkpointing only the layer inputs plus one layer are held.
    activation_checkpointing / full_logits: None gives the leanest the recipe allows (checkpointing
    on a GPU unless the recipe says "off"; chunked logits where the family allows), the least a run
    can need."""
    recipe = get_finetune_recipe(recipe) if isinstance(recipe, str) else recipe
    c, cfg = base_config, recipe.train_config(hardware)
    h, L = c.get("hidden_size") or c["n_embd"], c.get("num_hidden_layers") or c["n_layer"]
    linear, emb, lora = _weight_counts(recipe, c)
    # full finetuning: fp32 weights (the optimizer updates them)
    half = 4 if hardware == "cpu" or recipe.lora is None else 2
    tokens = cfg.micro_batch_size * cfg.seq_len
    layer_act = _layer_activations(c, hardware, tokens, cfg.seq_len, half)
    ckpt = _uses_checkpointing(recipe, hardware, activation_checkpointing)
    act = (L * 2 * tokens * h + layer_act) if ckpt else L * layer_act
    chunked = chunked_loss(c) and not full_logits
    # chunked: one chunk's logits; else fp16 logits + fp32 copy + fp32 log-softmax/grad
    logits = (2**25 * 8) if chunked else tokens * c["vocab_size"] * 12
    gb = 1e9
    rows = _weight_rows(recipe, linear, emb, lora, half) + [
        (
            "activations",
            act / gb,
            f"micro-batch {cfg.micro_batch_size} x {cfg.seq_len}, "
            f"{'with' if ckpt else 'without'} activation checkpointing",
        ),
        (
            "logits + loss",
            logits / gb,
            "chunked cross-entropy" if chunked else "full (tokens, vocab) logits",
        ),
    ]
    out = [{"part": p, "gb": round(v, 3), "how": how} for p, v, how in rows]
    return out + [
        {
            "part": "total",
            "gb": round(sum(r["gb"] for r in out), 3),
            "how": "tensors only; `device_need_gb` adds the CUDA context and allocator slack",
        }
    ]


def _need_gb(recipe: FinetuneRecipe, hardware: str, config: dict, ckpt: bool, full: bool) -> float:
    """`device_need_gb` of the plan (activation checkpointing, full logits) given."""
    table = memory_table(recipe, hardware, config, activation_checkpointing=ckpt, full_logits=full)
    return device_need_gb(table, hardware)


def device_need_gb(table: list[dict[str, Any]], hardware: str) -> float:
    """The memory a device needs for a `memory_table`: its tensors plus `fit.memory`'s overhead."""
    tensors = table[-1]["gb"]
    return tensors + overhead_gb(tensors, "cpu" if hardware == "cpu" else "cuda")


def memory_gb_of(device: torch.device | str) -> float:
    """The memory a device has for tensors, in GB: a GPU's total memory, else the machine's RAM."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory / 1e9
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): assume a laptop's 8 GB
        return 8.0


def packing_supported(base_config: dict[str, Any]) -> bool:
    """Whether packed records keep their attention to themselves in this base: a family whose
    transformers code builds its mask with `masking_utils`, in a transformers that reads restarting
    position ids as record boundaries (4.53 and later)."""
    if base_config.get("model_type") not in PACKABLE_TYPES:
        return False
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return True


# ----- the plan -----------------------------------------------------------------------------------
@dataclass
class FinetunePlan:
    """How a run trains, decided once from the memory estimate against the device and kept in
    finetune.json (a resumed run keeps it): recompute activations or not, full logits or chunked,
    packed rows or padded."""

    activation_checkpointing: bool
    full_logits: bool
    pack: bool
    need_gb: float  # the estimate of this plan, CUDA context and slack included
    memory_gb: float | None  # the device's memory it was decided against
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FinetunePlan":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def plan_finetune(
    recipe: FinetuneRecipe, hardware: str, base_config: dict[str, Any], memory_gb: float | None
) -> FinetunePlan:
    """The fastest plan whose estimate fits FIT_FRACTION of `memory_gb` (None: any fits). Tried
    fastest first: no recomputation and the full logits; then chunked logits (a loop over row
    chunks, no extra matmul); then activation checkpointing (one more forward per step); the leanest
    when none fits."""
    rule = checkpointing_rule(recipe, hardware)
    ckpts = [rule] if rule is not None else [False, True]
    logits = [True, False] if chunked_loss(base_config) else [True]
    options = [(c, f) for c in ckpts for f in logits]
    pack = recipe.pack and packing_supported(base_config)
    for c, f in options:
        need = _need_gb(recipe, hardware, base_config, c, f)
        if memory_gb is None or need <= FIT_FRACTION * memory_gb:
            break
    where = f"of {memory_gb:.1f} GB" if memory_gb is not None else "(device memory unknown)"
    fits = memory_gb is None or need <= FIT_FRACTION * memory_gb
    why = (
        f"about {need:.1f} GB {where}: activation checkpointing {'on' if c else 'off'}, "
        f"{'full' if f else 'chunked'} logits"
        + ("" if fits else "; the leanest plan, and it may not fit")
    )
    return FinetunePlan(
        c, f, pack, round(need, 3), None if memory_gb is None else round(memory_gb, 3), why
    )


def resumed_plan(
    old: dict[str, Any],
    recipe: FinetuneRecipe,
    hardware: str,
    base_config: dict[str, Any],
    memory_gb: float | None,
) -> FinetunePlan:
    """The plan of the run being resumed (its finetune.json). Its packing is always kept (the rows
    must be the same); its memory choices too, unless this device is too small for them. A run from
    before plans were kept had padded rows and checkpointing per hardware class."""
    if "plan" in old:
        plan = FinetunePlan.from_dict(old["plan"])
    else:
        r = old.get("recipe", {})
        rule = r.get("activation_checkpointing", ["t4", "a100"])
        ckpt = (
            hardware in rule
            if isinstance(rule, list)
            else rule == "on" or (rule == "auto" and hardware != "cpu")
        )
        plan = FinetunePlan(
            ckpt, False, bool(r.get("pack", False)), 0.0, None, "a run from before plans were kept"
        )
    need = _need_gb(recipe, hardware, base_config, plan.activation_checkpointing, plan.full_logits)
    if memory_gb is not None and need > FIT_FRACTION * memory_gb:
        lean = plan_finetune(recipe, hardware, base_config, memory_gb)
        return dataclasses.replace(
            lean,
            pack=plan.pack,
            why=lean.why + " (re-planned: the run's plan does not fit this device)",
        )
    return dataclasses.replace(plan, need_gb=round(need, 3))


# ----- the default --------------------------------------------------------------------------------
def default_finetune_recipe(
    base_config: dict[str, Any],
    hardware: str,
    memory_gb: float | None = None,
    resume_from: Iterable[str | Path | None] = (),
) -> tuple[str, str]:
    """(recipe name, why): the resumed run's own; on a GPU lora-r16 when its estimate fits
    `memory_gb` with 10% to spare, else qlora-r16; on a CPU lora-r8 (4-bit kernels are slow)."""
    resumed = recipe_name_of(*resume_from)
    if resumed in FINETUNE_RECIPES:
        return resumed, "the recipe of the run on Drive (it continues where it stopped)"
    if hardware == "cpu":
        return "lora-r8", (
            "on a CPU: the smallest adapter, base weights in fp32 (4-bit kernels are slow here)"
        )
    need = device_need_gb(memory_table("lora-r16", hardware, base_config), hardware)
    if memory_gb is None or need <= 0.9 * memory_gb:
        return "lora-r16", (
            f"lora-r16 needs about {need:.1f} GB"
            + (f" of this GPU's {memory_gb:.0f} GB" if memory_gb else "")
        )
    return "qlora-r16", (
        f"lora-r16 would need about {need:.1f} GB, more than this GPU's "
        f"{memory_gb:.0f} GB: the base goes in 4-bit"
    )
