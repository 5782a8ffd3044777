"""Speed options that stay off until a GPU measures each faster with the same loss curve
(benchmarks/gpu_kit.py's speed_steps rows, docs/BENCHMARKS.md section 5). Each is one field, resolved
here (FlashAttention-3's kernel in `model.attention`):

- `ModelConfig.bf16_residual`: under bf16 autocast the residual stream (the embedding's output and
  every block's sum) is kept in bf16 instead of fp32 (`residual`): half the bytes through every add
  and norm, at bf16's rounding of each sum.
- `TrainConfig.fp8_head`: the head's matmul (the largest one at GPT-2's vocabulary) in FP8 through
  torchao's `Float8Linear`, on GPUs with FP8 matmuls (sm89+: L4, H100, H200) (`to_fp8_head`).
- `ModelConfig.attn_impl="fa3"`: attention through FlashAttention-3 from the Hugging Face kernels
  hub, on Hopper (`model.attention.flash_attention_3`).

`check_fast_options` refuses, in one line that says what to do, an option whose package, GPU or
precision is missing, before any work; the trainer calls it and then `apply_fast_options`."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn

from tinygpt.core.config import ConfigError, ModelConfig, TrainConfig
from tinygpt.model.attention import device_profile, load_fa3

FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (L4) and Hopper (H100, H200)
FP8_MULTIPLE = 16  # an FP8 matmul's dimensions are multiples of 16
HEAD = "lm_head"  # the one module `to_fp8_head` converts


def residual(x: torch.Tensor, bf16_residual: bool) -> torch.Tensor:
    """The residual stream as it starts (the embedding's output): in bf16 where `bf16_residual` is
    set and bf16 autocast is on for x's device, else as it is (fp32). Invariant: a block adds
    Linear outputs (o_proj, down_proj), which bf16 autocast gives in bf16, so a bf16 stream stays
    bf16 through every block; the norms still compute in fp32. Off (the default) nothing changes:
    logits match transformers exactly."""
    device_type = x.device.type
    if (
        bf16_residual
        and torch.is_autocast_enabled(device_type)
        and torch.get_autocast_dtype(device_type) == torch.bfloat16
    ):
        return x.to(torch.bfloat16)
    return x


def fp8_problem(
    device_type: str, capability: tuple[int, int] | None, has_torchao: bool, model: ModelConfig
) -> str | None:
    """Why `train.fp8_head` cannot run here, in one line that says what to do; None when it can. A
    pure function of the device's description, so each refusal is checkable on any machine."""
    off = "or set train.fp8_head=false"
    if device_type != "cuda" or capability is None or capability < FP8_CAPABILITY:
        here = device_type if capability is None else f"sm{capability[0]}{capability[1]}"
        return (
            f"train.fp8_head needs a GPU with FP8 matmuls (sm89+: L4, H100, H200), and this is "
            f"{here}: train on one, {off}"
        )
    if not has_torchao:
        return f"train.fp8_head needs torchao: pip install torchao, {off}"
    if model.d_model % FP8_MULTIPLE or model.vocab_size % FP8_MULTIPLE:
        return (
            f"train.fp8_head needs d_model ({model.d_model}) and vocab_size ({model.vocab_size}) "
            f"multiples of {FP8_MULTIPLE}: {off}"
        )
    return None


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """torchao's module filter (`convert_to_float8_training(module_filter_fn=...)`): the head only,
    a plain Linear whose dimensions are multiples of 16; every other Linear stays as it is."""
    return (
        fqn == HEAD
        and type(module) is nn.Linear
        and module.in_features % FP8_MULTIPLE == 0
        and module.out_features % FP8_MULTIPLE == 0
    )


def to_fp8_head(model: nn.Module) -> nn.Module:
    """`model` with its head swapped for torchao's `Float8Linear` in place (the same weight
    Parameter, so a tied embedding stays tied and checkpoints keep `lm_head.weight`)."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=fp8_filter)
    head = getattr(model, HEAD, None)
    if head is None or type(head) is nn.Linear:  # none at the root, or left unconverted
        raise ConfigError(f"train.fp8_head found no {HEAD} to convert: set train.fp8_head=false")
    return model


def check_fast_options(
    model: ModelConfig | None, train: TrainConfig, device: torch.device, precision: str
) -> None:
    """Refuse, in one line, an option set in `model` (a tinygpt GPT's config; None for another
    model) or `train` that cannot run on `device` at `precision` (the resolved one: bf16, fp16,
    fp32). Loads FlashAttention-3's kernel where it is asked for, so a missing one fails here."""
    if model is None:
        if train.fp8_head:
            raise ConfigError("train.fp8_head is for a tinygpt model: set train.fp8_head=false")
        return
    if model.bf16_residual and precision != "bf16":
        raise ConfigError(
            f"model.bf16_residual keeps the residual stream in bf16 under bf16 autocast, and this "
            f"run trains in {precision}: set train.precision=bf16, or model.bf16_residual=false"
        )
    device_type, capability = device_profile(device)
    if train.fp8_head:
        has_torchao = importlib.util.find_spec("torchao") is not None
        if problem := fp8_problem(device_type, capability, has_torchao, model):
            raise ConfigError(problem)
        if precision != "bf16":
            raise ConfigError(
                f"train.fp8_head runs under bf16 autocast, and this run trains in {precision}: "
                "set train.precision=bf16, or train.fp8_head=false"
            )
    if model.attn_impl == "fa3":
        load_fa3(device, model.head_dim)


def apply_fast_options(
    model: nn.Module, train: TrainConfig, device: torch.device, precision: str
) -> nn.Module:
    """`model` with `train`'s options applied after `check_fast_options` (the model's own options
    act inside its forward)."""
    config = getattr(model, "config", None)
    check_fast_options(
        config if isinstance(config, ModelConfig) else None, train, device, precision
    )
    return to_fp8_head(model) if train.fp8_head else model
