"""The one place that decides numeric precision for a device: bf16, fp16 + GradScaler, or fp32."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

from tinygpt.core.gpu_classes import BF16_CAPABILITY

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    name: str  # "bf16", "fp16" or "fp32"
    device_type: str  # "cuda", "cpu", "mps"
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def use_scaler(self) -> bool:
        """fp16 has too little range for small gradients:
        scale the loss, unscale before clipping."""
        return self.name == "fp16"

    def autocast(self):
        """The autocast context for forward passes (a no-op in fp32)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only for fp16 (disabled it passes everything through)."""
        return torch.amp.GradScaler(
            self.device_type if self.device_type != "mps" else "cpu", enabled=self.use_scaler
        )

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_device(requested: str = "auto") -> torch.device:
    """cuda if present, then mps, else cpu; or exactly what was asked for."""
    if requested != "auto":
        dev = torch.device(requested)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                "device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu "
                "or, in Colab, Runtime > Change runtime type > GPU"
            )
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def native_bf16(device: torch.device) -> bool:
    """True only where bf16 matmuls run on hardware: CUDA compute
    capability 8.0 (Ampere) or newer. `torch.cuda.is_bf16_supported()`
    also says True on a T4 (sm_75) through emulation, which is slow."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= BF16_CAPABILITY


def choose_precision(device: torch.device, requested: str = "auto") -> Precision:
    """bf16 on sm_80+, fp16 with a GradScaler on older
    CUDA GPUs, fp32 on CPU and MPS, unless overridden."""
    dt = device.type
    if requested != "auto":
        if requested not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"precision must be auto, bf16, fp16 or fp32, got {requested!r}")
        if dt == "cuda" and requested == "bf16" and not native_bf16(device):
            reason = "bf16 asked for on a GPU without native bf16: it will be emulated and slow"
        else:
            reason = f"{requested} asked for"
        return Precision(requested, dt, reason)
    if dt == "cuda":
        cap = "{}.{}".format(*torch.cuda.get_device_capability(device))
        if native_bf16(device):
            return Precision("bf16", dt, f"compute capability {cap} >= 8.0 has native bf16")
        return Precision("fp16", dt, f"compute capability {cap} < 8.0: fp16 with a GradScaler")
    return Precision("fp32", dt, f"{dt}: fp32 by default (autocast gains little here)")


def enable_tf32() -> None:
    """TF32 for fp32 matmuls and cuDNN convolutions on Ampere+ (no effect elsewhere), leaving every
    reader of the setting in agreement. Where torch has the `fp32_precision` settings they are the
    ones set (the legacy cuDNN flag's setter warns there that it is going away). torch keeps the
    legacy cuBLAS value apart and its legacy readers raise ("mix of the legacy and new APIs") when
    the two disagree, which is the state the new setting alone leaves (or transformers'
    `enable_tf32`, which sets the global one); torch 2.9's Inductor reads that legacy flag on CUDA
    (`_warn_tf32_disabled`, pad_mm, its Triton matmul heuristics). So the legacy cuBLAS value is
    moved to agree, through the one setter that writes both and warns about nothing. Without the new
    settings (torch 2.9 and later): the legacy flags."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(
        torch.backends.cudnn, "conv"
    ):
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        torch._C._set_cublas_allow_tf32(True)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def compiles(mode: str, device_type: str) -> bool:
    """Whether a step with `train.compile` = `mode` is compiled on a device of this type: "auto"
    compiles on CUDA only (on a CPU, at the sizes that train there, compiling costs more than it
    gains)."""
    return mode in ("on", "regional") or (mode == "auto" and device_type == "cuda")
