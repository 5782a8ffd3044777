"""The finetuning loss: a transformers causal LM's summed cross-entropy (`causal_lm_loss`), through
the chunked head losses of `model.losses` where the family allows, and `FinetuneLoss`, the model and
its loss as the one module the Trainer trains and compiles."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinygpt.finetune.memory_plan import SOFTCAP_HEAD_TYPES, chunked_loss
from tinygpt.model.attention import whole_rows
from tinygpt.model.losses import IGNORE_INDEX, linear_cross_entropy, softcapped_loss


def causal_lm_loss(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Summed fp32 cross-entropy over targets that are not IGNORE_INDEX (x and y already shifted).
    position_ids: of packed rows (0 again at each record's start: attention stays inside each
    record). chunk_rows: as in `losses.linear_cross_entropy` (None: by size, 0: full logits)."""
    # A DDP wrapper (no get_base_model) must see the forward call: it takes the plain path.
    hf = model.get_base_model() if hasattr(model, "get_base_model") else None
    if hf is None and hasattr(model, "get_output_embeddings") and hasattr(model, "base_model"):
        hf = model  # full finetuning: the transformers model itself
    head = hf.get_output_embeddings() if hf is not None else None
    pos = {"position_ids": position_ids} if position_ids is not None else {}
    if (
        hf is not None
        and chunked_loss({"model_type": hf.config.model_type})
        and isinstance(head, torch.nn.Linear)
        and head.bias is None
    ):
        hidden = hf.base_model(input_ids=x, use_cache=False, **pos).last_hidden_state
        cap = getattr(hf.config, "final_logit_softcapping", None)
        if cap and hf.config.model_type in SOFTCAP_HEAD_TYPES:
            return softcapped_loss(hidden, head.weight, y, float(cap), chunk_rows=chunk_rows)
        return linear_cross_entropy(hidden, head.weight, y, reduction="sum", chunk_rows=chunk_rows)
    logits = model(input_ids=x, use_cache=False, **pos).logits.float()
    return F.cross_entropy(
        logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class FinetuneLoss(torch.nn.Module):
    """A PEFT model and its loss as one module: what the Trainer trains and compiles, so that the
    forward pass and the loss (`causal_lm_loss`, hidden states through the head) are one compiled
    graph; nothing reaches around the compiled wrapper to the base model. Its parameters are the
    PEFT model's. full_logits: the head's logits for every token at once (fastest; `FinetunePlan`
    decides whether they fit), else chunked by size (`losses.default_chunk_rows`)."""

    def __init__(self, model: torch.nn.Module, *, full_logits: bool = True):
        super().__init__()
        self.model = model
        self.chunk_rows = 0 if full_logits else None

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return causal_lm_loss(self.model, x, y, position_ids, chunk_rows=self.chunk_rows)


def module_loss(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *extra: torch.Tensor
) -> torch.Tensor:
    """The Trainer's loss_fn for a `FinetuneLoss` (or its compiled wrapper): the module computes
    it. Rows without position ids are whole sequences: attention runs causal with no mask, compiled
    too (`whole_rows`), so FlashAttention can take it; packed rows keep their records' mask."""
    with whole_rows(not extra):
        return model(x, y, *extra)


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model a `FinetuneLoss` wraps (any other module itself): the one checkpoints hold."""
    return model.model if isinstance(model, FinetuneLoss) else model
