"""Time to a validation loss: the fast CPU recipe against the `cpu` recipe, on the same machine, in one run.

    python benchmarks/time_to_loss.py                       # the built-in corpus, then Tiny Shakespeare
    python benchmarks/time_to_loss.py --corpus builtin --fast-set train.lr=3e-3   # explore one change

Both recipes train on the same text with the same tokenizer (the data settings of `cpu`, so their
validation losses are in the same units, on the same held-out batches), each in a fresh run folder,
one after the other in this process. Every `--eval-every` steps both are evaluated (the same cost for
both); the wall time at each evaluation is counted from the end of the first step (start-up, which
the second run gets cheaper from the token shards the first one wrote, is printed separately). The goal (issue 14): the fast recipe reaches the `cpu` recipe's final validation
loss in at most half of the `cpu` recipe's wall time. The table goes to a dated file in benchmarks/results/, the
plot to docs/images/time_to_loss.png.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from tinygpt.core.callback import Callback
from tinygpt.core.paths import shared_data_dir
from tinygpt.core.recipes import apply_overrides, get_recipe
from tinygpt.pretrain.run_pretrain import pretrain

REPO = Path(__file__).resolve().parents[1]


class Clock(Callback):
    """A trainer callback: (seconds since the run began, step, val_loss) at every evaluation."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.points: list[tuple[float, int, float]] = []
        self.startup_s = 0.0

    def on_startup(self, record: dict) -> None:
        """After the first step: the clock starts here (start-up is reported on its own; a second run on
        the same text finds its token shards written and would start faster)."""
        self.startup_s = record.get("total_s", 0.0)
        self.t0 = time.perf_counter()

    def on_log(self, m: dict) -> None:
        if m.get("val_loss") is not None:
            self.points.append((time.perf_counter() - self.t0, m["step"], m["val_loss"]))


def train(name: str, source: str, overrides: list[str], eval_every: int, tmp: Path) -> Clock:
    base = get_recipe("cpu")
    recipe = get_recipe(name)
    # the `cpu` recipe's data settings on both sides: the same tokenizer, the same validation batches
    recipe = recipe.replace(data={**base.data.to_dict(), "source": source},
                            train={"eval_every": eval_every, "eval_batches": base.train.eval_batches,
                                   "save_every": 0, "sample_every": 0})
    recipe = apply_overrides(recipe, overrides)
    clock = Clock()
    pretrain(recipe, tmp / name, progress=False, device="cpu", cache_dir=tmp / "cache", callbacks=[clock])
    return clock


def reached(points: list[tuple[float, int, float]], target: float) -> float | None:
    """The wall time at which the validation loss first reaches `target` (linear between evaluations)."""
    prev = None
    for t, _, loss in points:
        if loss <= target:
            if prev is None or prev[2] == loss:
                return t
            return prev[0] + (t - prev[0]) * (prev[2] - target) / (prev[2] - loss)
        prev = (t, None, loss)
    return None


def compare(source: str, label: str, fast: str, fast_overrides: list[str], eval_every: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ref = train("cpu", source, [], eval_every, Path(tmp))
        new = train(fast, source, fast_overrides, eval_every, Path(tmp))
    target, ref_s = ref.points[-1][2], ref.points[-1][0]
    t = reached(new.points, target)
    print(f"\n### {label}\n")
    print(f"| recipe | start-up (s) | wall (s) | steps | final val loss | time to {target:.3f} (s) |")
    print("|---|---|---|---|---|---|")
    print(f"| cpu | {ref.startup_s:.1f} | {ref_s:.1f} | {ref.points[-1][1]} | {target:.3f} | {ref_s:.1f} |")
    print(f"| {fast} | {new.startup_s:.1f} | {new.points[-1][0]:.1f} | {new.points[-1][1]} | "
          f"{new.points[-1][2]:.3f} | {'not reached' if t is None else f'{t:.1f}'} |")
    ratio = None if t is None else t / ref_s
    print(f"\n{fast} reaches cpu's final validation loss in "
          f"{'-' if ratio is None else f'{ratio:.2f}x'} of cpu's wall time (goal: at most 0.5x)")
    print("\nloss against time (s: val loss)")
    for name, c in (("cpu", ref), (fast, new)):
        print(f"- {name}: " + ", ".join(f"{s:.0f}: {v:.3f}" for s, _, v in c.points))
    return {"label": label, "cpu": ref.points, fast: new.points, "ratio": ratio}


def plot(results: list[dict], fast: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.8), squeeze=False)
    for ax, r in zip(axes[0], results):
        for name, style in (("cpu", "o-"), (fast, "s-")):
            ax.plot([p[0] for p in r[name]], [p[2] for p in r[name]], style, label=name, markersize=3)
        ax.axhline(r["cpu"][-1][2], color="grey", lw=0.8, ls="--")
        ax.set(title=r["label"], xlabel="wall time after the first step (s)", ylabel="validation loss (nats/token)")
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"\nplot: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", action="append", help="builtin, or a file; default: builtin and Tiny Shakespeare "
                    "from ../shared/data where present")
    ap.add_argument("--fast", default="cpu-fast", help="the recipe set against `cpu`")
    ap.add_argument("--fast-set", action="append", default=[], metavar="KEY=VALUE", help="override the fast recipe")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--plot", default=str(REPO / "docs" / "images" / "time_to_loss.png"))
    args = ap.parse_args()
    corpora = args.corpus
    if not corpora:
        corpora = ["builtin"]
        shakespeare = shared_data_dir() / "tinyshakespeare.txt"
        if shakespeare.is_file():
            corpora.append(str(shakespeare))
        else:
            print(f"(no {shakespeare}: the second corpus is skipped)", file=sys.stderr)
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = [compare(c, "built-in corpus" if c == "builtin" else Path(c).name, args.fast, args.fast_set,
                       args.eval_every) for c in corpora]
    if args.plot:
        plot(results, args.fast, Path(args.plot))


if __name__ == "__main__":
    main()
