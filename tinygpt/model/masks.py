"""Training-time attention masks: each document of a training window kept apart, and an attention
window that grows during training (modded-nanogpt's FlexAttention records). They change what the
model attends to while it trains, not the network: the saved model is a plain causal LM, evaluated,
generated from and exported as any other.

One rule (`mask_rule`) says which key a query may see; on CUDA it becomes FlexAttention's block mask
(only the blocks that hold a visible key are computed), elsewhere a boolean mask for
`F.scaled_dot_product_attention` built from the same rule."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F


def document_ids(x: np.ndarray | torch.Tensor, eot_id: int) -> torch.Tensor:
    """(B, T) int: which document of the window each token belongs to, counted from 0 at the
    window's first token. A document ends with its end-of-text token (the shards put one after
    each), so the token after it starts the next."""
    x = torch.as_tensor(x)
    ends = (x == eot_id).to(torch.int32)
    return (ends.cumsum(-1) - ends).to(torch.int32)


def mask_rule(docs: torch.Tensor | None, window: torch.Tensor | None) -> Callable:
    """mask(b, h, q, k) -> bool: query q sees key k when k is not after q, both are in one
    document (docs: (B, T) document ids, or None: no documents) and k is fewer than `window`
    tokens back (a 0-d tensor, or None: the whole context). FlexAttention's mask_mod signature."""

    def rule(b: Any, h: Any, q: Any, k: Any) -> Any:
        keep = q >= k
        if docs is not None:
            keep = keep & (docs[b, q] == docs[b, k])
        if window is not None:
            keep = keep & (q - k < window)
        return keep

    return rule


def training_mask(
    docs: torch.Tensor | None, window: int | None, B: int, T: int, device: torch.device
) -> Any:
    """The mask `masked_attention` takes for a (B, T) batch: a FlexAttention block mask on CUDA,
    else a (B, 1, T, T) boolean tensor (True: attend). None when there is nothing to mask beyond
    causality (no documents and a window of the whole context)."""
    if window is not None and window >= T:
        window = None
    if docs is None and window is None:
        return None
    docs = docs.to(device) if docs is not None else None
    win = torch.tensor(window, device=device) if window is not None else None
    rule = mask_rule(docs, win)
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(rule, B if docs is not None else None, None, T, T, device=device)
    i = torch.arange(T, device=device)
    b = torch.arange(B, device=device)[:, None, None, None]
    return rule(b, 0, i[None, None, :, None], i[None, None, None, :]).expand(B, 1, T, T)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, enable_gqa: bool
) -> torch.Tensor:
    """Attention under a `training_mask`: FlexAttention for a block mask, SDPA for a tensor."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
    from torch.nn.attention.flex_attention import flex_attention

    # autocast casts SDPA's inputs to its dtype but not FlexAttention's: do it here (QK-norm's
    # weights would otherwise leave q and k in fp32 beside a bf16 v)
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
