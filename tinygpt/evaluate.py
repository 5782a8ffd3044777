"""Evaluation: perplexity and bits per byte, multiple choice (HellaSwag), code metrics (in
`tinygpt.codeexec`, re-exported here), and the summary and comparison of training runs.

Every model function takes a tinygpt `GPT` or a Hugging Face causal LM (through `as_causal_lm`),
and a tinygpt `Tokenizer` or a Hugging Face tokenizer. Wrap a call in `Precision.autocast()` to
evaluate in bf16/fp16; log-probabilities are always taken in fp32.
"""
from __future__ import annotations

import bz2
import contextlib
import gzip
import itertools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .codeexec import (  # noqa: F401  (re-exported: the code metrics are part of evaluation)
    CodeProblem, DataFormatError, ExecResult, bleu, bleu_with_signature, check_completions, evaluate_code,
    extract_code, is_valid_python, load_humaneval, load_mbpp, pass_at_k, run_program, syntax_accuracy,
    truncate_at_stops, _progress,
)
from .model import IGNORE_INDEX

# Published zero-shot numbers (lm-evaluation-harness) to put beside a model's own.
HELLASWAG_REFERENCE = {"random": {"acc": 0.25, "acc_norm": 0.25},
                       "gpt2-124m": {"acc": 0.2892, "acc_norm": 0.3114}}


# --- models and tokenizers --------------------------------------------------------------------

@dataclass
class CausalLM:
    """What evaluation needs of a model: logits for token ids, the longest context, the device."""

    module: torch.nn.Module
    max_seq_len: int

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.module(idx)
        return out.logits if hasattr(out, "logits") else out  # Hugging Face returns a ModelOutput


def as_causal_lm(model: Any, max_seq_len: int | None = None) -> CausalLM:
    """Adapt a tinygpt `GPT` (logits from ``model(idx)``) or a Hugging Face causal LM (``.logits``,
    also under `peft`). The context comes from ``config.max_seq_len`` / ``max_position_embeddings``."""
    if isinstance(model, CausalLM):
        return model if max_seq_len is None else CausalLM(model.module, max_seq_len)
    if max_seq_len is None:
        cfg = getattr(model, "config", None)
        for name in ("max_seq_len", "max_position_embeddings", "n_positions"):
            if getattr(cfg, name, None):
                max_seq_len = int(getattr(cfg, name))
                break
        else:
            raise ValueError("cannot tell the model's context length; pass max_seq_len=")
    return CausalLM(model, max_seq_len)


def encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """text -> ids with no special tokens added, for a tinygpt or a Hugging Face tokenizer."""
    if hasattr(tokenizer, "eot_id"):
        return tokenizer.encode
    # verbose=False: a whole text is longer than model_max_length on purpose (it is cut into windows)
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
        x[i, :len(a)], y[i, :len(b)] = torch.tensor(a), torch.tensor(b)
    logits = lm.logits(x.to(lm.device))
    y = y.to(logits.device)
    return sum(float(F.cross_entropy(logits[i].float(), y[i], ignore_index=IGNORE_INDEX, reduction="sum"))
               for i in range(len(inputs)))  # one row at a time in fp32: a big vocabulary stays small


# --- perplexity and bits per byte -------------------------------------------------------------

