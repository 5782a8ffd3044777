"""`--size auto --hours H` against each fixed CPU recipe given the same hours, on one corpus, one evaluator.

    python benchmarks/size_auto.py --hours 0.1667 --out /tmp/size_auto                 # builtin, 10 minutes
    python benchmarks/size_auto.py --hours 0.6667 --data ../shared/data/wikitext2_test.txt \\
        --heldout ../shared/data/wikitext2_valid.txt --out /tmp/size_auto_ts     # another corpus, 40 min
    ... --side-by-side --threads 1          # the four runs at once, one thread each
    ... --start-at $(($(date +%s) + 90))    # two side-by-side commands, one start
    ... --validation                        # also on the source's own validation split
    ... --score-only                        # evaluate the finished runs in --out again, train nothing

The runs: `--size auto` on the ladder `tinygpt pretrain --size auto` plans on a CPU (cpu-fast's; --auto-recipe
to choose another), then `cpu`, `cpu-fast` and `cpu-smoke` as they are, each with `--hours H` (and `--data`
when given). One after another by default (each budget is then this machine's time); with --side-by-side all at
once, as processes of --threads threads, so that every run, the planner's timing included, sees the same
machine (each run's steps are fixed from its own speed when it starts: a load that comes later slows all of
them alike and changes no run's steps). The evaluator is the same for all: bits per byte (tokenizer-independent:
the recipes have 512- and 4096-token vocabularies), in windows of the context each run trained at (as `tinygpt
eval perplexity` scores), on a held-out text none of them trained on (--heldout; by default Python sources
outside the standard library, numpy's, for the builtin corpus). Runs already in --out are resumed, so a
finished one is only evaluated. Prints a markdown table and writes it to a dated file in benchmarks/results/
(`--results`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import results_file  # noqa: E402
import torch  # noqa: E402

from tinygpt.core.checkpoint import step_of  # noqa: E402
from tinygpt.core.config import DataConfig  # noqa: E402
from tinygpt.core.gpu_classes import size_auto_recipe  # noqa: E402
from tinygpt.data.sources import validation_text  # noqa: E402
from tinygpt.evals.lm import perplexity  # noqa: E402
from tinygpt.model.loading import load_run  # noqa: E402
from tinygpt.pretrain.run_pretrain import pretrain  # noqa: E402

FIXED = ("cpu", "cpu-fast", "cpu-smoke")
HELDOUT_CHARS = 200_000
# side by side, the runs wait this long after launch: eight processes importing torch at once would
# otherwise slow the planner's timing (the fixed recipes measure their speed later, on their own steps)
START_DELAY_S = 60.0


def default_heldout() -> str:
    """Python that the builtin corpus (the standard library's sources) does not hold: numpy's own sources."""
    import numpy

    files = sorted(Path(numpy.__file__).parent.rglob("*.py"))
    text = ""
    for f in files:
        text += f.read_text(errors="replace") + "\n"
        if len(text) >= HELDOUT_CHARS:
            break
    return text[:HELDOUT_CHARS]


def run_one(recipe: str, size: str | None, args: argparse.Namespace, heldout: str) -> dict:
    """Train one run for the hours (resumed if --out has it), evaluate it on the held-out text: its row."""
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = args.out / f"{recipe}{'-auto' if size else ''}"
    t0, c0 = time.time(), time.process_time()
    val_loss = None
    if not args.score_only:
        val_loss = pretrain(
            recipe,
            run_dir,
            hours=args.hours,
            size=size,
            data=args.data,
            device="cpu",
            progress=False,
            tensorboard=False,
        ).val_loss
    train_wall, train_cpu = time.time() - t0, time.process_time() - c0
    model, tokenizer, trained, ckpt = load_run(run_dir, "latest", "cpu")
    # windows of the context the run trained at, as `tinygpt eval perplexity` scores: the recipes keep a
    # position table twice their training context, and positions never trained are not the model's
    window = trained.train.seq_len
    score = perplexity(model, tokenizer, heldout, window)
    extra = {}
    if args.validation:  # the source's own validation split, the same text for every run
        split = validation_text(DataConfig(source=args.data or "builtin", max_chars=4_000_000))[
            :HELDOUT_CHARS
        ]
        extra["bits_per_byte_validation"] = perplexity(model, tokenizer, split, window)[
            "bits_per_byte"
        ]
    info = json.loads((run_dir / "run.json").read_text())
    m = info["recipe"]["model"]
    return {
        "run": f"{recipe}{' --size auto' if size else ''}",
        "size": (info.get("plan") or {}).get("size") or "",
        "layers x width": f"{m['n_layer']} x {m['d_model']}",
        "steps": step_of(ckpt),
        "val_loss (own tokens)": val_loss,
        "window": window,
        "bits_per_byte": score["bits_per_byte"],
        "train_wall_s": round(train_wall),
        "train_cpu_s": round(train_cpu),
        **extra,
    }


def side_by_side(
    runs: list[tuple[str, str | None]], argv: list[str], start_at: float
) -> list[dict]:
    """Each run in its own process, all started at once; their rows, in the order of `runs` (`--start-at`
    goes last: argparse keeps the last of a repeated option, so a --start-at in `argv` is overridden)."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *argv, "--only", str(i), "--start-at", str(start_at)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(len(runs))
    ]
    rows = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a run failed (exit {proc.returncode})")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hours", type=float, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", default=None, help="the corpus (default: each recipe's, builtin)")
    ap.add_argument(
        "--heldout", type=Path, default=None, help="held-out text (default: numpy's sources)"
    )
    ap.add_argument(
        "--auto-recipe", default=size_auto_recipe("cpu", "cpu"), help="the ladder --size auto plans"
    )
    ap.add_argument(
        "--side-by-side", action="store_true", help="all runs at once, one process each"
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads per run (default: torch's)"
    )
    ap.add_argument(
        "--validation",
        action="store_true",
        help="also bits per byte on the source's own validation split (4M-character cap)",
    )
    ap.add_argument(
        "--score-only",
        action="store_true",
        help="evaluate the runs --out holds as they are, train nothing (no val_loss, no times)",
    )
    ap.add_argument(
        "--start-at",
        type=float,
        default=None,
        help="with --side-by-side: when the runs start (seconds since the epoch; default: in "
        f"{START_DELAY_S:.0f} s), shared by two commands started together",
    )
    ap.add_argument(
        "--only", type=int, default=None, help=argparse.SUPPRESS
    )  # one run, in its own process
    results_file.add_option(ap)
    args = ap.parse_args(argv)
    runs = [(args.auto_recipe, "auto")] + [(name, None) for name in FIXED]
    heldout = args.heldout.read_text()[:HELDOUT_CHARS] if args.heldout else default_heldout()
    if args.only is not None:
        # every process has imported and read its texts: the planner's timing sees the runs, not start-ups
        time.sleep(max(0.0, (args.start_at or 0) - time.time()))
        print(json.dumps(run_one(*runs[args.only], args, heldout)), flush=True)
        return 0
    if args.side_by_side:
        start_at = args.start_at or time.time() + START_DELAY_S
        rows = side_by_side(runs, [a for a in argv if a != "--side-by-side"], start_at)
    else:
        rows = []
        for recipe, size in runs:
            rows.append(run_one(recipe, size, args, heldout))
            print(json.dumps(rows[-1]), flush=True)
    say = results_file.Report()
    say(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}; --hours {args.hours:g}, data {args.data or 'builtin'}"
        f"{', side by side' if args.side_by_side else ''}, threads {args.threads or torch.get_num_threads()}\n"
    )
    keys = list(rows[0])
    say("| " + " | ".join(keys) + " |")
    say("|" + "---|" * len(keys))
    for r in rows:
        say(
            "| "
            + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in r.values())
            + " |"
        )
    best = min(rows, key=lambda r: r["bits_per_byte"])
    say(f"\nlowest bits per byte: {best['run']}")
    results_file.write(
        args.results,
        __file__,
        "size-auto",
        f"`--size auto --hours {args.hours:g}` against the fixed CPU recipes, {Path(args.data).name if args.data else 'builtin'}",
        say.text(),
        argv,
        "the fixed recipes cpu, cpu-fast and cpu-smoke with the same --hours (their rows), scored on the "
        "same held-out text",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
