"""Code metrics: extracting code from a completion, syntax accuracy, BLEU (sacrebleu), pass@k, and
running candidates against a problem's tests (tinygpt/evals/sandbox.py: behind a kernel boundary,
the solution and the test in two processes, so the model's code cannot forge the verdict).

Each code task (tinygpt/evals/tasks/humaneval.py, mbpp.py) loads its problems into one form,
`CodeProblem`: the solution is ``prefix + completion``; the test process runs ``context``
(HumanEval's prompt, for its helpers), then ``test`` against the solution's names (HumanEval: the
entry point; MBPP: every name the solution defines)."""

from __future__ import annotations

import ast
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from tinygpt.evals import sandbox
from tinygpt.evals.sandbox import ExecResult, SandboxUnavailable


def with_bar(it: Iterable, total: int, desc: str, enabled: bool, **tqdm_options: Any) -> Iterable:
    """`it` behind a tqdm bar when one is asked for and tqdm is installed, else `it` itself."""
    if not enabled:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return it
    return tqdm(it, total=total, desc=desc, **tqdm_options)


# --- extraction and syntax --------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str) -> str:
    """The code in a completion: the first fenced block tagged python/py (else the first fenced
    block of any kind; an unclosed fence runs to the end), or the completion itself if none."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    for lang, body in blocks:
        if lang.lower() in ("python", "py", "python3"):
            return body
    return blocks[0][1]


def truncate_at_stops(completion: str, stops: Sequence[str]) -> str:
    """The completion up to the first stop sequence (a base model writes on past the function)."""
    cuts = [i for i in map(completion.find, stops) if i != -1]
    return completion[: min(cuts, default=len(completion))]


def answer_ended(completion: str, stops: Sequence[str]) -> bool:
    """Whether a completion has ended as `CodeProblem.clean` reads it: its fenced block closed, or
    (with no fence) a stop sequence written; generation stops there."""
    if "```" in completion:
        return completion.count("```") >= 2
    return any(s in completion for s in stops)


def empty_share(codes: Sequence[str]) -> float:
    """The share of answers that hold nothing but blanks: beside a score of 0, it says whether the
    model wrote wrong code or none."""
    return sum(not c.strip() for c in codes) / len(codes) if codes else 0.0


def _statements(tree: ast.AST, function: str = "") -> int:
    """How many statements `function`'s body holds (its last top-level definition); else in all."""
    if function:
        for node in reversed(getattr(tree, "body", [])):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
                return sum(isinstance(n, ast.stmt) for n in ast.walk(node)) - 1
    return sum(isinstance(n, ast.stmt) for n in ast.walk(tree))


def _parse(code: str) -> ast.AST | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: null bytes
        return None


# --- BLEU and pass@k --------------------------------------------------------------------------


def bleu_with_signature(
    hypotheses: Sequence[str], references: Sequence[str], **sacrebleu_options: Any
) -> tuple[float, str]:
    """Corpus BLEU (0-100) against one reference per hypothesis, exactly
    `sacrebleu.corpus_bleu(hypotheses, [references]).score`, and sacrebleu's signature (e.g.
    ``nrefs:1|case:mixed|eff:no|tok:13a|...``) to print beside it so that it can be reproduced.
    Options go to `sacrebleu.metrics.BLEU` (e.g. tokenize="char")."""
    if len(hypotheses) != len(references) or not hypotheses:
        raise ValueError(
            f"{len(hypotheses)} hypotheses but {len(references)} references: give one reference "
            "per hypothesis, at least one"
        )
    from sacrebleu.metrics import BLEU

    metric = BLEU(**sacrebleu_options)
    score = metric.corpus_score(list(hypotheses), [list(references)]).score
    # the signature needs a scored corpus (it counts references)
    return score, str(metric.get_signature())


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021) for n samples of
    which c pass, as a running product so that large n neither overflows nor loses precision."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError("n, c and k must be integers")
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(
            f"pass@{k} needs at least k={k} samples per problem but n={n}: "
            f"generate n >= {k} samples or ask for a smaller k"
        )
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


# --- problems: each code task's loader (tinygpt/evals/tasks/) reads its file into this form ---


