"""The `tinygpt` command: probe | recipes | pretrain | finetune | generate | eval | export | push."""
from __future__ import annotations

import argparse
import errno
import json
import shlex
import signal
import sys
from pathlib import Path

import torch

from tinygpt.core.callback import Callback
from tinygpt.core.checkpoint import latest_valid
from tinygpt.core.config import RECIPES, ConfigError, Recipe, get_recipe
from tinygpt.core.precision import PRECISION_FOR_HARDWARE, resolve_device
from tinygpt.core.rundir import RunDir, recipe_name_of
from tinygpt.core.units import count
from tinygpt.evals import sandbox
from tinygpt.evals.code import SANDBOX_NOTE
from tinygpt.evals.tasks import TASKS, run_eval
from tinygpt.finetune.lora import (
    finetune,
    generate_response,
    load_finetuned,
    merge_adapter,
)
from tinygpt.model.generate import generate_text
from tinygpt.model.gguf import QUANTS
from tinygpt.model.gpt import meta_model
from tinygpt.model.loading import load_run
from tinygpt.publish import FORMATS, export, push
from tinygpt.sync.identity import run_identity
from tinygpt.sync.mirror import catch_up, mirror_lag
from tinygpt.train.budget import Budget
from tinygpt.train.distributed import torchrun_env
from tinygpt.train.hardware import hardware_report
from tinygpt.train.init import pretrain_recipe
from tinygpt.train.memory import estimate_memory
from tinygpt.train.pretrain import identity_config, pretrain
from tinygpt.train.probe import ProbeError, expectations, probe, requested_precision, trainer_speed


def _probe(args) -> int:
    print(probe_report(args.recipe, args.json))
    return 0


