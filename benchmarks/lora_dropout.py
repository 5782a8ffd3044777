"""LoRA dropout 0 against the presets' 0.05: what it does to quality, at equal steps and seeds.

    python benchmarks/lora_dropout.py --base runs/cpu-base --data ../shared/data/code_alpaca_2k.json \\
        --steps 150 --seeds 0 1

The base is a tinygpt pretraining run (made here with the `cpu-fast` recipe on the built-in corpus when
--base does not exist yet). Each (seed, dropout) pair finetunes `lora-r16` with only the dropout
changed and reports the held-out loss of the records the trainer sets aside. A seed sets the
adapter's initial weights, the batch order and the held-out split, so the two dropouts of one seed
differ in the dropout alone: compare within a seed. unsloth's fast LoRA path needs
dropout 0; on the GPU it saves the dropout masks' memory and a kernel per adapted layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_file  # noqa: E402

from tinygpt.finetune.presets import get_finetune_recipe  # noqa: E402
from tinygpt.finetune.run_finetune import finetune  # noqa: E402
from tinygpt.pretrain.run_pretrain import pretrain  # noqa: E402


def base_run(path: Path, steps: int) -> Path:
    if not (path / "checkpoints").is_dir():
        pretrain("cpu-fast", path, max_steps=steps, progress=False)
    return path


def one(base: Path, data: str, dropout: float, seed: int, steps: int, out: Path) -> dict:
    preset = get_finetune_recipe("lora-r16")
    recipe = dataclasses.replace(
        preset, lora=dataclasses.replace(preset.lora, dropout=dropout), name=f"lora-d{dropout}"
    )
    t0 = time.process_time()
    result = finetune(
        recipe,
        str(base),
        data,
        out / f"d{dropout}-s{seed}",
        max_steps=steps,
        device="cpu",
        progress=False,
        train={"seed": seed, "eval_every": steps},
    )
    return {
        "dropout": dropout,
        "seed": seed,
        "val_loss": result.train.val_loss,
        "train_loss": result.train.loss,
        "cpu_s": round(time.process_time() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--base-steps", type=int, default=300)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--dropouts", type=float, nargs="+", default=[0.05, 0.0])
    results_file.add_option(ap)
    args = ap.parse_args()
    base = base_run(args.base, args.base_steps)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            one(base, args.data, d, s, args.steps, Path(tmp))
            for s in args.seeds
            for d in args.dropouts
        ]
    for r in rows:
        print(json.dumps(r))
    means = {
        d: statistics.mean(r["val_loss"] for r in rows if r["dropout"] == d) for d in args.dropouts
    }
    for d, m in means.items():
        print(f"dropout {d}: held-out loss mean {m:.4f}")
    results_file.write(
        args.results,
        __file__,
        "lora-dropout",
        f"LoRA r16 dropout {' vs '.join(map(str, args.dropouts))}: held-out loss after "
        f"{args.steps} steps, seeds {args.seeds}",
        results_file.table(rows)
        + "\n\n"
        + "\n".join(f"- dropout {d}: mean held-out loss {m:.4f}" for d, m in means.items()),
        reference=f"the presets' dropout ({args.dropouts[0]})",
    )


if __name__ == "__main__":
    main()
