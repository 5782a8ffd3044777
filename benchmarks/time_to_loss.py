"""Time to a validation loss: the fast CPU recipe against the `cpu` recipe, on the same machine, in one run.

    python benchmarks/time_to_loss.py                       # the built-in corpus, then Tiny Shakespeare
    python benchmarks/time_to_loss.py --corpus builtin --fast-set train.lr=3e-3   # explore one change

Both recipes train on the same text with the same tokenizer (the data settings of `cpu`, so their
validation losses are in the same units, on the same held-out batches), each in a fresh run folder,
one after the other in this process. Every `--eval-every` steps both are evaluated (the same cost for
both); the wall time at each evaluation is counted from the end of the first step (start-up, which
the second run gets cheaper from the token shards the first one wrote, is printed separately). The goal (issue 14): the fast recipe reaches the `cpu` recipe's final validation
loss in at most half of the `cpu` recipe's wall time. The table goes to a dated file in benchmarks/results/
(`--results`), the plot to docs/images/time_to_loss.png.

Tokens to a loss (`--tokens`): each `--run LABEL=RECIPE [SECTION.FIELD=VALUE ...]` trained at one small
ladder shape (4 layers of width 256, a BPE of 4,096 trained on the corpus, context 256, 2,048 tokens a
step, fp32, warm-up the recipe's fraction of its steps) on one corpus, `--jobs` at a time, one thread
each; then the tokens each needed to reach the first run's final validation loss, and each final model's
bits per byte on held-out text (`tinygpt eval --task perplexity --data HELD_OUT`, the evaluator users run):

    python benchmarks/time_to_loss.py --tokens --corpus ../shared/data/wikitext2_test.txt \
        --held-out ../shared/data/wikitext2_valid.txt --steps 300 --jobs 2 \
        --run fast=a100-124m-fast --run speedrun=a100-124m-speedrun \
        --run "speedrun-60%=a100-124m-speedrun train.max_steps=180"
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import results_file
import torch

from tinygpt.core.batch_schedule import tokens_through
from tinygpt.core.callback import Callback
from tinygpt.core.paths import shared_data_dir
from tinygpt.core.recipe_choice import apply_overrides
from tinygpt.core.recipes import get_recipe
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
    recipe = recipe.replace(
        data={**base.data.to_dict(), "source": source},
        train={
            "eval_every": eval_every,
            "eval_batches": base.train.eval_batches,
            "save_every": 0,
            "sample_every": 0,
        },
    )
    recipe = apply_overrides(recipe, overrides)
    clock = Clock()
    pretrain(
        recipe, tmp / name, progress=False, device="cpu", cache_dir=tmp / "cache", callbacks=[clock]
    )
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


def compare(
    source: str, label: str, fast: str, fast_overrides: list[str], eval_every: int, say: Callable
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ref = train("cpu", source, [], eval_every, Path(tmp))
        new = train(fast, source, fast_overrides, eval_every, Path(tmp))
    target, ref_s = ref.points[-1][2], ref.points[-1][0]
    t = reached(new.points, target)
    say(f"\n### {label}\n")
    say(f"| recipe | start-up (s) | wall (s) | steps | final val loss | time to {target:.3f} (s) |")
    say("|---|---|---|---|---|---|")
    say(
        f"| cpu | {ref.startup_s:.1f} | {ref_s:.1f} | {ref.points[-1][1]} | {target:.3f} | {ref_s:.1f} |"
    )
    say(
        f"| {fast} | {new.startup_s:.1f} | {new.points[-1][0]:.1f} | {new.points[-1][1]} | "
        f"{new.points[-1][2]:.3f} | {'not reached' if t is None else f'{t:.1f}'} |"
    )
    ratio = None if t is None else t / ref_s
    say(
        f"\n{fast} reaches cpu's final validation loss in "
        f"{'-' if ratio is None else f'{ratio:.2f}x'} of cpu's wall time (goal: at most 0.5x)"
    )
    say("\nloss against time (s: val loss)")
    for name, c in (("cpu", ref), (fast, new)):
        say(f"- {name}: " + ", ".join(f"{s:.0f}: {v:.3f}" for s, _, v in c.points))
    return {"label": label, "cpu": ref.points, fast: new.points, "ratio": ratio}


# the ladder's small shape the tokens mode compares recipes at (the recipe keeps everything else)
SHAPE = {
    "n_layer": 4,
    "n_head": 4,
    "n_kv_head": 4,
    "d_model": 256,
    "d_ff": 704,
    "max_seq_len": 256,
    "vocab_size": 4096,
}


def at_shape(spec: str, source: str, steps: int) -> tuple[str, object]:
    """(label, recipe) of a `--run LABEL=RECIPE [SECTION.FIELD=VALUE ...]` at SHAPE on `source`; the
    overrides come last (train.max_steps=210 shortens one run)."""
    label, _, rest = spec.partition("=")
    name, *overrides = rest.split()
    recipe = get_recipe(name)
    t = recipe.train
    recipe = recipe.replace(
        model=SHAPE,
        data={"source": source, "tokenizer": "train", "vocab_size": 4096, "max_chars": None},
        train={
            "micro_batch_size": 8,
            "seq_len": 256,
            "grad_accum_steps": 1,
            "max_steps": steps,
            "warmup_steps": max(1, round(steps * t.warmup_steps / t.max_steps)),
            "eval_batches": 8,
            "save_every": 0,
            "sample_every": 0,
            "precision": "fp32",
            "compile": "off",
            "device": "cpu",
            "window_start": t.window_start * 256 // t.seq_len,
        },
    )  # the same fraction of the context
    recipe = apply_overrides(recipe, overrides)
    every = max(1, recipe.train.max_steps // 5)
    return label, recipe.replace(train={"eval_every": every})


def tokens_run(spec: str, source: str, steps: int, out: str, held_out: str | None) -> dict:
    """One run of the tokens mode, in a process of its own with one thread."""
    torch.set_num_threads(1)
    label, recipe = at_shape(spec, source, steps)
    run_dir = Path(out) / label
    clock = Clock()
    pretrain(
        recipe,
        run_dir,
        progress=False,
        device="cpu",
        cache_dir=Path(out) / f"{label}.cache",
        callbacks=[clock],
    )
    t = recipe.train
    result = {
        "label": label,
        "spec": spec,
        "points": [(tokens_through(t, s), v) for _, s, v in clock.points],
        "tokens": tokens_through(t, t.max_steps),
    }
    if held_out:
        cmd = [
            sys.executable,
            "-m",
            "tinygpt",
            "eval",
            str(run_dir),
            "--task",
            "perplexity",
            "--data",
            held_out,
            "--max-chars",
            "200000",
            "--device",
            "cpu",
            "--json",
        ]
        done = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        result["held_out"] = (
            json.loads(done.stdout) if done.returncode == 0 else done.stderr.strip()[-300:]
        )
    return result


def tokens_to_loss(args: argparse.Namespace) -> None:
    """The tokens mode: every run, then the table against the first run's final validation loss."""
    source = args.corpus[0] if args.corpus else "builtin"
    out = args.out or tempfile.mkdtemp(prefix="tokens_to_loss_")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        results = list(
            pool.map(
                tokens_run,
                args.run,
                [source] * len(args.run),
                [args.steps] * len(args.run),
                [out] * len(args.run),
                [args.held_out] * len(args.run),
            )
        )
    say = results_file.Report()
    target = results[0]["points"][-1][1]
    say(
        f"\n### tokens to {target:.3f} ({results[0]['label']}'s final validation loss), {Path(source).name}\n"
    )
    say("| run | tokens | final val loss | held-out bits/byte | tokens to the target | ratio |")
    say("|---|---|---|---|---|---|")
    for r in results:
        t = reached([(tok, None, v) for tok, v in r["points"]], target)
        held = r.get("held_out")
        bpb = f"{held['bits_per_byte']:.4f}" if isinstance(held, dict) else "-"
        ratio = "-" if t is None else f"{t / results[0]['tokens']:.2f}"
        say(
            f"| {r['label']} | {r['tokens']:,} | {r['points'][-1][1]:.4f} | {bpb} | "
            f"{'not reached' if t is None else f'{t:,.0f}'} | {ratio} |"
        )
    for r in results:
        say(
            f"- {r['label']} (`{r['spec']}`): "
            + ", ".join(f"{t // 1000}k: {v:.3f}" for t, v in r["points"])
        )
    Path(out, "tokens_to_loss.json").write_text(json.dumps(results, indent=1))
    print(f"\nruns and tokens_to_loss.json: {out}")
    results_file.write(
        args.results,
        __file__,
        "tokens-to-loss",
        f"Tokens to a loss at the ladder's small shape, {Path(source).name}",
        say.text(),
        reference=f"the first run, {results[0]['label']} (`{results[0]['spec']}`): its final "
        "validation loss is the target",
    )