def format_table(rows: list[tuple]) -> str:
    """Rows as aligned text columns (the first row is not special)."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def probe_report(recipe: str | None = None, as_json: bool = False, *,
                 cache_dir: str | Path | None = "default") -> str:
    """What `tinygpt probe [--recipe NAME] [--json]` prints. The trial search runs on a CUDA GPU;
    elsewhere the estimate stands in for it."""
    report = hardware_report()
    rec = get_recipe(recipe or report.default_recipe)
    requested, _ = requested_precision(rec, report.device, report.native_bf16)
    prec = report.precision if requested == "auto" else requested
    est = estimate_memory(rec.model, rec.train.micro_batch_size, rec.train.seq_len, prec, device_type=report.device,
                          loss=rec.train.loss)
    result, note, speed = None, None, None
    if report.device == "cuda":
        try:
            result = probe(rec, cache_dir=cache_dir)
        except ProbeError as e:
            note = str(e)
    else:  # host memory is plentiful and trials on a CPU mostly measure its speed: keep the recipe
        note = (f"the trial search runs on a CUDA GPU; on {report.device} the recipe's micro-batch is used as is "
                "and the estimate above stands in for a measurement")
        if rec.hardware == "cpu":  # a CPU recipe's step takes a second: time it (a GPU recipe's would take minutes)
            speed = trainer_speed(rec, report.device)
    exp = expectations(rec, report, result, speed)
    if as_json:
        return json.dumps({"hardware": report.to_dict(), "recipe": rec.name, "memory_estimate": est.to_dict(),
                           "search": result and result.to_dict(), "expectations": exp.to_dict(), "note": note},
                          indent=2)
    out = ["Hardware", format_table(report.rows()), f"\nRecipe: {rec.name} (default here: {report.default_recipe})",
           f"\nMemory estimate at micro-batch {rec.train.micro_batch_size}, context {rec.train.seq_len}, {prec}",
           format_table(est.rows())]
    if result is not None:
        limit = f" of its {result.time_limit_s:.0f} s limit" if result.time_limit_s else ""
        cached = " (cached)" if result.from_cache else f" ({len(result.trials)} trials, {result.search_s:.1f} s{limit})"
        out += [f"\nSearch{cached}: micro-batch {result.micro_batch_size} x {result.grad_accum_steps} "
                f"accumulation steps"
                f" x context {result.seq_len}, checkpointing {'on' if result.activation_checkpointing else 'off'}, "
                f"{result.precision}, peak {result.peak_gb:.2f} of {result.memory_limit_gb:.1f} GB"]
        out += [f"  - {n}" for n in result.notes]
    if note:
        out.append(f"\n{note}")
    out += ["\nExpectations", format_table(exp.rows())]
    return "\n".join(out)


def _recipes(args) -> int:
    rows = []
    for r in RECIPES.values():
        prec = PRECISION_FOR_HARDWARE.get(r.hardware, "auto") if r.train.precision == "auto" else r.train.precision
        rows.append((r.name, r.hardware, meta_model(r.model).num_params(), r.train.seq_len, r.train.tokens_per_step,
                     r.token_budget, prec, r.data.source, r.description))
    if args.json:
        print(json.dumps([dict(zip(("name", "hardware", "params", "context", "tokens_per_step", "token_budget",
                                    "precision", "data", "description"), row)) for row in rows], indent=1))
        return 0
    print(f"{'recipe':<14} {'hw':<5} {'params':>8} {'ctx':>5} {'tok/step':>9} {'budget':>7} {'prec':<5} "
          f"{'data':<40} description")
    for name, hw, p, ctx, tps, budget, prec, data, desc in rows:
        print(f"{name:<14} {hw:<5} {p / 1e6:>7.1f}M {ctx:>5} {tps:>9,} {count(budget):>7} {prec:<5} {data:<40} {desc}")
    return 0


def apply_overrides(recipe: Recipe, assignments: list[str]) -> Recipe:
    """`train.lr=1e-3`-style overrides, values parsed as JSON where they can be (numbers, true, null)."""
    changes: dict[str, dict] = {"model": {}, "train": {}, "data": {}}
    for a in assignments:
        key, sep, raw = a.partition("=")
        section, _, name = key.partition(".")
        if not sep or section not in changes or not name:
            raise ConfigError(f"cannot read override {a!r}: write SECTION.FIELD=VALUE with SECTION model, train "
                              "or data")
        fields = getattr(recipe, section).to_dict()
        if name not in fields:
            raise ConfigError(f"{section} has no field {name!r}; fields: {', '.join(fields)}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        current = fields[name]
        # a number field takes a number (int where it is an int); a string field a string
        if isinstance(current, (int, float)) and not isinstance(current, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or (isinstance(current, int) and not isinstance(value, int) and current is not None):
                kind = "a whole number" if isinstance(current, int) else "a number"
                raise ConfigError(f"--set {a}: {section}.{name} must be {kind} (it is {current!r} in recipe "
                                  f"{recipe.name}), not {raw!r}")
        elif isinstance(current, str) and not isinstance(value, str):
            value = raw
        changes[section][name] = value
    return recipe.replace(**changes)


def default_pretrain_recipe(run_dir: str | Path, say: bool = True) -> str:
    """The recipe `tinygpt pretrain` uses without --recipe: the run folder's own (a resume), else the
    hardware's default (the probe's choice), said in one line."""
    name = recipe_name_of(run_dir)
    if name in RECIPES:
        why = f"the recipe of the run in {run_dir}"
    else:
        report = hardware_report()
        name, why = report.default_recipe, f"the default for this {report.hardware_class} machine"
    if say:
        print(f"recipe {name}: {why} (--recipe NAME to choose; `tinygpt recipes` lists them)", flush=True)
    return name


def _pretrain(args) -> int:
    env = torchrun_env()
    main_rank = env is None or env.rank == 0  # under torchrun rank 0 reports for the job
    name = args.recipe or default_pretrain_recipe(args.run_dir, say=main_rank)
    plain_rerun = args.resume == "auto" and not args.set and not args.data and args.hours is None and not args.init
    if plain_rerun and (done := finished_run(args.run_dir, name, args.max_steps)) is not None:
        if main_rank:
            print(done)
            if args.mirror:  # "complete" means complete on the mirror too: what it lacks goes there now
                recipe = RunDir(args.run_dir).recipe()
                lag = catch_up(args.run_dir, args.mirror,
                               identity=run_identity(args.run_dir, args.mirror, identity_config(recipe)))
                print(mirror_line(args.mirror, lag) or f"the mirror {args.mirror} has all of it")
        return 0
    recipe = pretrain_recipe(name, args.init, args.run_dir, args.mirror)  # with a base: sized for it
    if recipe.model.init and main_rank:
        print(f"base {recipe.model.init}: its weights and tokenizer, lr {recipe.train.lr:g}, context "
              f"{recipe.train.seq_len}", flush=True)
    res = pretrain(apply_overrides(recipe, args.set), args.run_dir, data=args.data,
                   max_steps=args.max_steps, save_every=args.save_every, eval_every=args.eval_every,
                   resume=args.resume, mirror=args.mirror, device=args.device, hours=args.hours,
                   progress=not args.quiet, parallel=args.parallel, probe=args.probe,
                   callbacks=[SayResumed()] if main_rank else [])
    if not main_rank:
        return 130 if res.interrupted else 0
    print(f"step {res.step}: loss {res.loss if res.loss is None else round(res.loss, 4)}, "
          f"val_loss {res.val_loss if res.val_loss is None else round(res.val_loss, 4)}, "
          f"checkpoint {res.checkpoint}")
    samples = RunDir(args.run_dir).samples()
    if samples and not res.interrupted:
        print("sample:\n" + samples.split("===\n")[-1].strip())
    behind = mirror_line(args.mirror, mirror_lag(args.run_dir, args.mirror)) if args.mirror else None
    if res.interrupted:
        print("stopped by a signal; run the same command again to resume")
        if behind:
            print(behind)
        return 130  # like an interrupted shell command: a script can tell the run did not finish
    print(next_steps(args.run_dir))
    if behind:
        print(behind)  # the last line: the run is done here, not yet on the mirror
    return 0


def next_steps(run_dir: str | Path) -> str:
    """What to run after a finished pretraining run: sample, evaluate, export (the README's order)."""
    d = shlex.quote(str(run_dir))
    return ("next:\n"
            f"  tinygpt generate --run-dir {d} --prompt \"def main(\" --max-new-tokens 100   # text from the model\n"
            f"  tinygpt eval {d} --task perplexity        # loss, perplexity, bits per byte on its validation text\n"
            f"  tinygpt export {d} hf-model/              # a Hugging Face folder (transformers, llama.cpp)")


def mirror_line(mirror: str | Path, lag: list[str]) -> str | None:
    """The line a command ends with when the mirror is behind the local run (None when it is not)."""
    if not lag:
        return None
    return (f"the mirror {mirror} is behind: it lacks {'; '.join(lag)}; the local run folder has everything, "
            "and the same command again (with --mirror) copies the rest once the mirror has room and is reachable")


def finished_run(run_dir: str | Path, recipe_name: str, max_steps: int | None = None) -> str | None:
    """For a run that already reached its recipe's last step, what to say instead of training nothing:
    that it is complete, its final figures, and how to train longer; None otherwise."""
    run = RunDir(run_dir)
    if not run.is_pretrain_run() or recipe_name_of(run_dir) != recipe_name:
        return None
    last = latest_valid(run.checkpoints)
    budget = Budget.load(Path(run_dir))
    max_steps = max_steps or (budget.max_steps if budget else None) or \
        run.recipe_dict().get("train", {}).get("max_steps")
    step = int(last.name.split("_")[-1]) if last is not None else None
    if step is None or max_steps is None or step < max_steps:
        return None
    records = run.metrics()
    loss = next((m["loss"] for m in reversed(records) if m.get("loss") is not None), None)
    val = next((m["val_loss"] for m in reversed(records) if m.get("val_loss") is not None), None)
    figures = ", ".join(f"{k} {v:.4g}" for k, v in (("loss", loss), ("val_loss", val)) if v is not None)
    return (f"run {run_dir} is complete: step {step} of {max_steps}" + (f", {figures}" if figures else "")
            + f"; checkpoint {last}. To train longer: the same command with --max-steps {2 * max_steps} "
            "(the learning-rate schedule is recomputed for the new end)")


class SayResumed(Callback):
    """Trainer callback: "resumed from step N" as training starts (also with --quiet)."""

    def on_start(self, trainer, resumed_from: int | None) -> None:
        if resumed_from is not None:
            print(f"resumed from step {resumed_from}", flush=True)


def _finetune(args) -> int:
    res = finetune(args.recipe, args.base, args.data, args.run_dir, max_steps=args.max_steps, hardware=args.hardware,
                   resume=args.resume, device=args.device, mirror=args.mirror, progress=not args.quiet)
    d = res.data
    print(f"data: {d.records} records ({d.format}), {d.train_examples} train / {d.val_examples} val examples, "
          f"{d.truncated} truncated, {d.dropped} dropped")
    t = res.train
    print(f"step {t.step}: loss {t.loss if t.loss is None else round(t.loss, 4)}, "
          f"val_loss {t.val_loss if t.val_loss is None else round(t.val_loss, 4)}; "
          f"{res.trainable_params:,} trainable of {res.total_params:,} parameters")
    if t.interrupted:
        print("stopped by a signal; run the same command again to resume")
    elif res.model_dir is not None:  # full finetuning
        print(f"model (transformers format): {res.model_dir}")
    elif res.adapter_dir is not None:
        print(f"adapter (PEFT format): {res.adapter_dir}")
        if args.merge:
            print(f"merged model: {merge_adapter(res.adapter_dir)}")
    if args.mirror and (behind := mirror_line(args.mirror, mirror_lag(args.run_dir, args.mirror))):
        print(behind)
    return 130 if t.interrupted else 0


def _generate(args) -> int:


    if not args.prompt:
        raise ConfigError("the prompt is empty: give some text to continue, e.g. --prompt 'def '")
    if args.adapter:

        model, tok = load_finetuned(args.adapter)
        print(generate_response(model, tok, args.prompt, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p))
        return 0
    if not args.run_dir:
        raise ConfigError("give --run-dir (a pretraining run) or --adapter (a finetuning run)")
    model, tok, _, _ = load_run(args.run_dir, args.checkpoint, device="cuda" if torch.cuda.is_available() else "cpu")
    for i in range(args.num_samples):
        text = generate_text(model, tok, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                             seed=None if args.seed is None else args.seed + i)
        print(text)
        if i + 1 < args.num_samples:
            print("-" * 40)
    return 0


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _jsonable(v):
    """NaN (a standard error of one item) as null: strict JSON readers refuse NaN."""
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return [_jsonable(x) for x in v] if isinstance(v, (list, tuple)) else v


def _eval(args) -> int:
    if TASKS[args.task].runs_code:  # said before anything runs; no boundary: refused unless --unsafe-exec
        b = sandbox.boundary()
        if b.kind == "none" and not args.unsafe_exec:
            raise sandbox.SandboxUnavailable(sandbox.unavailable_message(b))
        print(f"{args.task} {SANDBOX_NOTE}; here: {b.describe()}", file=sys.stderr, flush=True)
    with sandbox.sigterm_as_interrupt():  # SIGTERM ends the sandboxes as Ctrl-C does
        res = run_eval(args.run_dir, args.task, data=args.data, which=args.which,
                       device=str(resolve_device(args.device)), limit=args.limit, window=args.window,
                       stride=args.stride, max_chars=args.max_chars, batch_size=args.batch_size, n=args.n, ks=args.k,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, progress=not args.json,
                       unsafe_exec=args.unsafe_exec, say=lambda note: print(note, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(_jsonable(res), indent=1, default=str))
        return 0
    skip = {"reference", "per_problem", "diagnosis"}
    width = max(len(k) for k in res)
    for k, v in res.items():
        if k not in skip:
            print(f"{k:<{width}}  {_fmt(v)}")
    if "reference" in res:  # HellaSwag: the published numbers beside this model's
        print(f"\n{'model':<22} {'acc':>7} {'acc_norm':>9}")
        print(f"{'this model (n=' + str(res['n']) + ')':<22} {res['acc']:>7.2%} {res['acc_norm']:>9.2%}")
        for name, ref in res["reference"].items():
            print(f"{name:<22} {ref['acc']:>7.2%} {ref['acc_norm']:>9.2%}")
        print(f"(published figures: {res['reference_source']}; the same query text)")
    if "per_problem" in res:
        for p in res["per_problem"]:
            print(f"  {p['task_id']:<14} {p['passed']}/{p['n']} passed  {', '.join(p['statuses'])}")
    for note in res.get("diagnosis", []):
        print(f"- {note}")
    return 0


# --- export and push (GGUF, model card, the Hub): tinygpt.publish ---
def _export(args) -> int:
    out = export(args.run_dir, args.out_dir, args.format, args.quant, args.which)
    if args.format == "gguf":
        print(f"exported {args.run_dir} to {out} as GGUF ({args.quant}) with a Modelfile and a model card; run it "
              f"with `cd {out} && ollama create mymodel -f Modelfile && ollama run mymodel`, or llama.cpp's "
              f"`llama-cli -m {next(out.glob('*.gguf'))}`")
    else:
        print(f"exported {args.run_dir} ({args.which}) to {out} as a Hugging Face folder with a model card; load "
              f"it with AutoModelForCausalLM.from_pretrained({str(out)!r}) and "
              f"AutoTokenizer.from_pretrained({str(out)!r})")
    return 0


def _push(args) -> int:
    url = push(args.run_dir, args.repo_id, private=args.private, gguf=None if args.gguf == "none" else args.gguf,
               which=args.which)
    print(f"pushed {args.run_dir} to {url}")
    return 0
# --- end export and push ---


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinygpt", description=__doc__)
    p.add_argument("--debug", action="store_true", help="on an error, show the full traceback, not one line")
    sub = p.add_subparsers(dest="command", required=True)

    pr = sub.add_parser("probe", help="what this machine is, and what it can train (micro-batch, context, precision)")
    pr.add_argument("--recipe", default=None, help="probe for this recipe (default: the one this hardware suits)")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=_probe)

    r = sub.add_parser("recipes", help="list the named recipes")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=_recipes)

    t = sub.add_parser("pretrain", help="pretrain a GPT from scratch or from a base (resumes automatically)")
    t.add_argument("--recipe", default=None,
                   help="a name from `tinygpt recipes` (default: the run folder's own recipe when it has one, "
                        "else the one this hardware suits, as `tinygpt probe` shows)")
    t.add_argument("--data", default=None, help="builtin, a text file or folder, or hf:NAME[:CONFIG][@SPLIT]")
    t.add_argument("--init", default=None, metavar="BASE",
                   help="continue pretraining a model: hf:NAME[@REVISION] (e.g. hf:HuggingFaceTB/SmolLM2-135M), a "
                        "Llama/Qwen3 model folder, or a tinygpt run folder; its weights, tokenizer and architecture, "
                        "with the recipe's batch and steps at a lower learning rate")
    t.add_argument("--run-dir", default="runs/default")
    t.add_argument("--max-steps", type=int, default=None)
    t.add_argument("--hours", type=float, default=None,
                   help="a time budget: the steps that fit are measured after warm-up and fixed, with the "
                        "warmup-stable-decay schedule ending on time (start-up not counted)")
    t.add_argument("--save-every", type=int, default=None)
    t.add_argument("--eval-every", type=int, default=None)
    t.add_argument("--resume", choices=("auto", "never"), default="auto")
    t.add_argument("--mirror", default=None, help="a folder (e.g. on Google Drive) that mirrors the run's checkpoints")
    t.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: the best available)")
    t.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override recipe fields, e.g. --set train.lr=1e-3 model.n_layer=6 data.max_chars=100000")
    t.add_argument("--probe", choices=("auto", "off"), default="auto",
                   help="on a GPU, let the probe choose micro-batch, context and precision "
                        "(off: the recipe as written)")
    t.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="under torchrun: DDP, or FSDP2 to shard a model too big for one GPU")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_pretrain)

    f = sub.add_parser("finetune", help="LoRA / QLoRA / full finetuning of a tinygpt run or a Hugging Face model")
    f.add_argument("--recipe", default="lora-r16", help="lora-r8, lora-r16, lora-r32, qlora-r16, or full (every "
                   "weight trains: 16 bytes per parameter, for small bases)")
    f.add_argument("--base", required=True, help="a tinygpt run folder, a model folder, or a Hugging Face id")
    f.add_argument("--data", required=True,
                   help="a JSON/JSONL file, a saved dataset folder, or hf:NAME[:CONFIG][@SPLIT]")
    f.add_argument("--run-dir", required=True)
    f.add_argument("--max-steps", type=int, default=None)
    f.add_argument("--hardware", choices=("cpu", "t4", "a100"), default=None,
                   help="which of the recipe's settings to use (default: detected)")
    f.add_argument("--resume", choices=("auto", "never"), default="auto")
    f.add_argument("--mirror", default=None, help="a folder (e.g. on Google Drive) that mirrors the run's checkpoints")
    f.add_argument("--device", default=None)
    f.add_argument("--merge", action="store_true", help="also save the base with the adapter folded in")
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(func=_finetune)

    g = sub.add_parser("generate", help="sample text from a trained run")
    g.add_argument("--run-dir", default=None, help="a pretraining run folder (not needed with --adapter)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--checkpoint", default="latest", help="latest, best, or a checkpoint folder")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--adapter", default=None,
                   help="a finetuning run or adapter folder: the prompt is an instruction answered by base + adapter")
    g.set_defaults(func=_generate)

    e = sub.add_parser("eval", help="evaluate a run (or a Hugging Face model folder) on one task")
    e.add_argument("run_dir", metavar="RUN_DIR")
    e.add_argument("--task", required=True, choices=tuple(TASKS),
                   help="; ".join(f"{t.name}: {t.help}" for t in TASKS.values()))
    e.add_argument("--data", default=None, help="the task's data file, or hf:NAME[:CONFIG][@SPLIT], e.g. "
                   "hf:wikitext:wikitext-2-raw-v1@test or hf:Rowan/hellaswag@validation (downloads from the Hub); "
                   "perplexity: default the run's own validation split, `builtin` the built-in corpus's")
    e.add_argument("--which", default="latest", help="latest, best, or a checkpoint folder (default: latest)")
    e.add_argument("--device", default="auto", help="cpu, cuda, mps (default: the best available)")
    e.add_argument("--limit", type=int, default=None, help="only the first N items or problems")
    e.add_argument("--window", type=int, default=None, help="perplexity: tokens per window (default: the context)")
    e.add_argument("--stride", type=int, default=None, help="perplexity: sliding-window stride (default: none)")
    e.add_argument("--max-chars", type=int, default=None, help="perplexity: score only the first N characters")
    e.add_argument("--batch-size", type=int, default=None)
    e.add_argument("--n", type=int, default=1, help="code tasks: samples per problem")
    e.add_argument("--k", type=int, nargs="+", default=[1], help="code tasks: pass@k for these k (each <= n)")
    e.add_argument("--max-new-tokens", type=int, default=384)
    e.add_argument("--temperature", type=float, default=None, help="code tasks (default: greedy for n=1, else 0.8)")
    e.add_argument("--json", action="store_true", help="print the whole result as JSON")
    e.add_argument("--unsafe-exec", action="store_true", help="humaneval/mbpp: run generated code even where no "
                   "kernel boundary is available (rlimits only; use a throwaway VM)")
    e.set_defaults(func=_eval)

    # --- export and push ---
    x = sub.add_parser("export", help="export a run (a finetune merged) to a Hugging Face folder or a GGUF for "
                                      "llama.cpp / Ollama, with a model card")
    x.add_argument("run_dir", metavar="RUN_DIR")
    x.add_argument("out_dir", metavar="OUT_DIR", help="a new or empty folder; nothing is overwritten")
    x.add_argument("--which", default="latest", help="latest, best, or a checkpoint folder (default: latest)")
    x.add_argument("--format", choices=FORMATS, default="hf",
                   help="hf: config.json + model.safetensors + tokenizer; gguf: one .gguf file + an Ollama Modelfile")
    x.add_argument("--quant", choices=QUANTS, default="f16", help="GGUF only: the weights' type (default f16)")
    x.set_defaults(func=_export)

    u = sub.add_parser("push", help="upload a run (Hugging Face files + GGUF + model card) to the Hugging Face Hub; "
                                    "the token comes from HF_TOKEN or Colab's secret HF_TOKEN")
    u.add_argument("run_dir", metavar="RUN_DIR")
    u.add_argument("repo_id", metavar="REPO_ID", help="USER/NAME or ORG/NAME (created if it does not exist)")
    u.add_argument("--private", action="store_true", help="create the repository private")
    u.add_argument("--gguf", choices=(*QUANTS, "none"), default="q8_0",
                   help="also upload a GGUF of this type, for `ollama run hf.co/REPO_ID` (default q8_0)")
    u.add_argument("--which", default="latest", help="latest, best, or a checkpoint folder (default: latest)")
    u.set_defaults(func=_push)
    # --- end export and push ---
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line, not only before the command
    args = parser.parse_args([a for a in argv if a != "--debug"])
    args.debug = debug
    # SIGTERM (a notebook's stop button, `kill`, a closing terminal) unwinds like Ctrl-C, so every temporary
    # (an export's .tmp-<out>-<pid>/, a first try's run folder) is removed on the way out; training
    # installs its own handler, which saves a checkpoint first
    old_term = _sigterm_raises()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"tinygpt {args.command}: error: {one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 2
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _sigterm_raises():
    """Make SIGTERM raise KeyboardInterrupt; the handler it replaces (None where signals cannot be set)."""
    try:
        return signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread
        return None


def one_line(e: BaseException) -> str:
    """An error as one line that says what happened and what to do."""
    if isinstance(e, OSError) and e.strerror:
        where = f" {e.filename}" if e.filename else ""
        hint = "; free some disk space and run again" if e.errno == errno.ENOSPC else ""
        return f"{e.strerror}:{where}{hint}"
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
