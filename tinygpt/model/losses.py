"""Cross-entropy of a linear head without materialising the full (tokens, vocab) logits.

`F.cross_entropy(head(x).float(), y)` keeps, for the backward pass, the logits of every token in
the micro-batch: with a 50k vocabulary that is 50304 * 6 bytes (bf16 logits + fp32 log-softmax)
per token, about 10 GB at 32k tokens, more than the whole 124M model with its activations. It is
what caps the micro-batch.

`linear_cross_entropy` walks over the flattened tokens in chunks of rows. For each chunk it
computes the logits (matmul in the autocast dtype, log-softmax in fp32), the loss, and right
away the gradient of the logits, which it turns into the chunk's gradient of the hidden states
and adds into the head weight's gradient; then it drops the chunk. Only those two gradients,
the size of the hidden states and of the weight, wait for the backward pass, which merely scales
them by the incoming gradient (the loss is linear in its output). This does the same three
matmuls as the plain loss (no recomputation), and peak memory holds one chunk of logits.

It is a `torch.autograd.Function`, so a head weight tied to the embedding receives this gradient
through autograd and it adds to the embedding's own, and it traces under `torch.compile`.

`softcapped_loss` is the same loss for a head whose logits are soft-capped (Gemma-2), a chunk of
rows at a time, each chunk recomputed in the backward pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# targets with this value carry no loss (prompt tokens, padding); the one definition
IGNORE_INDEX = -100

# Below this many logits (rows x vocab) the plain loss is used: its logits are small and one
# fused kernel beats a Python loop. 2**24 fp32 logits are 64 MB.
PLAIN_MAX_LOGITS = 2**24
# Each chunk holds about this many logits: 2**25 fp32 logits are 128 MB, large enough that the
# chunk matmuls (e.g. 667 x 768 x 50304) still run at full speed on a GPU.
CHUNK_LOGITS = 2**25


# `mode` is `TrainConfig.loss` (`core.config.LossMode`): "auto" chunks by
# size (below), "full" always keeps the full logits (the fastest where they
# fit: one fused kernel, no loop), "chunked" always chunks. On a GPU the
# probe times "full" against "chunked" and keeps the faster one that fits.


def default_chunk_rows(n_rows: int, vocab_size: int, mode: str = "auto") -> int:
    """Rows per chunk for `n_rows` tokens; 0 means the plain loss over the full logits ("full", or
    "auto" when all logits are small)."""
    if mode == "full" or (mode == "auto" and n_rows * vocab_size <= PLAIN_MAX_LOGITS):
        return 0
    rows = max(1, CHUNK_LOGITS // vocab_size)
    if rows >= 64:
        rows -= rows % 64  # a multiple of 64 keeps the matmul tiles whole
    return min(rows, n_rows)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype autocast would give `F.linear(x, weight)`."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, weight.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed token loss of `x @ weight.T` against `targets`; the gradients are made in forward."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_rows: int,
        ignore_index: int,
        compute_dtype: torch.dtype,
        grad_x_needed: bool,
        grad_w_needed: bool,
    ):
        n_rows = x.shape[0]
        w = weight.to(compute_dtype)
        acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        loss = torch.zeros((), dtype=acc_dtype, device=x.device)
        grad_x = torch.empty_like(x) if grad_x_needed else None
        # fp32 accumulator: a bf16 sum over many chunks would lose the small contributions.
        grad_w = (
            torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
            if grad_w_needed
            else None
        )
        for start in range(0, n_rows, chunk_rows):
            end = min(start + chunk_rows, n_rows)
            xc = x[start:end].to(compute_dtype)
            tc = targets[start:end]
            valid = tc != ignore_index
            safe_t = torch.where(valid, tc, torch.zeros_like(tc)).unsqueeze(1)
            logits = (xc @ w.t()).to(acc_dtype)
            lse = torch.logsumexp(logits, dim=1)
            target_logit = logits.gather(1, safe_t).squeeze(1)
            loss = loss + torch.where(valid, lse - target_logit, torch.zeros_like(lse)).sum()
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
                grad_w.add_(g.t() @ xc)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        gx = grad_x * grad_loss.to(grad_x.dtype) if grad_x is not None else None
        gw = (
            (grad_w * grad_loss.to(grad_w.dtype)).to(ctx.weight_dtype)
            if grad_w is not None
            else None
        )
        return gx, gw, None, None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         reduction: str = "mean", ignore_index: int = IGNORE_INDEX,
                         chunk_rows: int | None = None, mode: str = "auto") -> torch.Tensor:
    """Cross-entropy of the logits `x @ weight.T` (fp32 log-softmax) against `targets`.

    x: (..., d) hidden states; weight: (vocab, d) head; targets: (...) class ids, `ignore_index`
    for tokens without a loss. reduction: "mean" over the non-ignored tokens (NaN when there are
    none, as F.cross_entropy) or "sum". chunk_rows: None picks by `mode` (`default_chunk_rows`),
    0 forces the plain loss, n > 0 forces chunks of n rows.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    x2 = x.reshape(-1, x.shape[-1])
    t = targets.reshape(-1)
    if x2.shape[0] != t.shape[0]:
        raise ValueError(f"{x2.shape[0]} hidden states but {t.shape[0]} targets")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(x2.shape[0], weight.shape[0], mode)
    if chunk_rows == 0:
        logits = F.linear(x2, weight).float()
        return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction=reduction)
    grad_on = torch.is_grad_enabled()
    loss_sum = _ChunkedLinearCrossEntropy.apply(
        x2, weight, t, chunk_rows, ignore_index, _compute_dtype(x2, weight),
        grad_on and x2.requires_grad, grad_on and weight.requires_grad)
    if reduction == "sum":
        return loss_sum
    # A tensor division, no .item(): no host-device sync in the training loop.
    return loss_sum / (t != ignore_index).sum()


def softcapped_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cap: float,
                    *, chunk_rows: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of Gemma-2's logits cap * tanh(hidden @ weight.T / cap), a chunk of rows
    at a time. Each chunk's logits are recomputed in the backward pass instead of kept: one more
    head matmul buys the (tokens, 256k vocab) logits that would not fit a T4 next to the model.
    chunk_rows: None picks by size (`default_chunk_rows`), 0 takes the full logits."""

    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    rows = default_chunk_rows(h.shape[0], weight.shape[0]) if chunk_rows is None else chunk_rows

    def part(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        z = F.linear(hc, weight).float()
        return F.cross_entropy(cap * torch.tanh(z / cap), tc, ignore_index=IGNORE_INDEX,
                               reduction="sum")

    if rows <= 0 or rows >= h.shape[0]:
        return part(h, t)
    return sum(checkpoint(part, h[i:i + rows], t[i:i + rows], use_reentrant=False)
               for i in range(0, h.shape[0], rows))