def plot(results: list[dict], fast: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.8), squeeze=False)
    for ax, r in zip(axes[0], results):
        for name, style in (("cpu", "o-"), (fast, "s-")):
            ax.plot(
                [p[0] for p in r[name]], [p[2] for p in r[name]], style, label=name, markersize=3
            )
        ax.axhline(r["cpu"][-1][2], color="grey", lw=0.8, ls="--")
        ax.set(
            title=r["label"],
            xlabel="wall time after the first step (s)",
            ylabel="validation loss (nats/token)",
        )
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"\nplot: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--corpus",
        action="append",
        help="builtin, or a file; default: builtin and Tiny Shakespeare "
        "from ../shared/data where present",
    )
    ap.add_argument("--fast", default="cpu-fast", help="the recipe set against `cpu`")
    ap.add_argument(
        "--fast-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override the fast recipe",
    )
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--plot", default=str(REPO / "docs" / "images" / "time_to_loss.png"))
    ap.add_argument(
        "--tokens", action="store_true", help="tokens to a loss at the ladder's small shape"
    )
    ap.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="LABEL=RECIPE [SECTION.FIELD=VALUE ...]",
        help="--tokens: a run; the first one's final validation loss is the target",
    )
    ap.add_argument(
        "--steps", type=int, default=300, help="--tokens: steps of 2,048 tokens per run"
    )
    ap.add_argument("--jobs", type=int, default=1, help="--tokens: runs at once")
    ap.add_argument("--held-out", help="--tokens: a text file for `tinygpt eval --task perplexity`")
    ap.add_argument(
        "--out", help="--tokens: keep the run folders here (default: a new temporary folder)"
    )
    results_file.add_option(ap)
    args = ap.parse_args()
    if args.tokens:
        return tokens_to_loss(args)
    corpora = args.corpus
    if not corpora:
        corpora = ["builtin"]
        shakespeare = shared_data_dir() / "tinyshakespeare.txt"
        if shakespeare.is_file():
            corpora.append(str(shakespeare))
        else:
            print(f"(no {shakespeare}: the second corpus is skipped)", file=sys.stderr)
    say = results_file.Report()
    print(
        f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    results = [
        compare(
            c,
            "built-in corpus" if c == "builtin" else Path(c).name,
            args.fast,
            args.fast_set,
            args.eval_every,
            say,
        )
        for c in corpora
    ]
    if args.plot:
        plot(results, args.fast, Path(args.plot))
    results_file.write(
        args.results,
        __file__,
        "time-to-loss",
        f"Time to a validation loss: {args.fast} against cpu",
        say.text(),
        reference="the `cpu` recipe on the same text, tokenizer and validation batches (the cpu rows); "
        f"goal: {args.fast} reaches its final loss in at most 0.5x its wall time",
    )


if __name__ == "__main__":
    main()
