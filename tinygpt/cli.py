"""The `tinygpt` command: probe | recipes | pretrain | finetune | generate | eval | export | push.

Each command's options are the fields of an options dataclass in the library module that runs it
(`PretrainOptions`, `FinetuneOptions`, `GenerateOptions`, ...): `core.options` makes the argparse
options from the fields and the dataclass from what was parsed, so an option is stated once, on its
field. What is here is the terminal: what each command prints, and its exit status."""

from __future__ import annotations

import argparse
import errno
import json
import signal
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from tinygpt.cli_report import (
    figures_line,
    finetune_next_steps,
    mirror_line,
    report_pretrain,
    say_complete,
)
from tinygpt.core.callback import Callback
from tinygpt.core.config import ConfigError
from tinygpt.core.gpu_classes import HARDWARE
from tinygpt.core.options import add_options, did_you_mean, from_args, option
from tinygpt.core.recipe_choice import RecipeChoice, parse_overrides
from tinygpt.core.recipes import RECIPES
from tinygpt.core.rundir import FINETUNE_JSON, RunDir
from tinygpt.core.signals import interrupted_at_start
from tinygpt.core.units import count

# Each command imports what it runs when it runs (`tinygpt --help` imports none of it: not torch,
# the trainer, the evaluations or finetuning; tests/test_imports.py counts the modules).


def _probe(args) -> int:
    from tinygpt.fit.report import ProbeOptions, probe_report

    print(probe_report(**asdict(from_args(ProbeOptions, args))))
    return 0


@dataclass
class RecipesOptions:
    """What `tinygpt recipes` prints."""

    as_json: bool = option(False, flag="--json", help="print the recipes as JSON")


def _recipes(args) -> int:
    from tinygpt.model.gpt import meta_model

    rows = [
        {
            "name": r.name,
            "hardware": r.hardware,
            "params": meta_model(r.model).num_params(),
            "context": r.train.seq_len,
            "tokens_per_step": r.train.tokens_per_step,
            "token_budget": r.token_budget,
            "precision": HARDWARE[r.hardware].precision
            if r.train.precision == "auto"
            else r.train.precision,
            "data": r.data.source,
            "description": r.description,
        }
        for r in RECIPES.values()
    ]
    if from_args(RecipesOptions, args).as_json:
        print(json.dumps(rows, indent=1))
        return 0
    w = max(len(row["name"]) for row in rows)
    print(
        f"{'recipe':<{w}} {'hw':<5} {'params':>8} {'ctx':>5} {'tok/step':>9} {'budget':>7} "
        f"{'prec':<5} {'data':<40} description"
    )
    for name, hw, p, ctx, tps, budget, prec, data, desc in (row.values() for row in rows):
        print(
            f"{name:<{w}} {hw:<5} {p / 1e6:>7.1f}M {ctx:>5} {tps:>9,} {count(budget):>7} {prec:<5} "
            f"{data:<40} {desc}"
        )
    return 0


def default_pretrain_recipe(run_dir: str | Path, say: bool = True, sized: bool = False) -> str:
    """The recipe `tinygpt pretrain` uses without --recipe
    (`pretrain.init.default_recipe`; `sized`: --size auto), said in one line."""
    from tinygpt.pretrain.init import default_recipe

    name, why = default_recipe(run_dir, sized)
    if say:
        print(
            f"recipe {name}: {why} (--recipe NAME to choose; `tinygpt recipes` lists them)",
            flush=True,
        )
    return name


