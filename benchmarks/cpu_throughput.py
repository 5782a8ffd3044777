"""CPU throughput: tokenizing the built-in corpus into the token cache, and training the default recipe.

    python benchmarks/cpu_throughput.py                      # the `cpu` recipe, 50 timed steps
    python benchmarks/cpu_throughput.py --recipe cpu-smoke --steps 20 --json

Prints tokens/s of (1) BPE training, (2) the token cache build (fresh cache folder) and
(3) training steps after warm-up (median over steps, the loss read every step so the
timing is honest on any device), and writes them to a dated file in benchmarks/results/ (`--results`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import results_file
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinygpt.core.recipes import get_recipe  # noqa: E402
from tinygpt.data.sampler import WindowSampler  # noqa: E402
from tinygpt.data.shards import build_token_cache  # noqa: E402
from tinygpt.data.sources import iter_documents  # noqa: E402
from tinygpt.model.gpt import GPT  # noqa: E402
from tinygpt.model.tokenizer import train_bpe  # noqa: E402
from tinygpt.pretrain.run_tokenizer import TOKENIZER_TRAIN_CHARS  # noqa: E402
from tinygpt.train.optim import build_optimizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipe", default="cpu")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    ap.add_argument("--json", action="store_true")
    results_file.add_option(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = get_recipe(args.recipe)
    d = recipe.data

    t0 = time.perf_counter()
    sample = iter_documents(
        type(d)(**{**d.to_dict(), "max_chars": min(d.max_chars or 1e12, TOKENIZER_TRAIN_CHARS)})
    )
    tok = train_bpe(sample, d.vocab_size)
    bpe_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        data = build_token_cache(d, tok, cache)
        cache_s = time.perf_counter() - t0
        n_tokens = data.meta["train_tokens"] + data.meta["val_tokens"]
        tc = recipe.train
        torch.manual_seed(0)
        model = GPT(recipe.model)
        opt = build_optimizer(model, tc, "cpu")
        sampler = WindowSampler(data, tc.seq_len, tc.seed)
        times = []
        for i in range(args.warmup + args.steps):
            t = time.perf_counter()
            for _ in range(tc.grad_accum_steps):
                x, y = sampler.next_batch(tc.micro_batch_size)
                (model(x, y) / tc.grad_accum_steps).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
        step_s = statistics.median(times)
    row = {
        "date": time.strftime("%Y-%m-%d"),
        "recipe": recipe.name,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "params": model.num_params(),
        "corpus_chars": data.meta["chars"],
        "tokens": n_tokens,
        "chars_per_token": round(data.meta["chars_per_token"], 3),
        "bpe_train_s": round(bpe_s, 2),
        "cache_build_s": round(cache_s, 2),
        "cache_tokens_per_s": round(n_tokens / cache_s),
        "step_s_median": round(step_s, 4),
        "train_tokens_per_s": round(tc.tokens_per_step / step_s),
        "recipe_time_estimate_s": round(step_s * tc.max_steps + bpe_s + cache_s, 1),
    }
    if args.json:
        print(json.dumps(row, indent=1))
    else:
        for k, v in row.items():
            print(f"{k:>24}: {v}")
    results_file.write(
        args.results,
        __file__,
        "cpu-throughput",
        f"CPU throughput: token cache and training steps of recipe `{recipe.name}`",
        results_file.table([{"measure": k, "value": v} for k, v in row.items()]),
        reference="the issue's bound: the `cpu` recipe trains within 5 minutes on 2 cores "
        "(recipe_time_estimate_s)",
    )


if __name__ == "__main__":
    main()
