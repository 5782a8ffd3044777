"""Language-model scoring every task shares: perplexity and bits per byte of a text, log-likelihoods
and multiple choice, and batching that says a long run's time first; reading an evaluation text (a
file or a Hub data set) is `tinygpt.evals.texts`'s. The tasks that use them are in
`tinygpt.evals.tasks` (one module each); code metrics are in `tinygpt.evals.code`, run summaries in
`tinygpt.evals.compare_runs`.

Every model function takes a tinygpt `GPT` or a Hugging Face causal LM (through `as_causal_lm`), and
a tinygpt `Tokenizer` or a Hugging Face tokenizer. Wrap a call in `Precision.autocast()` to evaluate
in bf16/fp16; log-probabilities are always taken in fp32."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from tinygpt.core.units import duration
from tinygpt.evals.code import with_bar
from tinygpt.model.losses import IGNORE_INDEX

# --- models and tokenizers --------------------------------------------------------------------


@dataclass
class CausalLM:
    """What evaluation needs of a model: logits for token ids, the longest context, the device.
    `trained`: the context a run trained at where its position table is longer; scoring keeps
    within it wherever the text scored fits, and reaches past it only for a longer continuation."""

    module: torch.nn.Module
    max_seq_len: int
    trained: int | None = None

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.module(idx)
        return out.logits if hasattr(out, "logits") else out  # Hugging Face returns a ModelOutput


def as_causal_lm(model: Any) -> CausalLM:
    """Adapt a tinygpt `GPT` (logits from ``model(idx)``) or a Hugging Face causal LM (``.logits``,
    also under `peft`); a `CausalLM` as it is. The context comes from ``config.max_seq_len`` /
    ``max_position_embeddings`` / ``n_positions``."""
    if isinstance(model, CausalLM):
        return model
    cfg = getattr(model, "config", None)
    for name in ("max_seq_len", "max_position_embeddings", "n_positions"):
        if getattr(cfg, name, None):
            return CausalLM(model, int(getattr(cfg, name)))
    raise ValueError("cannot tell the model's context length (no config.max_seq_len)")


def encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """text -> ids with no special tokens added, for a tinygpt or a Hugging Face tokenizer."""
    if hasattr(tokenizer, "eot_id"):
        return tokenizer.encode
    # verbose=False: a whole text is longer than model_max_length on purpose (cut into windows)
    return lambda text: tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def start_token(tokenizer: Any) -> int | None:
    """The id put before a text so that its first token is predicted too: tinygpt's end-of-text
    (documents are separated by it in training), else the tokenizer's BOS or EOS."""
    if hasattr(tokenizer, "eot_id"):
        return tokenizer.eot_id
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            return int(getattr(tokenizer, name))
    return None


@contextlib.contextmanager
def _evaluating(module: torch.nn.Module):
    was_training = module.training
    module.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        module.train(was_training)


def _nll_sum(lm: CausalLM, inputs: list[list[int]], targets: list[list[int]]) -> float:
    """Summed cross-entropy (nats) of a batch of windows, right-padded (a causal model never looks
    right, so padding changes nothing before it)."""
    T = max(len(x) for x in inputs)
    x = torch.zeros(len(inputs), T, dtype=torch.long)
    y = torch.full((len(inputs), T), IGNORE_INDEX, dtype=torch.long)
    for i, (a, b) in enumerate(zip(inputs, targets)):
        x[i, : len(a)], y[i, : len(b)] = torch.tensor(a), torch.tensor(b)
    logits = lm.logits(x.to(lm.device))
    y = y.to(logits.device)
    return sum(
        float(F.cross_entropy(logits[i].float(), y[i], ignore_index=IGNORE_INDEX, reduction="sum"))
        # one row at a time in fp32: a big vocabulary stays small
        for i in range(len(inputs))
    )


# --- time: said first when the work is long ----------------------------------------------------

# an evaluation expected to take longer says so, with how to shorten it, before it goes on
LONG_SECONDS = 120.0
# what the suggested shorter run aims at (a quarter of the whole, when that is less)
SHORT_SECONDS = 180.0