def _pretrain(args) -> int:
    from tinygpt.fit.plan import refuse_sized_base
    from tinygpt.pretrain.init import pretrain_recipe
    from tinygpt.pretrain.pretrain_options import PretrainOptions, check_budget_overrides
    from tinygpt.pretrain.run_pretrain import pretrain
    from tinygpt.train.budget import finished_run
    from tinygpt.train.distributed import torchrun_env

    env = torchrun_env()
    main_rank = env is None or env.rank == 0  # under torchrun rank 0 reports for the job
    choice = from_args(RecipeChoice, args)
    opts = from_args(PretrainOptions, args, callbacks=[SayResumed()] if main_rank else [])
    name = choice.recipe or default_pretrain_recipe(
        opts.run_dir, say=main_rank, sized=opts.size == "auto"
    )
    # as typed: PretrainOptions takes a budgeted run's hours from its folder
    plain_rerun = (
        opts.resume == "auto"
        and args.hours is None
        and not (opts.data or choice.init or choice.overrides)
    )
    if plain_rerun and (done := finished_run(opts.run_dir, name, opts.max_steps)) is not None:
        if main_rank:
            say_complete(done, opts.run_dir, opts.mirror)
        return 0
    refuse_sized_base(choice.init if opts.size == "auto" else None)  # before the base is read
    # with a base: sized for it (never the mirror's)
    recipe = pretrain_recipe(name, choice.init, opts.run_dir)
    changes = parse_overrides(recipe, choice.overrides)
    check_budget_overrides(changes, opts.hours)  # a --set that --hours would override: refused
    if recipe.model.init and main_rank:
        print(
            f"base {recipe.model.init}: its weights and tokenizer, lr {recipe.train.lr:g}, context "
            f"{recipe.train.seq_len}",
            flush=True,
        )
    res = pretrain(recipe.replace(**changes), options=opts)
    if not main_rank:
        return 130 if res.interrupted else 0
    return report_pretrain(res, opts.run_dir, opts.mirror)


class SayResumed(Callback):
    """Trainer callback: "resumed from step N" as training starts (also with --quiet)."""

    def on_start(self, trainer, resumed_from: int | None) -> None:
        if resumed_from is not None:
            print(f"resumed from step {resumed_from}", flush=True)


def _finetune(args) -> int:
    from tinygpt.finetune.finetune_options import FinetuneOptions
    from tinygpt.finetune.lora import merge_adapter
    from tinygpt.sync.catchup import mirror_lag

    opts = from_args(FinetuneOptions, args)
    res = opts.run()
    d = res.data
    print(
        f"data: {d.records} records ({d.format}), {d.train_examples} train / {d.val_examples} val "
        f"examples, {d.truncated} truncated, {d.dropped} dropped"
    )
    t = res.train
    print(
        f"step {t.step}: {figures_line(loss=t.loss, val_loss=t.val_loss)}; "
        f"{res.trainable_params:,} trainable of {res.total_params:,} parameters"
    )
    if t.interrupted:
        print("stopped by a signal; run the same command again to resume")
    elif res.model_dir is not None:  # full finetuning
        print(f"model (transformers format): {res.model_dir}")
    elif res.adapter_dir is not None:
        print(f"adapter (PEFT format): {res.adapter_dir}")
        if opts.merge:
            print(f"merged model: {merge_adapter(res.adapter_dir)}")
    if not t.interrupted:
        print(finetune_next_steps(opts.run_dir, full=res.model_dir is not None))
    if opts.mirror and (behind := mirror_line(opts.mirror, mirror_lag(opts.run_dir, opts.mirror))):
        print(behind)
    return 130 if t.interrupted else 0


def _generate(args) -> int:
    import torch

    from tinygpt.finetune.lora import load_finetuned
    from tinygpt.model.generate import GenerateOptions, generate_response, generate_text
    from tinygpt.model.loading import load_run

    o = from_args(GenerateOptions, args)
    if not o.prompt:
        raise ConfigError("the prompt is empty: give some text to continue, e.g. --prompt 'def '")
    adapter = o.adapter or (o.run_dir if o.run_dir and is_finetuning_run(o.run_dir) else None)
    if adapter:  # a finetuning run answers the prompt as an instruction
        model, tok = load_finetuned(adapter)
        sampling = dict(max_new_tokens=o.max_new_tokens, temperature=o.temperature, top_p=o.top_p)
        print(generate_response(model, tok, o.prompt, **sampling))
        return 0
    if not o.run_dir:
        raise ConfigError("give the run folder: tinygpt generate RUN_DIR --prompt TEXT")
    model, tok, _, _ = load_run(
        o.run_dir, o.checkpoint, device="cuda" if torch.cuda.is_available() else "cpu"
    )
    sampling = (o.prompt, o.max_new_tokens, o.temperature, o.top_k, o.top_p)
    for i in range(o.num_samples):
        print(generate_text(model, tok, *sampling, seed=None if o.seed is None else o.seed + i))
        if i + 1 < o.num_samples:
            print("-" * 40)
    return 0