def perplexity(model: Any, tokenizer: Any, text: str, window: int | None = None, stride: int | None = None,
               batch_size: int = 4, progress: bool = False) -> dict[str, Any]:
    """Token-level perplexity and bits per byte of `text`.

    With ``stride=None`` the text is cut into non-overlapping windows of `window` tokens (default:
    the model's context), each scored from an empty context. With a stride, windows start every
    `stride` tokens and only the tokens no earlier window scored count, so each one (past the
    first window) sees at least ``window - stride`` tokens of context: a lower, fairer perplexity
    for ``window / stride`` times the compute. ``stride == window`` is the non-overlapping case.
    Bits per byte = total nats / (ln 2 * UTF-8 bytes of the text): comparable across tokenizers.
    The text starts after the start token (`start_token`) so that its first token is scored too.
    Logits are (batch_size, window, vocab): lower both for a large vocabulary on a small GPU.
    """
    lm = as_causal_lm(model)
    window = window or lm.max_seq_len
    if not 1 <= window <= lm.max_seq_len:
        raise ValueError(f"window must be between 1 and the model's context {lm.max_seq_len}, got {window}")
    if stride is not None and not 1 <= stride <= window:
        raise ValueError(f"stride must be between 1 and window ({window}), got {stride}")
    step = stride or window
    start = start_token(tokenizer)
    ids = ([start] if start is not None else []) + encoder(tokenizer)(text)
    n_pred = len(ids) - 1  # ids[1:] are predicted; without a start token the first one is not
    if n_pred < 1:
        raise ValueError("the text is too short to score; give at least one token of text")
    spans, prev_end = [], 0  # (begin, end, first scored target): inputs ids[begin:end], targets ids[begin+1:end+1]
    for begin in range(0, n_pred, step):
        end = min(begin + window, n_pred)
        spans.append((begin, end, prev_end))
        prev_end = end
        if end == n_pred:
            break
    total = 0.0
    with _evaluating(lm.module):
        batches = [spans[i:i + batch_size] for i in range(0, len(spans), batch_size)]
        for batch in _progress(batches, len(batches), "perplexity", progress):
            inputs = [ids[b:e] for b, e, _ in batch]
            targets = [[IGNORE_INDEX] * (s - b) + ids[s + 1:e + 1] for b, e, s in batch]
            total += _nll_sum(lm, inputs, targets)
    n_bytes = len(text.encode("utf-8"))
    return {"mode": "non-overlapping" if stride in (None, window) else "sliding", "window": window,
            "stride": step, "windows": len(spans), "tokens": n_pred, "bytes": n_bytes,
            "first_token_scored": start is not None, "nll_nats": total, "loss": total / n_pred,
            "perplexity": math.exp(total / n_pred), "bits_per_byte": total / (math.log(2) * n_bytes)}


def _open_text(path: str | Path):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {path}")
    return {".gz": gzip.open, ".bz2": bz2.open}.get(path.suffix, open)(path, "rt", encoding="utf-8")


def read_text(path: str | Path, max_chars: int | None = None) -> str:
    """A UTF-8 text file (.txt, .gz or .bz2), at most `max_chars` characters of it."""
    with _open_text(path) as f:
        return f.read(max_chars) if max_chars else f.read()


# --- multiple choice: HellaSwag ---------------------------------------------------------------

@dataclass
class ChoiceItem:
    context: str
    endings: list[str]
    label: int


