"""Does the probe predict what the trainer does? Its tokens/s against the trainer's measured steady state.

    python benchmarks/probe_accuracy.py --recipe cpu                  # CPU: the probe times the step; the whole run
    python benchmarks/probe_accuracy.py --recipe a100-124m --steps 200 --data builtin   # GPU: search + timing

The prediction is what `tinygpt probe --json` reports (on a GPU: the micro-batch search, then the
trainer's own compiled step timed for the micro-batches that fit; on a CPU: a CPU recipe's step as it
stands). The trainer's figure is the median `tokens_per_s` of a real `pretrain` run of the same recipe
(as the probe fitted it), over the logged steps after the first (compile and warm-up excluded; steps
that evaluated or saved are left out). Goal (issue 14): within 15%. The table goes to a dated file in
benchmarks/results/ (`--results`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import results_file
import torch

from tinygpt.core.recipes import get_recipe
from tinygpt.fit.report import probe_report
from tinygpt.pretrain.run_pretrain import pretrain


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipe", default="cpu")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps of the run (default: the recipe's own; a short run "
        "on a 2-core CPU shares it with the tokenizing process and measures slow)",
    )
    ap.add_argument("--data", default=None, help="a source for the run (default: the recipe's)")
    results_file.add_option(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        predicted = json.loads(
            probe_report(args.recipe, as_json=True, cache_dir=Path(tmp) / "probe")
        )
        exp = predicted["expectations"]
        recipe = get_recipe(args.recipe)
        recipe = recipe.replace(
            train={
                "log_every": 5,
                "eval_every": 0,
                "save_every": 0,
                "max_steps": args.steps or recipe.train.max_steps,
            }
        )
        result = pretrain(
            recipe, Path(tmp) / "run", data=args.data, progress=False, cache_dir=Path(tmp) / "cache"
        )
    steady = [m["tokens_per_s"] for m in result.metrics if m.get("tokens_per_s") and m["step"] > 5]
    measured = statistics.median(steady)
    say = results_file.Report()
    say(
        f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {predicted['hardware'].get('name') or predicted['hardware']['device']}"
    )
    say(
        "| recipe | probe's tokens/s | how | trainer's tokens/s (median of logged steps after warm-up) | ratio |"
    )
    say("|---|---|---|---|---|")
    say(
        f"| {args.recipe} | {exp['tokens_per_s']:,.0f} | {exp['tokens_per_s_source']} | {measured:,.0f} "
        f"({len(steady)} logs) | {exp['tokens_per_s'] / measured:.2f} |"
    )
    say(
        f"\nprediction / measurement = {exp['tokens_per_s'] / measured:.2f} (goal: within 0.85-1.15)"
    )

    results_file.write(
        args.results,
        __file__,
        "probe-accuracy",
        f"The probe's tokens/s against the trainer's, recipe `{args.recipe}`",
        say.text(),
        reference="the trainer's measured tokens/s on the same recipe (goal: the probe within 15%)",
    )


if __name__ == "__main__":
    main()
