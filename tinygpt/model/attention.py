"""Which attention kernel serves grouped-query attention (GQA: fewer key/value heads than query
heads) on a device, and keys/values repeated to the query heads where no fused kernel takes them
grouped.

`F.scaled_dot_product_attention(..., enable_gqa=True)` has a fused kernel only in flash attention
(CUDA compute capability 8.0+, fp16/bf16, head_dim <= 256) and, from torch 2.9, in the CPU's flash
kernel (pytorch#157893). Everywhere else (a T4, fp32 on CUDA, MPS, torch before 2.9 on the CPU) it
falls back to the math kernel, which builds the full T x T attention matrix per head; with keys and
values repeated to the query heads first, the memory-efficient kernel (CUDA) or flash (CPU) serves
instead. `attention_kernel` is that decision as a pure function of the device's description;
`expand_kv` applies it to a live tensor; the memory estimate (`fit.memory`) counts what it decides.
For Hugging Face bases `EXPANDING_SDPA` is the same rule as a transformers attention implementation
(`use_expanding_sdpa`); `hf_attention` picks a base's.

`ModelConfig.attn_impl="fa3"` (off until a GPU measures it faster with the same loss curve) runs the
model's plain causal attention through FlashAttention-3 from the Hugging Face kernels hub
(`flash_attention_3`, where `fa3_serves`); `fa3_problem` says, in one line, why it cannot here."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import torch

from tinygpt.core.config import ConfigError

ENABLE_GQA_TORCH = (2, 5)  # SDPA's enable_gqa argument
CPU_FUSED_GQA_TORCH = (2, 9)  # the CPU flash kernel takes grouped keys/values
FLASH_MAX_HEAD_DIM = 256
EXPANDING_SDPA = "tinygpt_sdpa"  # the transformers attention implementation registered here
# the same, with packed records kept apart by a FlexAttention block mask (a base trained on a GPU)
PACKED_FLEX = "tinygpt_sdpa_flex"
FA3_KERNEL = "kernels-community/flash-attn3"  # FlashAttention-3 on the Hugging Face kernels hub
FA3_CAPABILITY = (9, 0)  # its kernels are Hopper's (sm90: H100, H200)
FA3_DTYPES = (torch.float16, torch.bfloat16)
FA3_LOADED: list = []  # FlashAttention-3's module once `load_fa3` has loaded it in this process


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version ("2.9.0+cu128" -> (2, 9)); this torch's by default."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def attention_kernel(
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    version: tuple[int, int],
    head_dim: int = 64,
) -> str:
    """How attention with fewer key/value heads than query heads runs on this device: "fused": a
    fused kernel takes grouped keys/values as they are (pass enable_gqa=True); "expand": only equal
    head counts have a fused kernel: repeat keys/values to the query heads first; "math": only the
    math kernel serves either way (MPS), a T x T matrix per head regardless. `capability`: CUDA's
    compute capability (None elsewhere); `version`: torch's (major, minor)."""
    if device_type == "mps":
        return "math"
    if version < ENABLE_GQA_TORCH:
        return "expand"
    if device_type == "cuda":
        flash = (
            capability is not None
            and capability >= (8, 0)
            and dtype in (torch.float16, torch.bfloat16)
            and head_dim <= FLASH_MAX_HEAD_DIM
            and head_dim % 8 == 0
        )
        return "fused" if flash else "expand"
    if device_type == "cpu":
        return "fused" if version >= CPU_FUSED_GQA_TORCH else "expand"
    return "expand"


def device_profile(device: torch.device) -> tuple[str, tuple[int, int] | None]:
    """(device type, CUDA compute capability or None): what `attention_kernel` needs of a device."""
    cap = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    return device.type, cap  # type: ignore[return-value]


