"""Language-model metrics: perplexity and bits per byte, multiple choice (HellaSwag), and where the
standard evaluation data sets are (offline copy or Hub). Code metrics are in `tinygpt.evals.code`,
run summaries in `tinygpt.evals.runs`, the task registry behind `tinygpt eval` in `tinygpt.evals.tasks`.

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
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from tinygpt.core.config import DataConfig
from tinygpt.core.files import write_text_atomic
from tinygpt.core.paths import cache_root, hub_spec, is_hub, shared_data_dir
from tinygpt.core.units import duration
from tinygpt.evals.code import DataFormatError
from tinygpt.model.losses import IGNORE_INDEX
from tinygpt.train.data import iter_documents

# Published zero-shot numbers to put beside a model's own: GPT-2 124M through lm-evaluation-harness on all
# 10,042 validation items, so on the query text `hellaswag_query` builds (lm-eval's), scored as `multiple_choice` does.
HELLASWAG_REFERENCE = {"random": {"acc": 0.25, "acc_norm": 0.25},
                       "gpt2-124m": {"acc": 0.2892, "acc_norm": 0.3114}}
HELLASWAG_REFERENCE_SOURCE = "lm-evaluation-harness, zero-shot, all 10,042 validation items"


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


# --- time: said first when the work is long ----------------------------------------------------

LONG_SECONDS = 120.0  # an evaluation expected to take longer says so, with how to shorten it, before it goes on
SHORT_SECONDS = 180.0  # what the suggested shorter run aims at (a quarter of the whole, when that is less)


def _shorter(size: int, expected: float) -> int:
    """How much of `size` (characters, items) takes about `SHORT_SECONDS`, or a quarter of `expected`."""
    return _round_down(size * min(SHORT_SECONDS, expected / 4) / expected)


def _round_down(x: float) -> int:
    """`x` rounded down to one significant digit (a number a person would type): 237000 -> 200000."""
    if x < 1:
        return 1
    scale = 10 ** int(math.floor(math.log10(x)))
    return int(x // scale * scale)


def _run_batches(batches: list, run: Callable[[Any], None], desc: str, progress: bool,
                 say: Callable[[str], None] | None, describe: Callable[[float, float], str],
                 cost: Sequence[float] | None = None) -> None:
    """``run(batch)`` for every batch. The first two are timed before any bar is shown; when the whole is
    expected to take more than `LONG_SECONDS`, ``say(describe(expected_total_s, s_per_batch))`` comes first.
    The first batch warms up, so the rate is the second's, per unit of `cost` (e.g. tokens; default: one
    per batch) when batches differ in size."""
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
    rest = batches[done:]
    bar = None
    if progress and rest:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=n, initial=done, desc=desc, leave=False)  # gone when done: the result says it
        except ImportError:
            pass
    for b in rest:
        run(b)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


# --- perplexity and bits per byte -------------------------------------------------------------

def perplexity(model: Any, tokenizer: Any, text: str, window: int | None = None, stride: int | None = None,
               batch_size: int = 4, progress: bool = False,
               say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Token-level perplexity and bits per byte of `text`.

    With ``stride=None`` the text is cut into non-overlapping windows of `window` tokens (default:
    the model's context), each scored from an empty context. With a stride, windows start every
    `stride` tokens and only the tokens no earlier window scored count, so each one (past the
    first window) sees at least ``window - stride`` tokens of context: a lower, fairer perplexity
    for ``window / stride`` times the compute. ``stride == window`` is the non-overlapping case.
    Bits per byte = total nats / (ln 2 * UTF-8 bytes of the text): comparable across tokenizers.
    The text starts after the start token (`start_token`) so that its first token is scored too.
    Logits are (batch_size, window, vocab): lower both for a large vocabulary on a small GPU.
    A text expected to take over `LONG_SECONDS` is first said with its time and a shorter ``--max-chars``
    (`_shorter`), through `say` (measured on the first batches; see `_run_batches`).
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
    n_bytes = len(text.encode("utf-8"))

    def run(batch) -> None:
        nonlocal total
        inputs = [ids[b:e] for b, e, _ in batch]
        targets = [[IGNORE_INDEX] * (s - b) + ids[s + 1:e + 1] for b, e, s in batch]
        total += _nll_sum(lm, inputs, targets)

    def describe(expected: float, per_batch: float) -> str:
        chars = _shorter(len(text), expected)
        how = f"stride {step}" if step != window else "non-overlapping"
        return (f"perplexity over {n_bytes / 1e6:.1f} MB ({len(spans):,} windows of {window} tokens, {how}): about "
                f"{duration(expected)} on this {lm.device.type.upper()}; --max-chars {chars} takes about "
                f"{duration(expected * chars / len(text))}")

    with _evaluating(lm.module):
        batches = [spans[i:i + batch_size] for i in range(0, len(spans), batch_size)]
        _run_batches(batches, run, "perplexity", progress, say, describe)
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


def hellaswag_preprocess(text: str) -> str:
    """lm-evaluation-harness's clean-up of HellaSwag text (its hellaswag task's ``preprocess``), rule for rule:
    strip; " [title]" (a WikiHow step title) becomes ". "; every other ``[...]`` fragment goes (the
    layout markers [header], [step], [substeps] and bracketed asides alike); then one pass that turns
    each double space into one."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_query(activity_label: str, ctx_a: str, ctx_b: str) -> str:
    """The text an item's endings are scored after, built as lm-evaluation-harness builds it:
    ``preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())``."""
    return hellaswag_preprocess(f"{activity_label}: {ctx_a} {ctx_b.capitalize()}")


