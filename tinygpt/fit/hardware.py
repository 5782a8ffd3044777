"""What this machine is: the GPU table (peak TFLOP/s, hardware class), RAM and cores, and the one
rule that puts a device into a hardware class. The probe, the recipes' defaults, MFU and the
finetuning recipes all ask here. "GB" is GiB (2**30 bytes), as Colab and nvidia-smi count it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tinygpt.core.config import ConfigError, ModelConfig
from tinygpt.core.gpu_classes import HARDWARE
from tinygpt.core.precision import choose_precision, native_bf16, resolve_device
from tinygpt.fit.memory import GB, estimate_memory

# (name as in torch.cuda.get_device_name, peak dense bf16/fp16 tensor TFLOP/s, hardware class),
# every class's GPUs, longest name first ("H100 PCIe" before "H100"); a name matches as a whole word
GPU_TABLE: list[tuple[str, float, str]] = sorted(
    ((gpu, tflops, c.name) for c in HARDWARE.values() for gpu, tflops in c.gpus),
    key=lambda row: -len(row[0]),
)


def gpu_spec(name: str) -> tuple[float | None, str | None]:
    """(peak dense bf16/fp16 TFLOP/s, hardware class) for a CUDA device name, or (None, None)."""
    for key, tflops, hw in GPU_TABLE:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name, re.IGNORECASE):
            return tflops, hw
    return None, None


def peak_tflops(name: str, precision: str = "bf16") -> float | None:
    """The MFU denominator for a CUDA device name: the table's bf16/fp16 peak; None for fp32 (a TF32
    or fp32 MFU against a bf16 peak would mislead) and for unlisted GPUs."""
    return None if precision == "fp32" else gpu_spec(name)[0]


def gpu_peak_tflops(dev: torch.device, precision: str) -> float | None:
    """The GPU's peak dense TFLOP/s from the table (for MFU); None on a CPU or an unknown GPU."""
    if dev.type != "cuda":
        return None
    try:
        return peak_tflops(torch.cuda.get_device_name(dev), precision)
    except Exception:  # the table is a nicety; training does not depend on it
        return None


@dataclass
class HardwareReport:
    device: str  # "cuda", "mps" or "cpu"
    name: str
    total_memory_gb: float | None
    free_memory_gb: float | None
    compute_capability: str | None
    native_bf16: bool
    peak_tflops: float | None
    cpu_cores: int
    # a key of core.gpu_classes.HARDWARE (or the device type of an unlisted one)
    hardware_class: str
    default_recipe: str
    precision: str
    precision_reason: str
    torch_version: str

    def to_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        return [
            (k, "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v))
            for k, v in self.to_dict().items()
        ]


def ram_gb() -> tuple[float | None, float | None]:
    """(total, available) RAM: psutil where installed (Colab has it), else Linux's /proc/meminfo."""
    with contextlib.suppress(ImportError):
        import psutil

        return psutil.virtual_memory().total / GB, psutil.virtual_memory().available / GB
    with contextlib.suppress(OSError, KeyError, ValueError):
        lines = Path("/proc/meminfo").read_text().splitlines()  # outside run folders: the kernel's
        kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in lines)}
        return kb["MemTotal"] * 1024 / GB, kb["MemAvailable"] * 1024 / GB
    return None, None


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        # outside run folders: the kernel's
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def cpu_cores() -> int:
    """The cores this process may use (a Colab or container quota is less than os.cpu_count())."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def hardware_report(device: str | torch.device = "auto") -> HardwareReport:
    """What this machine is, and what the probe picks for it by default."""
    dev = resolve_device(str(device))
    total, free = ram_gb()
    cap, peak, hw, name = None, None, dev.type, cpu_name()
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        free_b, total_b = torch.cuda.mem_get_info(dev)
        free, total = free_b / GB, total_b / GB
        major, minor = torch.cuda.get_device_capability(dev)
        cap = f"{major}.{minor}"
        peak, hw = gpu_spec(name)[0], gpu_class(name, major, total)
    elif dev.type == "mps":
        name = f"Apple MPS ({platform.machine()})"  # unified memory: the RAM figures stand
    prec, default = choose_precision(dev), HARDWARE[hw].default_recipe if hw in HARDWARE else "cpu"
    return HardwareReport(
        dev.type,
        name,
        total,
        free,
        cap,
        native_bf16(dev),
        peak,
        cpu_cores(),
        hw,
        default,
        prec.name,
        prec.reason,
        torch.__version__,
    )


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation (0..1); None where the peak is unknown (CPU, MPS, unlisted GPUs)."""
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12) if peak_tflops else None


