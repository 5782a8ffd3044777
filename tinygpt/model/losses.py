"""Cross-entropy of a linear head without materialising the full (tokens, vocab) logits.

`F.cross_entropy(head(x).float(), y)` keeps, for the backward pass, the logits of every token in the
micro-batch: with a 50k vocabulary that is 50304 * 6 bytes (bf16 logits + fp32 log-softmax) per
token, about 10 GB at 32k tokens, more than the whole 124M model with its activations. It is what
caps the micro-batch.

`linear_cross_entropy` walks over the flattened tokens in chunks of rows. For each chunk it computes
the logits (matmul in the autocast dtype, log-softmax in fp32), the loss, and right away the
gradient of the logits, which it turns into the chunk's gradient of the hidden states and adds into
the head weight's gradient; then it drops the chunk. Only those two gradients, the size of the
hidden states and of the weight, wait for the backward pass, which merely scales them by the
incoming gradient (the loss is linear in its output). This does the same three matmuls as the plain
loss (no recomputation), and peak memory holds one chunk of logits.

It is one opaque custom op (`torch.library.custom_op`) with its own autograd formula, so a head
weight tied to the embedding receives this gradient through autograd and it adds to the embedding's
own, and `torch.compile` sees one node whatever the number of chunks: the per-chunk loop is never
unrolled into the graph (it was: 1,660 FX nodes at micro-batch 16 of a 124M model, 2,518 at 32,
against 780 with the full logits). On CUDA the weight's gradient accumulates inside the GEMM, into
its fp32 buffer.

`cross_entropy` takes a model's head and picks among these (and the plain loss).
`softcapped_loss` is the same loss for a head whose logits are soft-capped (Gemma-2), a chunk of
rows at a time, each chunk recomputed in the backward pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# targets with this value carry no loss (prompt tokens, padding); the one definition
IGNORE_INDEX = -100

# Below this many logits (rows x vocab) the plain loss is used where the free memory is not known
# (a CPU): its logits are small and one fused kernel beats a Python loop. 2**24 fp32 logits are 64 MB.
PLAIN_MAX_LOGITS = 2**24
# Each chunk holds about this many logits where the free memory is not known: 2**25 fp32 logits are
# 128 MB, large enough that the chunk matmuls (e.g. 667 x 768 x 50304) still run at full speed.
CHUNK_LOGITS = 2**25
# Bytes a logit costs the full loss at its peak: the logits in the autocast dtype, their fp32 copy
# and its gradient (2 + 4 + 4, counted as fp32 throughout); and a chunk's logit: fp32 logits, their
# gradient built in place, its copy in the compute dtype.
FULL_LOGIT_BYTES = 12
CHUNK_LOGIT_BYTES = 8
# On a GPU "auto" keeps the full logits while they take at most this share of the free memory (the
# rest is the activations'); a chunk takes at most CHUNK_SHARE of it.
FULL_SHARE = 0.5
CHUNK_SHARE = 0.125


# `mode` is `TrainConfig.loss` (`core.config.LossMode`): "full" always keeps the full logits (the
# fastest where they fit: one fused kernel, no loop), "chunked" always chunks, "auto" keeps the full
# logits where they fit: on a GPU by the free memory (`resolve_loss`, at the trainer's start, for its
# micro-batch), elsewhere by size (PLAIN_MAX_LOGITS).


def free_memory(device: torch.device) -> int | None:
    """Bytes a CUDA device can still give: the driver's free memory and what torch's caching allocator
    holds unused. None elsewhere (a CPU's memory is not what limits its loss)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def default_chunk_rows(
    n_rows: int, vocab_size: int, mode: str = "auto", free_bytes: int | None = None
) -> int:
    """Rows per chunk for `n_rows` tokens; 0 means the plain loss over the full logits ("full", or
    "auto" when the full logits fit). `free_bytes`: the device's free memory where known (a GPU):
    the full logits fit within FULL_SHARE of it, a chunk takes CHUNK_SHARE of it; unknown: by size."""
    if mode == "full":
        return 0
    if mode == "auto" and (
        n_rows * vocab_size <= PLAIN_MAX_LOGITS
        if free_bytes is None
        else n_rows * vocab_size * FULL_LOGIT_BYTES <= FULL_SHARE * free_bytes
    ):
        return 0
    budget = (
        CHUNK_LOGITS
        if free_bytes is None
        else max(CHUNK_LOGITS, int(CHUNK_SHARE * free_bytes) // CHUNK_LOGIT_BYTES)
    )
    rows = max(1, budget // vocab_size)
    if rows >= 64:
        rows -= rows % 64  # a multiple of 64 keeps the matmul tiles whole
    return min(rows, n_rows)


def resolve_loss(mode: str, n_rows: int, vocab_size: int, device: torch.device) -> str:
    """`TrainConfig.loss` as a trainer of `n_rows` tokens per micro-batch runs it on `device`: on a
    GPU "auto" becomes "full" where the full logits fit in its free memory now (the model and its
    optimizer already there), else "chunked"; elsewhere it stays "auto" (by size, per call)."""
    free = free_memory(device) if mode == "auto" else None
    if free is None:
        return mode
    return "full" if default_chunk_rows(n_rows, vocab_size, "auto", free) == 0 else "chunked"


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype autocast would give `F.linear(x, weight)`."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, weight.dtype)


def _accumulate(grad_w: torch.Tensor, g: torch.Tensor, xc: torch.Tensor) -> None:
    """grad_w += g.T @ xc inside the GEMM (beta 1): on CUDA half-precision inputs write the fp32
    buffer directly (cuBLAS accumulates in fp32; addmm's out_dtype, in every torch setup.py
    allows); elsewhere a same-dtype addmm_, or one add."""
    if g.dtype == grad_w.dtype:
        grad_w.addmm_(g.t(), xc)
    elif g.is_cuda:
        torch.addmm(grad_w, g.t(), xc, out_dtype=grad_w.dtype, out=grad_w)
    else:
        grad_w.add_(g.t() @ xc)  # the CPU has no mixed-dtype addmm


@torch.library.custom_op("tinygpt::chunked_linear_ce", mutates_args=())
def _chunked_linear_ce(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int,
    ignore_index: int,
    compute_dtype: torch.dtype,
    grad_x_needed: bool,
    grad_w_needed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed token loss of `x @ weight.T`, its gradient in x, in weight), the gradients made in
    the forward pass a chunk of rows at a time; one opaque op, so `torch.compile` sees one node
    whatever the number of chunks. chunk_rows < 0: sized by the device's free memory now. A gradient
    not needed is an empty tensor."""
    n_rows = x.shape[0]
    if chunk_rows < 0:
        chunk_rows = default_chunk_rows(n_rows, weight.shape[0], "chunked", free_memory(x.device))
    w = weight.to(compute_dtype)
    acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    loss = torch.zeros((), dtype=acc_dtype, device=x.device)
    grad_x = torch.empty_like(x) if grad_x_needed else x.new_empty(0)
    # fp32 accumulator: a bf16 sum over many chunks would lose the small contributions.
    grad_w = torch.zeros(weight.shape if grad_w_needed else (0,), dtype=acc_dtype, device=x.device)
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        xc = x[start:end].to(compute_dtype)
        tc = targets[start:end]
        valid = tc != ignore_index
        safe_t = torch.where(valid, tc, torch.zeros_like(tc)).unsqueeze(1)
        logits = (xc @ w.t()).to(acc_dtype)
        lse = torch.logsumexp(logits, dim=1)
        target_logit = logits.gather(1, safe_t).squeeze(1)
        loss += torch.where(valid, lse - target_logit, torch.zeros_like(lse)).sum()
        if not (grad_x_needed or grad_w_needed):
            continue
        # d(loss)/d(logits) = softmax - onehot(target), zero on ignored rows; built in place.
        grad_logits = logits.sub_(lse.unsqueeze(1)).exp_()
        grad_logits.scatter_add_(1, safe_t, -torch.ones_like(safe_t, dtype=grad_logits.dtype))
        grad_logits.mul_(valid.unsqueeze(1))
        g = grad_logits.to(compute_dtype)
        if grad_x_needed:
            grad_x[start:end] = (g @ w).to(x.dtype)
        if grad_w_needed:
            _accumulate(grad_w, g, xc)
    return loss, grad_x, grad_w


@_chunked_linear_ce.register_fake
def _(x, weight, targets, chunk_rows, ignore_index, compute_dtype, grad_x_needed, grad_w_needed):
    acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    return (
        x.new_empty((), dtype=acc_dtype),
        torch.empty_like(x) if grad_x_needed else x.new_empty(0),
        x.new_empty(weight.shape if grad_w_needed else (0,), dtype=acc_dtype),
    )


def _setup_context(ctx, inputs, output) -> None:
    _, grad_x, grad_w = output
    ctx.save_for_backward(grad_x, grad_w)
    ctx.weight_dtype = inputs[1].dtype


def _backward(ctx, grad_loss, _grad_x, _grad_w):
    """The loss is linear in its output: the gradients made in forward, scaled."""
    grad_x, grad_w = ctx.saved_tensors
    gx = grad_x * grad_loss.to(grad_x.dtype) if grad_x.numel() else None
    gw = (grad_w * grad_loss.to(grad_w.dtype)).to(ctx.weight_dtype) if grad_w.numel() else None
    return gx, gw, None, None, None, None, None, None


_chunked_linear_ce.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: str = "mean",
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None,
    mode: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of the logits `x @ weight.T` (fp32 log-softmax) against `targets`.

    x: (..., d) hidden states; weight: (vocab, d) head; targets: (...) class ids, `ignore_index` for
    tokens without a loss. reduction: "mean" over the non-ignored tokens (NaN when there are none,
    as F.cross_entropy) or "sum". chunk_rows: None picks by `mode` (`default_chunk_rows`; on CUDA a
    chunk's rows come from the free memory when the op runs), 0 forces the plain loss, n > 0 forces
    chunks of n rows."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    x2 = x.reshape(-1, x.shape[-1])
    t = targets.reshape(-1)
    if x2.shape[0] != t.shape[0]:
        raise ValueError(f"{x2.shape[0]} hidden states but {t.shape[0]} targets")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(x2.shape[0], weight.shape[0], mode)
        if chunk_rows and x2.is_cuda:
            chunk_rows = -1  # sized inside the op, by the free memory when it runs
    if chunk_rows == 0:
        logits = F.linear(x2, weight).float()
        return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction=reduction)
    grad_on = torch.is_grad_enabled()
    loss_sum, _, _ = _chunked_linear_ce(
        x2,
        weight,
        t,
        chunk_rows,
        ignore_index,
        _compute_dtype(x2, weight),
        grad_on and x2.requires_grad,
        grad_on and weight.requires_grad,
    )
    if reduction == "sum":
        return loss_sum
    # A tensor division, no .item(): no host-device sync in the training loop.
    return loss_sum / (t != ignore_index).sum()


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma-2's soft-capped logits, cap * tanh(logits / cap); the logits themselves where cap is None."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


def softcapped_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    cap: float,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of Gemma-2's logits cap * tanh(hidden @ weight.T / cap), a chunk of rows
    at a time. Each chunk's logits are recomputed in the backward pass instead of kept: one more
    head matmul buys the (tokens, 256k vocab) logits that would not fit a T4 next to the model.
    chunk_rows: None picks by size (`default_chunk_rows`), 0 takes the full logits."""

    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    rows = default_chunk_rows(h.shape[0], weight.shape[0]) if chunk_rows is None else chunk_rows

    def part(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        z = F.linear(hc, weight).float()
        return F.cross_entropy(softcap(z, cap), tc, ignore_index=IGNORE_INDEX, reduction="sum")

    if rows <= 0 or rows >= h.shape[0]:
        return part(h, t)
    return sum(
        checkpoint(part, h[i : i + rows], t[i : i + rows], use_reentrant=False)
        for i in range(0, h.shape[0], rows)
    )


def cross_entropy(
    head: torch.nn.Module,
    x: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "mean",
    mode: str = "auto",
    cap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of head(x) against targets, in fp32, ignoring IGNORE_INDEX; with `cap`, of the
    soft-capped logits cap * tanh(head(x) / cap) (`ModelConfig.logit_softcap`).

    Large vocabularies go through `tinygpt.model.losses` in chunks of rows, so the full logits are
    never held for the backward pass; small problems use the plain F.cross_entropy."""
    plain = type(head) is torch.nn.Linear and head.bias is None
    if cap is not None and plain:  # the full logits or chunks of them, as `mode` says
        rows = default_chunk_rows(x.numel() // x.shape[-1], head.weight.shape[0], mode)
        total = softcapped_loss(x, head.weight, targets, cap, chunk_rows=rows)
        return total if reduction == "sum" else total / (targets != IGNORE_INDEX).sum()
    if not plain:
        # A wrapped head (LoRA, 4-bit) is not just its .weight: run it and take the plain loss.
        logits = softcap(head(x).float(), cap)
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction=reduction,
        )
    return linear_cross_entropy(
        x, head.weight, targets, reduction=reduction, ignore_index=IGNORE_INDEX, mode=mode
    )