def hellaswag_item(record: dict[str, Any]) -> ChoiceItem:
    """A HellaSwag record (rowanz/hellaswag's JSONL, or the Hub's Rowan/hellaswag: activity_label,
    ctx_a, ctx_b, endings, label) as the item lm-evaluation-harness scores: its query and its four
    preprocessed endings."""
    try:
        endings, label = record["endings"], str(record["label"]).strip()
        query = hellaswag_query(record["activity_label"], record["ctx_a"], record["ctx_b"])
    except KeyError as e:
        raise DataFormatError(f"HellaSwag record {record.get('ind')} has no {e.args[0]!r}; records need "
                              "activity_label, ctx_a, ctx_b, endings and label (rowanz/hellaswag's format)") from None
    if len(endings) != 4 or label not in ("0", "1", "2", "3"):
        raise DataFormatError(f"HellaSwag record {record.get('ind')} needs four endings and a label 0-3")
    return ChoiceItem(query, [hellaswag_preprocess(e) for e in endings], int(label))


_SENTENCE_END = re.compile(r"[.!?] ")
# The activity labels of HellaSwag's WikiHow items (WikiHow's categories); every other label is an
# ActivityNet activity. A WikiHow item's ctx_b is empty.
WIKIHOW_LABELS = frozenset({
    "Arts and Entertainment", "Cars & Other Vehicles", "Computers and Electronics", "Education and Communications",
    "Family Life", "Finance and Business", "Food and Entertaining", "Health", "Hobbies and Crafts",
    "Holidays and Traditions", "Home and Garden", "Home,Categories", "Personal Care and Style", "Pets and Animals",
    "Philosophy and Religion", "Relationships", "Sports and Fitness", "Travel", "Uncategorized", "Work World",
    "Youth"})


