"""The hardware classes: one entry per class of
machine, holding everything tinygpt decides per class.

A class is a group of devices that train alike: "cpu", "mps", and the GPU classes named for the
GPU each stands for (t4, l4, a100, h100, ...). `fit.hardware` puts a device into a class (by
the GPU names listed here, else by generation and memory); the probe's default recipe, the
precision a table shows for a class, the finetuning settings and the notebooks' default time budget
are read from its entry. Elsewhere classes are named only by the rule for unlisted GPUs
(`fit.hardware.gpu_class`) and by finetuning's settings, kept for three of them (cpu, t4, a100).

Adding a class is one `HardwareClass` entry and its name in `HARDWARE`. No torch here: this is data.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Native bf16 matmuls start with compute capability 8.0 (Ampere); below
# it a CUDA GPU trains in fp16 with a GradScaler (`core.precision`
# holds the rule for a device; this is the same rule for a class).
BF16_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class HardwareClass:
    """One class of hardware. Invariants: a "cuda" class has a `capability` (that of the GPU it is named
    for) and lists its GPUs; `default_recipe` names a pretraining recipe made for it or a smaller
    class; `finetune` names one of the classes finetuning has settings for (cpu, t4, a100)."""

    name: str
    device_type: str  # "cpu", "mps" or "cuda"
    capability: tuple[int, int] | None  # CUDA compute capability of the GPU the class is named for
    # the pretraining recipe the probe picks here (`tinygpt pretrain` without --recipe)
    default_recipe: str
    # whose finetuning settings it takes: "a100" (bf16 and 35+ GB), "t4" (other GPUs) or "cpu"
    finetune: str
    # how long one Colab session of this class usually lasts: the default time budget
    session_hours: float | None
    # (name as in torch.cuda.get_device_name, peak dense bf16/fp16 tensor TFLOP/s: the MFU
    # denominator). A name matches as a whole word, so "L4" is not found in "L40S" nor "A10" in
    # "A100"; the longest match wins.
    gpus: tuple[tuple[str, float], ...] = ()
    # the recipe whose ladder `--size auto` plans here without --recipe, where not `default_recipe`
    # (on a CPU: cpu-fast's family, which beat cpu's ladder at 10 minutes, docs/BENCHMARKS.md section 13)
    ladder_recipe: str | None = None

    @property
    def precision(self) -> str:
        """What `core.precision.choose_precision` gives on this class's GPU: bf16, fp16 (+
        GradScaler) or fp32."""
        if self.device_type != "cuda":
            return "fp32"
        return "bf16" if self.capability >= BF16_CAPABILITY else "fp16"


# Session hours: Colab's free T4 and its L4 last about 3 h before a
# disconnect is likely; an A100 or H100 costs compute units by the hour, so
# a session is planned at 2 h. A CPU trains the recipe's steps (no budget).
CPU = HardwareClass("cpu", "cpu", None, "cpu", "cpu", None, ladder_recipe="cpu-fast")
MPS = HardwareClass("mps", "mps", None, "cpu", "cpu", None, ladder_recipe="cpu-fast")
T4 = HardwareClass(
    "t4", "cuda", (7, 5), "t4-50m", "t4", 3.0, (("V100", 125.0), ("T4", 65.0), ("P100", 19.0))
)
L4 = HardwareClass(
    "l4",
    "cuda",
    (8, 9),
    "l4-124m",
    "t4",
    3.0,
    (("L4", 121.0), ("A10G", 125.0), ("A10", 125.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0)),
)
A100 = HardwareClass(
    "a100",
    "cuda",
    (8, 0),
    "a100-124m",
    "a100",
    2.0,
    (("A100", 312.0), ("L40S", 362.0), ("L40", 181.0), ("A6000", 155.0)),
)
# The H100 and H200 default to the flagship (the GPT-2 baseline); h100-760m is there to pick.
# "H100 80GB HBM3" is the SXM part
H100 = HardwareClass(
    "h100",
    "cuda",
    (9, 0),
    "a100-124m",
    "a100",
    2.0,
    (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0)),
)
H200 = replace(H100, name="h200", gpus=(("GH200", 989.0), ("H200 NVL", 835.0), ("H200", 989.0)))
# Colab's G4: an RTX PRO 6000 Blackwell, 96 GB, compute capability 12.0. NVIDIA gives 4,000 sparse
# FP4 TOPS, so about 500 dense bf16 TFLOP/s: half an H100 SXM, 1.6x an A100. Unlisted, the
# generation-and-memory rule took it for an H100 and MFU had no peak. It trains like its neighbours:
# bf16; the flagship by default (the H100, twice as fast, defaults to it too); finetuning's a100
# settings (bf16 and 35+ GB); paid by the hour like an A100.
G4 = HardwareClass("g4", "cuda", (12, 0), "a100-124m", "a100", 2.0, (("RTX PRO 6000", 500.0),))

HARDWARE: dict[str, HardwareClass] = {c.name: c for c in (CPU, MPS, T4, L4, A100, H100, H200, G4)}


def size_auto_recipe(hardware_class: str, default: str) -> str:
    """The recipe `--size auto` ladders on this class without --recipe (`default` for an unlisted class)."""
    hw = HARDWARE.get(hardware_class)
    return (hw.ladder_recipe or hw.default_recipe) if hw is not None else default