def load_hellaswag(path: str | Path, limit: int | None = None) -> list[ChoiceItem]:
    """HellaSwag items from a text file of six lines per item: context, gold index (0-3), four endings."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of items or None, got {limit}")
    hint = ("expected six lines per item: the context, the gold index (0-3), then the four endings "
            "(the format of klosax/hellaswag_text_data)")
    items: list[ChoiceItem] = []
    with _open_text(path) as f:
        lines = (line.rstrip("\n") for line in f)
        while limit is None or len(items) < limit:  # streamed: a small limit reads only what it needs
            group = list(itertools.islice(lines, 6))
            if not group or group == [""]:
                break
            first = 6 * len(items) + 1
            if len(group) < 6:
                raise DataFormatError(f"{path} ends with an incomplete item of {len(group)} lines at line {first}; {hint}")
            if group[1].strip() not in ("0", "1", "2", "3"):
                raise DataFormatError(f"{path} line {first + 1}: gold index {group[1][:40]!r} is not 0-3; {hint}")
            items.append(ChoiceItem(group[0], group[2:], int(group[1])))
    return items


def loglikelihoods(model: Any, tokenizer: Any, requests: Sequence[tuple[str, str]], batch_size: int = 16,
                   progress: bool = False) -> list[float]:
    """log P(continuation | context) in nats for each (context, continuation), summed over the
    continuation's tokens only. Tokenized as lm-evaluation-harness does: the continuation's tokens
    are those of context + continuation after the context's, and context trailing spaces move to
    the continuation; an empty context becomes the start token; too long inputs lose their left."""
    lm, encode, start = as_causal_lm(model), encoder(tokenizer), start_token(tokenizer)
    seqs = []
    for ctx, cont in requests:
        n_space = len(ctx) - len(ctx.rstrip(" "))
        if n_space:
            ctx, cont = ctx[:-n_space], ctx[-n_space:] + cont
        whole = encode(ctx + cont)
        ctx_ids = encode(ctx) if ctx else []
        cont_ids = whole[len(ctx_ids):]
        if not ctx_ids:
            if start is None:
                raise ValueError("an empty context needs a tokenizer with a BOS or EOS token")
            ctx_ids = [start]
        if not 1 <= len(cont_ids) <= lm.max_seq_len:
            raise ValueError(f"continuation {cont[:40]!r} has {len(cont_ids)} tokens; it needs 1 to {lm.max_seq_len}")
        seqs.append(((ctx_ids + cont_ids)[-(lm.max_seq_len + 1):], len(cont_ids)))
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))  # similar lengths pad less
    out = [0.0] * len(seqs)
    with _evaluating(lm.module):
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        for batch in _progress(batches, len(batches), "loglikelihood", progress):
            T = max(len(seqs[j][0]) for j in batch) - 1
            x = torch.zeros(len(batch), T, dtype=torch.long)
            for r, j in enumerate(batch):
                x[r, :len(seqs[j][0]) - 1] = torch.tensor(seqs[j][0][:-1])
            logits = lm.logits(x.to(lm.device))
            for r, j in enumerate(batch):
                seq, n = seqs[j]
                pos = torch.arange(len(seq) - 1 - n, len(seq) - 1, device=logits.device)
                logp = F.log_softmax(logits[r, pos].float(), dim=-1)
                tgt = torch.tensor(seq[-n:], device=logits.device)
                out[j] = float(logp.gather(1, tgt[:, None]).sum())
    return out


def multiple_choice(model: Any, tokenizer: Any, items: Sequence[ChoiceItem], batch_size: int = 16,
                    progress: bool = False) -> dict[str, Any]:
    """acc (highest log-likelihood) and acc_norm (log-likelihood / characters of the ending, as
    lm-evaluation-harness defines it); each ending is scored as " " + ending after the context."""
    if not items:
        raise ValueError("no items to score")
    requests = [(it.context, " " + e) for it in items for e in it.endings]
    lls = loglikelihoods(model, tokenizer, requests, batch_size, progress)
    correct = correct_norm = i = 0
    for it in items:
        ll = lls[i:i + len(it.endings)]
        i += len(it.endings)
        correct += max(range(len(ll)), key=lambda j: ll[j]) == it.label
        correct_norm += max(range(len(ll)), key=lambda j: ll[j] / max(len(it.endings[j]), 1)) == it.label
    n = len(items)
    acc, acc_norm = correct / n, correct_norm / n
    se = (lambda p: math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan"))
    return {"n": n, "acc": acc, "acc_stderr": se(acc), "acc_norm": acc_norm, "acc_norm_stderr": se(acc_norm)}


def hellaswag(model: Any, tokenizer: Any, path: str | Path, limit: int | None = None, batch_size: int = 16,
              progress: bool = False) -> dict[str, Any]:
    """HellaSwag accuracy on the first `limit` items of the validation file (all 10,042 by default)."""
    return {"task": "hellaswag", **multiple_choice(model, tokenizer, load_hellaswag(path, limit), batch_size,
                                                   progress), "reference": HELLASWAG_REFERENCE}


# --- runs: metrics, summary, comparison -------------------------------------------------------

def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl. A cut-off last line (a run killed mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a run folder that has trained and logged?")
    lines = [ln for ln in path.read_text(encoding="utf-8").split("\n") if ln.strip()]
    records = []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):
                break
            raise DataFormatError(f"{path} line {i} is not JSON ({e}); metrics.jsonl holds one JSON object per line") from e
    return records


def _run_info(run_dir: Path) -> dict[str, Any]:
    p = run_dir / "run.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def _tokens_per_step(info: dict[str, Any]) -> int | None:
    from .config import Recipe

    return Recipe.from_dict(info["recipe"]).train.tokens_per_step if "recipe" in info else None


def _tokens(m: dict[str, Any], per_step: int | None) -> int | None:
    # The trainer logs "tokens" (with the DDP world size); older records only have the step.
    if m.get("tokens") is not None:
        return int(m["tokens"])
    return m["step"] * per_step if per_step else None


def _diagnose(train: list[dict], val: list[dict]) -> list[str]:
    notes = []
    bad = [m for m in train if not math.isfinite(m["loss"])]
    if bad:
        notes.append(f"the loss became {bad[0]['loss']} at step {bad[0]['step']}: lower the learning rate or use "
                     "bf16/fp32 instead of fp16, and resume from the last checkpoint before it")
    good = [m["loss"] for m in train if math.isfinite(m["loss"])]
    if len(good) >= 3 and min(good[-3:]) >= good[0]:
        notes.append("the training loss has not decreased: check the learning rate (too high or too low) and the data")
    if len(val) >= 3:
        best = min(val, key=lambda m: m["val_loss"])
        if best is not val[-1] and val[-1]["val_loss"] > 1.02 * best["val_loss"]:
            notes.append(f"validation loss has risen since step {best['step']} ({best['val_loss']:.4g} -> "
                         f"{val[-1]['val_loss']:.4g}): overfitting; use best/, more data or fewer steps")
    norms = [(m["grad_norm"], m["step"]) for m in train if m.get("grad_norm") is not None]
    if len(norms) >= 5:
        med = statistics.median(n for n, _ in norms)
        top = max(norms)
        if med > 0 and top[0] > 10 * med:
            notes.append(f"gradient norm spike of {top[0]:.3g} at step {top[1]} (median {med:.3g}): "
                         "a lower learning rate or longer warmup may help")
    if len(good) >= 10:
        q = len(good) // 5
        if good[-1] < good[-q - 1] * 0.97:
            notes.append("the loss was still falling at the end: a longer run would likely help")
    return notes


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """The numbers of a run from metrics.jsonl and run.json, with a diagnosis (a list of findings)."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    info = _run_info(run_dir)
    per_step = _tokens_per_step(info)
    train = [m for m in records if m.get("loss") is not None]
    val = [m for m in records if m.get("val_loss") is not None]
    if not train:
        raise DataFormatError(f"{run_dir / 'metrics.jsonl'} has no record with a training loss yet")
    # The first interval includes start-up and compilation: leave it out of the speed figures.
    timed = [m for m in train[1:] or train if m.get("tokens_per_s")]

    def med(key: str) -> float | None:
        xs = [m[key] for m in timed if m.get(key) is not None]
        return statistics.median(xs) if xs else None

    best = min(val, key=lambda m: m["val_loss"]) if val else None
    mem = [m["memory_gb"] for m in records if m.get("memory_gb") is not None]
    return {
        "run": run_dir.name, "recipe": info.get("recipe", {}).get("name"), "steps": train[-1]["step"],
        "tokens_seen": _tokens(train[-1], per_step), "loss_first": train[0]["loss"], "loss_last": train[-1]["loss"],
        "loss_min": min(m["loss"] for m in train), "val_loss_last": val[-1]["val_loss"] if val else None,
        "val_loss_best": best["val_loss"] if best else None, "val_loss_best_step": best["step"] if best else None,
        "val_bits_per_token": best["val_loss"] / math.log(2) if best else None, "lr_last": train[-1].get("lr"),
        "tokens_per_s": med("tokens_per_s"), "mfu": med("mfu"), "memory_gb_max": max(mem) if mem else None,
        "grad_norm_max": max((m["grad_norm"] for m in train if m.get("grad_norm") is not None), default=None),
        "diagnosis": _diagnose(train, val) or ["no problems found"],
    }


