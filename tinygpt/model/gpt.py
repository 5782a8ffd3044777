"""The GPT: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, optional GQA, tied embeddings, QK-norm and
attention biases; and modded-nanogpt's soft-capped logits, ReLU² gate, value embeddings and U-net
skips, of which transformers' Llama and Qwen3 hold only the ReLU² gate: `ModelConfig`).

Parameter names are those of Hugging Face `LlamaForCausalLM` (`Qwen3ForCausalLM` with QK-norm), so a
state_dict moves between the two with no renaming (`tinygpt.model.hf` does the config.json side).
With `ModelConfig.fused_proj` the q/k/v and gate/up projections are one matrix each (`qkv_proj`,
`gate_up_proj`), but `state_dict` and `load_state_dict` still speak the Hugging Face names
(`_fuse_in_state_dict`). Attention is `F.scaled_dot_product_attention`, which picks flash /
memory-efficient kernels on CUDA; with GQA, keys and values are repeated to the query heads where no
fused kernel takes them grouped (`model.attention`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tinygpt.core.config import ModelConfig
from tinygpt.model.attention import expand_kv, fa3_serves, flash_attention_3
from tinygpt.model.fast_options import residual
from tinygpt.model.losses import IGNORE_INDEX, cross_entropy, softcap  # noqa: F401  (handed on)
from tinygpt.model.masks import masked_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, exactly as Llama does, so that
        # logits match transformers and bf16 activations do not lose the small variances.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def norm_class(config: ModelConfig) -> Callable[[int], nn.Module]:
    """The model's norm, built from its width (litgpt's `Config.norm_class`): every norm of the GPT
    (before attention and the MLP, the final one, QK-norm's) comes from here."""
    return partial(RMSNorm, eps=config.norm_eps)


def rope_tables(config: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, shape (max_seq_len, head_dim), in the half-split layout Llama uses."""
    head_dim, theta = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    t = torch.arange(config.max_seq_len, dtype=torch.int64, device=device).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


@dataclass
class KVCache:
    """Preallocated keys and values for every layer; `pos` is how many positions are filled."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    pos: int = 0

    @classmethod
    def empty(cls, config: ModelConfig, batch_size: int, max_len: int, device, dtype) -> "KVCache":
        shape = (batch_size, config.n_kv_head, max_len, config.head_dim)
        return cls(
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)],
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def _fuse_in_state_dict(module: nn.Module, fused: str, parts: tuple[tuple[str, int], ...]) -> None:
    """Make `module.<fused>` (a Linear whose output rows are `parts`, (name, rows) in order) save as
    the separate `module.<name>.weight` matrices (and `.bias` vectors, where it has a bias) and load
    from them, so that files keep the Hugging Face names.

    On `module` itself, not on the fused Linear: `load_state_dict`
    checks each module's keys for unexpected names before its children
    load, and hands each child only the keys under its own prefix."""
    names, sizes = [n for n, _ in parts], [r for _, r in parts]

    def split(mod, state_dict, prefix, local_metadata):
        # This module's keys are the last ones in the dict (it is filled depth first): re-insert
        # them in order with the fused matrix replaced by its parts, as copies (safetensors refuses
        # shared storage). Each part's bias right after its weight, the order of the unfused module.
        mine = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
        weight, bias = f"{prefix}{fused}.weight", f"{prefix}{fused}.bias"
        for k, v in mine.items():
            if k == weight:
                biases = mine[bias].split(sizes, dim=0) if bias in mine else [None] * len(names)
                for name, part, part_bias in zip(names, v.split(sizes, dim=0), biases):
                    state_dict[f"{prefix}{name}.weight"] = part.clone()
                    if part_bias is not None:
                        state_dict[f"{prefix}{name}.bias"] = part_bias.clone()
            elif k != bias:
                state_dict[k] = v

    def join(mod, state_dict, prefix, *args):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in names]
            # else leave it: a missing key is reported as usual
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused}.{kind}"] = torch.cat(
                    [state_dict.pop(k) for k in keys], dim=0
                )

    module.fused_parts = {**getattr(module, "fused_parts", {}), fused: parts}
    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(join)


def value_table(config: ModelConfig, layer: int) -> int | None:
    """The value-embedding table block `layer` mixes into its values (`ModelConfig.value_embeds`: the
    first N blocks take tables 0..N-1, the last N take them again in the same order), or None."""
    n, first_of_last = config.value_embeds, config.n_layer - config.value_embeds
    return layer if layer < n else layer - first_of_last if layer >= first_of_last else None


