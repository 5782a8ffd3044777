"""Memory of a training step: an estimate with a breakdown a person would draw, and a tracker of
the real peak on any device. "GB" here is GiB (2**30 bytes), as Colab and nvidia-smi count it.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tinygpt.core.config import ModelConfig
from tinygpt.model.attention import attention_kernel, torch_version
from tinygpt.model.gpt import meta_model
from tinygpt.model.losses import default_chunk_rows

GB = 2**30
CUDA_CONTEXT_GB = 0.5  # the driver's context: never in torch.cuda.max_memory_allocated
FRAGMENTATION = 0.05  # the caching allocator's blocks are never a perfect fit


def overhead_gb(tensor_gb: float, device_type: str = "cuda") -> float:
    """What a device needs beyond the tensors themselves: the CUDA context and the allocator's
    slack. The one rule for pretraining's estimate, the probe and the finetuning memory table."""
    return (CUDA_CONTEXT_GB if device_type == "cuda" else 0.0) + FRAGMENTATION * tensor_gb


@dataclass
class MemoryEstimate:
    """Training memory by part, in GB; `rows()` is the table a person would draw. The overhead and the total
    follow from the parts (`overhead_gb`, the one rule)."""

    params_gb: float
    grads_gb: float
    optimizer_gb: float
    weight_copies_gb: float
    activations_gb: float
    loss_gb: float
    n_params: int
    micro_batch_size: int
    seq_len: int
    precision: str
    activation_checkpointing: bool
    device_type: str
    loss_chunk_rows: int  # 0: the plain F.cross_entropy over the full logits
    # `model.attention.attention_kernel`: "fused", "expand" (GQA K/V repeated) or "math"
    attention: str = "fused"

    @property
    def tensors_gb(self) -> float:
        weights = (self.params_gb, self.grads_gb, self.optimizer_gb, self.weight_copies_gb)
        return sum(weights) + self.activations_gb + self.loss_gb

    @property
    def overhead_gb(self) -> float:
        return overhead_gb(self.tensors_gb, self.device_type)

    @property
    def total_gb(self) -> float:
        return self.tensors_gb + self.overhead_gb

    def to_dict(self) -> dict:
        return {**asdict(self), "overhead_gb": self.overhead_gb, "total_gb": self.total_gb}

    def rows(self) -> list[tuple[str, str, str]]:
        n, tok = f"{self.n_params / 1e6:.1f}M", f"{self.micro_batch_size} x {self.seq_len} tokens"
        ckpt = "layer inputs (checkpointing)" if self.activation_checkpointing else "every layer"
        ckpt += {
            "expand": ", keys/values repeated to the query heads",
            "math": ", a T x T attention matrix per head (math kernel)",
        }.get(self.attention, "")
        loss = f"{tok} x vocab x 12 B (fp32 log-probs + 2 gradients)"
        if self.loss_chunk_rows:
            loss = f"chunks of {self.loss_chunk_rows} rows of logits + head gradients"
        copies = f"matmul weights in {self.precision} (autocast)"
        if self.precision == "fp32":
            copies = "none: fp32 matmuls use the master weights"
        context = "CUDA context + " if self.device_type == "cuda" else ""
        return [
            ("part", "GB", "how"),
            ("parameters", f"{self.params_gb:.2f}", f"{n} x 4 B (fp32 master weights)"),
            ("gradients", f"{self.grads_gb:.2f}", f"{n} x 4 B"),
            ("AdamW states", f"{self.optimizer_gb:.2f}", f"{n} x 2 x 4 B"),
            ("weight copies", f"{self.weight_copies_gb:.2f}", copies),
            ("activations", f"{self.activations_gb:.2f}", f"{tok}, {ckpt}, {self.precision}"),
            ("loss (logits)", f"{self.loss_gb:.2f}", loss),
            ("overhead", f"{self.overhead_gb:.2f}", f"{context}allocator fragmentation"),
            ("total", f"{self.total_gb:.2f}", ""),
        ]