def assume_constant_result(fn):
    """`torch.compiler.assume_constant_result` without importing the compiler: that decorator
    imports torch._dynamo (sympy, fx: about 2 CPU-seconds) only to set this one attribute, which the
    compiler reads when it traces a call of `fn`; applied at import, it made every command
    (`--help`, generate, CPU training with compile off) pay for a compiler it never ran.
    tests/test_imports.py checks that the attribute is still all the decorator sets."""
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result
def _expands(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    # A constant for the compiler: the graph is already
    # specialised on the device and dtype of its inputs.
    device_type, capability = device_profile(device)
    return attention_kernel(device_type, capability, dtype, torch_version(), head_dim) != "fused"


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B, H_kv * n_rep, T, D), each key/value head repeated for its group of
    query heads (the layout `enable_gqa` and transformers' `repeat_kv` use)."""
    if n_rep == 1:
        return x
    B, H, T, D = x.shape
    return x[:, :, None].expand(B, H, n_rep, T, D).reshape(B, H * n_rep, T, D)


def expand_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k, v, enable_gqa) for `F.scaled_dot_product_attention(q, k, v, ...)`: keys and values
    repeated to the query heads where no fused kernel takes them grouped, else as they are with
    enable_gqa. A single query (decoding) is left grouped: its attention row is 1 x T, and repeating
    the cache would copy all of it."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        return k, v, False
    if q.shape[2] == 1 or not _expands(q.device, q.dtype, q.shape[-1]):
        return k, v, True
    return repeat_kv(k, n_rep), repeat_kv(v, n_rep), False


class _Ungrouped:
    """What transformers' SDPA function reads of an attention module once keys and values are
    expanded: no `num_key_value_groups` (so it neither repeats them again nor passes enable_gqa),
    the same `is_causal`."""

    def __init__(self, is_causal: bool):
        self.is_causal = is_causal


def _expanding_sdpa(module, query, key, value, attention_mask, **kwargs):
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(attention_mask, BlockMask):  # packed records, under PACKED_FLEX
        from transformers.integrations.flex_attention import flex_attention_forward

        return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)

    k, v, grouped = expand_kv(query, key, value)
    if k is key or grouped:  # nothing to expand here: transformers' own SDPA path
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(
        _Ungrouped(getattr(module, "is_causal", True)), query, k, v, attention_mask, **kwargs
    )


class WholeRows:
    """Set (`whole_rows`) while a batch's rows are each one sequence (no padding mask, no packed
    records): transformers' mask builder cannot see that under `torch.compile`, where it takes the
    position ids for possible packing and builds a (B, 1, T, T) mask."""

    on = False


@contextlib.contextmanager
def whole_rows(on: bool = True):
    """Rows are whole sequences inside this block: SDPA gets no mask and is_causal=True (read when a
    graph is traced, and guarded on: a packed batch outside traces its own)."""
    was, WholeRows.on = WholeRows.on, on
    try:
        yield
    finally:
        WholeRows.on = was


def _causal_sdpa_mask(**kwargs):
    """transformers' sdpa mask builder, except that whole rows (`whole_rows`) whose queries are their
    keys (training, no cache) get no mask, compiled too: SDPA then runs with is_causal=True, which
    FlashAttention takes. (While dynamo traces, transformers builds the (B, 1, T, T) mask, which
    rules FlashAttention out.)"""
    from transformers.masking_utils import sdpa_mask

    if WholeRows.on and _unpadded_training(kwargs):
        return None
    return sdpa_mask(**kwargs)


def _unpadded_training(kwargs: dict) -> bool:
    """The mask builder's arguments are a training batch's: queries are the keys (no cache, no
    offsets), no padding mask, no local attention."""
    positions = kwargs.get("cache_position")  # transformers before q_length was passed
    q_length = kwargs.get("q_length", None if positions is None else positions.shape[0])
    return (
        kwargs.get("attention_mask") is None
        and kwargs.get("local_size") is None
        and q_length == kwargs.get("kv_length")
        and type(kwargs.get("q_offset", 0)) is int
        and kwargs.get("q_offset", 0) == 0
        and type(kwargs.get("kv_offset", 0)) is int
        and kwargs.get("kv_offset", 0) == 0
    )


def _packed_flex_mask(**kwargs):
    """`_causal_sdpa_mask`, except that packed records in training (a mask beyond causality:
    transformers turned off the causal skip) get a FlexAttention block mask: no (B, 1, T, T)
    tensor, and the blocks between records are never computed."""
    if (
        not WholeRows.on
        and _unpadded_training(kwargs)
        and kwargs.get("allow_is_causal_skip") is False
    ):
        from transformers.masking_utils import flex_attention_mask

        return flex_attention_mask(**kwargs)
    return _causal_sdpa_mask(**kwargs)


