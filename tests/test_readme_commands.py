"""The README's commands, as a new user types them on a fresh clone (no shared data, no network).

Every `tinygpt ...` the README shows is read out of it: the synopsis lines (`tinygpt eval RUN_DIR --task ...`)
may only name flags the command has, and every concrete command must parse. Then the concrete ones run for real,
in the README's order, in an empty folder: command 1 with `--max-steps 5` (its recipe, tokenizer and model, in seconds instead of
two minutes), so that `runs/default` exists for the commands after it.
The one command not run is the 3-hour training (`--hours 3`); its table is `tinygpt probe --hours 3`, which runs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tinygpt.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
# words that stand for what a user fills in: a line with one of them is a synopsis, not a command
PLACEHOLDERS = re.compile(
    r"\b(CMD|DIR|RUN_DIR|OUT_DIR|NAME|TEXT|SOURCE|PATH|USER/NAME|RUN_DIR_OR_HF_ID|N|H|K|P|T|D)\b"
)


def readme_commands() -> list[str]:
    """Every `tinygpt ...` of README.md, in order: the lines of its code blocks and its inline code spans,
    without their comments and the `pip install ... &&` before command 1."""
    text = (ROOT / "README.md").read_text()
    found = []
    for block in re.finditer(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.group(1).splitlines():
            line = line.split("  #")[0].split("&& ")[-1]
            if line.strip().startswith("tinygpt "):
                found.append([block.start(), len(found), line.strip()])
            elif (
                line.startswith(" ") and line.strip().startswith("[") and found
            ):  # a synopsis goes on
                found[-1][2] += " " + line.strip()
    for m in re.finditer(r"`(tinygpt [^`]*)`", text):
        found.append([m.start(), len(found), " ".join(m.group(1).split())])
    return [line for _, _, line in sorted(found)]


def is_synopsis(command: str) -> bool:
    return "[" in command or "|" in command or bool(PLACEHOLDERS.search(command))


def flags_of(command: str) -> set[str]:
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    return set(sub._option_string_actions)


def test_the_readme_shows_the_main_commands_and_only_flags_that_exist():
    commands = readme_commands()
    names = {c.split()[1] for c in commands}
    assert {
        "pretrain",
        "generate",
        "eval",
        "finetune",
        "export",
        "push",
        "probe",
        "recipes",
    } <= names, names
    for command in commands:
        name = command.split()[1]
        if name == "CMD":  # `tinygpt CMD --help`: any command
            continue
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", command):
            assert flag in flags_of(name), (
                f"README: `{command}` names {flag}, which `tinygpt {name}` lacks"
            )
        if not is_synopsis(command):
            build_parser().parse_args(
                shlex.split(command)[1:]
            )  # argparse exits (a failure) on a bad one


@pytest.mark.slow  # the README's commands in turn (trains, finetunes, evaluates): about 90 CPU-seconds
def test_every_concrete_readme_command_runs_as_written_on_a_fresh_clone(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TINYGPT_SHARED_DATA", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    concrete = [c for c in readme_commands() if not is_synopsis(c)]
    assert concrete[0] == "tinygpt pretrain", concrete  # command 1 comes first
    ran = []
    for command in concrete:
        argv = shlex.split(command)[1:]
        if argv[0] == "pretrain" and "--hours" in argv:  # trains for hours: parsed above, not run
            continue
        if argv == ["pretrain"]:
            argv = ["pretrain", "--max-steps", "5"]  # command 1, in seconds: runs/default
        assert main(argv) == 0, (command, capsys.readouterr())
        out = capsys.readouterr()
        assert "Traceback" not in out.err, (command, out.err[-2000:])
        ran.append(argv[0])
    assert (tmp_path / "runs" / "default" / "run.json").is_file()
    assert {"pretrain", "generate", "eval", "finetune", "recipes", "probe"} <= set(ran), ran


def test_the_readmes_choices_are_the_commands_choices_and_every_command_is_shown():
    """The command-line block lists each command, and where it spells a flag's values (`--task a|b|c`), it
    spells all of them, the ones argparse takes, so that a value added to a Literal shows here or fails."""
    commands = readme_commands()
    sub = build_parser()._subparsers._group_actions[0].choices
    assert set(sub) <= {c.split()[1] for c in commands}, set(sub)
    for command in commands:
        name = command.split()[1]
        for flag, values in re.findall(
            r"(?<![\w-])(--[a-z][a-z-]*) ([\w-]+(?:\|[\w-]+)+)", command
        ):
            action = sub[name]._option_string_actions[flag]
            assert set(values.split("|")) == set(action.choices), (
                f"README: `{command}` gives {flag} {values}; `tinygpt {name}` takes {'|'.join(action.choices)}"
            )
