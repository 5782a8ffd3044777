"""Fit the size planner's scaling law on tinygpt's own runs: the ladder's lower rungs, trained on the CPU.

    python benchmarks/fit_scaling.py --out /tmp/scaling         # train the grid (resumable), fit, report
    python benchmarks/fit_scaling.py --out /tmp/scaling --write # ... and write tinygpt/fit/scaling_laws.json
    python benchmarks/fit_scaling.py --recipe cpu-fast --jobs 2 --out /tmp/scaling --write   # the cpu-fast ladder

Each run is `pretrain` of the recipe at one rung (`tinygpt.fit.ladder.rung`) for one token budget, with the
schedule `--hours` uses (warmup-stable-decay), evaluated once at its end on 32 fixed validation batches; runs
already in --out/runs.jsonl are not trained again. The fit: L(N, D) = E + A/N^alpha + B/D^beta, N the
non-embedding parameters, D the tokens trained; alpha and beta on a grid (0.05 steps), E, A, B by
non-negative least squares for each, D counted as the planner counts it (effective tokens where a run
reads its source more than once), the squared relative error plus a pull of 0.02 per unit of distance
toward Chinchilla's exponents (so that few points do not choose wild ones). The held-out runs (--held-out)
are left out of the fit and predicted: their error is the law's error. With --jobs N, N runs train at once,
each on cores/N threads (a run's loss does not depend on its speed: each trains a fixed number of tokens).
The law and the table go to a dated file in benchmarks/results/ (`--results`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import results_file
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tinygpt.core.recipes import get_recipe  # noqa: E402
from tinygpt.fit.ladder import (  # noqa: E402
    CHINCHILLA,
    LAWS_FILE,
    effective_tokens,
    rung,
    rung_name,
    unique_tokens,
)
from tinygpt.model.gpt import meta_model  # noqa: E402
from tinygpt.pretrain.run_pretrain import pretrain  # noqa: E402

# (depth, tokens) of each recipe's grid: the runs fitted, then the runs held out. The cpu-fast grid reaches the
# tokens its 10- and 40-minute budgets buy (0.25M to 3.5M, over three epochs of the built-in corpus's 4M
# characters at the top) and the rungs they choose among (d2 to d5).
GRIDS = {
    "cpu": (
        [(2, 100_000), (2, 200_000), (2, 400_000), (3, 100_000), (3, 200_000), (4, 100_000)],
        [(3, 300_000), (4, 200_000)],
    ),
    "cpu-fast": (
        [
            (2, 250_000),
            (2, 1_000_000),
            (2, 2_000_000),
            (2, 3_500_000),
            (3, 250_000),
            (3, 1_000_000),
            (3, 3_000_000),
            (4, 500_000),
            (4, 2_000_000),
            (5, 250_000),
        ],
        [(4, 1_000_000), (3, 2_000_000)],
    ),
}
EVAL_BATCHES = 32
PRIOR_PULL = 0.02


def train_point(
    recipe_name: str, depth: int, tokens: int, out: Path, threads: int | None = None
) -> dict:
    """One run of the grid: its final validation loss, parameters, tokens, and CPU time."""
    if threads:
        torch.set_num_threads(threads)
    recipe = rung(get_recipe(recipe_name), depth)
    steps = max(1, round(tokens / recipe.train.tokens_per_step))
    recipe = recipe.replace(
        train=dict(
            schedule="wsd",
            max_steps=steps,
            eval_every=steps,
            save_every=steps,
            eval_batches=EVAL_BATCHES,
        )
    )
    run_dir = out / f"{recipe_name}-{rung_name(depth)}-{tokens}"
    t0, c0 = time.time(), time.process_time()
    result = pretrain(recipe, run_dir, progress=False, tensorboard=False, device="cpu")
    return {
        "recipe": recipe_name,
        "size": rung_name(depth),
        "depth": depth,
        "params": meta_model(recipe.model).num_params(non_embedding=True),
        "tokens": steps * recipe.train.tokens_per_step,
        "steps": steps,
        "val_loss": result.val_loss,
        "lr": recipe.train.lr,
        "wall_s": round(time.time() - t0, 1),
        "cpu_s": round(time.process_time() - c0, 1),
    }


def data(p: dict, unique: float | None) -> float:
    """A run's D as the planner counts it: its tokens, as effective tokens where they repeat the source."""
    return effective_tokens(p["tokens"], unique)


