"""Options stated once: an option dataclass's fields are the command line (core/options.py), and the real
commands parse into the same options objects as before."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import pytest
from conftest import INVALID

from tinygpt.cli import COMMANDS, build_parser
from tinygpt.core.config import CompileMode, ConfigError, PrecisionName, Schedule, TrainConfig
from tinygpt.core.fields import field_problem
from tinygpt.core.options import add_options, from_args, option, option_fields
from tinygpt.core.recipe_choice import RecipeChoice
from tinygpt.core.recipes import get_recipe
from tinygpt.finetune.finetune_options import FinetuneOptions
from tinygpt.fit.report import ProbeOptions
from tinygpt.model.generate import GenerateOptions
from tinygpt.pretrain.pretrain_options import PretrainOptions
from tinygpt.publish.export import ExportOptions
from tinygpt.publish.hub import PushOptions


@dataclass(kw_only=True)
class Sampling:
    """How to sample."""

    run_dir: str = option(flag="RUN_DIR", help="the run folder")
    prompt: str = option(help="the text to continue")
    steps: int = option(200, help="tokens to generate")
    top_p: float | None = option(None, help="nucleus sampling")
    out: str | Path | None = option(None, help="where to write; 100% of the text")
    mode: str = option("fast", choices=("fast", "exact"), metavar="MODE", help="how")
    stops: list[str] = option(default_factory=list, flag="--stop", help="stop at these strings")
    ks: tuple[int, ...] = option((1,), flag="--k", help="pass@k for these k")
    progress: bool = option(True, flag="--quiet", help="no progress bar")
    echo: bool = field(
        default=False, metadata={"help": "print the prompt too"}
    )  # the plain-field spelling
    seen: int = 0  # no help: not an option


def _parser(*classes: type) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x")
    for cls in classes:
        add_options(p, cls)
    return p


def test_each_field_with_help_is_an_option_with_its_help_and_default():
    text = _parser(Sampling).format_help()
    assert (
        "How to sample.:" in text or "How to sample.\n" in text
    )  # the group: the docstring's first line
    for line in (
        "RUN_DIR",
        "the run folder",
        "--prompt PROMPT",
        "--steps STEPS",
        "tokens to generate (default: 200)",
        "--top-p TOP_P",
        "--mode MODE",
        "how (default: fast)",
        "--stop STOP [STOP ...]",
        "pass@k for these k (default: 1)",
        "--quiet",
        "no progress bar",
        "--echo",
        "100% of the text",
    ):
        assert line in text, line
    assert (
        "--seen" not in text and "nucleus sampling (default" not in text
    )  # None is no default worth saying
    assert [f.name for f in option_fields(Sampling)][-1] == "echo"


def test_parsed_arguments_come_back_as_the_dataclass():
    p = _parser(Sampling)
    s = from_args(
        Sampling,
        p.parse_args(
            [
                "r",
                "--prompt",
                "def",
                "--top-p",
                "0.9",
                "--out",
                "o.txt",
                "--mode",
                "exact",
                "--stop",
                "a",
                "b",
                "--stop",
                "c",
                "--k",
                "1",
                "10",
                "--quiet",
                "--echo",
            ]
        ),
        seen=3,
    )
    assert s == Sampling(
        run_dir="r",
        prompt="def",
        top_p=0.9,
        out="o.txt",
        mode="exact",
        stops=["a", "b", "c"],
        ks=[1, 10],
        progress=False,
        echo=True,
        seen=3,
    )
    assert from_args(Sampling, p.parse_args(["r", "--prompt", "x"])) == Sampling(
        run_dir="r", prompt="x"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["r"],
        ["r", "--prompt", "x", "--mode", "slow"],
        ["r", "--prompt", "x", "--steps", "many"],
        [],
    ],
)
def test_a_missing_required_option_or_a_bad_value_is_argparses_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _parser(Sampling).parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_field_added_to_pretrain_options_is_an_option_that_reaches_the_recipe():
    """Adding an option is one field: here a subclass's, which `apply` sets on the recipe it names."""

    @dataclass
    class More(PretrainOptions):
        warmup: int | None = option(None, help="warm-up steps", sets="train.warmup_steps")

    p = _parser(RecipeChoice, More)
    assert "--warmup WARMUP" in p.format_help() and "warm-up steps" in p.format_help()
    opts = from_args(
        More, p.parse_args(["--warmup", "7", "--max-steps", "9", "--run-dir", "somewhere"])
    )
    recipe = opts.apply(get_recipe("cpu-smoke"))
    assert (recipe.train.warmup_steps, recipe.train.max_steps) == (7, 9) and opts.run_dir == Path(
        "somewhere"
    )
    assert from_args(More, p.parse_args([])).apply(get_recipe("cpu-smoke")) == get_recipe(
        "cpu-smoke"
    )


def _command(argv: list[str], *classes: type, **extra) -> list:
    args = build_parser().parse_args(argv)
    return [from_args(cls, args, **extra) for cls in classes]