def _six_line_query(line: str) -> str:
    """lm-evaluation-harness's query from a six-line file's context line (klosax/hellaswag_text_data).

    That line is ``activity_label + ": " + ctx``, where ctx is the data set's ``ctx_a + " " + ctx_b`` with
    ctx_b as written (lower case) and " [title]" already a sentence end, but other brackets kept. So
    lm-eval's ``preprocess`` is applied again (it changes nothing it already did), and ctx_b is
    capitalised. The line does not mark where ctx_b begins. In HellaSwag a WikiHow item's ctx_b is empty
    (its label is one of `WIKIHOW_LABELS`), and an ActivityNet item's is the start of the sentence after
    ctx_a, which ends a sentence: so ctx_b is what follows the last sentence end of an ActivityNet
    context. A JSONL file of the records (`hellaswag_item`) needs no such rule.
    """
    label, sep, ctx = hellaswag_preprocess(line).partition(": ")
    ends = [m.end() for m in _SENTENCE_END.finditer(ctx)]
    if sep and ends and label not in WIKIHOW_LABELS:
        ctx = ctx[:ends[-1]] + ctx[ends[-1]:].capitalize()
    return label + sep + ctx


def _is_jsonl(path: Path) -> bool:
    return ".jsonl" in path.suffixes or ".json" in path.suffixes


def load_hellaswag(path: str | Path, limit: int | None = None) -> list[ChoiceItem]:
    """HellaSwag items, their text as lm-evaluation-harness builds it (`hellaswag_query`), from either
    a JSONL file of the data set's records (rowanz/hellaswag's hellaswag_val.jsonl, .gz or .bz2; exact),
    or a text file of six lines per item: context, gold index (0-3), four endings
    (klosax/hellaswag_text_data, the offline copy; see `_six_line_query`)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of items or None, got {limit}")
    path = Path(path)
    items: list[ChoiceItem] = []
    if _is_jsonl(path):
        with _open_text(path) as f:
            for n, line in enumerate(f, 1):
                if limit is not None and len(items) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DataFormatError(f"{path} line {n} is not JSON ({e}); expected one HellaSwag record per "
                                          "line (rowanz/hellaswag's hellaswag_val.jsonl)") from None
                items.append(hellaswag_item(record))
        return items
    hint = ("expected six lines per item: the context, the gold index (0-3), then the four endings "
            "(the format of klosax/hellaswag_text_data), or a .jsonl file of HellaSwag records")
    with _open_text(path) as f:
        lines = (line.rstrip("\n") for line in f)
        while limit is None or len(items) < limit:  # streamed: a small limit reads only what it needs
            group = list(itertools.islice(lines, 6))
            if not group or group == [""]:
                break
            first = 6 * len(items) + 1
            if len(group) < 6:
                raise DataFormatError(f"{path} ends with an incomplete item of {len(group)} lines at line "
                                      f"{first}; {hint}")
            if group[1].strip() not in ("0", "1", "2", "3"):
                raise DataFormatError(f"{path} line {first + 1}: gold index {group[1][:40]!r} is not 0-3; {hint}")
            items.append(ChoiceItem(_six_line_query(group[0]), [hellaswag_preprocess(e) for e in group[2:]],
                                    int(group[1])))
    return items


def loglikelihoods(model: Any, tokenizer: Any, requests: Sequence[tuple[str, str]], batch_size: int = 16,
                   progress: bool = False, say: Callable[[str], None] | None = None,
                   describe: Callable[[float, float], str] | None = None) -> list[float]:
    """log P(continuation | context) in nats for each (context, continuation), summed over the
    continuation's tokens only. Tokenized as lm-evaluation-harness does: the continuation's tokens
    are those of context + continuation after the context's, and context trailing spaces move to
    the continuation; an empty context becomes the start token; too long inputs lose their left.
    `say` and `describe`: as in `_run_batches` (a long run says its expected time first)."""
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

    def run(batch) -> None:
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

    if describe is None:
        def describe(expected: float, per_batch: float) -> str:
            return (f"{len(seqs):,} log-likelihoods: about {duration(expected)} on this "
                    f"{lm.device.type.upper()}")
    with _evaluating(lm.module):
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        cost = [len(b) * max(len(seqs[j][0]) for j in b) for b in batches]  # padded tokens: longest first
        _run_batches(batches, run, "loglikelihood", progress, say, describe, cost)
    return out


def multiple_choice(model: Any, tokenizer: Any, items: Sequence[ChoiceItem], batch_size: int = 16,
                    progress: bool = False, say: Callable[[str], None] | None = None,
                    name: str = "multiple choice") -> dict[str, Any]:
    """acc (highest log-likelihood) and acc_norm (log-likelihood / characters of the ending, as
    lm-evaluation-harness defines it); each ending is scored as " " + ending after the context."""
    if not items:
        raise ValueError("no items to score")
    requests = [(it.context, " " + e) for it in items for e in it.endings]

    def describe(expected: float, per_batch: float) -> str:
        limit = _shorter(len(items), expected)
        return (f"{name} over {len(items):,} items: about {duration(expected)} on this "
                f"{as_causal_lm(model).device.type.upper()}; --limit {limit} takes about "
                f"{duration(expected * limit / len(items))}")

    lls = loglikelihoods(model, tokenizer, requests, batch_size, progress, say, describe)
    correct = correct_norm = i = 0
    for it in items:
        ll = lls[i:i + len(it.endings)]
        i += len(it.endings)
        correct += max(range(len(ll)), key=lambda j: ll[j]) == it.label
        correct_norm += max(range(len(ll)), key=lambda j: ll[j] / max(len(it.endings[j]), 1)) == it.label
    n = len(items)
    acc, acc_norm = correct / n, correct_norm / n
    def se(p: float) -> float:  # the standard error of a proportion over n items
        return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")

    return {"n": n, "acc": acc, "acc_stderr": se(acc), "acc_norm": acc_norm, "acc_norm_stderr": se(acc_norm)}


def hellaswag(model: Any, tokenizer: Any, path: str | Path, limit: int | None = None, batch_size: int = 16,
              progress: bool = False, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """HellaSwag accuracy on the first `limit` items of the validation file (all 10,042 by default), on
    lm-evaluation-harness's query text (`load_hellaswag`), with the published reference figures."""
    return {"task": "hellaswag", **multiple_choice(model, tokenizer, load_hellaswag(path, limit), batch_size,
                                                   progress, say, "hellaswag"), "reference": HELLASWAG_REFERENCE,
            "reference_source": HELLASWAG_REFERENCE_SOURCE}