def _activation_and_loss_bytes(
    c: ModelConfig,
    tokens: int,
    e: int,
    checkpointing: bool,
    chunk_rows: int,
    seq_len: int,
    kernel: str,
) -> tuple[int, int]:
    """(activations, loss) bytes at the peak, counted tensor by tensor (tests check them against
    saved-tensor hooks and a tracked step). The residual stream and RMSNorm are fp32 under
    autocast; e is the matmul dtype's size. kernel: `attention_kernel`'s answer for this device.
    ReLU² keeps what SiLU keeps; value embeddings and U-net skips are counted; not counted: soft-capped
    logits' tanh (`ModelConfig.logit_softcap`: 4 B more a logit over the full logits)."""
    d, ff, v = c.d_model, c.d_ff, c.vocab_size
    # Keys and values as SDPA keeps them: repeated to the
    # query heads unless a fused kernel takes them grouped.
    kvd = (c.n_kv_head if kernel == "fused" else c.n_head) * c.head_dim

    def norm_then(n_linears: int) -> int:
        # RMSNorm keeps its input and the normalised x; each Linear keeps
        # its input, which autocast casts once per Linear (activations
        # are not cached, only weights); in fp32 it is one tensor.
        return 8 * d + (4 * d if e == 4 else n_linears * e * d)

    # SDPA (flash / memory-efficient) keeps q, k, v, the output and a
    # logsumexp: no T x T matrix. The math kernel keeps the softmax's
    # output instead of the logsumexp: seq_len scores per token and head.
    attn = norm_then(3) + e * (d + 2 * kvd) + e * d
    attn += e * c.n_head * seq_len if kernel == "math" else 4 * c.n_head
    # per head, on q and k before RoPE: the fp32 input, the normalised x in e, the rsqrt per head
    if c.qk_norm:
        heads = c.n_head + c.n_kv_head
        attn += (4 + e) * heads * c.head_dim + 4 * heads
    mlp = norm_then(2) + 4 * e * ff  # SwiGLU: gate, silu(gate), up and their product
    layer = attn + mlp + 8  # + the two norms' rsqrt
    # F.cross_entropy: fp32 log-probs saved, their gradient and the logits' gradient
    if chunk_rows == 0:
        # + final norm, lm_head input, int64 ids
        head, loss_bytes = norm_then(1) + 16, 12 * tokens * v
    # tinygpt.model.losses: gradients made in forward, one chunk of logits at a time (fp32, plus
    else:
        # temporaries: logsumexp's, and under autocast the matmul output and the gradient in e);
        # the hidden states and their gradient (fp32), the head's fp32 gradient, and either its
        # two e copies (forward) or its scaled gradient (backward)
        head = 8 * d + 16
        loss_bytes = 8 * d * tokens + 8 * v * d + (6 if e == 4 else 8) * chunk_rows * v
    # Outside the blocks: each value-embedding table's fp32 lookup, and in each of the 2 blocks it
    # feeds the projected values kept for their mixing weight (on the safe side with checkpointing,
    # which recomputes them); each U-net skip's fp32 sum.
    head += c.value_embeds * (4 + 2 * e) * c.n_kv_head * c.head_dim
    head += 4 * d * (c.n_layer // 2 if c.unet_skips else 0)
    if checkpointing:
        # Each block keeps only its fp32 input. A block is recomputed (with the gradients in flight
        # through it) only after the loss's memory is freed: one of the two phases sets the peak.
        recompute = (layer + 4 * d + 2 * e * ff) * tokens
        kept = (c.n_layer * 4 * d + head) * tokens + max(0, recompute - head * tokens - loss_bytes)
        return kept, loss_bytes
    return (c.n_layer * layer + head) * tokens, loss_bytes


def _estimated_kernel(
    model: ModelConfig, precision: str, device_type: str, capability: tuple[int, int] | None
) -> str:
    """The attention kernel `model.attention` would run on this device: "fused" whenever keys and
    values are not grouped (and not on MPS), else `attention_kernel`'s answer. A CUDA GPU of unknown
    capability is one that picks this precision by default (fp16: a T4, sm75; else sm80)."""
    if device_type == "cuda" and capability is None:
        capability = (7, 5) if precision == "fp16" else (8, 0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    # (MPS: the math kernel either way)
    grouped = model.n_kv_head != model.n_head or device_type == "mps"
    if not grouped:
        return "fused"
    return attention_kernel(device_type, capability, dtype, torch_version(), model.head_dim)


def _params_and_copies(model: ModelConfig, e: int, chunk_rows: int) -> tuple[int, int]:
    """(parameters, bytes of autocast's weight copies) of the model, counted on the meta device.
    e is the matmul dtype's size: fp32 (e == 4) makes no copies."""
    meta = meta_model(model)
    n = meta.num_params()
    # Autocast caches one copy of each Linear's parameters (weight, and bias where the config gives
    # one) per forward; the chunked loss copies lm_head itself.
    matmul = sum(
        p.numel()
        for m in meta.modules()
        if isinstance(m, torch.nn.Linear) and not (chunk_rows and m is meta.lm_head)
        for p in m.parameters(recurse=False)
    )
    return n, 0 if e == 4 else e * matmul


def estimate_memory(
    model: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: str = "fp32",
    activation_checkpointing: bool | None = None,
    device_type: str = "cuda",
    loss: str = "auto",
    capability: tuple[int, int] | None = None,
    attention: str | None = None,
) -> MemoryEstimate:
    """Peak training memory of AdamW at this micro-batch and context; precision "bf16", "fp16" or
    "fp32"; `loss` as `TrainConfig.loss`. Attention as `model.attention` runs it on this device
    (`attention` overrides; a CUDA GPU of unknown `capability`: see `_estimated_kernel`)."""
    ckpt = activation_checkpointing
    if ckpt is None:
        ckpt = model.activation_checkpointing
    if attention is None:
        attention = _estimated_kernel(model, precision, device_type, capability)
    tokens, e = micro_batch_size * seq_len, 4 if precision == "fp32" else 2
    # what model.cross_entropy will do
    chunk_rows = default_chunk_rows(tokens, model.vocab_size, loss)
    activations, loss_bytes = _activation_and_loss_bytes(
        model, tokens, e, ckpt, chunk_rows, seq_len, attention
    )
    n, copies = _params_and_copies(model, e, chunk_rows)
    return MemoryEstimate(
        4 * n / GB,
        4 * n / GB,
        8 * n / GB,
        copies / GB,
        activations / GB,
        loss_bytes / GB,
        n,
        micro_batch_size,
        seq_len,
        precision,
        ckpt,
        device_type,
        chunk_rows,
        attention,
    )


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the tensors created while active, on any device: the CPU's stand-in
    for torch.cuda.max_memory_allocated (views and in-place results are not new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = self.peak_bytes = 0
        self._refs: dict[int, weakref.ref] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(a.untyped_storage())
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                key = id(s)
                if key not in inputs and key not in self._refs:
                    self.live_bytes += s.nbytes()
                    self._refs[key] = weakref.ref(
                        s, lambda _, k=key, n=s.nbytes(): self._freed(k, n)
                    )
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out
