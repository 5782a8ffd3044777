"""`--size auto --hours H` against each fixed CPU recipe given the same hours, on one corpus, one evaluator.

    python benchmarks/size_auto.py --hours 0.1667 --out /tmp/size_auto                 # builtin, 10 minutes
    python benchmarks/size_auto.py --hours 0.6667 --data ../shared/data/wikitext2_test.txt \\
        --heldout ../shared/data/wikitext2_valid.txt --out /tmp/size_auto_ts     # another corpus, 40 min

Runs, one after another (never side by side: each budget is this machine's time): `cpu --size auto`, then
`cpu`, `cpu-fast` and `cpu-smoke` as they are, each with `--hours H` (and `--data` when given). The evaluator
is the same for all: bits per byte (tokenizer-independent: the recipes have 512- and 4096-token vocabularies)
on a held-out text none of them trained on (--heldout; by default Python sources outside the standard library,
numpy's, for the builtin corpus). Runs already in --out are resumed, so a finished one is only evaluated.
Prints a markdown table for docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tinygpt.evals.lm import perplexity  # noqa: E402
from tinygpt.model.loading import load_run  # noqa: E402
from tinygpt.train.pretrain import pretrain  # noqa: E402

RUNS = [("cpu", "auto"), ("cpu", None), ("cpu-fast", None), ("cpu-smoke", None)]
HELDOUT_CHARS = 200_000


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", default=None, help="the corpus (default: each recipe's, builtin)")
    ap.add_argument("--heldout", type=Path, default=None, help="held-out text (default: numpy's sources)")
    args = ap.parse_args(argv)
    heldout = args.heldout.read_text()[:HELDOUT_CHARS] if args.heldout else default_heldout()
    rows = []
    for recipe, size in RUNS:
        run_dir = args.out / f"{recipe}{'-auto' if size else ''}"
        t0, c0 = time.time(), time.process_time()
        result = pretrain(recipe, run_dir, hours=args.hours, size=size, data=args.data, device="cpu",
                          progress=False, tensorboard=False)
        train_wall, train_cpu = time.time() - t0, time.process_time() - c0
        model, tokenizer = load_run(run_dir, "latest", "cpu")[:2]
        score = perplexity(model, tokenizer, heldout)
        info = json.loads((run_dir / "run.json").read_text())
        m = info["recipe"]["model"]
        rows.append({"run": f"{recipe}{' --size auto' if size else ''}", "size": (info.get("plan") or {}).get("size"),
                     "layers x width": f"{m['n_layer']} x {m['d_model']}", "steps": result.step,
                     "val_loss (own tokens)": result.val_loss, "bits_per_byte": score["bits_per_byte"],
                     "train_wall_s": round(train_wall), "train_cpu_s": round(train_cpu)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; --hours {args.hours:g}, data {args.data or 'builtin'}\n")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    best = min(rows, key=lambda r: r["bits_per_byte"])
    print(f"\nlowest bits per byte: {best['run']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