def shorter(size: int, expected: float) -> int:
    """How much of `size` (characters, items) takes about `SHORT_SECONDS`, or a quarter of
    `expected`, rounded down to one significant digit (a number a person would type: 237000 ->
    200000)."""
    x = size * min(SHORT_SECONDS, expected / 4) / expected
    if x < 1:
        return 1
    scale = 10 ** int(math.floor(math.log10(x)))
    return int(x // scale * scale)


def run_batches(
    batches: list,
    run: Callable[[Any], None],
    desc: str,
    progress: bool,
    say: Callable[[str], None] | None,
    describe: Callable[[float, float], str],
    cost: Sequence[float] | None = None,
) -> None:
    """``run(batch)`` for every batch. The first two are timed before any bar is shown; when the
    whole is expected to take more than `LONG_SECONDS`, ``say(describe(expected_total_s,
    s_per_batch))`` comes first. The first batch warms up, so the rate is the second's, per unit of
    `cost` (e.g. tokens; default: one per batch) when batches differ in size."""
    n, done = len(batches), 0
    cost = list(cost) if cost is not None else [1.0] * n
    first = per = 0.0
    while done < min(n, 2):
        start = time.perf_counter()
        run(batches[done])
        per = (time.perf_counter() - start) / max(cost[done], 1e-9)
        first = first or per * cost[done]
        done += 1
    expected = first + per * sum(cost[1:])
    if say is not None and n > done and expected > LONG_SECONDS:
        say(describe(expected, per))
    # a bar for the rest, gone when done: the result says it
    for b in with_bar(batches[done:], n, desc, progress and n > done, initial=done, leave=False):
        run(b)


# --- perplexity and bits per byte -------------------------------------------------------------


def _windows(n_pred: int, window: int, step: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) of each window: inputs ids[begin:end], targets
    ids[begin+1:end+1], of which those before the first scored target were scored by an earlier
    one."""
    spans, prev_end = [], 0
    for begin in range(0, n_pred, step):
        end = min(begin + window, n_pred)
        spans.append((begin, end, prev_end))
        prev_end = end
        if end == n_pred:
            break
    return spans


def _window_and_step(lm: CausalLM, window: int | None, stride: int | None) -> tuple[int, int]:
    """The window (default: the model's context) and the step between windows, checked."""
    window = window or lm.max_seq_len
    if not 1 <= window <= lm.max_seq_len:
        raise ValueError(
            f"window must be between 1 and the model's context {lm.max_seq_len}, got {window}"
        )
    if stride is not None and not 1 <= stride <= window:
        raise ValueError(f"stride must be between 1 and window ({window}), got {stride}")
    return window, stride or window


def _scores(nll: float, tokens: int, n_bytes: int) -> dict[str, float]:
    """Mean loss, perplexity and bits per byte of `nll` nats over `tokens` tokens and `n_bytes`."""
    return {
        "nll_nats": nll,
        "loss": nll / tokens,
        "perplexity": math.exp(nll / tokens),
        "bits_per_byte": nll / (math.log(2) * n_bytes),
    }


def perplexity(
    model: Any,
    tokenizer: Any,
    text: str,
    window: int | None = None,
    stride: int | None = None,
    batch_size: int = 4,
    progress: bool = False,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Token-level perplexity and bits per byte of `text`.

    With ``stride=None`` the text is cut into non-overlapping windows of `window` tokens (default:
    the model's context), each scored from an empty context. With a stride, windows start every
    `stride` tokens and only the tokens no earlier window scored count, so each one (past the first
    window) sees at least ``window - stride`` tokens of context: a lower, fairer perplexity for
    ``window / stride`` times the compute. ``stride == window`` is the non-overlapping case. Bits
    per byte = total nats / (ln 2 * UTF-8 bytes of the text): comparable across tokenizers. The text
    starts after the start token (`start_token`) so that its first token is scored too. Logits are
    (batch_size, window, vocab): lower both for a large vocabulary on a small GPU. A long text is
    first said through `say` with its time and a shorter ``--max-chars`` (`run_batches`)."""
    lm = as_causal_lm(model)
    window, step = _window_and_step(lm, window, stride)
    start = start_token(tokenizer)
    ids = ([start] if start is not None else []) + encoder(tokenizer)(text)
    n_pred = len(ids) - 1  # ids[1:] are predicted; without a start token the first one is not
    if n_pred < 1:
        raise ValueError("the text is too short to score; give at least one token of text")
    spans = _windows(n_pred, window, step)
    total = 0.0
    n_bytes = len(text.encode("utf-8"))

    def run(batch) -> None:
        nonlocal total
        inputs = [ids[b:e] for b, e, _ in batch]
        targets = [[IGNORE_INDEX] * (s - b) + ids[s + 1 : e + 1] for b, e, s in batch]
        total += _nll_sum(lm, inputs, targets)

    def describe(expected: float, per_batch: float) -> str:
        chars = shorter(len(text), expected)
        how = f"stride {step}" if step != window else "non-overlapping"
        return (
            f"perplexity over {n_bytes / 1e6:.1f} MB ({len(spans):,} windows of {window} tokens, "
            f"{how}): about {duration(expected)} on this {lm.device.type.upper()}; --max-chars "
            f"{chars} takes about {duration(expected * chars / len(text))}"
        )

    with _evaluating(lm.module):
        batches = [spans[i : i + batch_size] for i in range(0, len(spans), batch_size)]
        run_batches(batches, run, "perplexity", progress, say, describe)
    return {
        "mode": "non-overlapping" if step == window else "sliding",
        "window": window,
        "stride": step,
        "windows": len(spans),
        "tokens": n_pred,
        "bytes": n_bytes,
        "first_token_scored": start is not None,
        **_scores(total, n_pred, n_bytes),
    }


# --- log-likelihoods and multiple choice (HellaSwag: tasks/hellaswag.py) ---------------------


@dataclass
class ChoiceItem:
    """One multiple-choice item: endings scored after the context; `label`: the right one."""

    context: str
    endings: list[str]
    label: int


def _request_ids(
    lm: CausalLM, encode: Callable, start: int | None, ctx: str, cont: str
) -> tuple[list[int], int]:
    """One request's ids (context + continuation, cut on the left to fit) and its continuation's
    length."""
    n_space = len(ctx) - len(ctx.rstrip(" "))
    if n_space:
        ctx, cont = ctx[:-n_space], ctx[-n_space:] + cont
    whole = encode(ctx + cont)
    ctx_ids = encode(ctx) if ctx else []
    cont_ids = whole[len(ctx_ids) :]
    if not ctx_ids:
        if start is None:
            raise ValueError("an empty context needs a tokenizer with a BOS or EOS token")
        ctx_ids = [start]
    if not cont_ids:
        raise ValueError(f"continuation {cont[:40]!r} has no tokens of its own")
    if len(cont_ids) > lm.max_seq_len:
        raise ValueError(
            f"continuation {cont[:40]!r} is {len(cont_ids)} tokens, more than this model's "
            f"context ({lm.max_seq_len}): score it with a model of a longer context "
            "(model.max_seq_len)"
        )
    fits = lm.trained is not None and len(cont_ids) < lm.trained
    return (ctx_ids + cont_ids)[-((lm.trained if fits else lm.max_seq_len) + 1) :], len(cont_ids)


def loglikelihoods(
    model: Any,
    tokenizer: Any,
    requests: Sequence[tuple[str, str]],
    batch_size: int = 16,
    progress: bool = False,
    say: Callable[[str], None] | None = None,
    describe: Callable[[float, float], str] | None = None,
) -> list[float]:
    """log P(continuation | context) in nats for each (context, continuation), summed over the
    continuation's tokens only. Tokenized as lm-evaluation-harness does: the continuation's tokens
    are those of context + continuation after the context's, and context trailing spaces move to the
    continuation; an empty context becomes the start token; too long inputs lose their left (past
    the trained context, `CausalLM.trained`, where the continuation fits in it). `say` and
    `describe`: as in `run_batches` (a long run says its expected time first)."""
    lm, encode, start = as_causal_lm(model), encoder(tokenizer), start_token(tokenizer)
    seqs = [_request_ids(lm, encode, start, ctx, cont) for ctx, cont in requests]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))  # similar lengths pad less
    out = [0.0] * len(seqs)

    def run(batch) -> None:
        T = max(len(seqs[j][0]) for j in batch) - 1
        x = torch.zeros(len(batch), T, dtype=torch.long)
        for r, j in enumerate(batch):
            x[r, : len(seqs[j][0]) - 1] = torch.tensor(seqs[j][0][:-1])
        logits = lm.logits(x.to(lm.device))
        for r, j in enumerate(batch):
            seq, n = seqs[j]
            pos = torch.arange(len(seq) - 1 - n, len(seq) - 1, device=logits.device)
            logp = F.log_softmax(logits[r, pos].float(), dim=-1)
            tgt = torch.tensor(seq[-n:], device=logits.device)
            out[j] = float(logp.gather(1, tgt[:, None]).sum())

    if describe is None:

        def describe(expected: float, per_batch: float) -> str:
            on = lm.device.type.upper()
            return f"{len(seqs):,} log-likelihoods: about {duration(expected)} on this {on}"

    with _evaluating(lm.module):
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        # padded tokens: longest first
        cost = [len(b) * max(len(seqs[j][0]) for j in b) for b in batches]
        run_batches(batches, run, "loglikelihood", progress, say, describe, cost)
    return out


def multiple_choice(
    model: Any,
    tokenizer: Any,
    items: Sequence[ChoiceItem],
    batch_size: int = 16,
    progress: bool = False,
    say: Callable[[str], None] | None = None,
    name: str = "multiple choice",
) -> dict[str, Any]:
    """acc (highest log-likelihood) and acc_norm (log-likelihood / characters of the ending, as
    lm-evaluation-harness defines it); each ending is scored as " " + ending after the context."""
    if not items:
        raise ValueError("no items to score")
    requests = [(it.context, " " + e) for it in items for e in it.endings]

    def describe(expected: float, per_batch: float) -> str:
        limit = shorter(len(items), expected)
        return (
            f"{name} over {len(items):,} items: about {duration(expected)} on this "
            f"{as_causal_lm(model).device.type.upper()}; --limit {limit} takes about "
            f"{duration(expected * limit / len(items))}"
        )

    lls = loglikelihoods(model, tokenizer, requests, batch_size, progress, say, describe)
    correct = correct_norm = i = 0
    for it in items:
        ll = lls[i : i + len(it.endings)]
        i += len(it.endings)
        correct += max(range(len(ll)), key=lambda j: ll[j]) == it.label
        correct_norm += (
            max(range(len(ll)), key=lambda j: ll[j] / max(len(it.endings[j]), 1)) == it.label
        )
    n = len(items)
    acc, acc_norm = correct / n, correct_norm / n

    def se(p: float) -> float:  # the standard error of a proportion over n items
        return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")

    return {
        "n": n,
        "acc": acc,
        "acc_stderr": se(acc),
        "acc_norm": acc_norm,
        "acc_norm_stderr": se(acc_norm),
    }
