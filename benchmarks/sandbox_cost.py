"""What the code sandbox costs (tinygpt/evals/sandbox.py): seconds per program for each boundary this
machine offers, and HumanEval's canonical solutions end to end.

    python benchmarks/sandbox_cost.py                      # 20 programs per boundary, then HumanEval
    python benchmarks/sandbox_cost.py --repeat 50 --workers 4

Each program is one problem in the sandbox as `tinygpt eval` runs it: the solution's and the test's
processes behind the boundary, one call across the pipe. The Markdown section printed goes to a dated file in
benchmarks/results/ (`--results`), with the machine's load average: the figures scale with it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import results_file

from tinygpt.evals import code, sandbox
from tinygpt.evals.tasks.humaneval import load_humaneval

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("TINYGPT_SHARED_DATA", REPO.parent / "shared" / "data"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--workers", type=int, default=4)
    results_file.add_option(ap)
    args = ap.parse_args()
    say = results_file.Report()
    say(
        f"### {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the start\n"
    )
    say("| boundary | seconds per program (one at a time) |\n|---|---|")
    for kind in sandbox.KINDS:
        b = sandbox.boundary(kind)
        if b.kind != kind:
            say(f"| {kind} | not available here ({b.why_not}) |")
            continue
        os.environ["TINYGPT_SANDBOX"] = kind
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            r = sandbox.run(
                "def f(x):\n    return 2 * x\n", "assert f(2) == 4\n", names=("f",), unsafe=True
            )
            assert r.passed, r.stderr
        say(f"| {kind} | {(time.perf_counter() - t0) / args.repeat:.3f} |")
    os.environ.pop("TINYGPT_SANDBOX")
    path = DATA / "HumanEval.jsonl.gz"
    if path.is_file():
        probs = load_humaneval(path)
        t0 = time.perf_counter()
        rs = code.check_completions(probs, [p.canonical_solution for p in probs], args.workers)
        dt = time.perf_counter() - t0
        say(
            f"\nHumanEval's {len(probs)} canonical solutions, {args.workers} at a time, boundary "
            f"{rs[0].boundary}: {sum(r.passed for r in rs)} passed in {dt:.1f} s "
            f"({dt / len(probs):.3f} s per problem)"
        )

    results_file.write(
        args.results,
        __file__,
        "sandbox-cost",
        "What the code sandbox costs",
        say.text(),
        reference="the `none` row: the same program with no boundary",
    )


if __name__ == "__main__":
    main()
