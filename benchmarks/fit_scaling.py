"""Fit the size planner's scaling law on tinygpt's own runs: the ladder's lower rungs, trained on the CPU.

    python benchmarks/fit_scaling.py --out /tmp/scaling         # train the grid (resumable), fit, report
    python benchmarks/fit_scaling.py --out /tmp/scaling --write # ... and write tinygpt/train/scaling_laws.json

Each run is `pretrain` of the recipe at one rung (`tinygpt.train.plan.rung`) for one token budget, with the
schedule `--hours` uses (warmup-stable-decay), evaluated once at its end on 32 fixed validation batches; runs
already in --out/runs.jsonl are not trained again. The fit: L(N, D) = E + A/N^alpha + B/D^beta, N the
non-embedding parameters, D the tokens trained; alpha and beta on a grid (0.05 steps), E, A, B by
non-negative least squares for each, the squared relative error plus a pull of 0.02 per unit of distance
toward Chinchilla's exponents (so that few points do not choose wild ones). The held-out runs (--held-out)
are left out of the fit and predicted: their error is the law's error.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tinygpt.core.recipes import get_recipe  # noqa: E402
from tinygpt.model.gpt import meta_model  # noqa: E402
from tinygpt.train.plan import CHINCHILLA, LAWS_FILE, rung, rung_name  # noqa: E402
from tinygpt.train.pretrain import pretrain  # noqa: E402

FIT = [(2, 100_000), (2, 200_000), (2, 400_000), (3, 100_000), (3, 200_000), (4, 100_000)]
HELD_OUT = [(3, 300_000), (4, 200_000)]
EVAL_BATCHES = 32
PRIOR_PULL = 0.02


def train_point(recipe_name: str, depth: int, tokens: int, out: Path) -> dict:
    """One run of the grid: its final validation loss, parameters, tokens, and CPU time."""
    recipe = rung(get_recipe(recipe_name), depth)
    steps = max(1, round(tokens / recipe.train.tokens_per_step))
    recipe = recipe.replace(train=dict(schedule="wsd", max_steps=steps, eval_every=steps, save_every=steps,
                                       eval_batches=EVAL_BATCHES))
    run_dir = out / f"{recipe_name}-{rung_name(depth)}-{tokens}"
    t0, c0 = time.time(), time.process_time()
    result = pretrain(recipe, run_dir, progress=False, tensorboard=False, device="cpu")
    return {"recipe": recipe_name, "size": rung_name(depth), "depth": depth,
            "params": meta_model(recipe.model).num_params(non_embedding=True),
            "tokens": steps * recipe.train.tokens_per_step, "steps": steps, "val_loss": result.val_loss,
            "lr": recipe.train.lr, "wall_s": round(time.time() - t0, 1), "cpu_s": round(time.process_time() - c0, 1)}


def fit(points: list[dict]) -> dict:
    """The constants that predict the points best (relative error), exponents pulled toward Chinchilla's."""
    n = np.array([p["params"] for p in points], dtype=np.float64)
    d = np.array([p["tokens"] for p in points], dtype=np.float64)
    y = np.array([p["val_loss"] for p in points], dtype=np.float64)
    best = None
    for alpha, beta in itertools.product(np.arange(0.05, 1.0001, 0.05), repeat=2):
        X = np.stack([np.ones_like(n), n ** -alpha, d ** -beta], axis=1) / y[:, None]
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
    return {"E": float(E), "A": float(A), "B": float(B), "alpha": alpha, "beta": beta,
            "rms_relative_error": float(np.sqrt(err))}


def predict(law: dict, p: dict) -> float:
    return law["E"] + law["A"] / p["params"] ** law["alpha"] + law["B"] / p["tokens"] ** law["beta"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", default="cpu")
    ap.add_argument("--write", action="store_true", help=f"write tinygpt/train/{LAWS_FILE}")
    ap.add_argument("--fit-only", action="store_true", help="fit the runs already in --out, train nothing")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    have = {(p["depth"], p["tokens"]) for p in done if p["recipe"] == args.recipe}
    for depth, tokens in ([] if args.fit_only else FIT + HELD_OUT):
        steps = round(tokens / get_recipe(args.recipe).train.tokens_per_step)
        if (depth, steps * get_recipe(args.recipe).train.tokens_per_step) in have:
            continue
        point = train_point(args.recipe, depth, tokens, args.out)
        print(json.dumps(point), flush=True)
        with open(log, "a") as f:
            f.write(json.dumps(point) + "\n")
        done.append(point)
    runs = [p for p in done if p["recipe"] == args.recipe and p["val_loss"] is not None]
    held = {(d, round(t / get_recipe(args.recipe).train.tokens_per_step)) for d, t in HELD_OUT}
    is_held = [(p["depth"], p["steps"]) in held for p in runs]
    law = fit([p for p, h in zip(runs, is_held) if not h])
    print(f"\nL(N, D) = {law['E']:.3f} + {law['A']:.4g}/N^{law['alpha']:.2f} + {law['B']:.4g}/D^{law['beta']:.2f}"
          f"  (rms relative error on the fitted runs {law['rms_relative_error']:.2%})\n")
    print("| size | params | tokens | val loss | predicted | error | held out | CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    errors = []
    for p, h in zip(runs, is_held):
        pred = predict(law, p)
        err = (pred - p["val_loss"]) / p["val_loss"]
        if h:
            errors.append(abs(err))
        print(f"| {p['size']} | {p['params']:,} | {p['tokens']:,} | {p['val_loss']:.4f} | {pred:.4f} | {err:+.1%} "
              f"| {'yes' if h else ''} | {p['cpu_s']:.0f} |")
    if errors:
        print(f"\nheld-out runs: largest error {max(errors):.1%}")
    if args.write:
        path = ROOT / "tinygpt" / "train" / LAWS_FILE
        laws = json.loads(path.read_text())["laws"] if path.is_file() else {}
        laws[args.recipe] = {**law, "held_out_max_error": max(errors) if errors else None,
                             "source": f"fitted on {len(runs) - len(errors)} tinygpt runs of the {args.recipe} "
                                       f"ladder (benchmarks/fit_scaling.py, {time.strftime('%Y-%m-%d')})",
                             "runs": runs}
        path.write_text(json.dumps({"laws": laws}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
