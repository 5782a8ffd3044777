"""The `tinygpt` command: probe | recipes | pretrain | finetune | generate | eval | export."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import ConfigError, RECIPES, Recipe, get_recipe


def _recipes(args) -> int:
    rows = []
    for r in RECIPES.values():
        rows.append((r.name, r.hardware, _param_count(r.model), r.train.seq_len, r.train.tokens_per_step,
                     r.token_budget, r.train.precision, r.description))
    if args.json:
        print(json.dumps([dict(zip(("name", "hardware", "params", "context", "tokens_per_step", "token_budget",
                                    "precision", "description"), row)) for row in rows], indent=1))
        return 0
    print(f"{'recipe':<12} {'hw':<5} {'params':>8} {'ctx':>5} {'tok/step':>9} {'budget':>8} {'prec':<5} description")
    for name, hw, p, ctx, tps, budget, prec, desc in rows:
        print(f"{name:<12} {hw:<5} {p / 1e6:>7.1f}M {ctx:>5} {tps:>9,} {budget / 1e6:>7.0f}M {prec:<5} {desc}")
    return 0


def _param_count(m) -> int:
    """Exact parameter count from the config alone (matches GPT.num_params)."""
    attn = m.d_model * m.head_dim * (2 * m.n_head + 2 * m.n_kv_head)
    mlp = 3 * m.d_model * m.d_ff
    per_layer = attn + mlp + 2 * m.d_model
    emb = m.vocab_size * m.d_model
    return m.n_layer * per_layer + m.d_model + emb * (1 if m.tie_embeddings else 2)


def apply_overrides(recipe: Recipe, assignments: list[str]) -> Recipe:
    """`train.lr=1e-3`-style overrides, values parsed as JSON where they can be (numbers, true, null)."""
    changes: dict[str, dict] = {"model": {}, "train": {}, "data": {}}
    for a in assignments:
        key, sep, raw = a.partition("=")
        section, _, name = key.partition(".")
        if not sep or section not in changes or not name:
            raise ConfigError(f"cannot read override {a!r}: write SECTION.FIELD=VALUE with SECTION model, train or data")
        fields = getattr(recipe, section).to_dict()
        if name not in fields:
            raise ConfigError(f"{section} has no field {name!r}; fields: {', '.join(fields)}")
        try:
            changes[section][name] = json.loads(raw)
        except ValueError:
            changes[section][name] = raw
    return recipe.replace(**changes)


def _pretrain(args) -> int:
    from .pretrain import pretrain

    res = pretrain(apply_overrides(get_recipe(args.recipe), args.set), args.run_dir, data=args.data, max_steps=args.max_steps, save_every=args.save_every,
                   eval_every=args.eval_every, resume=args.resume, mirror=args.mirror, device=args.device,
                   progress=not args.quiet, world_size=1)
    print(f"step {res.step}: loss {res.loss if res.loss is None else round(res.loss, 4)}, "
          f"val_loss {res.val_loss if res.val_loss is None else round(res.val_loss, 4)}, "
          f"checkpoint {res.checkpoint}")
    samples = Path(args.run_dir) / "samples.txt"
    if samples.is_file() and not res.interrupted:
        print("sample:\n" + samples.read_text(encoding="utf-8").split("===\n")[-1].strip())
    if res.interrupted:
        print("stopped by a signal; run the same command again to resume")
    return 0


def _generate(args) -> int:
    import torch

    from .checkpoint import load_run
    from .generate import generate_text

    if not args.prompt:
        raise ConfigError("the prompt is empty: give some text to continue, e.g. --prompt 'def '")
    model, tok, _, _ = load_run(args.run_dir, args.checkpoint, device="cuda" if torch.cuda.is_available() else "cpu")
    for i in range(args.num_samples):
        text = generate_text(model, tok, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                             seed=None if args.seed is None else args.seed + i)
        print(text)
        if i + 1 < args.num_samples:
            print("-" * 40)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinygpt", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("recipes", help="list the named recipes")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=_recipes)

    t = sub.add_parser("pretrain", help="pretrain a GPT from scratch (resumes automatically)")
    t.add_argument("--recipe", default="cpu", help="a name from `tinygpt recipes` (default: cpu)")
    t.add_argument("--data", default=None, help="builtin, a text file or folder, or hf:NAME[:CONFIG][@SPLIT]")
    t.add_argument("--run-dir", default="runs/default")
    t.add_argument("--max-steps", type=int, default=None)
    t.add_argument("--save-every", type=int, default=None)
    t.add_argument("--eval-every", type=int, default=None)
    t.add_argument("--resume", choices=("auto", "never"), default="auto")
    t.add_argument("--mirror", default=None, help="a folder (e.g. on Google Drive) that mirrors the run's checkpoints")
    t.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: the best available)")
    t.add_argument("--set", nargs="+", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override recipe fields, e.g. --set train.lr=1e-3 model.n_layer=6 data.max_chars=100000")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_pretrain)

    g = sub.add_parser("generate", help="sample text from a trained run")
    g.add_argument("--run-dir", required=True)
    g.add_argument("--prompt", required=True)
    g.add_argument("--checkpoint", default="latest", help="latest, best, or a checkpoint folder")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"tinygpt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