def test_the_commands_parse_into_their_options_as_before(tmp_path):
    run = str(tmp_path / "run")
    choice, opts = _command(
        [
            "pretrain",
            "--recipe",
            "cpu",
            "--data",
            "x.txt",
            "--run-dir",
            run,
            "--max-steps",
            "5",
            "--save-every",
            "2",
            "--eval-every",
            "3",
            "--resume",
            "never",
            "--mirror",
            "m",
            "--device",
            "cpu",
            "--set",
            "train.lr=1e-3",
            "model.n_layer=2",
            "--set",
            "data.max_chars=9",
            "--probe",
            "off",
            "--parallel",
            "fsdp",
            "--quiet",
            "--init",
            "hf:x",
        ],
        RecipeChoice,
        PretrainOptions,
    )
    assert choice == RecipeChoice(
        "cpu", "hf:x", ["train.lr=1e-3", "model.n_layer=2", "data.max_chars=9"]
    )
    assert opts == PretrainOptions(
        run_dir=run,
        data="x.txt",
        max_steps=5,
        save_every=2,
        eval_every=3,
        resume="never",
        mirror="m",
        device="cpu",
        progress=False,
        parallel="fsdp",
        probe="off",
    )
    assert _command(["pretrain"], RecipeChoice, PretrainOptions) == [
        RecipeChoice(),
        PretrainOptions(),
    ]
    assert (
        _command(["pretrain", "--hours", "1.5", "--run-dir", run], PretrainOptions)[0].hours == 1.5
    )
    assert _command(
        ["finetune", "--base", "b", "--data", "d", "--run-dir", "r", "--hardware", "t4", "--merge"],
        FinetuneOptions,
    ) == [FinetuneOptions(base="b", data="d", run_dir="r", hardware="t4", merge=True)]
    assert _command(
        ["generate", "--prompt", "x", "--top-k", "3", "--seed", "4"], GenerateOptions
    ) == [GenerateOptions(prompt="x", top_k=3, seed=4)]
    assert _command(["export", "r", "o", "--format", "gguf"], ExportOptions) == [
        ExportOptions(run_dir="r", out_dir="o", format="gguf")
    ]
    assert _command(["push", "r", "u/n", "--gguf", "none", "--private"], PushOptions) == [
        PushOptions(run_dir="r", repo_id="u/n", gguf="none", private=True)
    ]
    assert _command(["probe", "--recipe", "cpu", "--json"], ProbeOptions) == [
        ProbeOptions("cpu", as_json=True)
    ]


def test_every_generated_option_has_its_help():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, (_, _, groups) in COMMANDS.items():
        flags = {a.dest: a for a in sub.choices[name]._actions}
        for cls, _ in groups:
            for f in option_fields(cls):
                assert (
                    flags[f.name].help and f.metadata["help"].split("(")[0] in flags[f.name].help
                ), (name, f.name)


SCHEDULES_AND_ONE_MORE = (
    *get_args(Schedule),
    "made-up",
)  # read where the annotation is (as a string)


def test_a_literals_values_are_the_options_choices_and_a_new_entry_is_one_more_choice(capsys):
    """A fixed set of values is stated once, as the field's `Literal`: the command line's choices are read
    from it (here a subclass adds one more schedule), and the one validator refuses anything else in one
    line that says what to choose."""
    compile_flag = next(a for a in _parser(PretrainOptions)._actions if a.dest == "compile")
    assert tuple(compile_flag.choices) == get_args(CompileMode) == ("auto", "on", "regional", "off")
    today = get_args(Schedule)

    @dataclass
    class Train(TrainConfig):
        schedule: Literal[SCHEDULES_AND_ONE_MORE] = option(
            "cosine", help="the learning-rate schedule"
        )

    p = _parser(Train)
    assert "{" + ",".join((*today, "made-up")) + "}" in p.format_help()
    assert from_args(Train, p.parse_args(["--schedule", "made-up"])).schedule == "made-up"
    with pytest.raises(SystemExit):
        p.parse_args(["--schedule", INVALID])
    assert "invalid choice" in capsys.readouterr().err
    assert field_problem(Train(schedule="made-up"), "train.") is None
    with pytest.raises(ConfigError) as e:
        Train(schedule=INVALID)
    assert (
        str(e.value)
        == f"train.schedule must be one of {', '.join(today)}, made-up, got '{INVALID}'"
    )
    with pytest.raises(ConfigError) as e:
        TrainConfig(schedule="made-up")
    assert str(e.value) == f"train.schedule must be one of {', '.join(today)}, got 'made-up'"


def test_a_bad_value_on_the_command_line_is_one_line_before_any_work(tmp_path, capsys):
    from tinygpt.cli import main

    for sets, said in (
        (
            [f"train.schedule={INVALID}"],
            f"train.schedule must be one of {', '.join(get_args(Schedule))}, got '{INVALID}'",
        ),
        (
            [f"train.precision={INVALID}"],
            f"train.precision must be one of {', '.join(get_args(PrecisionName))}, got '{INVALID}'",
        ),
        (["train.eval_every=-1"], "train.eval_every must be 0 or a positive whole number, got -1"),
    ):
        assert (
            main(
                [
                    "pretrain",
                    "--recipe",
                    "cpu-smoke",
                    "--run-dir",
                    str(tmp_path / "r"),
                    "--quiet",
                    "--set",
                    *sets,
                ]
            )
            == 2
        )
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, err
    with pytest.raises(
        SystemExit
    ) as e:  # argparse's own refusal, with the choices read from the Literal
        main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--run-dir",
                str(tmp_path / "r"),
                "--compile",
                INVALID,
            ]
        )
    assert e.value.code == 2 and f"invalid choice: '{INVALID}'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
