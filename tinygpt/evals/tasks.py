"""The evaluation tasks, one registry: `tinygpt eval --task`, `run_eval` and the notebooks read it.

A new task is one function (in its own module when it is more than a few lines) and one entry in
`TASKS`: its name, what data it needs, and how it scores a loaded model. `run_eval` loads the model
once (a tinygpt run, a finetuning run with its adapter folded in, or a Hugging Face folder).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tinygpt.core.config import Recipe
from tinygpt.core.paths import is_hub
from tinygpt.core.rundir import EVALS_JSONL, RunDir, RunDirError, read_json
from tinygpt.evals import code, lm, sandbox
from tinygpt.evals.runs import summarize_run
from tinygpt.finetune.lora import load_finetuned
from tinygpt.model.generate import generate_text
from tinygpt.model.hf import hf_generate_fn, load_hf_causal_lm
from tinygpt.model.loading import load_run
from tinygpt.train.data import validation_text


@dataclass
class Request:
    """What a caller asked for, the same for every task (each task reads the fields it uses)."""
    data: str | Path | None = None
    limit: int | None = None
    window: int | None = None
    stride: int | None = None
    max_chars: int | None = None
    batch_size: int | None = None
    n: int = 1
    ks: Sequence[int] = (1,)
    max_new_tokens: int = 384
    temperature: float | None = None
    progress: bool = False
    unsafe_exec: bool = False  # code tasks: run generated code even with no kernel boundary (sandbox.py)
    say: Callable[[str], None] | None = None  # one-line notes before long work (expected time, a window too long)


@dataclass
class Loaded:
    """A model loaded for evaluation and where it came from."""
    model: Any
    tokenizer: Any
    source: str
    is_hf: bool
    recipe: Recipe | None = None  # a tinygpt run's recipe: its data and context are the defaults


@dataclass(frozen=True)
class Task:
    name: str
    help: str                                             # one line for `tinygpt eval --help`
    data_help: str | None                                 # what --data must be; None: the task needs no data
    score: Callable[[Loaded, Request], dict[str, Any]] | None  # None: needs no model (reads the run folder)
    runs_code: bool = False                               # executes what the model writes (said first)
    data_optional: bool = False                           # a tinygpt run brings its own (validation split)


def _perplexity(m: Loaded, r: Request) -> dict[str, Any]:
    """On `data`; with no data, on the run's own validation split (text it never trained on);
    `builtin`: the built-in corpus's validation split. The window defaults to the run's context."""
    if r.data is None or str(r.data) in ("builtin", "stdlib"):
        if m.recipe is None:
            raise ValueError(f"perplexity of {m.source} needs --data: {lm.DATA_HELP['perplexity']}")
        cfg = m.recipe.data if r.data is None else dataclasses.replace(m.recipe.data, source="builtin",
                                                                       max_chars=None)
        text = validation_text(cfg, r.max_chars)
    else:
        text = lm.load_eval_text(r.data, r.max_chars)
    trained = m.recipe.train.seq_len if m.recipe is not None else None
    if r.window and trained and r.window > trained and r.say is not None:
        r.say(f"--window {r.window} is beyond the context this model was trained at ({trained} tokens): positions "
              f"past {trained} were never trained, so the perplexity will be worse than the model's; --window "
              f"{trained} measures the model as trained")
    window = r.window or trained
    return lm.perplexity(m.model, m.tokenizer, text, window, r.stride, r.batch_size or 4, r.progress, r.say)


def _hellaswag(m: Loaded, r: Request) -> dict[str, Any]:
    return lm.hellaswag(m.model, m.tokenizer, lm.hellaswag_path(r.data), r.limit, r.batch_size or 16, r.progress,
                        r.say)


def _context_length(m: Loaded) -> int | None:
    if not m.is_hf:
        return m.model.config.max_seq_len
    cfg = m.model.config
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def _generator(m: Loaded, max_new_tokens: int, temperature: float) -> Callable[[str], str]:
    """`generate(prompt) -> completion`, stopping at the model's context: a prompt that fills it gets an
    empty completion, and the first one cut short is said in one line (no library's reminder)."""
    context = _context_length(m)
    said = []

    def room(prompt: str) -> int:
        if context is None:
            return max_new_tokens
        left = context - len(m.tokenizer.encode(prompt))
        if left < max_new_tokens and not said:
            said.append(True)
            print(f"note: a prompt of {context - left} tokens leaves {max(left, 0)} of the model's {context}-token "
                  f"context: its completion stops there (--max-new-tokens {max_new_tokens})", file=sys.stderr,
                  flush=True)
        return min(max_new_tokens, left)

    def generate(prompt: str) -> str:
        n = room(prompt)
        if n < 1:
            return ""
        if m.is_hf:
            return hf_generate_fn(m.model, m.tokenizer, n, temperature)(prompt)
        greedy = temperature == 0
        text = generate_text(m.model, m.tokenizer, prompt, n, temperature=1.0 if greedy else temperature,
                             top_k=1 if greedy else None)
        return text[len(prompt):]  # byte-level BPE decodes the prompt back exactly

    return generate


def _code_task(load: Callable[[str | Path], list[code.CodeProblem]]):
    def score(m: Loaded, r: Request) -> dict[str, Any]:
        problems = load(r.data)[:r.limit]
        temperature = (0.0 if r.n == 1 else 0.8) if r.temperature is None else r.temperature
        generate = _generator(m, r.max_new_tokens, temperature)
        return {"temperature": temperature, **code.evaluate_code(problems, generate, r.n, r.ks, progress=r.progress,
                                                                 unsafe=r.unsafe_exec)}
    return score


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("perplexity", "perplexity and bits per byte of a text (default: the run's own validation split)",
         lm.DATA_HELP["perplexity"], _perplexity, data_optional=True),
    Task("hellaswag", "HellaSwag accuracy (acc and acc_norm)", lm.DATA_HELP["hellaswag"], _hellaswag),
    Task("humaneval", "HumanEval pass@k (runs generated code)", lm.DATA_HELP["humaneval"],
         _code_task(code.load_humaneval), runs_code=True),
    Task("mbpp", "MBPP pass@k on problems 11-510 (runs generated code)", lm.DATA_HELP["mbpp"],
         _code_task(code.load_mbpp), runs_code=True),
    Task("summary", "a run's metrics.jsonl summarised, with a diagnosis (no model)", None, None),
)}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def check_request(task: Task, r: Request) -> None:
    """Refuse a request that cannot work before any model is loaded."""
    for name in ("limit", "max_chars", "batch_size"):
        v = getattr(r, name)
        if v is not None and v < 1:
            raise ValueError(f"{name} must be a positive number (or left out), got {v}")
    if task.data_help is None or (task.data_optional and (r.data is None or str(r.data) in ("builtin", "stdlib"))):
        return
    if r.data is None:
        raise ValueError(f"task {task.name} needs data (--data): {task.data_help}")
    if not is_hub(r.data) and not Path(r.data).exists():
        raise FileNotFoundError(f"no data file at {r.data}; task {task.name} needs {task.data_help}")
    if task.name in ("humaneval", "mbpp"):
        for k in r.ks:
            code.pass_at_k(r.n, 0, k)  # raises for k > n, saying what to do
    if task.runs_code and not r.unsafe_exec and sandbox.boundary().kind == "none":
        raise code.SandboxUnavailable(sandbox.unavailable_message())


