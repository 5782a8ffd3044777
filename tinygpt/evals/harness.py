"""What every evaluation task is made of: the `Task` record a task module declares, the `Request` a
caller makes (its fields are also `tinygpt eval`'s options, see `tinygpt.evals.eval_options`), the
model loaded once for it (`load_for_eval`), text generation within the model's context, and the
parts the code tasks share.

A task module (`tinygpt/evals/tasks/<name>.py`) holds its data sources, help, default sizes, scorer
and how its result prints, in one `TASK = Task(...)`; the registry (`tinygpt.evals.tasks.TASKS`)
lists the modules."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from tinygpt.core.options import option
from tinygpt.core.paths import SAMPLE_PREFIX, shared_data_dir
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import RunDir, RunDirError, read_json
from tinygpt.evals import code, sandbox
from tinygpt.finetune.lora import load_finetuned
from tinygpt.model.generate import generate
from tinygpt.model.hf import load_hf_causal_lm
from tinygpt.model.loading import load_run


@dataclass(kw_only=True)
class Request:
    """What a caller asked for, the same for every task (each task reads the fields it uses). A
    field left None takes the task's default (`Task.defaults`). The fields with help are `tinygpt
    eval`'s options."""

    data: str | Path | None = option(
        None,
        help="the task's data file, sample:NAME (a sample that ships with tinygpt: wikitext2, "
        "hellaswag, mbpp, humaneval), or hf:NAME[:CONFIG][@SPLIT], e.g. "
        "hf:wikitext:wikitext-2-raw-v1@test or hf:Rowan/hellaswag@validation (downloads from the "
        "Hub); perplexity: default the run's own validation split, `builtin` the built-in corpus's",
    )
    limit: int | None = option(None, help="only the first N items or problems")
    window: int | None = option(None, help="perplexity: tokens per window (default: the context)")
    stride: int | None = option(None, help="perplexity: sliding-window stride (default: none)")
    max_chars: int | None = option(None, help="perplexity: score only the first N characters")
    batch_size: int | None = option(None, help="items per forward pass (default: the task's)")
    n: int = option(1, help="code tasks: samples per problem")
    k: tuple[int, ...] = option((1,), help="code tasks: pass@k for these k (each <= n)")
    max_new_tokens: int | None = option(
        None, help="tokens per completion (default: the task's, 384 for humaneval and mbpp)"
    )
    temperature: float | None = option(None, help="code tasks (default: greedy for n=1, else 0.8)")
    unsafe_exec: bool = option(
        False,
        help="humaneval/mbpp: run generated code even where no kernel boundary is "
        "available (rlimits only; use a throwaway VM)",
    )
    progress: bool = False  # a bar while scoring
    say: Callable[[str], None] | None = None  # notes before long work (time, a window too long)


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

    `score(loaded, request) -> dict` scores a model (with ``needs_model=False``: ``score(run_dir,
    request)``, from the run folder alone). Its data: `data_help` says what ``--data`` must be
    (None: the task reads no data); `offline_file` is its name in the shared data folder, `hub` its
    Hugging Face name and `sample` the name of its sample that ships with the package
    (`default_data`); `data_default` names what is scored without ``--data`` (None: ``--data`` is
    required); `keywords` are ``--data`` words the scorer reads itself. `defaults`: the `Request`
    fields it sets when the caller leaves them None (its sizes). Printing: the result's scalars as a
    table but `hidden`, then `more(result)`. `headline`: the scores a model card shows (fnmatch
    patterns; none: every number)."""

    name: str
    help: str  # one line for `tinygpt eval --help`
    score: Callable[[Any, Request], dict[str, Any]]
    data_help: str | None = None
    offline_file: str | None = None
    hub: str | None = None
    sample: str | None = None  # its sample that ships with tinygpt (sample:NAME)
    data_default: str | None = None
    keywords: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    needs_model: bool = True
    runs_code: bool = False  # executes what the model writes (said first)
    check: Callable[[Request], None] | None = None  # refuses what cannot work, before loading
    hidden: tuple[str, ...] = ()
    more: Callable[[dict[str, Any]], list[str]] | None = None
    headline: tuple[str, ...] = ()


def default_data(task: Task, data_dir: str | Path | None = None, sample: bool = False) -> str:
    """Where a task's standard data set is: its offline file in `data_dir` (default
    `shared_data_dir()`) when it is there, else its Hugging Face Hub name; with `sample`, the sample
    that ships with the package (``sample:NAME``: no network, no data folder)."""
    if sample and task.sample:
        return SAMPLE_PREFIX + task.sample
    d = Path(data_dir) if data_dir is not None else shared_data_dir()
    if task.offline_file and d is not None and (d / task.offline_file).is_file():
        return str(d / task.offline_file)
    if task.hub:
        return task.hub
    raise FileNotFoundError(
        f"no offline data for {task.name!r} in {d}; pass {task.data_help or 'a data file'}"
    )


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
            raise RunDirError(
                f"{run / 'config.json'} is not a Hugging Face model config (no model_type); export "
                "the model again, or point at a tinygpt run folder"
            )
        model, tok = load_hf_causal_lm(run.path, device)
        return Loaded(model, tok, str(run.path), True)
    model, tok, recipe, ckpt = load_run(run.path, which, device)
    return Loaded(model, tok, str(ckpt), False, recipe)


# --- generation -----------------------------------------------------------------------------------


def context_length(m: Loaded) -> int | None:
    """The context the model can read: the one a tinygpt run trained at (its position table may be
    longer), else the model config's."""
    if not m.is_hf:
        trained = m.recipe.train.seq_len if m.recipe is not None else m.model.config.max_seq_len
        return min(trained, m.model.config.max_seq_len)
    cfg = m.model.config
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


CHUNK = 32  # new tokens between two looks for the end of the answer


def _opens(text: str) -> bool:
    """Whether text can begin a line of a function's body: indented, no line end before its code."""
    line, end, _ = text.partition("\n")
    return line[:1] in (" ", "\t") and "\r" not in line and (not end or bool(line.strip()))


def _note(line: str) -> None:
    """One line on stderr, above a progress bar rather than through it."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(line, file=sys.stderr, flush=True)
    else:
        tqdm.write(line, file=sys.stderr)


@dataclass
class Generator:
    """`generate(prompt) -> completion` within the model's context. A prompt that leaves the answer
    less than `max_new_tokens` is cut from the left to leave it at least half the context (`room`),
    said once in one line and counted (`cut`); no library's reminder about long sequences is shown.
    Tokens come `CHUNK` at a time and stop once `done(completion)` (the task's end of an answer) or
    at end-of-text. Sampling (a temperature above 0) is seeded: the same model gives the same
    answers, and the caller's random state is left as it was. With `body` (the prompt ends inside a
    function, after its docstring), the answer opens with indentation and code (`_opening`): a small
    model's likeliest next line often leaves the function at once (a blank line and the next `def`),
    an empty answer that says nothing about the code it can write."""

    m: Loaded
    max_new_tokens: int
    temperature: float
    done: Callable[[str], bool] | None = None
    say: Callable[[str], None] = _note
    seed: int = 0
    body: bool = False
    cut: int = field(default=0, init=False)  # prompts cut so far
    calls: int = field(default=0, init=False)
    texts: list[str] | None = field(default=None, init=False)  # each token's text, by id

    def __post_init__(self) -> None:
        self.context = context_length(self.m)

    def encode(self, prompt: str) -> list[int]:
        # verbose=False: transformers' "longer than the specified maximum" warning is ours to say
        if self.m.is_hf:
            return list(self.m.tokenizer(prompt, verbose=False)["input_ids"])
        return list(self.m.tokenizer.encode(prompt))

    def room(self, ids: list[int]) -> tuple[list[int], int]:
        """(the prompt's ids that fit, the new tokens it leaves room for)."""
        if self.context is None:
            return ids, self.max_new_tokens
        room = min(self.max_new_tokens, max(self.context - len(ids), self.context // 2))
        keep = self.context - room
        if len(ids) <= keep:
            return ids, room
        if not self.cut:
            self.say(
                f"note: a prompt of {len(ids)} tokens does not fit the model's "
                f"{self.context}-token context with room for its answer: it is cut to its last "
                f"{keep} tokens (from the left), leaving {room} for the answer; every such prompt "
                "is cut alike and counted (prompts_cut)"
            )
        self.cut += 1
        bos = getattr(self.m.tokenizer, "bos_token_id", None) if self.m.is_hf else None
        if bos is not None and ids[0] == bos:  # the start token stays
            return ids[:1] + ids[len(ids) - keep + 1 :], room
        return ids[-keep:], room

    @contextlib.contextmanager
    def _seeded(self) -> Iterator[torch.Tensor]:
        """Its own seeded random state (the caller's is restored after); yields the device."""
        device = next(self.m.model.parameters()).device
        self.calls += 1
        with (
            torch.inference_mode(),
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        ):
            torch.manual_seed(self.seed * 1_000_003 + self.calls)
            yield device

    def _texts(self) -> list[str]:
        if self.texts is None:
            size = len(self.m.tokenizer) if self.m.is_hf else self.m.tokenizer.vocab_size
            self.texts = [self.decode([i]) for i in range(size)]
        return self.texts

    def _opening(self, ids: list[int], most: int = 8) -> list[int]:
        """The answer's first tokens when the prompt ends inside a function (after its docstring):
        indentation, then code before any line end (`_opens`; by the `most`-th token at the latest),
        each the most likely (or a sampled) one of those, so that the answer opens a statement of
        the function's body, never nothing."""
        out: list[int] = []
        texts = self._texts()
        with self._seeded() as device:
            for step in range(most):
                x = torch.tensor([ids + out], dtype=torch.long, device=device)
                logits = self.m.model(input_ids=x).logits if self.m.is_hf else self.m.model(x)
                logits = logits[0, -1].float()
                # the last one brings code, not more blanks
                line, last = self.decode(out), step == most - 1
                allowed = torch.tensor(
                    [
                        i
                        for i, t in enumerate(texts)
                        if _opens(line + t) and (not last or (line + t).strip())
                    ],
                    device=device,
                )
                if not len(allowed):  # a tokenizer with no such token: the model's own way
                    break
                masked = torch.full_like(logits, float("-inf"))
                masked[allowed] = logits[allowed]
                if self.temperature == 0:
                    out.append(int(masked.argmax()))
                else:
                    probs = torch.softmax(masked / self.temperature, dim=-1)
                    out.append(int(torch.multinomial(probs, 1)))
                if self.decode(out).strip():
                    break
        return out

    def _more(self, ids: list[int], n: int) -> tuple[list[int], bool]:
        """Up to n new tokens after ids, and whether the model ended its text."""
        m, greedy, t = self.m, self.temperature == 0, self.temperature
        with self._seeded() as device:
            x = torch.tensor([ids], dtype=torch.long, device=device)
            if m.is_hf:
                tok = m.tokenizer
                pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
                sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": t}
                new = m.model.generate(
                    input_ids=x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=n,
                    pad_token_id=pad,
                    **sampling,
                )
                eos = tok.eos_token_id
            else:
                eos = m.tokenizer.eot_id
                top_k, temperature = (1, 1.0) if greedy else (None, t)
                new = generate(m.model, x, n, temperature=temperature, top_k=top_k, eot_id=eos)
        out = new[0, len(ids) :].tolist()
        if eos in out:
            return out[: out.index(eos)], True
        return out, False

    def decode(self, ids: list[int]) -> str:
        if self.m.is_hf:
            return self.m.tokenizer.decode(ids, skip_special_tokens=True)
        return self.m.tokenizer.decode(ids)

    def __call__(self, prompt: str) -> str:
        ids, room = self.room(self.encode(prompt))
        new: list[int] = self._opening(ids) if self.body and prompt.endswith("\n") else []
        text, ended = self.decode(new), False
        while len(new) < room and not ended and not (self.done and self.done(text)):
            more, ended = self._more(ids + new, min(CHUNK, room - len(new)))
            new += more
            text = self.decode(new)
            ended = ended or not more
        return text


# --- the code tasks (HumanEval, MBPP): generated code run against each problem's tests ------------


def _check_code(r: Request) -> None:
    for k in r.k:
        code.pass_at_k(r.n, 0, k)  # raises for k > n, saying what to do
    if not r.unsafe_exec and sandbox.boundary().kind == "none":
        raise code.SandboxUnavailable(sandbox.unavailable_message())


def _per_problem(res: dict[str, Any]) -> list[str]:
    return [
        f"  {p['task_id']:<14} {p['passed']}/{p['n']} passed  {', '.join(p['statuses'])}"
        for p in res["per_problem"]
    ]


def code_task(
    name: str,
    help: str,
    load: Callable[[str | Path], list[code.CodeProblem]],
    data_help: str,
    offline_file: str,
    sample: str,
) -> Task:
    """A task that generates `n` completions per problem (greedy for n == 1, else at temperature
    0.8) and runs them against its tests (`code.evaluate_code`): pass@k, syntax accuracy, BLEU."""

    def score(m: Loaded, r: Request) -> dict[str, Any]:
        problems = load(r.data)[: r.limit]
        temperature = (0.0 if r.n == 1 else 0.8) if r.temperature is None else r.temperature
        stops = problems[0].stops if problems else ()
        # HumanEval: the answer is a body
        body = bool(problems) and problems[0].prefix == problems[0].prompt
        generate = Generator(
            m, r.max_new_tokens, temperature, lambda text: code.answer_ended(text, stops), body=body
        )
        res = code.evaluate_code(
            problems, generate, r.n, r.k, progress=r.progress, unsafe=r.unsafe_exec
        )
        return {"temperature": temperature, "prompts_cut": generate.cut, **res}

    data_help = f"{data_help}, or {SAMPLE_PREFIX}{sample} (a sample that ships with tinygpt)"
    return Task(
        name,
        help,
        score,
        data_help,
        offline_file,
        sample=sample,
        runs_code=True,
        check=_check_code,
        defaults={"max_new_tokens": 384},
        hidden=("per_problem",),
        more=_per_problem,
        headline=("pass@*", "empty_answers"),
    )
