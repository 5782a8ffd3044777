"""Evaluation of the default CPU recipe's model: perplexity and bits per byte on WikiText-2 test, HellaSwag.

    python benchmarks/eval_cpu.py                                  # trains runs/cpu-eval first if it has no checkpoint
    python benchmarks/eval_cpu.py --run-dir runs/cpu --window 256 --stride 128 --hellaswag-limit 500

Every figure comes from the `tinygpt` command itself, run as a subprocess with --json, so the commands printed
with the results are exactly what was measured. The Markdown section printed goes to a dated file in
benchmarks/results/ (`--results`).
A uniform guess over the vocabulary (perplexity = vocab size) and random HellaSwag answers (25%) are the floors.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import results_file

REPO = Path(__file__).resolve().parents[1]
DATA = Path(
    os.path.relpath(os.environ.get("TINYGPT_SHARED_DATA", REPO.parent / "shared" / "data"), REPO)
)


def tinygpt(*args: str) -> tuple[str, float, str]:
    """(stdout, wall seconds, the command as a user types it) of `tinygpt ARGS`."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tinygpt", *args], cwd=REPO, capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"tinygpt {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout, time.perf_counter() - t0, "tinygpt " + shlex.join(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default="runs/cpu-eval")
    ap.add_argument("--recipe", default="cpu")
    ap.add_argument(
        "--window", type=int, default=256, help="tokens per window (the cpu recipe's context)"
    )
    ap.add_argument(
        "--stride",
        type=int,
        default=128,
        help="each scored token sees at least window - stride tokens",
    )
    ap.add_argument(
        "--max-chars", type=int, default=None, help="characters of WikiText-2 test (default: all)"
    )
    ap.add_argument("--hellaswag-limit", type=int, default=500)
    ap.add_argument("--device", default="cpu")
    results_file.add_option(ap)
    args = ap.parse_args()
    import torch

    run = args.run_dir
    run_path = (
        REPO / run
    )  # the commands run in the repository root; an absolute path stays as it is
    lines = []
    train = ("pretrain", "--recipe", args.recipe, "--run-dir", run, "--quiet")
    if list(run_path.glob("checkpoints/step_*")):
        lines.append(f"    tinygpt {shlex.join(train)}    # (trained before)")
    else:
        _, train_s, cmd = tinygpt(*train)
        lines.append(f"    {cmd}    # {train_s / 60:.1f} min")
    summary = json.loads(tinygpt("eval", run, "--task", "summary", "--json")[0])
    ppl_args = [
        "eval",
        run,
        "--task",
        "perplexity",
        "--data",
        str(DATA / "wikitext2_test.txt"),
        "--window",
        str(args.window),
        "--stride",
        str(args.stride),
        "--device",
        args.device,
        "--json",
    ]
    if args.max_chars:
        ppl_args += ["--max-chars", str(args.max_chars)]
    out, ppl_s, ppl_cmd = tinygpt(*ppl_args)
    ppl = json.loads(out)
    out, hs_s, hs_cmd = tinygpt(
        "eval",
        run,
        "--task",
        "hellaswag",
        "--data",
        str(DATA / "hellaswag_val.txt.bz2"),
        "--limit",
        str(args.hellaswag_limit),
        "--device",
        args.device,
        "--json",
    )
    hs = json.loads(out)
    data_cfg = json.loads((run_path / "run.json").read_text())["recipe"]["data"]
    vocab_size, source = data_cfg["vocab_size"], data_cfg["source"]
    source = "the standard library's source" if source == "builtin" else source
    uniform_bpb = ppl["tokens"] * math.log2(vocab_size) / ppl["bytes"]
    lines += [f"    {ppl_cmd}    # {ppl_s:.0f} s", f"    {hs_cmd}    # {hs_s:.0f} s"]
    hs_ref = hs["reference"]
    title = f"Evaluation of the model of recipe `{summary['recipe']}`"
    md = f"""{datetime.date.today().isoformat()}, CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()}, \
{torch.get_num_threads()} torch threads), torch {torch.__version__}, Python {platform.python_version()}. The model of `tinygpt pretrain` (recipe
`{summary["recipe"]}`, {summary["steps"]} steps, {summary["tokens_seen"]:,} tokens of {source};
best validation loss {summary["val_loss_best"]:.3f} at step {summary["val_loss_best_step"]}), its latest checkpoint:

{chr(10).join(lines)}

| evaluation | setting | result | floor |
|---|---|---|---|
| WikiText-2 test, perplexity (per token) | offline word-level file with `<unk>`, {ppl["bytes"]:,} bytes, \
{ppl["tokens"]:,} tokens; window {ppl["window"]}, stride {ppl["stride"]} ({ppl["windows"]:,} windows) \
| {ppl["perplexity"]:.1f} | {vocab_size:,} (uniform over the vocabulary) |
| WikiText-2 test, bits per byte | same | {ppl["bits_per_byte"]:.3f} | {uniform_bpb:.3f} |
| HellaSwag validation, acc | first {hs["n"]} of 10,042 items | {hs["acc"]:.1%} ± {hs["acc_stderr"]:.1%} \
| 25% (random); GPT-2 124M {hs_ref["gpt2-124m"]["acc"]:.1%} |
| HellaSwag validation, acc_norm | same | {hs["acc_norm"]:.1%} ± {hs["acc_norm_stderr"]:.1%} \
| 25% (random); GPT-2 124M {hs_ref["gpt2-124m"]["acc_norm"]:.1%} |
"""
    print(f"### {title}\n\n{md}")
    results_file.write(
        args.results,
        __file__,
        "eval-cpu-recipe",
        title,
        md,
        reference="the floors: a uniform guess over the vocabulary, random HellaSwag answers (25%); "
        "GPT-2 124M's HellaSwag accuracy",
    )


if __name__ == "__main__":
    main()
