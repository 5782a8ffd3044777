"""MBPP (Austin et al. 2021): short Python problems stated in words with three asserts; pass@k on
the test split (task ids 11-510) of the completions run against the asserts (in the sandbox), with
syntax accuracy and BLEU."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Sequence

from tinygpt.core.datafiles import DataFormatError, need_keys, read_jsonl
from tinygpt.evals.code import CodeProblem
from tinygpt.evals.harness import code_task

MBPP_STOPS = ("\nassert ", "\nprint(", "\nif __name__", "\n```")


def mbpp_prompt(text: str, tests: Sequence[str]) -> str:
    """The MBPP prompt of Austin et al. (2021): the task and its tests."""
    return (
        f"You are an expert Python programmer, and here is your task: {text} "
        f"Your code should pass these tests:\n\n" + "\n".join(tests) + "\n"
    )


def load_mbpp(
    path: str | Path, task_ids: Iterable[int] | None = range(11, 511)
) -> list[CodeProblem]:
    """MBPP problems (mbpp.jsonl); by default the test split, task ids 11-510. None: all 974."""
    path = Path(path)
    wanted = None if task_ids is None else set(task_ids)
    out = []
    for r in read_jsonl(path):
        need_keys(r, ("task_id", "text", "code", "test_list"), path, "MBPP")
        if wanted is not None and int(r["task_id"]) not in wanted:
            continue
        # The setup code builds test inputs from the solution's own classes (task 367: Node), so it
        # goes after the completion, before the asserts.
        setup = r.get("test_setup_code") or ""
        m = re.search(r"def\s+(\w+)\s*\(", r["code"])
        out.append(
            CodeProblem(
                f"MBPP/{r['task_id']}",
                mbpp_prompt(r["text"], r["test_list"]),
                "",
                "\n".join(([setup] if setup.strip() else []) + list(r["test_list"])),
                r["code"].replace("\r\n", "\n"),
                m.group(1) if m else "",
                MBPP_STOPS,
            )
        )
    if not out:
        raise DataFormatError(f"{path} holds no MBPP problems with the requested task ids")
    return out


TASK = code_task(
    "mbpp",
    "MBPP pass@k on problems 11-510 (runs generated code)",
    load_mbpp,
    "mbpp.jsonl (github.com/google-research/google-research, mbpp/)",
    "mbpp.jsonl",
    "mbpp",
)