@dataclass
class CodeProblem:
    """One problem in a common form. `prompt` is what the model sees; the solution is `prefix` + the
    completion (HumanEval: the prefix is the prompt, which the completion continues; MBPP: the
    completion is a whole solution). The test process runs `context`, binds `names` of the solution
    (None: all it defines) and runs `test`; `handles`: the solution may answer with objects that are
    not plain values (MBPP's classes), else plain values only."""

    task_id: str
    prompt: str
    prefix: str
    test: str
    canonical_solution: str
    entry_point: str = ""
    stops: tuple[str, ...] = ()
    context: str = ""
    names: tuple[str, ...] | None = None
    handles: bool = True

    def valid_syntax(self, completion: str) -> bool:
        """The model wrote valid code: not blank, it parses after the prefix, and it adds at least
        one statement (to the entry point's function when the prefix defines it): a prompt's header
        and docstring alone parse, so an empty answer or a lone comment is not valid syntax."""
        tree = _parse(self.prefix + completion) if completion.strip() else None
        before = _parse(self.prefix) if self.prefix else None
        if tree is None or before is None:
            return tree is not None and _statements(tree) > 0
        return _statements(tree, self.entry_point) > _statements(before, self.entry_point)

    def clean(self, completion: str) -> str:
        """Code from a raw completion: its fenced block if any, else the text up to a stop."""
        if "```" in completion:
            return extract_code(completion)
        return truncate_at_stops(completion, self.stops)


# --- execution ---------------------------------------------------------------------------------

SANDBOX_NOTE = (
    "runs the code the model writes: each problem's solution and test in two sandboxed processes "
    "(docs/TRUST.md: How generated code is run)"
)


def run_problem(problem: CodeProblem, completion: str, **limits: Any) -> ExecResult:
    """Run a completion against a problem's tests: the solution and the test in two sandboxed
    processes (`sandbox.run`), so that the solution cannot forge the verdict."""
    return sandbox.run(
        problem.prefix + completion,
        problem.test,
        context=problem.context,
        names=problem.names,
        handles=problem.handles,
        **limits,
    )


def check_completions(
    problems: Sequence[CodeProblem],
    completions: Sequence[str],
    workers: int | None = None,
    **limits: Any,
) -> list[ExecResult]:
    """Run problems[i] against completions[i] for every i, `workers` sandboxes at a time.
    Interrupted (Ctrl-C, or SIGTERM turned into KeyboardInterrupt), it kills every running sandbox
    and starts no other before the exception goes on: no process and no folder is left behind."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    workers = workers or min(4, os.cpu_count() or 1)
    sandbox.resume()
    pool = ThreadPoolExecutor(max_workers=workers)  # threads only wait on the sandboxes
    try:
        futures = [pool.submit(run_problem, p, c, **limits) for p, c in zip(problems, completions)]
        return [f.result() for f in futures]
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        sandbox.stop_all()
        raise
    finally:
        # the running ones end at once once killed; each removes its folder
        pool.shutdown(wait=True)


def evaluate_code(
    problems: Sequence[CodeProblem],
    generate: Callable[[str], str],
    n: int = 1,
    ks: Sequence[int] = (1,),
    workers: int | None = None,
    progress: bool = False,
    **limits: Any,
) -> dict[str, Any]:
    """Generate `n` completions per problem with `generate(prompt) -> completion`, clean them
    (`CodeProblem.clean`), run them against the tests, and report pass@k for each k, syntax
    accuracy and BLEU against the canonical solutions, with the outcome of every problem."""
    for k in ks:
        pass_at_k(n, 0, k)  # raises now, before any generation, if k > n
    if not problems:
        raise ValueError("no problems to evaluate")
    if not limits.get("unsafe") and sandbox.boundary().kind == "none":
        raise SandboxUnavailable(sandbox.unavailable_message())  # before any generation
    flat_problems, flat_codes = [], []
    for p in with_bar(problems, len(problems), "generating", progress):
        for _ in range(n):
            flat_problems.append(p)
            flat_codes.append(p.clean(generate(p.prompt)))
    results = check_completions(flat_problems, flat_codes, workers, **limits)
    per_problem, i = [], 0
    for p in problems:
        rs = results[i : i + n]
        per_problem.append(
            {
                "task_id": p.task_id,
                "n": n,
                "passed": sum(r.passed for r in rs),
                "statuses": [r.status for r in rs],
                "completions": flat_codes[i : i + n],
            }
        )
        i += n
    out: dict[str, Any] = {"problems": len(problems), "n": n, "sandbox": results[0].boundary}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, r["passed"], k) for r in per_problem) / len(per_problem)
    out["syntax_accuracy"] = sum(
        p.valid_syntax(c) for p, c in zip(flat_problems, flat_codes)
    ) / len(flat_codes)
    out["empty_answers"] = empty_share(flat_codes)
    out["bleu"], out["bleu_signature"] = bleu_with_signature(
        flat_codes, [p.canonical_solution for p in flat_problems]
    )
    out["per_problem"] = per_problem
    return out
