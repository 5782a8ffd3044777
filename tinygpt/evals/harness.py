"""What every evaluation task is made of: the `Task` record a task module declares, the `Request` a caller
makes (its fields are also `tinygpt eval`'s options, see `tinygpt.evals.options`), the model loaded once
for it (`load_for_eval`), text generation within the model's context, and the parts the code tasks share.

A task module (`tinygpt/evals/tasks/<name>.py`) holds its data sources, help, default sizes, scorer and
how its result prints, in one `TASK = Task(...)`; the registry (`tinygpt.evals.tasks.TASKS`) lists the
modules.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from tinygpt.core.config import Recipe
from tinygpt.core.options import option
from tinygpt.core.paths import shared_data_dir
from tinygpt.core.rundir import RunDir, RunDirError, read_json
from tinygpt.evals import code, sandbox
from tinygpt.finetune.lora import load_finetuned
from tinygpt.model.generate import generate_text
from tinygpt.model.hf import hf_generate_fn, load_hf_causal_lm
from tinygpt.model.loading import load_run


@dataclass(kw_only=True)
class Request:
    """What a caller asked for, the same for every task (each task reads the fields it uses). A field
    left None takes the task's default (`Task.defaults`). The fields with help are `tinygpt eval`'s options."""
    data: str | Path | None = option(None, help="the task's data file, or hf:NAME[:CONFIG][@SPLIT], e.g. "
                              "hf:wikitext:wikitext-2-raw-v1@test or hf:Rowan/hellaswag@validation (downloads from "
                              "the Hub); perplexity: default the run's own validation split, `builtin` the built-in "
                              "corpus's")
    limit: int | None = option(None, help="only the first N items or problems")
    window: int | None = option(None, help="perplexity: tokens per window (default: the context)")
    stride: int | None = option(None, help="perplexity: sliding-window stride (default: none)")
    max_chars: int | None = option(None, help="perplexity: score only the first N characters")
    batch_size: int | None = option(None, help="items per forward pass (default: the task's)")
    n: int = option(1, help="code tasks: samples per problem")
    k: tuple[int, ...] = option((1,), help="code tasks: pass@k for these k (each <= n)")
    max_new_tokens: int | None = option(None, help="tokens per completion (default: the task's, 384 for humaneval "
                                        "and mbpp)")
    temperature: float | None = option(None, help="code tasks (default: greedy for n=1, else 0.8)")
    unsafe_exec: bool = option(False, help="humaneval/mbpp: run generated code even where no kernel boundary is "
                               "available (rlimits only; use a throwaway VM)")
    progress: bool = False  # a bar while scoring
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
    """One evaluation task, declared in its own module as ``TASK``.

    `score(loaded, request) -> dict` scores a model (with ``needs_model=False``: ``score(run_dir, request)``,
    from the run folder alone). Its data: `data_help` says what ``--data`` must be (None: the task reads no
    data); `offline_file` is its name in the shared data folder and `hub` its Hugging Face name (`default_data`);
    `data_default` names what is scored without ``--data`` (None: ``--data`` is required); `keywords` are
    ``--data`` words the scorer reads itself. `defaults`: the `Request` fields it sets when the caller leaves
    them None (its sizes). Printing: the result's scalars as a table but `hidden`, then `more(result)`.
    `headline`: the scores a model card shows (fnmatch patterns; none: every number)."""
    name: str
    help: str                                            # one line for `tinygpt eval --help`
    score: Callable[[Any, Request], dict[str, Any]]
    data_help: str | None = None
    offline_file: str | None = None
    hub: str | None = None
    data_default: str | None = None
    keywords: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    needs_model: bool = True
    runs_code: bool = False                              # executes what the model writes (said first)
    check: Callable[[Request], None] | None = None       # refuses a request that cannot work, before loading
    hidden: tuple[str, ...] = ()
    more: Callable[[dict[str, Any]], list[str]] | None = None
    headline: tuple[str, ...] = ()


def default_data(task: Task, data_dir: str | Path | None = None) -> str:
    """Where a task's standard data set is: its offline file in `data_dir` (default `shared_data_dir()`)
    when it is there, else its Hugging Face Hub name."""
    d = Path(data_dir) if data_dir is not None else shared_data_dir()
    if task.offline_file and d is not None and (d / task.offline_file).is_file():
        return str(d / task.offline_file)
    if task.hub:
        return task.hub
    raise FileNotFoundError(f"no offline data for {task.name!r} in {d}; pass {task.data_help or 'a data file'}")


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


# --- generation ------------------------------------------------------------------------------------

def _context_length(m: Loaded) -> int | None:
    if not m.is_hf:
        return m.model.config.max_seq_len
    cfg = m.model.config
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def generator(m: Loaded, max_new_tokens: int, temperature: float) -> Callable[[str], str]:
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


# --- the code tasks (HumanEval, MBPP): generated code run against each problem's tests ---------------

def _check_code(r: Request) -> None:
    for k in r.k:
        code.pass_at_k(r.n, 0, k)  # raises for k > n, saying what to do
    if not r.unsafe_exec and sandbox.boundary().kind == "none":
        raise code.SandboxUnavailable(sandbox.unavailable_message())


def _per_problem(res: dict[str, Any]) -> list[str]:
    return [f"  {p['task_id']:<14} {p['passed']}/{p['n']} passed  {', '.join(p['statuses'])}"
            for p in res["per_problem"]]


def code_task(name: str, help: str, load: Callable[[str | Path], list[code.CodeProblem]], data_help: str,
              offline_file: str) -> Task:
    """A task that generates `n` completions per problem and runs them against its tests (`code.evaluate_code`):
    pass@k, syntax accuracy, BLEU; greedy for n == 1, temperature 0.8 above."""
    def score(m: Loaded, r: Request) -> dict[str, Any]:
        problems = load(r.data)[:r.limit]
        temperature = (0.0 if r.n == 1 else 0.8) if r.temperature is None else r.temperature
        generate = generator(m, r.max_new_tokens, temperature)
        return {"temperature": temperature, **code.evaluate_code(problems, generate, r.n, r.k, progress=r.progress,
                                                                 unsafe=r.unsafe_exec)}

    return Task(name, help, score, data_help, offline_file, runs_code=True, check=_check_code,
                defaults={"max_new_tokens": 384}, hidden=("per_problem",), more=_per_problem, headline=("pass@*",))
