"""CPU time per token of one recipe's optimizer step at its micro-batch, accumulated twice, and at twice the
micro-batch: whether a larger batch is cheaper per token on this machine (docs/BENCHMARKS.md section 13).

    OMP_NUM_THREADS=1 python benchmarks/batch_cost.py --recipe cpu-fast

The three are timed in turn, --rounds times, each 8 steps after 3 of warm-up, as process CPU time (a shared
machine's load moves wall time more than CPU time); the median of the rounds is printed and written to a dated
file in benchmarks/results/ (`--results`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import results_file  # noqa: E402
import torch  # noqa: E402

from tinygpt.core.recipes import get_recipe  # noqa: E402
from tinygpt.fit.step_speed import RandomBatches  # noqa: E402
from tinygpt.model.gpt import GPT  # noqa: E402
from tinygpt.train.step import TrainStep  # noqa: E402

WARMUP, STEPS = 3, 8


def cpu_us_per_token(recipe) -> float:
    t = dataclasses.replace(recipe.train, device="cpu")
    torch.manual_seed(0)
    step = TrainStep(GPT(recipe.model), t, RandomBatches(recipe.model.vocab_size, t.seq_len))
    for _ in range(WARMUP):
        step.optimizer_step()
    c0 = time.process_time()
    for _ in range(STEPS):
        step.optimizer_step()
    return (time.process_time() - c0) / (STEPS * t.tokens_per_step) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipe", default="cpu-fast")
    ap.add_argument("--rounds", type=int, default=4, help="times the three are timed in turn")
    results_file.add_option(ap)
    args = ap.parse_args()
    base = get_recipe(args.recipe)
    mb = base.train.micro_batch_size
    variants = {
        f"micro-batch {mb}": {},
        f"micro-batch {mb} x 2 accumulated": {"grad_accum_steps": 2},
        f"micro-batch {2 * mb}": {"micro_batch_size": 2 * mb},
    }
    times = {name: [] for name in variants}
    first = next(iter(variants))
    for _ in range(args.rounds):
        for name, train in variants.items():
            times[name].append(cpu_us_per_token(base.replace(train=train)))
    rows = []
    for name, ts in times.items():
        print(
            f"{name}: {statistics.median(ts):.1f} CPU us/token (rounds: {', '.join(f'{t:.1f}' for t in ts)})"
        )
        rows.append(
            {
                "step": name,
                "CPU us/token (median)": round(statistics.median(ts), 1),
                "x the recipe's own": round(
                    statistics.median(ts) / statistics.median(times[first]), 2
                ),
                "rounds": ", ".join(f"{t:.1f}" for t in ts),
            }
        )
    results_file.write(
        args.results,
        __file__,
        "batch-cost",
        f"CPU time per token of recipe `{base.name}` at its micro-batch, accumulated twice and doubled",
        results_file.table(rows),
        reference=f"the recipe's own step ({first})",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