def gpu_class(name: str, major: int, total_gb: float) -> str:
    """A CUDA GPU's hardware class: the table's for a listed name, else by generation and memory."""
    hw = gpu_spec(name)[1]
    if hw is not None:
        return hw
    if major < 8:
        return "t4"
    if total_gb >= 120:
        return "h200"
    if total_gb >= 70 and major >= 9:
        return "h100"
    return "a100" if total_gb >= 38 else "l4"


def device_class(device: str | torch.device = "auto") -> str:
    """A device's hardware class: "cpu", "mps" or a GPU class (a key of gpu_classes.HARDWARE)."""
    dev = resolve_device(str(device))
    if dev.type != "cuda":
        return dev.type
    props = torch.cuda.get_device_properties(dev)
    return gpu_class(torch.cuda.get_device_name(dev), props.major, props.total_memory / GB)


def check_device(dev: torch.device) -> None:
    """Refuse a device this machine does not have, in one line, before anything is written."""
    if dev.type == "mps" and not (
        getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    ):
        raise ConfigError(
            "device 'mps' was asked for but torch sees no Apple GPU (MPS) here; use --device cpu, "
            "or leave --device out to take the best device present"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(
            f"device {dev} was asked for but torch sees {torch.cuda.device_count()} CUDA GPU(s); "
            "use --device cuda:0, or leave --device out"
        )


def device_memory_gb(dev: torch.device) -> tuple[float | None, str]:
    """What a device has to train with, in GB, and what that is: the GPU's memory, or the RAM."""
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        return total / GB, f"the GPU ({torch.cuda.get_device_name(dev)})"
    return ram_gb()[0], "RAM"


def check_fits(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    dev: torch.device,
    loss: str = "auto",
    what: str = "this model",
) -> None:
    """Refuse, in one line that says what fits, a training run whose estimated memory (fit.memory)
    is more than the device has: a model the kernel's OOM killer would end after minutes, without a
    word. The estimate grows linearly with n_layer, so it is read at the fewest layers the model
    allows (1, or twice its value_embeds, 2 with unet_skips) and one more."""
    have, where = device_memory_gb(dev)
    if have is None:
        return

    def est(n_layer: int) -> float:
        m = dataclasses.replace(model, n_layer=n_layer)
        return estimate_memory(
            m, micro_batch_size, seq_len, precision, device_type=dev.type, loss=loss
        ).total_gb

    low = max(1, 2 * model.value_embeds, 2 * model.unet_skips)
    one, per_layer = est(low), est(low + 1) - est(low)
    need = one + (model.n_layer - low) * per_layer
    if need <= have:
        return
    most = int((have - one) // per_layer) + low if per_layer > 0 and have >= one else 0
    fits = (
        f"at this width (d_model {model.d_model}, vocab {model.vocab_size}) at most about {most} "
        "layers fit"
        if most >= 1
        else f"not even one layer of this width (d_model {model.d_model}, vocab "
        f"{model.vocab_size}) fits; lower d_model or vocab_size"
    )
    raise ConfigError(
        f"{what} needs about {need:,.1f} GB to train (n_layer {model.n_layer}, micro-batch "
        f"{micro_batch_size}, context {seq_len}, {precision}) but {where} has {have:.1f} GB: "
        f"{fits}; lower model.n_layer or model.d_model (or train.micro_batch_size)"
    )
