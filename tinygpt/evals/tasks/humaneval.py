"""HumanEval (Chen et al. 2021): 164 functions to complete from their
signature and docstring; pass@k of the completions run against each
problem's tests (in the sandbox), with syntax accuracy and BLEU."""

from __future__ import annotations

from pathlib import Path

from tinygpt.core.datafiles import need_keys, read_jsonl
from tinygpt.evals.code import CodeProblem
from tinygpt.evals.harness import code_task

# a base model writes on past the function
HUMANEVAL_STOPS = ("\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(")


def load_humaneval(path: str | Path) -> list[CodeProblem]:
    """The HumanEval problems (HumanEval.jsonl[.gz] from openai/human-eval)."""
    path = Path(path)
    keys = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
    out = []
    for r in read_jsonl(path):
        need_keys(r, keys, path, "HumanEval")
        out.append(
            CodeProblem(
                str(r["task_id"]),
                r["prompt"],
                r["prompt"],
                f"{r['test']}\n\ncheck({r['entry_point']})\n",
                r["canonical_solution"],
                r["entry_point"],
                HUMANEVAL_STOPS,
                context=r["prompt"],
                names=(r["entry_point"],),
                handles=False,
            )
        )
    return out


TASK = code_task(
    "humaneval",
    "HumanEval pass@k (runs generated code)",
    load_humaneval,
    "HumanEval.jsonl[.gz] (github.com/openai/human-eval, data/)",
    "HumanEval.jsonl.gz",
    "humaneval",
)