def relu2(x: torch.Tensor) -> torch.Tensor:
    """ReLU squared, transformers' ACT2FN["relu2"]."""
    return F.relu(x).square()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.head_dim
        q_dim, kv_dim = config.n_head * self.head_dim, config.n_kv_head * self.head_dim
        self.split_sizes = (q_dim, kv_dim, kv_dim)
        self.fused, bias = config.fused_proj, config.attention_bias
        if self.fused:  # one matmul for queries, keys and values, split after
            self.qkv_proj = nn.Linear(config.d_model, q_dim + 2 * kv_dim, bias=bias)
            _fuse_in_state_dict(
                self, "qkv_proj", (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim))
            )
        else:
            self.q_proj = nn.Linear(config.d_model, q_dim, bias=bias)
            self.k_proj = nn.Linear(config.d_model, kv_dim, bias=bias)
            self.v_proj = nn.Linear(config.d_model, kv_dim, bias=bias)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.d_model, bias=bias)
        if config.qk_norm:  # Qwen3's names and place: per head, before RoPE
            self.q_norm = norm_class(config)(self.head_dim)
            self.k_norm = norm_class(config)(self.head_dim)
        self.qk_norm = config.qk_norm
        self.fa3 = config.attn_impl == "fa3"
        if value_table(config, layer) is not None:  # the value's and the table's weights
            self.value_lambdas = nn.Parameter(torch.empty(2))

    def forward(
        self, x, cos, sin, cache: KVCache | None = None, layer: int = 0, mask=None, ve=None
    ):
        B, T, _ = x.shape
        if self.fused:
            q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if ve is not None:  # value_embeds: the token's own vector mixed into its value, whose
            # dtype (autocast's) it keeps: the table's lookup is fp32
            v = (self.value_lambdas[0] * v + self.value_lambdas[1] * ve).to(v.dtype)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_kv_head, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.fa3 and fa3_serves(mask is not None, cache is not None, v.dtype):
            return self.o_proj(flash_attention_3(q, k, v).reshape(B, T, -1))
        start = 0
        if cache is not None:
            start = cache.pos
            cache.k[layer][:, :, start : start + T] = k
            cache.v[layer][:, :, start : start + T] = v
            k, v = cache.k[layer][:, :, : start + T], cache.v[layer][:, :, : start + T]
        # grouped only where a fused kernel takes them so (model.attention)
        k, v, gqa = expand_kv(q, k, v)
        if mask is not None:  # training only: documents apart, a window (`model.masks`)
            y = masked_attention(q, k, v, mask, gqa)
        elif start == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif T == 1:  # one new token attends to everything cached: no mask needed
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        else:  # a chunk appended to a filled cache: causal within the chunk, full over the past
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fused = config.fused_proj
        if self.fused:  # one matmul for the gate and the up projection, split after
            self.gate_up_proj = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)
            _fuse_in_state_dict(
                self, "gate_up_proj", (("gate_proj", config.d_ff), ("up_proj", config.d_ff))
            )
        else:
            self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
            self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.act = F.silu if config.mlp_act == "silu" else relu2

    def forward(self, x):
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = norm_class(config)(config.d_model)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = norm_class(config)(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache=None, layer=0, mask=None, ve=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask, ve)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Named `model` inside GPT, like LlamaModel inside LlamaForCausalLM."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = norm_class(config)(config.d_model)
        kv_dim = config.n_kv_head * config.head_dim
        self.value_embeds = nn.ModuleList(
            nn.Embedding(config.vocab_size, kv_dim) for _ in range(config.value_embeds)
        )
        if config.unet_skips:  # the weight of each first-half block's output in its mirror's input
            self.skip_weights = nn.Parameter(torch.empty(config.n_layer // 2))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(config)
        # Not saved in the state_dict (Llama does not save them either); rebuilt from the config.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std), biases zero; the projections into the residual stream scaled by
        1/sqrt(2 n_layer) (GPT-2's scaled init) so that the residual variance does not grow with
        depth, or zero with `zero_init_proj`; U-net skip weights 1, value-embedding weights 0.5 (the
        value and the table's vector half each, modded-nanogpt's start). A fused matrix is drawn
        part by part, under each part's own name and in the unfused order, so that `fused_proj`
        starts from bit-identical weights (one draw over the whole matrix would give other numbers)."""
        fused = {
            f"{mod_name}.{name}.weight".lstrip("."): parts
            for mod_name, m in self.named_modules()
            for name, parts in getattr(m, "fused_parts", {}).items()
        }
        for name, p in self.named_parameters():
            if name in fused:
                prefix = name.rsplit(".", 2)[0]
                views = p.split([rows for _, rows in fused[name]], dim=0)
                for (part, _), view in zip(fused[name], views):
                    self._init_weight(f"{prefix}.{part}.weight", view)
            else:
                self._init_weight(name, p)

    def _init_weight(self, name: str, p: torch.Tensor) -> None:
        std = self.config.init_std
        if name.endswith(".bias"):  # attention_bias: a block still starts as the unbiased one
            nn.init.zeros_(p)
        elif name.endswith("value_lambdas"):
            nn.init.constant_(p, 0.5)
        elif p.dim() == 1:  # every norm's weight, and unet_skips' weights
            nn.init.ones_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):  # into the residual stream
            if self.config.zero_init_proj:
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
        else:
            nn.init.normal_(p, mean=0.0, std=std)

    def blocks(self) -> nn.ModuleList:
        """The transformer blocks, in order: what regional compilation compiles one by one."""
        return self.model.layers

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once (a tied embedding is one matrix)."""
        n = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if non_embedding:
            n -= self.model.embed_tokens.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight used in a matmul (forward 2, backward 4) plus
        attention's QK^T and AV: 6 * 2 * n_layer * seq_len * d_model (PaLM appendix B, causal
        attention counted at full length as PaLM and nanoGPT do). Elementwise work is not counted
        (norms, activations, soft-capping, the value-embedding and U-net mixes)."""
        c = self.config
        # matrices only (norm weights are elementwise); the embeddings
        # are lookups, but lm_head (tied or not) is a matmul
        matmul_params = sum(
            p.numel()
            for n, p in self.named_parameters()
            if p.dim() >= 2 and not n.startswith(("model.embed_tokens.", "model.value_embeds."))
        )
        if c.tie_embeddings:  # named_parameters lists the shared matrix once, under the embedding
            matmul_params += self.lm_head.weight.numel()
        return 6.0 * matmul_params + 12.0 * c.n_layer * seq_len * c.d_model

    def _rope(self, start: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if start + T > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {start + T} tokens is longer than the model's max_seq_len "
                f"{self.config.max_seq_len}; shorten the input or use a model with a longer context"
            )
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        return cos.to(device), sin.to(device)

    def hidden_states(
        self, idx: torch.Tensor, cache: KVCache | None = None, mask=None
    ) -> torch.Tensor:
        """The final normed hidden states (B, T, d_model); `mask`: a training-time attention mask
        (`model.masks.training_mask`), None for plain causal attention."""
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        cos, sin = self._rope(start, T, idx.device)
        x, c = residual(self.model.embed_tokens(idx), self.config.bf16_residual), self.config
        tables = [table(idx) for table in self.model.value_embeds]
        ves = [None if (j := value_table(c, i)) is None else tables[j] for i in range(c.n_layer)]
        half, skips = (c.n_layer // 2 if c.unet_skips else 0), []
        for i, block in enumerate(self.model.layers):
            if i >= c.n_layer - half:  # unet_skips: the mirrored first-half block's output
                x = x + self.model.skip_weights[i - c.n_layer + half] * skips.pop()
            if c.activation_checkpointing and self.training and cache is None:
                x = checkpoint(block, x, cos, sin, None, i, mask, ves[i], use_reentrant=False)
            else:
                x = block(x, cos, sin, cache, i, mask, ves[i])
            if i < half:
                skips.append(x)
        if cache is not None:
            cache.pos += T
        return self.model.norm(x)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        reduction: str = "mean",
        loss: str = "auto",
        mask=None,
    ):
        """Logits (B, T, vocab_size) without targets; with targets, the cross-entropy loss
        (mean over tokens whose target is not IGNORE_INDEX, or their sum with reduction="sum"),
        over the full logits or in chunks as `loss` says (`TrainConfig.loss`). `mask`: a training-time
        attention mask (`hidden_states`). Logits and loss are soft-capped with `logit_softcap`."""
        x, cap = self.hidden_states(idx, cache, mask), self.config.logit_softcap
        if targets is None:
            return softcap(self.lm_head(x), cap)
        return cross_entropy(self.lm_head, x, targets, reduction=reduction, mode=loss, cap=cap)


class _ShapesOnly(torch.overrides.TorchFunctionMode):
    """What `meta_model` needs of the GPT's construction, its shapes, without the two things that
    would run torch's Python meta kernels, which import the compiler (torch._dynamo, sympy: about 2
    CPU-seconds) on first use: `torch.nn.init` calls are left out (a meta tensor has no values to
    draw) and the RoPE tables are computed on the CPU (`torch.arange` there), to be replaced by meta
    tensors of their shape."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        if func is torch.arange:
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def meta_model(config: ModelConfig) -> GPT:
    """The model on the meta device: no memory, instant even at 760M, for counting parameters and
    FLOPs from the model itself (no formula elsewhere can drift from it); nothing initialised."""
    with torch.device("meta"), _ShapesOnly():
        model = GPT(config)
    for name in ("rope_cos", "rope_sin"):
        setattr(model, name, torch.empty_like(getattr(model, name), device="meta"))
    return model
