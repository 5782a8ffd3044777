"""Does llama.cpp run tinygpt's GGUF export as tinygpt runs the checkpoint? (issue 24)

For each kind of run a recipe makes (its own BPE and GPT-2's BPE, with and without QK-norm, and a merged
LoRA finetune), trained here for a few steps on the built-in corpus, this exports a GGUF, loads it with
llama.cpp (through llama-cpp-python) and compares on the same held-out text:
- tokenization: llama.cpp's token ids against tinygpt's;
- greedy continuation: 32 tokens after a 32-token prompt, llama.cpp's against tinygpt's (full forward passes);
- perplexity of the text: llama.cpp's logits against tinygpt's, as a ratio.

    pip install gguf llama-cpp-python     # llama-cpp-python builds llama.cpp with CMake (minutes)
    python benchmarks/gguf_agreement.py --steps 60 --quant f16 [--json out.json]

The table goes to a dated file in benchmarks/results/ (`--results`; docs/BENCHMARKS.md section 11 indexes it); tests/test_gguf.py runs the same comparison on tiny models.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import results_file
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tinygpt.core.recipes import get_recipe  # noqa: E402
from tinygpt.finetune.lora import load_finetuned  # noqa: E402
from tinygpt.model.loading import load_run  # noqa: E402
from tinygpt.publish.export import export  # noqa: E402


def held_out_text(chars: int = 6000) -> str:
    """Source the built-in corpus never trains on: this repository's own tinygpt/model/gpt.py."""
    return (REPO / "tinygpt" / "model" / "gpt.py").read_text(encoding="utf-8")[:chars]


def logits_fn(model: Any, hf: bool):
    """ids (list) -> float64 logits (len, vocab) of tinygpt's GPT, or of a transformers model (a merged finetune)."""

    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            x = torch.tensor([ids])
            out = model(input_ids=x).logits if hf else model(x)
        return out[0].double().numpy()

    return run


def nll(logits: np.ndarray, ids: list[int]) -> float:
    """Mean negative log-likelihood of ids[1:] under logits[:-1] (natural log)."""
    z = logits[:-1] - logits[:-1].max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].mean())


def greedy(logits_of, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(logits_of(ids)[-1])))
    return ids[len(prompt) :]


class LlamaCpp:
    """A GGUF loaded in llama.cpp (CPU), with the same three operations as the tinygpt side."""

    def __init__(self, path: Path, n_ctx: int, threads: int = 2):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            logits_all=True,
            verbose=False,
            n_threads=threads,
            n_batch=n_ctx,
            seed=0,
        )

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float64)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        out = []
        for _ in range(n):
            tok = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            out.append(tok)
            self.llm.eval([tok])
        return out


def compare(
    gguf_path: Path, logits_of, tokenizer: Any, context: int, text: str, n_new: int = 32
) -> dict[str, Any]:
    """Tokenization, greedy tokens and perplexity of llama.cpp (the GGUF) against tinygpt (logits_of)."""
    cpp = LlamaCpp(gguf_path, context)
    ours = tokenizer.encode(text) if hasattr(tokenizer, "eot_id") else tokenizer(text)["input_ids"]
    theirs = cpp.tokenize(text)
    ids = ours[:context]
    prompt = ids[:32]
    g_ours, g_cpp = greedy(logits_of, prompt, n_new), cpp.greedy(prompt, n_new)
    same = next((i for i, (a, b) in enumerate(zip(g_ours, g_cpp)) if a != b), n_new)
    ppl_ours, ppl_cpp = math.exp(nll(logits_of(ids), ids)), math.exp(nll(cpp.logits(ids), ids))
    return {
        "tokens": len(ours),
        "tokenization_equal": ours == theirs,
        "greedy_equal": g_ours == g_cpp,
        "greedy_same_prefix": same,
        "ppl_tinygpt": ppl_ours,
        "ppl_llama_cpp": ppl_cpp,
        "ppl_rel_diff": ppl_cpp / ppl_ours - 1,
    }


KINDS = {  # name: recipe overrides of cpu-smoke
    "own BPE, llama": {},
    "own BPE, QK-norm (qwen3)": {"model": {"qk_norm": True}},
    "GPT-2 BPE, llama": {
        "data": {"tokenizer": "gpt2", "vocab_size": 50304},
        "model": {"vocab_size": 50304},
    },
    "GPT-2 BPE, QK-norm (qwen3)": {
        "data": {"tokenizer": "gpt2", "vocab_size": 50304},
        "model": {"vocab_size": 50304, "qk_norm": True},
    },
}