def is_finetuning_run(path: str | Path) -> bool:
    """Whether `path` is a finetuning run (its settings, an adapter, or a full finetune's model)."""
    run = RunDir(path)
    return (run / FINETUNE_JSON).is_file() or run.is_finetune_run()


def _eval(args) -> int:
    from tinygpt.evals.eval_options import EvalOptions
    from tinygpt.evals.evaluate import evaluate, report

    o = from_args(EvalOptions, args)
    results = evaluate(o, say=lambda note: print(note, file=sys.stderr, flush=True))
    print(report(o.task, results, o.as_json))
    return 0


def _export(args) -> int:
    from tinygpt.publish.export import ExportOptions

    o = from_args(ExportOptions, args)
    out = o.run()
    if o.format == "gguf":
        print(
            f"exported {o.run_dir} to {out} as GGUF ({o.quant}) with a Modelfile and a model card; "
            f"run it with `cd {out} && ollama create mymodel -f Modelfile && ollama run mymodel`, "
            f"or llama.cpp's `llama-cli -m {next(out.glob('*.gguf'))}`"
        )
    else:
        print(
            f"exported {o.run_dir} ({o.which}) to {out} as a Hugging Face folder with a model "
            f"card; load it with AutoModelForCausalLM.from_pretrained({str(out)!r}) and "
            f"AutoTokenizer.from_pretrained({str(out)!r})"
        )
    return 0


def _push(args) -> int:
    from tinygpt.publish.hub import PushOptions

    o = from_args(PushOptions, args)
    print(f"pushed {o.run_dir} to {o.run()}")
    return 0


class Groups:
    """A command's option groups, (an options dataclass, the group's title), as iterated; a
    dataclass named "module:Name" is imported only then (by the command that runs, or by
    `build_parser()` whole)."""

    def __init__(self, *groups: tuple[type | str, str]):
        self.groups = groups

    def __iter__(self):
        for options, title in self.groups:
            if isinstance(options, str):
                module, name = options.split(":")
                # as an import statement does: `python -X importtime` lists it (not import_module)
                options = getattr(__import__(module, fromlist=[name]), name)
            yield options, title


# each command: its function, its help line, and its option groups
COMMANDS = {
    "probe": (
        _probe,
        "what this machine is, and what it can train (micro-batch, context, precision)",
        Groups(("tinygpt.fit.report:ProbeOptions", "probe")),
    ),
    "recipes": (_recipes, "list the named recipes", [(RecipesOptions, "list")]),
    "pretrain": (
        _pretrain,
        "pretrain a GPT from scratch or from a base (resumes automatically)",
        Groups(
            (RecipeChoice, "what to train"),
            ("tinygpt.pretrain.pretrain_options:PretrainOptions", "how to run it"),
        ),
    ),
    "finetune": (
        _finetune,
        "LoRA / QLoRA / full finetuning of a tinygpt run or a Hugging Face model",
        Groups(("tinygpt.finetune.finetune_options:FinetuneOptions", "finetuning")),
    ),
    "generate": (
        _generate,
        "sample text from a trained run",
        Groups(("tinygpt.model.generate:GenerateOptions", "sampling")),
    ),
    "eval": (
        _eval,
        "evaluate a run (or a Hugging Face model folder) on one task",
        Groups(("tinygpt.evals.eval_options:EvalOptions", "evaluation")),
    ),
    "export": (
        _export,
        "export a run (a finetune merged) to a Hugging Face folder or a GGUF for llama.cpp / "
        "Ollama, with a model card",
        Groups(("tinygpt.publish.export:ExportOptions", "export")),
    ),
    "push": (
        _push,
        "upload a run (Hugging Face files + GGUF + model card) to the Hugging Face Hub; the token "
        "comes from HF_TOKEN or Colab's secret HF_TOKEN",
        Groups(("tinygpt.publish.hub:PushOptions", "push")),
    ),
}