def fit(points: list[dict], unique: float | None) -> dict:
    """The constants that predict the points best (relative error), exponents pulled toward Chinchilla's."""
    n = np.array([p["params"] for p in points], dtype=np.float64)
    d = np.array([data(p, unique) for p in points], dtype=np.float64)
    y = np.array([p["val_loss"] for p in points], dtype=np.float64)
    best = None
    for alpha, beta in itertools.product(np.arange(0.05, 1.0001, 0.05), repeat=2):
        X = np.stack([np.ones_like(n), n**-alpha, d**-beta], axis=1) / y[:, None]
        coef, *_ = np.linalg.lstsq(X, np.ones_like(y), rcond=None)
        if (coef < 0).any():  # non-negative: refit with the negative terms dropped
            keep = coef >= 0
            coef = np.zeros(3)
            coef[keep], *_ = np.linalg.lstsq(X[:, keep], np.ones_like(y), rcond=None)
            coef = np.clip(coef, 0, None)
        err = float(np.mean((X @ coef - 1) ** 2))
        score = err + PRIOR_PULL * ((alpha - CHINCHILLA.alpha) ** 2 + (beta - CHINCHILLA.beta) ** 2)
        if best is None or score < best[0]:
            best = (score, float(alpha), float(beta), coef, err)
    _, alpha, beta, (E, A, B), err = best
    return {
        "E": float(E),
        "A": float(A),
        "B": float(B),
        "alpha": alpha,
        "beta": beta,
        "rms_relative_error": float(np.sqrt(err)),
    }


def predict(law: dict, p: dict, unique: float | None) -> float:
    return (
        law["E"]
        + law["A"] / p["params"] ** law["alpha"]
        + law["B"] / data(p, unique) ** law["beta"]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", default="cpu")
    ap.add_argument("--write", action="store_true", help=f"write tinygpt/fit/{LAWS_FILE}")
    ap.add_argument(
        "--fit-only", action="store_true", help="fit the runs already in --out, train nothing"
    )
    ap.add_argument("--jobs", type=int, default=1, help="runs trained at once")
    results_file.add_option(ap)
    args = ap.parse_args(argv)
    fit_grid, held_grid = GRIDS[args.recipe]
    recipe = get_recipe(args.recipe)
    unique = unique_tokens(recipe)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    have = {(p["depth"], p["tokens"]) for p in done if p["recipe"] == args.recipe}
    todo = [
        (depth, tokens)
        for depth, tokens in ([] if args.fit_only else fit_grid + held_grid)
        if (depth, round(tokens / recipe.train.tokens_per_step) * recipe.train.tokens_per_step)
        not in have
    ]
    todo.sort(key=lambda dt: -(dt[0] ** 2 * dt[1]))  # the longest first: the jobs end together
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(train_point, args.recipe, d, t, args.out, threads) for d, t in todo]
        for future in as_completed(futures):
            point = future.result()
            print(json.dumps(point), flush=True)
            with open(log, "a") as f:
                f.write(json.dumps(point) + "\n")
            done.append(point)
    runs = [p for p in done if p["recipe"] == args.recipe and p["val_loss"] is not None]
    held = {(d, round(t / recipe.train.tokens_per_step)) for d, t in held_grid}
    is_held = [(p["depth"], p["steps"]) in held for p in runs]
    law = fit([p for p, h in zip(runs, is_held) if not h], unique)
    say = results_file.Report()
    say(
        f"\nL(N, D) = {law['E']:.3f} + {law['A']:.4g}/N^{law['alpha']:.2f} + {law['B']:.4g}/D^{law['beta']:.2f}"
        f"  (rms relative error on the fitted runs {law['rms_relative_error']:.2%})\n"
    )
    say("| size | params | tokens | val loss | predicted | error | held out | CPU s |")
    say("|---|---|---|---|---|---|---|---|")
    errors = []
    for p, h in zip(runs, is_held):
        pred = predict(law, p, unique)
        err = (pred - p["val_loss"]) / p["val_loss"]
        if h:
            errors.append(abs(err))
        say(
            f"| {p['size']} | {p['params']:,} | {p['tokens']:,} | {p['val_loss']:.4f} | {pred:.4f} | {err:+.1%} "
            f"| {'yes' if h else ''} | {p['cpu_s']:.0f} |"
        )
    if errors:
        say(f"\nheld-out runs: largest error {max(errors):.1%}")
    results_file.write(
        args.results,
        __file__,
        f"scaling-law-{args.recipe}",
        f"The size planner's law fitted on the {args.recipe} ladder",
        say.text(),
        argv,
        "the held-out runs (held out: yes), predicted by the law fitted on the others; goal: within 5%",
    )
    if args.write:
        path = ROOT / "tinygpt" / "fit" / LAWS_FILE
        laws = json.loads(path.read_text())["laws"] if path.is_file() else {}
        laws[args.recipe] = {
            **law,
            "held_out_max_error": max(errors) if errors else None,
            "source": f"fitted on {len(runs) - len(errors)} tinygpt runs of the {args.recipe} "
            f"ladder (benchmarks/fit_scaling.py, {time.strftime('%Y-%m-%d')})",
            "runs": runs,
        }
        path.write_text(json.dumps({"laws": laws}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
