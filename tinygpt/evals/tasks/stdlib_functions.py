"""stdlib-functions: write a function of Python's standard library from its signature and docstring.

Every machine has the data (the standard library's sources: the built-in corpus) and nothing the
model writes is run: the scores are syntax accuracy (the body parses and adds a statement to the
function, as `CodeProblem.valid_syntax` judges HumanEval's), exact matches, and corpus BLEU against
the real body. The functions and methods come from the validation split of `builtin` (every 20th
document, the rule training uses), whole in their document, with a body of at most `MAX_BODY_CHARS`;
one whose text is also in the training split (a helper defined in two modules) is left out. So a
model pretrained on `builtin` never saw them. They depend on the Python version, which the result
names."""

from __future__ import annotations

import ast
import itertools
import platform
import re
import textwrap
from typing import Any, Iterator

from tinygpt.core.config import DataConfig
from tinygpt.core.units import duration
from tinygpt.data.sources import is_validation_document, iter_documents
from tinygpt.evals import lm
from tinygpt.evals.code import CodeProblem, bleu_with_signature, empty_share
from tinygpt.evals.harness import Generator, Loaded, Request, Task

MAX_BODY_CHARS = 400  # bodies a small model can write within its default 128 new tokens
_DEF = re.compile(r"([ \t]*)def \w")


def _normal(text: str) -> str:
    """Text without indentation or blank lines: a method matches the same code as a function."""
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def _functions(doc: str) -> Iterator[CodeProblem]:
    """The functions and methods that lie whole in a document and have a docstring and a body: the
    prompt is the header and docstring (dedented), the reference the body."""
    lines = doc.splitlines(keepends=True)
    for start, line in enumerate(lines):
        if (m := _DEF.match(line)) is None:
            continue
        indent = len(m.group(1))
        # the first line after the header at the def's indentation or less
        outside = (j for j in range(start + 1, len(lines)) if lines[j].strip())
        end = next((j for j in outside if len(lines[j]) - len(lines[j].lstrip()) <= indent), None)
        if end is None or lines[end].lstrip().startswith("#"):
            # it runs on past the document, or a comment at its level may still be inside it
            continue
        source = textwrap.dedent("".join(lines[start:end]))
        try:
            fn = ast.parse(source).body[0]
        except SyntaxError:
            continue
        if not isinstance(fn, ast.FunctionDef) or ast.get_docstring(fn) is None or len(fn.body) < 2:
            continue
        head, cut = source.splitlines(keepends=True), fn.body[0].end_lineno  # the docstring's end
        prompt, body = "".join(head[:cut]), "".join(head[cut:])
        if len(body.strip()) <= MAX_BODY_CHARS:
            yield CodeProblem(fn.name, prompt, prompt, "", body.rstrip() + "\n", fn.name)


def held_out_functions(limit: int | None = None) -> list[CodeProblem]:
    """The first `limit` functions (default: all) of the built-in corpus's validation split."""
    cfg = DataConfig(source="builtin")
    train, val = [], []
    for i, doc in enumerate(iter_documents(cfg)):
        (val if is_validation_document(i, cfg.val_fraction) else train).append(doc)
    seen = _normal("".join(train))
    out: list[CodeProblem] = []
    for p in itertools.chain.from_iterable(map(_functions, val)):
        text = _normal(p.prompt + p.canonical_solution)
        if text not in seen:
            out.append(p)
            seen += "\n" + text  # the same function twice in the split is one problem
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise FileNotFoundError(
            "this Python has no standard-library sources to take functions from"
        )
    return out


def body(completion: str) -> str:
    """What of a completion belongs to the function: its lines up to the first one at column 0."""
    return "".join(
        itertools.takewhile(
            lambda line: not line.strip() or line[0] in " \t", completion.splitlines(keepends=True)
        )
    )


def ended(completion: str) -> bool:
    """Whether a completion has left the function: a line at column 0 after its first."""
    return body(completion) != completion and bool(completion.strip())


def grade(problems: list[CodeProblem], bodies: list[str]) -> dict[str, Any]:
    """Syntax accuracy, exact matches and corpus BLEU of the bodies written for `problems`."""
    n, pairs = len(problems), list(zip(problems, bodies))
    bleu, signature = bleu_with_signature(bodies, [p.canonical_solution for p in problems])
    return {
        "problems": n,
        "syntax_accuracy": sum(p.valid_syntax(b) for p, b in pairs) / n,
        "exact_match": sum(_normal(b) == _normal(p.canonical_solution) for p, b in pairs) / n,
        "empty_answers": empty_share(bodies),
        "bleu": bleu,
        "bleu_signature": signature,
    }


def score(m: Loaded, r: Request) -> dict[str, Any]:
    problems = held_out_functions(r.limit)
    temperature = 0.0 if r.temperature is None else r.temperature
    generate, bodies = Generator(m, r.max_new_tokens, temperature, ended, body=True), []

    def run(batch: list[CodeProblem]) -> None:
        bodies.extend(body(generate(p.prompt)) for p in batch)

    def describe(expected: float, per_batch: float) -> str:
        limit = lm.shorter(len(problems), expected)
        return (
            f"stdlib-functions over {len(problems)} functions: about {duration(expected)}; --limit "
            f"{limit} takes about {duration(expected * limit / len(problems))}"
        )

    lm.run_batches([[p] for p in problems], run, "stdlib-functions", r.progress, r.say, describe)
    return {
        "python": platform.python_version(),
        "temperature": temperature,
        "prompts_cut": generate.cut,
        **grade(problems, bodies),
    }


TASK = Task(
    "stdlib-functions",
    "held-out standard-library functions written from their docstrings: syntax accuracy "
    "and BLEU (runs nothing; every machine has the data)",
    score,
    data_default=f"Python {platform.python_version()}'s standard library (held-out functions)",
    defaults={"max_new_tokens": 128},
    headline=("syntax_accuracy", "bleu", "empty_answers", "problems"),
)