def build_parser(commands: set[str] | None = None) -> argparse.ArgumentParser:
    """The command line, with the options of `commands` only (of all commands without it, whose
    modules it then imports)."""
    # allow_abbrev=False: a flag is spelled out or refused (`--max-step` is no `--max-steps`)
    p = argparse.ArgumentParser(
        prog="tinygpt", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument(
        "--debug", action="store_true", help="on an error, show the full traceback, not one line"
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, (func, help_line, groups) in COMMANDS.items():
        command = sub.add_parser(name, help=help_line, description=help_line, allow_abbrev=False)
        for options, title in groups if commands is None or name in commands else ():
            add_options(command, options, title)
        command.set_defaults(func=func)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser({a for a in argv if not a.startswith("-")})  # the command's options only
    debug = "--debug" in argv  # accepted anywhere on the line, not only before the command
    args, unknown = parser.parse_known_args([a for a in argv if a != "--debug"])
    if unknown:
        _refuse_unknown(parser, args.command, unknown)
    args.debug = debug
    if signal.getsignal(signal.SIGINT) is interrupted_at_start:  # `tinygpt` started: from here on
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C unwinds and cleans up
    # SIGTERM (a notebook's stop button, `kill`, a closing terminal) unwinds like Ctrl-C, so every
    # temporary (an export's .tmp-<out>-<pid>/, a first try's run folder) is removed on the way out;
    # training installs its own handler, which saves a checkpoint first
    try:
        old_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    except ValueError:  # not the main thread: signals cannot be set
        old_term = None
    # one line each, no source line
    old_show, warnings.showwarning = warnings.showwarning, _warning_line
    try:
        return args.func(args)
    except KeyboardInterrupt as k:
        trainer = sys.modules.get("tinygpt.train.trainer")  # not imported: no TrainingError
        if trainer is not None and isinstance(k.__context__, trainer.TrainingError):
            # the run had already failed when the signal came (torchrun stops every rank once one
            # has died): the failure is the reason to tell, not the signal
            return _error(args, k.__context__)
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        return _error(args, e)
    finally:
        warnings.showwarning = old_show
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """argparse's error for words the command does not take (exit 2), naming the flag closest to the
    first unknown one."""
    sub = parser._subparsers._group_actions[0].choices[command]
    word = next((a for a in unknown if a.startswith("--")), "").split("=")[0]
    flags = [f for f in sub._option_string_actions if f.startswith("--")]
    # an abbreviation (`--temp`) names the flags it begins, before any merely similar one
    hint = did_you_mean(word, [f for f in flags if f.startswith(word)] or flags) if word else ""
    sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line ("tinygpt: warning: ..."), not Python's file:line and source."""
    print(
        f"tinygpt: warning: {' '.join(str(message).split())}", file=file or sys.stderr, flush=True
    )


def _error(args: argparse.Namespace, e: Exception) -> int:
    """A command's failure as one line (the traceback with --debug)."""
    if args.debug:
        raise e
    print(
        f"tinygpt {args.command}: error: {one_line(e)} (--debug shows the traceback)",
        file=sys.stderr,
    )
    return 2


def one_line(e: BaseException) -> str:
    """An error as one line that says what happened and what to do."""
    if isinstance(e, OSError) and e.strerror:
        where = f" {e.filename}" if e.filename else ""
        hint = "; free some disk space and run again" if e.errno == errno.ENOSPC else ""
        return f"{e.strerror}:{where}{hint}"
    text = ""
    for line in filter(None, (line.strip() for line in str(e).splitlines())):
        # a heading and its list ("holds a different
        # configuration:" then one line per field) read as one
        text += (" " if text.endswith(":") else "; " if text else "") + line
    return text or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