def load_for_eval(path: str | Path, which: str = "latest", device: str = "cpu") -> Loaded:
    """A tinygpt run folder, a finetuning run (its adapter folded into the base: plain model speed),
    or a Hugging Face model folder (config.json)."""
    run = RunDir(path)
    if run.is_finetune_run():
        model, tok = load_finetuned(run.path, merge=True, device=device)
        return Loaded(model, tok, str(run.path), True)
    if (run / "config.json").is_file() and not run.is_pretrain_run():
        config = read_json(run / "config.json")  # a garbled config.json: one line that names it
        if not isinstance(config, dict) or "model_type" not in config:
            raise RunDirError(f"{run / 'config.json'} is not a Hugging Face model config (no model_type); export "
                              "the model again, or point at a tinygpt run folder")
        model, tok = load_hf_causal_lm(run.path, device)
        return Loaded(model, tok, str(run.path), True)
    model, tok, recipe, ckpt = load_run(run.path, which, device)
    return Loaded(model, tok, str(ckpt), False, recipe)


def run_eval(run_dir: str | Path, task: str, *, which: str = "latest", device: str = "cpu",
             **request: Any) -> dict[str, Any]:
    """Evaluate a run folder (see `load_for_eval`) on one task of `TASKS`; `request` holds the fields of
    `Request` (data, limit, window, stride, max_chars, batch_size, n, ks, max_new_tokens, temperature,
    progress, unsafe_exec, say: a function given one-line notes before long work, e.g. `print`). Perplexity:
    `data` a text file or hf:NAME[:CONFIG][@SPLIT] (see `lm.eval_data`);
    hellaswag: hellaswag_val.txt[.bz2] or hf:Rowan/hellaswag@validation; humaneval / mbpp: the problems
    file, pass@k for `ks` with `n` samples per problem, greedy for n == 1 and temperature 0.8 above."""
    t = get_task(task)
    if t.score is None:
        return summarize_run(run_dir)
    r = Request(**request)
    check_request(t, r)
    loaded = load_for_eval(run_dir, which, device)
    data = str(r.data) if r.data is not None else "the run's validation split"
    head = {"run": Path(run_dir).name, "checkpoint": loaded.source, "task": task, "data": data}
    result = {**head, **t.score(loaded, r)}
    record_eval(run_dir, result)
    return result


def record_eval(run_dir: str | Path, result: dict[str, Any]) -> None:
    """Append a result's scalar figures to the run folder's evals.jsonl (tinygpt runs only, not a
    Hugging Face folder): what was evaluated, on what, and the scores."""
    run = RunDir(run_dir)
    if not (run.is_pretrain_run() or run.is_finetune_run()):
        return
    keep = ("run", "checkpoint", "task", "data")
    scores = {k: v for k, v in result.items() if k not in keep and isinstance(v, (int, float, str, bool))}
    record = {**{k: result[k] for k in keep}, "scores": scores,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        with open(run.path / EVALS_JSONL, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:  # a read-only folder (someone else's run): the result is still returned
        warnings.warn(f"the result was not recorded in {run.path / EVALS_JSONL}: {e.strerror or e}", stacklevel=2)
