"""Finetuning without the tensors: recipes, hardware, memory estimates, a base's config, the default
recipe, and the files of a finetuning run folder (its settings, adapter folders, copies to Drive).

`tinygpt.finetune.lora` re-exports everything here. Nothing in this module loads a model: a recipe, its
memory table and the default choice need only a base's `config.json`.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load_file as load_safetensors

from tinygpt.core.checkpoint import (
    MANIFEST,
    MODEL_FILE,
    find_run_checkpoint,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from tinygpt.core.config import Recipe, TrainConfig, check_same_settings
from tinygpt.core.files import FileTooLarge, UnsafePathError, atomic_output
from tinygpt.core.hardware import HARDWARE
from tinygpt.core.precision import DTYPES, resolve_device
from tinygpt.core.rundir import (  # noqa: F401  (handed on to lora)
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_INFO,
    BASE_DIR,
    FULL_MODEL_DIR,
    MERGED_DIR,
    RunDir,
    recipe_name_of,
)
from tinygpt.core.rundir import FINETUNE_JSON as FINETUNE_INFO  # noqa: F401
from tinygpt.model.attention import attention_kernel, torch_version
from tinygpt.model.hf import UntrustedModel, from_pretrained
from tinygpt.model.tokenizer import UnsafeTokenizer
from tinygpt.train.hardware import device_class
from tinygpt.train.memory import overhead_gb

# The files of a finetuning run folder besides the trainer's (checkpoints/, metrics.jsonl).
# Families whose logits are exactly lm_head(hidden): their loss goes through the chunked
# `losses.linear_cross_entropy` (no full (tokens, vocab) logits).
PLAIN_HEAD_TYPES = {"llama", "qwen2", "qwen3", "mistral", "gemma", "phi3"}
# Families whose logits are cap * tanh(lm_head(hidden) / cap) (Gemma-2): chunked too, by `finetune.softcapped_loss`.
SOFTCAP_HEAD_TYPES = {"gemma2"}
# Families whose transformers implementation builds its attention mask with `masking_utils`, which reads
# position ids that restart at 0 as record boundaries (attention stays inside each packed record).
PACKABLE_TYPES = PLAIN_HEAD_TYPES | SOFTCAP_HEAD_TYPES
# A plan must fit this share of the device's memory (the rest is headroom, as for the default recipe).
FIT_FRACTION = 0.9


class FinetuneError(RuntimeError):
    """Finetuning cannot start or go on; the message says what to do."""


@dataclass
class LoraSettings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: tuple[str, ...] | None = None  # None: every linear layer but lm_head
    use_rslora: bool = False  # scale by alpha / sqrt(r) instead of alpha / r
    use_dora: bool = False

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise FinetuneError(f"LoRA needs r >= 1, alpha > 0 and 0 <= dropout < 1; got r={self.r}, "
                                f"alpha={self.alpha}, dropout={self.dropout}")
        if self.target_modules is not None:
            self.target_modules = tuple(self.target_modules)


@dataclass
class FinetuneRecipe:
    """LoRA settings (None: full finetuning, every weight trains) plus a TrainConfig per finetuning class ("cpu",
    "t4", "a100": the `finetune` entries of `core.hardware.HARDWARE`, coarser groups of the hardware classes)."""

    name: str
    description: str
    lora: LoraSettings | None
    train: dict[str, TrainConfig]
    quantize: str = "none"  # "none" or "nf4" (QLoRA)
    # "auto": only where the memory estimate without it does not fit the device (`plan_finetune`);
    # "on", "off"; or a tuple of hardware classes that always recompute (the old form)
    activation_checkpointing: str | tuple[str, ...] = "auto"
    template: str = "alpaca"
    pack: bool = True  # several records per row, each attending only to itself, where the base supports it

    def train_config(self, hardware: str, **overrides: Any) -> TrainConfig:
        if hardware not in self.train:
            raise FinetuneError(f"recipe {self.name!r} has no setting for hardware {hardware!r}; "
                                f"choose one of {', '.join(self.train)}")
        return dataclasses.replace(self.train[hardware], **overrides)

    def to_dict(self) -> dict[str, Any]:
        ckpt = self.activation_checkpointing
        return {**{k: getattr(self, k) for k in ("name", "description", "quantize", "template", "pack")},
                "lora": dataclasses.asdict(self.lora) if self.lora is not None else None,
                "activation_checkpointing": ckpt if isinstance(ckpt, str) else list(ckpt),
                "train": {k: v.to_dict() for k, v in self.train.items()}}


def _settings() -> dict[str, TrainConfig]:
    # compile "auto": the whole step (forward and loss, `lora.FinetuneLoss`) compiled on CUDA, eager elsewhere
    common = dict(weight_decay=0.0, grad_clip=1.0, compile="auto", eval_batches=8, log_every=10, keep_last=3)
    return {  # effective batch 16 sequences on both GPUs
        "t4": TrainConfig(micro_batch_size=4, grad_accum_steps=4, seq_len=512, lr=2e-4, min_lr=2e-5, warmup_steps=100,
                          max_steps=1000, eval_every=100, save_every=50, precision="auto", **common),
        "a100": TrainConfig(micro_batch_size=8, grad_accum_steps=2, seq_len=768, lr=2.5e-4, min_lr=2.5e-5,
                            warmup_steps=150, max_steps=1000, eval_every=100, save_every=50, precision="auto",
                            **common),
        "cpu": TrainConfig(micro_batch_size=4, grad_accum_steps=2, seq_len=256, lr=2e-3, min_lr=2e-4, warmup_steps=3,
                           max_steps=30, eval_every=10, save_every=10, precision="fp32",
                           **{**common, "eval_batches": 2, "log_every": 5, "keep_last": 2}),
    }


FINETUNE_RECIPES: dict[str, FinetuneRecipe] = {
    f"lora-r{r}": FinetuneRecipe(f"lora-r{r}", f"LoRA rank {r} (alpha {2 * r}) on every linear layer of attention "
                                 "and MLP; base weights in fp16 (T4) or bf16 (A100)", LoraSettings(r=r, alpha=2 * r),
                                 _settings()) for r in (8, 16, 32)}
FINETUNE_RECIPES["qlora-r16"] = FinetuneRecipe(
    "qlora-r16", "QLoRA: the base in 4-bit NF4 with double quantization, LoRA rank 16 in fp32; the one that fits "
    "a 2B model on a T4", LoraSettings(r=16, alpha=32), _settings(), quantize="nf4")
# Full finetuning moves every weight, so it takes a tenth of LoRA's learning rate (adapters start at zero and
# need the larger steps); weights, gradients and both AdamW moments in fp32 are 16 bytes per parameter.
FULL_LR_FACTOR = 0.1
FINETUNE_RECIPES["full"] = FinetuneRecipe(
    "full", "Full finetuning: every weight trains (fp32 weights, gradients and AdamW states, 16 bytes per parameter; "
    "half-precision compute); for small bases, the result a whole model folder", None,
    {hw: dataclasses.replace(c, lr=c.lr * FULL_LR_FACTOR, min_lr=c.min_lr * FULL_LR_FACTOR)
     for hw, c in _settings().items()})


def get_finetune_recipe(name: str) -> FinetuneRecipe:
    if name not in FINETUNE_RECIPES:
        raise FinetuneError(f"unknown finetune recipe {name!r}; choose one of {', '.join(FINETUNE_RECIPES)}")
    r = FINETUNE_RECIPES[name]
    return dataclasses.replace(r, lora=dataclasses.replace(r.lora) if r.lora is not None else None,
                               train=dict(r.train))


def finetune_device(hardware: str) -> tuple[str, tuple[int, int] | None, torch.dtype]:
    """What a finetuning class runs on, as `model.attention.attention_kernel` needs it: device type, compute
    capability, dtype (the class's entry in `core.hardware.HARDWARE`)."""
    c = HARDWARE[hardware]
    return c.device_type, c.capability, DTYPES[c.precision]


def detect_hardware(device: torch.device | str) -> str:
    """The finetuning class ("cpu", "t4" or "a100") of a device: its hardware class's `finetune` entry."""
    return HARDWARE[device_class(device)].finetune


def this_hardware(device: str = "auto") -> tuple[str, float | None]:
    """(hardware class, GPU memory in GB or None) of this machine."""
    dev = resolve_device(device)
    gpu_gb = torch.cuda.get_device_properties(dev).total_memory / 1e9 if dev.type == "cuda" else None
    return detect_hardware(dev), gpu_gb


def check_qlora(device: torch.device) -> None:
    """Raise a FinetuneError unless bitsandbytes can run an NF4 layer forward and backward on `device`."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # ImportError, or a broken CUDA setup raising at import
        raise FinetuneError(f"QLoRA needs bitsandbytes, which cannot be imported ({e}): `pip install bitsandbytes`, "
                            "or choose a LoRA recipe such as lora-r16") from e
    if device.type not in ("cuda", "cpu", "xpu"):
        raise FinetuneError(f"QLoRA: bitsandbytes has no 4-bit kernels for {device.type}; "
                            "use a LoRA recipe (lora-r16) or a CUDA GPU")
    try:
        layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4").to(device)
        x = torch.randn(2, 64, device=device, requires_grad=True)
        layer(x).sum().backward()
    except Exception as e:
        raise FinetuneError(f"QLoRA: bitsandbytes {bnb.__version__} cannot run a 4-bit NF4 layer on {device}: "
                            f"{type(e).__name__}: {e}. Use a LoRA recipe (lora-r16) instead") from e


# bitsandbytes' 4-bit layers compile without graph breaks only from these versions on (together).
QLORA_COMPILE_FLOOR = {"bitsandbytes": (0, 46), "torch": (2, 8)}


def qlora_compile(compile: str, device_type: str, bnb_version: str, torch_version_: str) -> tuple[str, str | None]:
    """(the compile setting QLoRA trains with, a one-line note or None). Below QLORA_COMPILE_FLOOR a compiled
    4-bit step breaks into many graphs (slower than eager, and slow to compile): QLoRA then runs eagerly."""
    compiling = compile in ("on", "regional") or (compile == "auto" and device_type == "cuda")
    have = {"bitsandbytes": torch_version(bnb_version), "torch": torch_version(torch_version_)}
    short = [f"{k} >= {'.'.join(map(str, v))}" for k, v in QLORA_COMPILE_FLOOR.items() if have[k] < v]
    if not compiling or not short:
        return compile, None
    return "off", (f"QLoRA runs eagerly: compiling its 4-bit layers needs {' and '.join(short)} (this runtime has "
                   f"bitsandbytes {bnb_version}, torch {torch_version_.split('+')[0]})")


def chunked_loss(config: dict[str, Any]) -> bool:
    """Whether finetuning's loss avoids the full (tokens, vocab) logits for a base with this config."""
    return config.get("model_type") in PLAIN_HEAD_TYPES or config.get("model_type") in SOFTCAP_HEAD_TYPES


# ----- the base ----------------------------------------------------------------------------------
def _need(module: str, what: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise FinetuneError(f"{what} needs `pip install {module}`") from e


def is_tinygpt_run(base: str | Path) -> bool:
    return RunDir(Path(base).expanduser()).is_pretrain_run()


def base_config(path: str):
    """The `transformers` config of a base (a local folder or a Hub id): the cheap check that it exists, and
    (`model.hf.from_pretrained`) that it is a model tinygpt loads, naming no code of its own."""
    _need("transformers", "finetuning")

    p = Path(path).expanduser()
    if p.exists() and not (p / "config.json").is_file():
        raise FinetuneError(f"base {path!r} is a folder with neither run.json (a tinygpt run) nor config.json "
                            "(a Hugging Face model)")
    if not p.exists() and (path.startswith(("/", ".", "~")) or path.count("/") > 1):
        raise FinetuneError(f"base {path!r} does not exist: give a tinygpt run folder, a model folder or a "
                            "Hub id such as google/gemma-2-2b")
    try:
        return from_pretrained("AutoConfig", path)
    except (UntrustedModel, UnsafeTokenizer, UnsafePathError, FileTooLarge):
        raise  # one line that names the file already
    except Exception as e:
        raise FinetuneError(f"could not load base model {path!r}: {type(e).__name__}: {e}\nCheck the folder or "
                            "the Hub id and the network; gated models (Gemma, Llama) need their licence accepted on "
                            "the Hub and `hf auth login` (or HF_TOKEN set)") from e


def base_config_dict(base: str | Path) -> dict[str, Any]:
    """A base's `config.json` as a dict (what `memory_table` reads), without loading any weights;
    for a tinygpt run folder, that of the `LlamaForCausalLM` (or `Qwen3ForCausalLM`) it is exported as."""
    if is_tinygpt_run(base):
        recipe = Recipe.from_dict(RunDir(Path(base).expanduser()).recipe_dict())
        return {"model_type": recipe.model.family.model_type, **recipe.model.to_hf_llama()}
    return base_config(str(base)).to_dict()


# ----- memory -------------------------------------------------------------------------------------
def checkpointing_rule(recipe: FinetuneRecipe, hardware: str) -> bool | None:
    """The recipe's activation checkpointing on this hardware: True, False, or None (decided by memory)."""
    rule = recipe.activation_checkpointing
    if isinstance(rule, str):
        if rule not in ("auto", "on", "off"):
            raise FinetuneError(f"activation_checkpointing must be auto, on or off, got {rule!r}")
        return None if rule == "auto" else rule == "on"
    return hardware in rule


def memory_table(recipe: FinetuneRecipe | str, hardware: str, base_config: dict[str, Any], *,
                 activation_checkpointing: bool | None = None, full_logits: bool | None = None) -> list[dict[str, Any]]:
    """Estimated GPU memory (GB) of finetuning a base with a Llama-like `config.json` dict.
    Activations: 2 bytes x tokens x (17 d_model + 5 d_ff) per layer (a layer with LoRA dropout and
    flash attention); with activation checkpointing only the layer inputs plus one layer are held.
    activation_checkpointing / full_logits: None gives the leanest the recipe allows (checkpointing on a GPU
    unless the recipe says "off"; chunked logits where the family allows), the least a run can need."""
    recipe = get_finetune_recipe(recipe) if isinstance(recipe, str) else recipe
    c, cfg = base_config, recipe.train_config(hardware)
    h = c.get("hidden_size") or c["n_embd"]
    L = c.get("num_hidden_layers") or c["n_layer"]
    nh = c.get("num_attention_heads") or c["n_head"]
    hd = c.get("head_dim") or h // nh
    nkv = c.get("num_key_value_heads") or nh
    ff = c.get("intermediate_size") or c.get("n_inner") or 4 * h
    V = c["vocab_size"]
    shapes = {"q_proj": (h, nh * hd), "k_proj": (h, nkv * hd), "v_proj": (h, nkv * hd), "o_proj": (nh * hd, h),
              "gate_proj": (h, ff), "up_proj": (h, ff), "down_proj": (ff, h)}
    linear = L * sum(a * b for a, b in shapes.values())
    emb = V * h * (1 if c.get("tie_word_embeddings", True) else 2)
    if recipe.lora is None:  # full finetuning: every weight is trained
        lora = linear + emb
    else:
        targets = recipe.lora.target_modules or tuple(shapes)
        lora = L * sum(recipe.lora.r * sum(shapes[t]) for t in targets if t in shapes)
    half = 4 if hardware == "cpu" or recipe.lora is None else 2  # full: fp32 weights (the optimizer updates them)
    nf4 = recipe.quantize == "nf4"
    tokens = cfg.micro_batch_size * cfg.seq_len
    layer_act = 2 * tokens * (17 * h + 5 * ff)
    # Beyond flash attention (`model.attention`): GQA keys/values repeated to the query heads where no fused kernel
    # takes them grouped (a T4), and an eager base's (Gemma-2's soft-capping) T x T scores: fp32 softmax + a copy.
    kernel = ("math" if c.get("final_logit_softcapping")
              else attention_kernel(*finetune_device(hardware), torch_version(), hd))
    if nkv < nh and kernel != "fused":
        layer_act += 2 * tokens * 2 * (nh - nkv) * hd
    if kernel == "math":
        layer_act += tokens * nh * cfg.seq_len * (4 + half)
    rule = checkpointing_rule(recipe, hardware)
    ckpt = (activation_checkpointing if activation_checkpointing is not None
            else rule if rule is not None else hardware != "cpu")
    act = (L * 2 * tokens * h + layer_act) if ckpt else L * layer_act
    chunked = chunked_loss(c) and not full_logits
    logits = (2**25 * 8) if chunked else tokens * V * 12  # fp16 logits + fp32 copy + fp32 log-softmax/grad
    gb = 1e9
    rows = [
        ("base weights", (linear * (0.516 if nf4 else half) + emb * half) / gb,
         "NF4: 4 bits + double-quantized scales (0.127 bits) per linear weight; embeddings stay 16-bit" if nf4
         else f"{half} bytes per weight"),
        ("adapters", lora * 4 / gb, f"{lora / 1e6:.1f}M LoRA weights in fp32") if recipe.lora is not None else
        ("adapters", 0.0, "none: full finetuning trains the base weights themselves"),
        ("gradients + AdamW", lora * 12 / gb, "fp32 gradient and two moments per "
         + ("adapter weight" if recipe.lora is not None else f"weight ({lora / 1e6:.1f}M)")),
        ("activations", act / gb, f"micro-batch {cfg.micro_batch_size} x {cfg.seq_len}, "
         f"{'with' if ckpt else 'without'} activation checkpointing"),
        ("logits + loss", logits / gb, "chunked cross-entropy" if chunked else "full (tokens, vocab) logits"),
    ]
    out = [{"part": p, "gb": round(v, 3), "how": how} for p, v, how in rows]
    return out + [{"part": "total", "gb": round(sum(r["gb"] for r in out), 3),
                   "how": "tensors only; `device_need_gb` adds the CUDA context and allocator slack"}]


def device_need_gb(table: list[dict[str, Any]], hardware: str) -> float:
    """The memory a device must have for a `memory_table`: its tensors plus `train.memory`'s overhead."""
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
    """Whether packed records keep their attention to themselves in this base: a family whose transformers
    code builds its mask with `masking_utils`, in a transformers that reads restarting position ids as
    record boundaries (4.53 and later)."""
    if base_config.get("model_type") not in PACKABLE_TYPES:
        return False
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class FinetunePlan:
    """How a run trains, decided once from the memory estimate against the device and kept in finetune.json
    (a resumed run keeps it): recompute activations or not, full logits or chunked, packed rows or padded."""

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


def plan_finetune(recipe: FinetuneRecipe, hardware: str, base_config: dict[str, Any],
                  memory_gb: float | None) -> FinetunePlan:
    """The fastest plan whose estimate fits FIT_FRACTION of `memory_gb` (None: any fits). Tried fastest
    first: no recomputation and the full logits; then chunked logits (a loop over row chunks, no extra
    matmul); then activation checkpointing (one more forward per step); the leanest when none fits."""
    rule = checkpointing_rule(recipe, hardware)
    ckpts = [rule] if rule is not None else [False, True]
    logits = [True, False] if chunked_loss(base_config) else [True]
    options = [(c, f) for c in ckpts for f in logits]
    pack = recipe.pack and packing_supported(base_config)
    for c, f in options:
        need = device_need_gb(memory_table(recipe, hardware, base_config, activation_checkpointing=c, full_logits=f),
                              hardware)
        if memory_gb is None or need <= FIT_FRACTION * memory_gb:
            break
    where = f"of {memory_gb:.1f} GB" if memory_gb is not None else "(device memory unknown)"
    fits = memory_gb is None or need <= FIT_FRACTION * memory_gb
    why = (f"about {need:.1f} GB {where}: activation checkpointing {'on' if c else 'off'}, "
           f"{'full' if f else 'chunked'} logits" + ("" if fits else "; the leanest plan, and it may not fit"))
    return FinetunePlan(c, f, pack, round(need, 3), None if memory_gb is None else round(memory_gb, 3), why)


def resumed_plan(old: dict[str, Any], recipe: FinetuneRecipe, hardware: str, base_config: dict[str, Any],
                 memory_gb: float | None) -> FinetunePlan:
    """The plan of the run being resumed (from its finetune.json). Its packing is always kept (the rows
    must be the same); its memory choices too, unless this device is too small for them. A run from
    before plans were recorded had the old rules: padded rows, checkpointing per hardware class."""
    if "plan" in old:
        plan = FinetunePlan.from_dict(old["plan"])
    else:
        r = old.get("recipe", {})
        rule = r.get("activation_checkpointing", ["t4", "a100"])
        ckpt = hardware in rule if isinstance(rule, list) else rule == "on" or (rule == "auto" and hardware != "cpu")
        plan = FinetunePlan(ckpt, False, bool(r.get("pack", False)), 0.0, None, "a run from before plans were kept")
    table = memory_table(recipe, hardware, base_config, activation_checkpointing=plan.activation_checkpointing,
                         full_logits=plan.full_logits)
    need = device_need_gb(table, hardware)
    if memory_gb is not None and need > FIT_FRACTION * memory_gb:
        lean = plan_finetune(recipe, hardware, base_config, memory_gb)
        return dataclasses.replace(lean, pack=plan.pack, why=lean.why + " (re-planned: the run's plan does not "
                                   "fit this device)")
    return dataclasses.replace(plan, need_gb=round(need, 3))


# ----- the default --------------------------------------------------------------------------------
def default_finetune_recipe(base_config: dict[str, Any], hardware: str, memory_gb: float | None = None,
                            resume_from: Iterable[str | Path | None] = ()) -> tuple[str, str]:
    """(recipe name, why): the run being resumed decides first; on a GPU lora-r16 when its estimate
    fits `memory_gb` with 10% to spare, else qlora-r16; on a CPU lora-r8 (4-bit kernels are slow there)."""
    resumed = recipe_name_of(*resume_from)
    if resumed in FINETUNE_RECIPES:
        return resumed, "the recipe of the run on Drive (it continues where it stopped)"
    if hardware == "cpu":
        return "lora-r8", "on a CPU: the smallest adapter, base weights in fp32 (4-bit kernels are slow here)"
    need = device_need_gb(memory_table("lora-r16", hardware, base_config), hardware)
    if memory_gb is None or need <= 0.9 * memory_gb:
        return "lora-r16", f"lora-r16 needs about {need:.1f} GB" + (f" of this GPU's {memory_gb:.0f} GB"
                                                                    if memory_gb else "")
    return "qlora-r16", (f"lora-r16 would need about {need:.1f} GB, more than this GPU's {memory_gb:.0f} GB: "
                         "the base goes in 4-bit")


# ----- the run folder's files --------------------------------------------------------------------
def check_same_run(run_dir: Path, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
    """Refuse a run folder whose finetune.json describes another run (the Trainer checks the TrainConfig)."""

    def identity(i: dict) -> dict:  # packing is part of the run's plan, which a resumed run keeps
        return {k: i.get(k) for k in ("base", "data", "hardware")} | {
            k: i["recipe"].get(k) for k in ("lora", "quantize", "template")}
    check_same_settings(f"run folder {run_dir}", identity(old) if old is not None else None, identity(new),
                        "another finetuning run")


def _adapter_dir(path: str | Path) -> Path:
    p = Path(path)
    p = p / ADAPTER_DIR if (p / ADAPTER_DIR).is_dir() else p
    if not (p / "adapter_model.safetensors").is_file():
        raise FinetuneError(f"{path} holds no adapter (no adapter_model.safetensors); finetune first, or "
                            "export_adapter(run_dir) to make one from a checkpoint")
    return p


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def verify_adapter(adapter_dir: Path) -> None:
    """Refuse a damaged adapter before it is used: with a manifest (every adapter tinygpt writes has
    one) sizes and sha256 of its files; without one (a PEFT folder from elsewhere) at least that the
    weights file reads back whole."""
    if (adapter_dir / MANIFEST).is_file():
        ok, why = verify_checkpoint(adapter_dir, required=ADAPTER_WEIGHTS)
    else:
        try:
            load_safetensors(str(adapter_dir / ADAPTER_WEIGHTS))
            ok, why = True, "ok"
        except Exception as e:  # a truncated or garbled file: safetensors says so in its own words
            ok, why = False, f"{ADAPTER_WEIGHTS} does not read back ({str(e).splitlines()[0][:120]})"
    if not ok:
        raise FinetuneError(f"adapter {adapter_dir} is damaged: {why}; export it again from the run's checkpoints "
                            "(export_adapter(run_dir)) or copy it again from Drive")


def export_adapter(run_dir: str | Path, which: str = "latest", out_dir: str | Path | None = None) -> Path:
    """A PEFT adapter folder from one of a run's checkpoints ("latest", "best" or a folder): the checkpoint's
    model.safetensors already holds exactly PEFT's adapter weights under PEFT's names."""
    run_dir = Path(run_dir)
    if not RunDir(run_dir).is_finetune_run():
        raise FinetuneError(f"{run_dir} is not a finetuning run folder (no adapter_config.json)")
    ckpt = find_run_checkpoint(run_dir, which)
    out = Path(out_dir) if out_dir is not None else run_dir / ADAPTER_DIR
    with atomic_output(out, folder=True) as tmp:  # an old adapter is replaced whole: a crash leaves one of the two
        shutil.copyfile(ckpt / MODEL_FILE, tmp / ADAPTER_WEIGHTS)
        for name in (ADAPTER_CONFIG, ADAPTER_INFO):
            shutil.copyfile(run_dir / name, tmp / name)
        # checked like a checkpoint before every use (sizes and sha256)
        write_manifest(tmp, {"step": int(read_manifest(ckpt).get("step", 0)), "kind": "adapter"})
    return out