def read_samples(run_dir: str | Path) -> str:
    """The generated samples a run wrote to samples.txt ("" when there are none)."""
    p = Path(run_dir) / "samples.txt"
    return p.read_text(encoding="utf-8") if p.is_file() else ""


def tokenizer_report(tokenizer: Any, texts: Sequence[str]) -> dict[str, Any]:
    """Compression of a tokenizer on some texts: characters and UTF-8 bytes per token."""
    encode = encoder(tokenizer)
    n_tokens = sum(len(encode(t)) for t in texts)
    return {"vocab_size": len(tokenizer.get_vocab()) if not hasattr(tokenizer, "eot_id") else tokenizer.vocab_size,
            "tokens": n_tokens, "chars_per_token": sum(map(len, texts)) / max(n_tokens, 1),
            "bytes_per_token": sum(len(t.encode("utf-8")) for t in texts) / max(n_tokens, 1)}


def _num_params(info: dict[str, Any]) -> int | None:
    if "recipe" not in info:
        return None
    from .config import Recipe
    from .model import GPT

    with torch.device("meta"):  # counts shapes without allocating a large model
        return GPT(Recipe.from_dict(info["recipe"]).model).num_params()


def compare_runs(run_dirs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """A table (one dict per run) of the runs' sizes and final metrics, ready for a DataFrame."""
    rows = []
    for d in run_dirs:
        s = summarize_run(d)
        rows.append({"run": s["run"], "recipe": s["recipe"], "params": _num_params(_run_info(Path(d))),
                     **{k: s[k] for k in ("steps", "tokens_seen", "loss_last", "val_loss_best", "tokens_per_s",
                                          "mfu", "memory_gb_max")}})
    return rows


def plot_runs(run_dirs: Sequence[str | Path], ax: Any = None, log_x: bool = False) -> Any:
    """Training (lines) and validation (dots) loss of several runs against tokens seen, on one
    matplotlib figure, which is returned."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plot_runs needs matplotlib: pip install matplotlib") from e
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(8, 5))
    for d in run_dirs:
        d = Path(d)
        per_step, records = _tokens_per_step(_run_info(d)), read_metrics(d)
        if per_step is None and not any("tokens" in m for m in records):
            raise DataFormatError(f"{d} has no run.json with a recipe and its metrics have no token counts; "
                                  "cannot put it on a tokens axis")
        train = [(_tokens(m, per_step), m["loss"]) for m in records if m.get("loss") is not None]
        val = [(_tokens(m, per_step), m["val_loss"]) for m in records if m.get("val_loss") is not None]
        (line,) = ax.plot(*zip(*train), label=f"{d.name} train") if train else ax.plot([], [])
        if val:
            ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{d.name} val")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats / token)")
    if log_x:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


# --- one entry point for the CLI and notebooks ------------------------------------------------

TASKS = ("perplexity", "hellaswag", "humaneval", "mbpp", "summary")


def run_eval(run_dir: str | Path, task: str, *, data: str | Path | None = None, which: str = "latest",
             device: str = "cpu", limit: int | None = None, window: int | None = None, stride: int | None = None,
             max_chars: int | None = None, batch_size: int | None = None, n: int = 1, ks: Sequence[int] = (1,),
             max_new_tokens: int = 384, temperature: float | None = None, progress: bool = False) -> dict[str, Any]:
    """Evaluate a tinygpt run folder, or a Hugging Face model folder (config.json), on one task:
    perplexity (`data`: a text file), hellaswag (`data`: hellaswag_val.txt[.bz2]), humaneval / mbpp
    (`data`: the problems file; pass@k for `ks` with `n` samples per problem, greedy by default for
    n == 1, temperature 0.8 for n > 1), or summary (a run's metrics.jsonl, no model needed)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if task == "summary":
        return summarize_run(run_dir)
    if data is None:
        raise ValueError(f"task {task} needs data=: the path of its data file")
    path = Path(run_dir)
    is_hf = (path / "config.json").is_file() and not (path / "run.json").is_file()
    if is_hf:
        from .hf import load_hf_causal_lm

        model, tok = load_hf_causal_lm(path, device)
        source = str(path)
    else:
        from .checkpoint import load_run

        model, tok, _, ckpt = load_run(path, which, device)
        source = str(ckpt)
    head = {"run": path.name, "checkpoint": source, "task": task, "data": str(data)}
    if task == "perplexity":
        return {**head, **perplexity(model, tok, read_text(data, max_chars), window, stride, batch_size or 4,
                                     progress)}
    if task == "hellaswag":
        return {**head, **hellaswag(model, tok, data, limit, batch_size or 16, progress)}
    problems = (load_humaneval(data) if task == "humaneval" else load_mbpp(data))[:limit]
    temperature = (0.0 if n == 1 else 0.8) if temperature is None else temperature
    if is_hf:
        from .hf import hf_generate_fn

        generate = hf_generate_fn(model, tok, max_new_tokens, temperature)
    else:
        from .generate import generate_text

        def generate(prompt: str) -> str:
            greedy = temperature == 0
            text = generate_text(model, tok, prompt, max_new_tokens, temperature=1.0 if greedy else temperature,
                                 top_k=1 if greedy else None)
            return text[len(prompt):]  # byte-level BPE decodes the prompt back exactly

    return {**head, "temperature": temperature, **evaluate_code(problems, generate, n, ks, progress=progress)}
