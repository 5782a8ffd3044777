"""Sampling with the KV cache: temperature, top-k, top-p, stop at end-of-text. And a transformers
model's answers to instructions, in the prompt format it was finetuned with (`model.prompts`): one
answer (`generate_response`), or a few before and after finetuning (`compare_generations`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tinygpt.core.options import option
from tinygpt.model.attention import hf_attention
from tinygpt.model.gpt import GPT, KVCache
from tinygpt.model.hf import from_pretrained
from tinygpt.model.prompts import Codec, format_prompt


@dataclass(kw_only=True)
class GenerateOptions:
    """What `tinygpt generate` samples: each field is one of its options (core/options.py)."""

    run_dir: str | None = option(
        None,
        flag="RUN_DIR",
        alias="--run-dir",
        deprecated=True,
        help="a run folder: a pretraining run, or a finetuning run (then the prompt is "
        "an instruction, as with --adapter)",
    )
    prompt: str = option(help="the text to continue (with --adapter: the instruction to answer)")
    checkpoint: str = option("latest", help="latest, best, or a checkpoint folder")
    max_new_tokens: int = option(200, help="tokens to generate")
    temperature: float = option(0.8, help="0 is greedy; higher is more varied")
    top_k: int | None = option(50, help="sample only from the k likeliest tokens")
    top_p: float | None = option(
        None, help="sample only from the likeliest tokens that cover this probability"
    )
    num_samples: int = option(1, help="how many samples, each from its own seed")
    seed: int | None = option(None, help="the random seed of the first sample (sample i: seed + i)")
    adapter: str | None = option(
        None,
        help="a finetuning run or adapter folder: the prompt is an instruction "
        "answered by base + adapter",
    )


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of logits (B, V). temperature 0 means greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already cover top_p (the first always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check(temperature: float, top_k: int | None, top_p: float | None, max_new_tokens: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eot_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue idx (B, T) by up to max_new_tokens; rows that emit eot_id stop (padded with eot_id).
    The prompt is processed once, then each new token costs one position thanks to the KV cache."""
    _check(temperature, top_k, top_p, max_new_tokens)
    if idx.numel() == 0 or idx.size(1) == 0:
        raise ValueError("the prompt is empty: give at least one token of text to continue")
    B, T = idx.shape
    max_len = model.config.max_seq_len
    if T >= max_len:  # keep the most recent context that leaves room to generate
        idx = idx[:, -(max_len - 1) :]
        T = idx.size(1)
    max_new_tokens = min(max_new_tokens, max_len - T)
    dtype = next(model.parameters()).dtype
    cache = KVCache.empty(model.config, B, T + max_new_tokens, idx.device, dtype)
    logits = model(idx, cache=cache)[:, -1]
    out = [idx]
    done = torch.zeros(B, dtype=torch.bool, device=idx.device)
    for i in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        if eot_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eot_id), nxt)
            done |= nxt == eot_id
        out.append(nxt[:, None])
        if eot_id is not None and bool(done.all()):
            break
        if i + 1 < max_new_tokens:
            logits = model(nxt[:, None], cache=cache)[:, -1]
    return torch.cat(out, dim=1)


def generate_text(
    model: GPT,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int | None = None,
    stop_at_eot: bool = True,
) -> str:
    """The prompt followed by its continuation, as text."""
    if not prompt:
        raise ValueError("the prompt is empty: give some text to continue, e.g. --prompt 'def '")
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    eot = tokenizer.eot_id if stop_at_eot else None
    out = generate(model, ids, max_new_tokens, temperature, top_k, top_p, eot, gen)[0].tolist()
    if stop_at_eot and tokenizer.eot_id in out[ids.size(1) :]:
        out = out[: ids.size(1) + out[ids.size(1) :].index(tokenizer.eot_id)]
    return tokenizer.decode(out)


# ----- a transformers model's answers to instructions --------------------------------------------
@torch.no_grad()
def generate_response(
    model,
    tokenizer,
    instruction: str,
    input: str = "",
    *,
    template: str = "alpaca",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float | None = None,
) -> str:
    """A transformers (or PEFT) model's answer to one instruction (greedy when temperature is 0)."""
    codec = Codec(tokenizer)
    ids = codec.encode_examples([[(format_prompt(instruction, input, template), False)]])[0][0]
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    kw: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        kw.update(temperature=temperature, top_p=top_p)
    context = getattr(model.config, "max_position_embeddings", None)
    # past the context the base was trained on, tokens are noise (and transformers warns)
    if context:
        max_new_tokens = max(1, min(max_new_tokens, context - len(ids)))
    # use_cache: training with activation checkpointing switched the config's default off
    kw.update(eos_token_id=codec.eos_id, pad_token_id=codec.pad_id, use_cache=True)
    out = model.generate(
        input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, **kw
    )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


@dataclass
class Generations:
    """Answers to a few instructions before and after finetuning; prints as text."""

    rows: list[tuple[str, str, str]]  # (instruction, before, after)

    def __str__(self) -> str:
        return "\n\n".join(
            f"### {i}\n--- before (the base) ---\n{b.strip()}\n"
            f"--- after (with the adapter) ---\n{a.strip()}"
            for i, b, a in self.rows
        )

    __repr__ = __str__


def compare_generations(
    model,
    tokenizer,
    instructions: Sequence[str],
    *,
    template: str = "alpaca",
    max_new_tokens: int = 96,
    base: str | None = None,
) -> Generations:
    """Greedy answers of a PEFT model with its adapter switched off (exactly the base: LoRA leaves
    the base weights alone, and no second copy of the base is loaded) and on. A fully finetuned
    model has no adapter to switch off: `base` (`FinetuneResult.base_path`) is then loaded beside it
    to answer first."""
    adapter = hasattr(model, "disable_adapter")
    if not adapter:
        if base is None:
            raise ValueError(
                "a fully finetuned model has no adapter to switch off: pass base=result.base_path"
            )
        config = from_pretrained("AutoConfig", base)
        load = dict(dtype=torch.float32, attn_implementation=hf_attention(config))
        original = from_pretrained("AutoModelForCausalLM", base, **load).eval()
    rows, kw = [], dict(template=template, max_new_tokens=max_new_tokens)
    for instruction in instructions:
        with model.disable_adapter() if adapter else contextlib.nullcontext():
            before = generate_response(model if adapter else original, tokenizer, instruction, **kw)
        after = generate_response(model, tokenizer, instruction, **kw)
        rows.append((instruction, before, after))
    return Generations(rows)
