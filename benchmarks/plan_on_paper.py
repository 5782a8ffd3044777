"""What `--size auto` would choose on each Colab GPU, on paper: no GPU needed.

    python benchmarks/plan_on_paper.py          # a markdown table, to a dated file in benchmarks/results/
    python benchmarks/plan_on_paper.py --text-tokens 250000    # on a text of that many tokens (--data FILE)

For each GPU class (T4, L4, A100, H100) and budget (1, 3, 12 hours), the planner (`tinygpt.fit.plan`) runs
on the class's default recipe (the H100 on h100-760m's ladder, context 2048) with tokens/s assumed, not
measured: the GPU's peak dense bf16/fp16 TFLOP/s (core/gpu_classes.py) times an MFU of 0.4, divided by each
rung's training FLOPs per token. The rungs must fit the class's memory at micro-batch 1 (the probe lowers the
micro-batch; activation checkpointing is not assumed). To be replaced by measured rows when a GPU is lent:
`tinygpt probe --hours H` there prints the same table from timed steps. With --text-tokens, the source is a
user's own text of that many tokens (Tiny Shakespeare is ~250k GPT-2 tokens), read again where the hours buy
more: the epochs column counts them, and "own size" marks a plan with no rung within the law (each would read
it more than MAX_EPOCHS times or see too few tokens per parameter: the recipe's own size is kept).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import results_file  # noqa: E402

from tinygpt.core.gpu_classes import HARDWARE  # noqa: E402
from tinygpt.core.recipes import get_recipe  # noqa: E402
from tinygpt.core.units import count  # noqa: E402
from tinygpt.fit.ladder import law_for, unique_tokens  # noqa: E402
from tinygpt.fit.memory import estimate_memory  # noqa: E402
from tinygpt.fit.plan import plan_size  # noqa: E402
from tinygpt.model.gpt import meta_model  # noqa: E402

MFU = 0.4
GPUS = {
    "t4": ("T4", 15.0, "t4-50m"),
    "l4": ("L4", 22.0, "l4-124m"),
    "a100": ("A100", 40.0, "a100-124m"),
    "h100": ("H100", 80.0, "h100-760m"),
}


def per_param(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--text-tokens", type=float, default=None, help="a source of this many tokens")
    results_file.add_option(ap)
    args = ap.parse_args()
    say = results_file.Report()
    say(
        "| GPU | recipe ladder | hours | assumed tokens/s (chosen) | chosen | non-emb. params | tokens "
        "| tokens/param | epochs | law |"
    )
    say("|---|---|---|---|---|---|---|---|---|---|")
    for cls, (gpu, mem_gb, recipe_name) in GPUS.items():
        hw = HARDWARE[cls]
        peak = dict(hw.gpus)[gpu] * 1e12
        recipe = get_recipe(recipe_name)
        prec = hw.precision

        def speed(r, peak=peak):
            return MFU * peak / meta_model(r.model).flops_per_token(r.train.seq_len)

        def fits(r, mem_gb=mem_gb, prec=prec):
            return (
                estimate_memory(r.model, 1, r.train.seq_len, prec, device_type="cuda").total_gb
                <= mem_gb
            )

        for hours in (1, 3, 12):
            unique = args.text_tokens or unique_tokens(recipe)
            plan = plan_size(recipe, hours, speed, fits=fits, unique_tokens=unique)
            c = plan.choice
            epochs = "-" if c.epochs is None else f"{c.epochs:,.2f}"
            size = f"{c.size} (own size)" if plan.outside_law else c.size
            say(
                f"| {gpu} | {recipe_name} | {hours} | {c.tokens_per_s:,.0f} | {size} | {count(c.params)} | "
                f"{count(c.tokens)} | {per_param(c.tokens_per_param)} | {epochs} | {law_for(recipe).source} |"
            )
    source = (
        f"a text of {args.text_tokens:,.0f} tokens" if args.text_tokens else "each recipe's source"
    )
    results_file.write(
        args.results,
        __file__,
        "plan-on-paper",
        f"What `--size auto` would choose on each Colab GPU, on paper, on {source}",
        f"tokens/s assumed, not measured: the GPU's peak dense TFLOP/s x MFU {MFU}.\n\n"
        + say.text(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