def use_expanding_sdpa() -> str:
    """Register `EXPANDING_SDPA` with transformers (its attention function, and sdpa's mask builder,
    which keeps packed records apart) and return the name, for
    `from_pretrained(attn_implementation=...)`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for name, masks in ((EXPANDING_SDPA, _causal_sdpa_mask), (PACKED_FLEX, _packed_flex_mask)):
        AttentionInterface.register(name, _expanding_sdpa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, masks)
    return EXPANDING_SDPA


def hf_attention(config: Any, packed_flex: bool = False) -> str:
    """The attention implementation a transformers model (its config) loads with here: eager where
    the logits are soft-capped (Gemma-2: sdpa ignores its soft-capping), else sdpa with GQA
    keys/values expanded where no fused kernel takes them grouped (`use_expanding_sdpa`: a T4);
    with `packed_flex` (training on a GPU) packed records are kept apart by FlexAttention
    (`PACKED_FLEX`) instead of SDPA with a (B, 1, T, T) mask."""
    if getattr(config, "final_logit_softcapping", None):
        return "eager"
    registered = use_expanding_sdpa()  # both names
    return PACKED_FLEX if packed_flex else registered


def fa3_problem(
    device_type: str, capability: tuple[int, int] | None, has_kernels: bool, head_dim: int
) -> str | None:
    """Why `attn_impl="fa3"` cannot run on this device, in one line that says what to do; None
    when it can (the kernel itself is fetched, or read from the hub's cache offline, by
    `load_fa3`). A pure function of the device's description, so each refusal is checkable."""
    off = "or set model.attn_impl='sdpa'"
    if device_type != "cuda" or capability is None or capability[0] != FA3_CAPABILITY[0]:
        here = device_type if capability is None else f"sm{capability[0]}{capability[1]}"
        return (
            f"model.attn_impl='fa3' needs a Hopper GPU (sm90: H100, H200), and this is {here}: "
            f"train on one, {off}"
        )
    if not has_kernels:
        return f"model.attn_impl='fa3' needs the kernels package: pip install kernels, {off}"
    if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return (
            f"model.attn_impl='fa3' needs head_dim a multiple of 8 up to 256 (this model's is "
            f"{head_dim}): change d_model or n_head, {off}"
        )
    return None


def load_fa3(device: torch.device, head_dim: int):
    """FlashAttention-3's module from the kernels hub (downloaded once, then from its cache), kept
    for this process (`fa3_serves`), or a one-line refusal (`fa3_problem`, or the hub's own failure:
    offline without the kernel cached)."""
    device_type, capability = device_profile(device)
    has_kernels = importlib.util.find_spec("kernels") is not None
    if problem := fa3_problem(device_type, capability, has_kernels, head_dim):
        raise ConfigError(problem)
    if not FA3_LOADED:
        try:
            from kernels import get_kernel

            FA3_LOADED.append(get_kernel(FA3_KERNEL))
        except Exception as e:  # noqa: BLE001 - offline, not cached, no build for this torch
            why = next(iter(str(e).strip().splitlines()), type(e).__name__)[:200]
            raise ConfigError(
                f"model.attn_impl='fa3' could not load {FA3_KERNEL} ({why}): run once online to "
                "cache it, or set model.attn_impl='sdpa'"
            ) from None
    return FA3_LOADED[0]


def fa3_serves(masked: bool, cached: bool, dtype: torch.dtype) -> bool:
    """Whether a model with `attn_impl="fa3"` runs this attention call through FlashAttention-3:
    once `load_fa3` has loaded the kernel in this process (the trainer's check does), for plain
    causal attention over the whole sequence (no training mask, no KV cache) in fp16 or bf16, the
    kernel's dtypes. Everything else stays with SDPA, the same math: masks, generation, fp32, and a
    model trained with FA3 evaluated where it was not loaded (another GPU, the CPU)."""
    return bool(FA3_LOADED) and not masked and not cached and dtype in FA3_DTYPES


def flash_attention_3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention by FlashAttention-3. q (B, H, T, D), k and v (B, H_kv, T, D), as the model
    holds them (grouped keys and values as they are: the kernel takes them); returns (B, T, H, D),
    FA3's layout. q and k come in v's dtype (QK-norm's fp32 output under autocast included)."""
    dtype = v.dtype
    out = FA3_LOADED[0].flash_attn_func(
        q.transpose(1, 2).to(dtype), k.transpose(1, 2).to(dtype), v.transpose(1, 2), causal=True
    )
    return out[0] if isinstance(out, tuple) else out  # some builds return (out, softmax_lse)