def hellaswag_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Table rows: each HellaSwag result (of `hellaswag` or `run_eval`) above the published reference numbers."""
    rows = [{"model": r.get("run", "model"), "items": r["n"], "acc": r["acc"], "acc_norm": r["acc_norm"],
             "acc_norm_stderr": r["acc_norm_stderr"]} for r in results]
    return rows + [{"model": f"{name} (published)", "items": 10042, **ref} for name, ref in HELLASWAG_REFERENCE.items()]


def tokenizer_report(tokenizer: Any, texts: Sequence[str]) -> dict[str, Any]:
    """Compression of a tokenizer on some texts: characters and UTF-8 bytes per token."""
    encode = encoder(tokenizer)
    n_tokens = sum(len(encode(t)) for t in texts)
    return {"vocab_size": len(tokenizer.get_vocab()) if not hasattr(tokenizer, "eot_id") else tokenizer.vocab_size,
            "tokens": n_tokens, "chars_per_token": sum(map(len, texts)) / max(n_tokens, 1),
            "bytes_per_token": sum(len(t.encode("utf-8")) for t in texts) / max(n_tokens, 1)}


# --- evaluation data: the offline copy when there is one, else the Hugging Face Hub ------------

WIKITEXT2_TEST_HUB = "hf:wikitext:wikitext-2-raw-v1@test"
HELLASWAG_HUB = "hf:Rowan/hellaswag@validation"
OFFLINE_FILES = {"perplexity": "wikitext2_test.txt", "hellaswag": "hellaswag_val.txt.bz2",
                 "humaneval": "HumanEval.jsonl.gz", "mbpp": "mbpp.jsonl"}
HUB_DATA = {"perplexity": WIKITEXT2_TEST_HUB, "hellaswag": HELLASWAG_HUB}
DATA_HELP = {"perplexity": "a text file, e.g. the WikiText-2 test file wikitext2_test.txt, or "
                            f"{WIKITEXT2_TEST_HUB} to read it from the Hugging Face Hub (needs datasets)",
             "hellaswag": "the validation file hellaswag_val.txt[.bz2] (six lines per item, from the Hub dataset "
                          "klosax/hellaswag_text_data), rowanz/hellaswag's hellaswag_val.jsonl, or "
                          f"{HELLASWAG_HUB} to download it (needs datasets)",
             "humaneval": "HumanEval.jsonl[.gz] (github.com/openai/human-eval, data/)",
             "mbpp": "mbpp.jsonl (github.com/google-research/google-research, mbpp/)"}


def eval_data(task: str, data_dir: str | Path | None = None) -> str:
    """Where a task's standard data set is: the offline file in `data_dir` (default
    `shared_data_dir()`) when it is there, else its Hugging Face Hub name for `run_eval`."""
    d = Path(data_dir) if data_dir is not None else shared_data_dir()
    if task in OFFLINE_FILES and d is not None and (d / OFFLINE_FILES[task]).is_file():
        return str(d / OFFLINE_FILES[task])
    if task in HUB_DATA:
        return HUB_DATA[task]
    raise FileNotFoundError(f"no offline data for {task!r} in {d}; pass {DATA_HELP.get(task, 'a data file')}")


def load_eval_text(data: str | Path, max_chars: int | None = None) -> str:
    """A text to score: a file (.txt, .gz, .bz2), or a Hugging Face dataset (hf:NAME[:CONFIG][@SPLIT],
    or a save_to_disk folder) whose records are joined as they are (WikiText's records are its lines)."""
    if is_hub(data) or Path(data).is_dir():
        with _from_hub(str(data), "perplexity"):
            return "".join(iter_documents(DataConfig(source=str(data), max_chars=max_chars)))
    return read_text(data, max_chars)


@contextlib.contextmanager
def _from_hub(spec: str, task: str):
    try:
        yield
    except OSError as e:  # ConnectionError and the Hub client's HTTP errors: say what works offline
        if not is_hub(spec):
            raise
        raise RuntimeError(f"could not read {spec} from the Hugging Face Hub ({e}); with no network, "
                           f"pass a local file instead: {DATA_HELP[task].split(', or ')[0]}") from e


def wikitext2_test_text(max_chars: int | None = None, data_dir: str | Path | None = None) -> str:
    """The WikiText-2 test text: the offline file when present, else the raw variant from the Hub."""
    return load_eval_text(eval_data("perplexity", data_dir), max_chars)


def hellaswag_path(data: str | Path | None = None, cache_dir: str | Path | None = None) -> Path:
    """A HellaSwag file for `load_hellaswag`: `data` when it is a path; the offline copy (or the
    Hub) when it is None; for hf:NAME[@SPLIT], that dataset's records written once into `cache_dir` as JSONL
    (each checked by `hellaswag_item`), so the query text is built from ctx_a and ctx_b exactly."""
    spec = str(data) if data is not None else eval_data("hellaswag")
    if not is_hub(spec):
        return Path(spec)
    name, _, split = hub_spec(spec)
    split = split or "validation"
    root = Path(cache_dir or cache_root("eval"))
    out = root / f"hellaswag-{name.replace('/', '--')}-{split}.jsonl"
    if not out.is_file():
        try:
            import datasets
        except ImportError as e:
            raise ImportError(f"{spec} needs `pip install datasets`; or pass {DATA_HELP['hellaswag']}") from e
        with _from_hub(spec, "hellaswag"):
            fields = ("ind", "activity_label", "ctx_a", "ctx_b", "label", "endings")
            records = [{k: rec[k] for k in fields if k in rec} for rec in datasets.load_dataset(name, split=split)]
        for rec in records:
            hellaswag_item(rec)  # a record that cannot be scored (the test split has no labels) is refused now
        text = "".join(json.dumps(rec) + "\n" for rec in records)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, text)  # whole or not at all: a cut-off download is not taken for the data set
    return out
