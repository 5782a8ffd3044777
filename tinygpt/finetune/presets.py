"""The finetuning recipes and the hardware they run on: LoRA settings, a train setting per
finetuning class (cpu, t4, a100), the class of this machine, and whether QLoRA's 4-bit kernels run
(and compile) here. Nothing in this module loads a model; what a recipe needs of memory with a given
base is `finetune.memory_plan`'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

import torch

from tinygpt.core.config import TrainConfig
from tinygpt.core.gpu_classes import HARDWARE
from tinygpt.core.precision import DTYPES, compiles, resolve_device
from tinygpt.fit.hardware import device_class
from tinygpt.model.attention import torch_version


class FinetuneError(RuntimeError):
    """Finetuning cannot start or go on; the message says what to do."""


def require_package(module: str, what: str):
    """The module `module`, or a FinetuneError saying that `what` needs it installed."""
    try:
        return __import__(module)
    except ImportError as e:
        raise FinetuneError(f"{what} needs `pip install {module}`") from e


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
            raise FinetuneError(
                "LoRA needs r >= 1, alpha > 0 and 0 <= dropout < 1; got "
                f"r={self.r}, alpha={self.alpha}, dropout={self.dropout}"
            )
        if self.target_modules is not None:
            self.target_modules = tuple(self.target_modules)


@dataclass
class FinetuneRecipe:
    """LoRA settings (None: full finetuning, every weight trains) plus a TrainConfig per finetuning
    class ("cpu", "t4", "a100": the `finetune` entries of `core.gpu_classes.HARDWARE`, coarser groups
    of the hardware classes)."""

    name: str
    description: str
    lora: LoraSettings | None
    train: dict[str, TrainConfig]
    quantize: str = "none"  # "none" or "nf4" (QLoRA)
    # "auto": only where the memory estimate without it does not fit the device (`plan_finetune`);
    # "on", "off"; or a tuple of hardware classes that always recompute (the old form)
    activation_checkpointing: str | tuple[str, ...] = "auto"
    template: str = "alpaca"
    # several records per row, each attending only to itself, where the base supports it
    pack: bool = True

    def train_config(self, hardware: str, **overrides: Any) -> TrainConfig:
        if hardware not in self.train:
            raise FinetuneError(
                f"recipe {self.name!r} has no setting for hardware {hardware!r}; "
                f"choose one of {', '.join(self.train)}"
            )
        return dataclasses.replace(self.train[hardware], **overrides)

    def to_dict(self) -> dict[str, Any]:
        ckpt = self.activation_checkpointing
        plain = ("name", "description", "quantize", "template", "pack")
        return {
            **{k: getattr(self, k) for k in plain},
            "lora": dataclasses.asdict(self.lora) if self.lora is not None else None,
            "activation_checkpointing": ckpt if isinstance(ckpt, str) else list(ckpt),
            "train": {k: v.to_dict() for k, v in self.train.items()},
        }


def _settings() -> dict[str, TrainConfig]:
    # compile "auto": the whole step (forward and loss, `loss.FinetuneLoss`) compiled on CUDA, eager
    # elsewhere. The A100 and CPU settings are variants of the T4's: geometry (effective batch 16
    # sequences on both GPUs), schedule, then logging.
    common = dict(weight_decay=0.0, grad_clip=1.0, compile="auto", eval_batches=8, log_every=10)
    t4 = TrainConfig(**common, precision="auto", keep_last=3, max_steps=1000, eval_every=100)
    t4 = replace(t4, micro_batch_size=4, grad_accum_steps=4, seq_len=512, save_every=50)
    t4 = replace(t4, lr=2e-4, min_lr=2e-5, warmup_steps=100)
    a100 = replace(t4, micro_batch_size=8, grad_accum_steps=2, seq_len=768)
    a100 = replace(a100, lr=2.5e-4, min_lr=2.5e-5, warmup_steps=150)
    cpu = replace(t4, grad_accum_steps=2, seq_len=256, max_steps=30, eval_every=10, save_every=10)
    cpu = replace(cpu, lr=2e-3, min_lr=2e-4, warmup_steps=3, precision="fp32")
    cpu = replace(cpu, eval_batches=2, log_every=5, keep_last=2)
    return {"t4": t4, "a100": a100, "cpu": cpu}


FINETUNE_RECIPES: dict[str, FinetuneRecipe] = {
    f"lora-r{r}": FinetuneRecipe(
        f"lora-r{r}",
        f"LoRA rank {r} (alpha {2 * r}) on every linear layer of attention and MLP; "
        "base weights in fp16 (T4) or bf16 (A100)",
        LoraSettings(r=r, alpha=2 * r),
        _settings(),
    )
    for r in (8, 16, 32)
}
FINETUNE_RECIPES["qlora-r16"] = FinetuneRecipe(
    "qlora-r16",
    "QLoRA: the base in 4-bit NF4 with double quantization, LoRA rank 16 in fp32; the "
    "one that fits a 2B model on a T4",
    LoraSettings(r=16, alpha=32),
    _settings(),
    quantize="nf4",
)
# Full finetuning moves every weight, so it takes a tenth of LoRA's learning rate (adapters start at
# zero and need the larger steps); weights, gradients and both AdamW moments in fp32 are 16 bytes
# per parameter.
FULL_LR_FACTOR = 0.1
FINETUNE_RECIPES["full"] = FinetuneRecipe(
    "full",
    "Full finetuning: every weight trains (fp32 weights, gradients and AdamW states, 16 bytes per "
    "parameter; half-precision compute); for small bases, the result a whole model folder",
    None,
    {
        hw: dataclasses.replace(c, lr=c.lr * FULL_LR_FACTOR, min_lr=c.min_lr * FULL_LR_FACTOR)
        for hw, c in _settings().items()
    },
)


def get_finetune_recipe(name: str) -> FinetuneRecipe:
    if name not in FINETUNE_RECIPES:
        raise FinetuneError(
            f"unknown finetune recipe {name!r}; choose one of {', '.join(FINETUNE_RECIPES)}"
        )
    r = FINETUNE_RECIPES[name]
    return dataclasses.replace(
        r, lora=dataclasses.replace(r.lora) if r.lora is not None else None, train=dict(r.train)
    )


# ----- hardware -----------------------------------------------------------------------------------
def finetune_device(hardware: str) -> tuple[str, tuple[int, int] | None, torch.dtype]:
    """What a finetuning class runs on, as `model.attention.attention_kernel` needs it: device type,
    compute capability, dtype (the class's entry in `core.gpu_classes.HARDWARE`)."""
    c = HARDWARE[hardware]
    return c.device_type, c.capability, DTYPES[c.precision]


def detect_hardware(device: torch.device | str) -> str:
    """The finetuning class ("cpu", "t4" or "a100") of a device: its hardware class's `finetune`."""
    return HARDWARE[device_class(device)].finetune


def this_hardware(device: str = "auto") -> tuple[str, float | None]:
    """(hardware class, GPU memory in GB or None) of this machine."""
    dev = resolve_device(device)
    gpu_gb = (
        torch.cuda.get_device_properties(dev).total_memory / 1e9 if dev.type == "cuda" else None
    )
    return detect_hardware(dev), gpu_gb


def check_qlora(device: torch.device) -> None:
    """Refuse (FinetuneError) a device where bitsandbytes cannot run an NF4 forward and backward."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # ImportError, or a broken CUDA setup raising at import
        raise FinetuneError(
            f"QLoRA needs bitsandbytes, which cannot be imported ({e}): `pip "
            "install bitsandbytes`, or choose a LoRA recipe such as lora-r16"
        ) from e
    if device.type not in ("cuda", "cpu", "xpu"):
        raise FinetuneError(
            f"QLoRA: bitsandbytes has no 4-bit kernels for {device.type}; "
            "use a LoRA recipe (lora-r16) or a CUDA GPU"
        )
    try:
        layer = bnb.nn.Linear4bit(
            64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4"
        ).to(device)
        x = torch.randn(2, 64, device=device, requires_grad=True)
        layer(x).sum().backward()
    except Exception as e:
        raise FinetuneError(
            f"QLoRA: bitsandbytes {bnb.__version__} cannot run a 4-bit NF4 layer "
            f"on {device}: {type(e).__name__}: {e}. Use a LoRA recipe (lora-r16) instead"
        ) from e


# bitsandbytes' 4-bit layers compile without graph breaks only from these versions on (together).
QLORA_COMPILE_FLOOR = {"bitsandbytes": (0, 46), "torch": (2, 8)}


def qlora_compile(
    compile: str, device_type: str, bnb_version: str, torch_version_: str
) -> tuple[str, str | None]:
    """(QLoRA's compile setting, a note or None): below QLORA_COMPILE_FLOOR a compiled 4-bit step
    breaks into many graphs (slower than eager, and slow to compile), so it runs eagerly."""
    compiling = compiles(compile, device_type)
    have = {"bitsandbytes": torch_version(bnb_version), "torch": torch_version(torch_version_)}
    short = [
        f"{k} >= {'.'.join(map(str, v))}" for k, v in QLORA_COMPILE_FLOOR.items() if have[k] < v
    ]
    if not compiling or not short:
        return compile, None
    return "off", (
        f"QLoRA runs eagerly: compiling its 4-bit layers needs {' and '.join(short)} "
        f"(this runtime has bitsandbytes {bnb_version}, torch {torch_version_.split('+')[0]})"
    )