def train_runs(root: Path, steps: int, finetune_steps: int) -> dict[str, Path]:
    from tinygpt.finetune.run_finetune import finetune
    from tinygpt.finetune.stdlib_instructions import write_stdlib_instructions
    from tinygpt.pretrain.run_pretrain import pretrain

    runs = {}
    for i, (name, over) in enumerate(KINDS.items()):
        recipe = get_recipe("cpu-smoke").replace(**over)
        if not (root / f"run{i}" / "best").is_dir():  # a --root trained before is reused
            pretrain(
                recipe, root / f"run{i}", max_steps=steps, progress=False, cache_dir=root / "cache"
            )
        runs[name] = root / f"run{i}"
    data = write_stdlib_instructions(root / "instructions.json", 500)
    if not (root / "ft" / "adapter").is_dir():
        finetune(
            "lora-r8",
            str(runs["own BPE, llama"]),
            str(data),
            root / "ft",
            hardware="cpu",
            progress=False,
            train=dict(
                seq_len=128,
                micro_batch_size=4,
                grad_accum_steps=1,
                max_steps=finetune_steps,
                warmup_steps=2,
                lr=5e-3,
                eval_every=finetune_steps,
                save_every=finetune_steps,
                eval_batches=1,
            ),
        )
    runs["merged LoRA (lora-r8 on own BPE, llama)"] = root / "ft"
    return runs


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--steps", type=int, default=60, help="pretraining steps of each run (cpu-smoke)"
    )
    p.add_argument("--finetune-steps", type=int, default=20)
    p.add_argument("--quant", nargs="+", default=["f16", "f32", "q8_0"])
    p.add_argument("--root", default=None, help="where the runs go (default: a temporary folder)")
    p.add_argument("--json", default=None)
    results_file.add_option(p)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root or tmp)
        shutil.rmtree(root / "gguf", ignore_errors=True)
        t0 = time.time()
        runs = train_runs(root, args.steps, args.finetune_steps)
        print(f"trained {len(runs)} runs in {time.time() - t0:.0f} s")
        text = held_out_text()
        for name, run in runs.items():
            if (run / "run.json").is_file():
                model, tok, recipe, _ = load_run(run)
                logits_of, context = logits_fn(model, False), recipe.model.max_seq_len
            else:
                model, tok = load_finetuned(run, merge=True)
                logits_of, context = logits_fn(model, True), model.config.max_position_embeddings
            for quant in args.quant:
                out = root / "gguf" / str(len(rows))
                export(run, out, "gguf", quant)
                r = {
                    "run": name,
                    "quant": quant,
                    **compare(next(out.glob("*.gguf")), logits_of, tok, context, text),
                }
                rows.append(r)
                print(
                    f"{name:<42} {quant:<5} tokenization {'same' if r['tokenization_equal'] else 'DIFFERENT'}, "
                    f"greedy {r['greedy_same_prefix']}/32 same, perplexity {r['ppl_tinygpt']:.4f} (tinygpt) vs "
                    f"{r['ppl_llama_cpp']:.4f} (llama.cpp): {100 * r['ppl_rel_diff']:+.3f}%",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    shown = [
        {**r, **{k: f"{r[k]:.4f}" for k in ("ppl_tinygpt", "ppl_llama_cpp")}}
        | {"ppl_rel_diff": f"{100 * r['ppl_rel_diff']:+.3f}%"}
        for r in rows
    ]
    results_file.write(
        args.results,
        __file__,
        "gguf-agreement",
        "GGUF in llama.cpp against tinygpt",
        f"Runs of cpu-smoke, {args.steps} pretraining steps each (the LoRA {args.finetune_steps} "
        "steps), exported at each type; a held-out text of tinygpt/model/gpt.py.\n\n"
        + results_file.table(shown),
        argv,
        "tinygpt's own forward pass on the same checkpoint (ppl_tinygpt, and the greedy tokens and ids "
        "each row compares); goal: perplexity within 1%",
    )
    return rows


if __name__ == "__main__":
    main()
