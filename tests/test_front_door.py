"""What a new user meets on a fresh clone: the README's install advice, and the words the main commands print."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from tinygpt.cli import main
from tinygpt.core.rundir import RunDirError
from tinygpt.model.loading import load_run

ROOT = Path(__file__).resolve().parents[1]


def test_the_readmes_cpu_install_names_pytorchs_cpu_index():
    """From the public index, `pip install torch==X` fetches the CUDA build (527 MB and nvidia-* packages): the
    README's CPU advice must name PyTorch's CPU index, before command 1."""
    readme = (ROOT / "README.md").read_text()
    installs = re.findall(r"pip install torch[^`\n]*", readme)
    assert installs, "the README no longer says how to install torch on a CPU machine"
    for line in installs:
        assert "--index-url https://download.pytorch.org/whl/cpu" in line, line
    # and it stands before command 1, which a user runs as soon as they read it
    assert readme.index(installs[0]) < readme.index('pip install -e ".[dev]" && tinygpt pretrain')


def test_the_main_commands_print_no_none_and_no_broken_joins(tmp_path, capsys):
    """pretrain, generate, eval (perplexity, summary), export and a refusal, in-process on the cpu-smoke
    recipe: nothing printed (stdout or stderr) says "None" or joins a heading to its list with ":;"."""
    run, out = tmp_path / "run", tmp_path / "hf-model"
    commands = [
        [
            "pretrain",
            str(run),
            "--recipe",
            "cpu-smoke",
            "--max-steps",
            "3",
            "--device",
            "cpu",
            "--quiet",
        ],
        ["generate", str(run), "--prompt", "def", "--max-new-tokens", "5", "--seed", "0"],
        ["eval", str(run), "--task", "perplexity", "--device", "cpu"],
        ["eval", str(run), "--task", "summary"],
        ["export", str(run), str(out)],
    ]
    printed = []
    for argv in commands:
        assert main(argv) == 0, (argv, capsys.readouterr())
        printed.append(capsys.readouterr())
    card = (out / "README.md").read_text()
    # a refusal whose message is a heading and a list (another configuration in the same folder)
    assert (
        main(
            [
                "pretrain",
                str(run),
                "--recipe",
                "cpu-smoke",
                "--max-steps",
                "3",
                "--device",
                "cpu",
                "--quiet",
                "--set",
                "train.lr=0.123",
            ]
        )
        == 2
    )
    printed.append(capsys.readouterr())
    text = "\n".join(p.out + p.err for p in printed)
    assert "different configuration" in text and "train.lr" in text
    for word in ("None", ":;"):
        assert word not in text, [line for line in text.splitlines() if word in line]
    assert "None" not in card, [line for line in card.splitlines() if "None" in line]


def _files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _finetuning_run(folder: Path) -> Path:
    """A finetuning run's folder as `tinygpt finetune` leaves it (its settings, adapter, a checkpoint)."""
    (folder / "checkpoints" / "step_000005").mkdir(parents=True)
    (folder / "finetune.json").write_text('{"recipe": "lora-r16", "base": "runs/default"}')
    (folder / "adapter_config.json").write_text("{}")
    (folder / "checkpoints" / "step_000005" / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return folder


def _exports(tmp_path: Path) -> dict[str, Path]:
    hf, gguf = tmp_path / "hf-model", tmp_path / "gguf-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"\0" * 64)
    gguf.mkdir()
    (gguf / "model-Q8_0.gguf").write_bytes(b"GGUF")
    (gguf / "Modelfile").write_text("FROM ./model-Q8_0.gguf\n")
    return {"Hugging Face model folder": hf, "GGUF export": gguf}


def test_a_folder_that_is_not_a_pretraining_run_gets_the_command_that_fits_it(tmp_path, capsys):
    ft = _finetuning_run(tmp_path / "ft")
    with pytest.raises(
        RunDirError, match="is a finetuning run"
    ) as e:  # what eval, export, ... say of one
        load_run(ft)
    assert f"tinygpt generate {ft} --prompt" in str(e.value)
    exports = _exports(tmp_path)
    hints = {
        exports["Hugging Face model folder"]: "from_pretrained(",
        exports["GGUF export"]: "ollama create",
        tmp_path: f"tinygpt pretrain {tmp_path}",
    }
    for folder, hint in hints.items():
        assert main(["generate", str(folder), "--prompt", "x"]) == 2
        err = capsys.readouterr().err
        assert hint in err and "--run-dir" not in err, err


def test_the_old_run_dir_flag_still_works_with_a_one_line_note(tmp_path, capsys):
    assert main(["generate", "--run-dir", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        err[0].startswith("note: --run-dir is deprecated")
        and f"tinygpt generate {tmp_path}" in err[0]
    )
    assert (
        main(["generate", str(tmp_path / "a"), "--run-dir", str(tmp_path / "b"), "--prompt", "x"])
        == 2
    )
    assert "given twice" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["pretrain", "finetune"])
def test_a_refused_run_leaves_any_existing_folder_as_it_was(command, tmp_path, capsys):
    """pretrain into a finetuning run or an export, finetune into a pretraining run or an export: refused,
    and every file of the folder (no .lock, no run.json, no tokenizer added) is as it was."""
    folders = _exports(tmp_path)
    if command == "pretrain":
        folders["finetuning run"] = _finetuning_run(tmp_path / "ft")
        argv = [
            "pretrain",
            "--recipe",
            "cpu-smoke",
            "--max-steps",
            "2",
            "--device",
            "cpu",
            "--quiet",
        ]
    else:
        run = folders["pretraining run"] = tmp_path / "pre"
        run.mkdir()
        (run / "run.json").write_text('{"recipe": {}}')
        (run / "tokenizer.json").write_text("{}")
        data = tmp_path / "data.jsonl"
        data.write_text('{"instruction": "add", "output": "def add(a, b): return a + b"}\n')
        argv = [
            "finetune",
            "--base",
            str(tmp_path / "no-base"),
            "--data",
            str(data),
            "--device",
            "cpu",
        ]
    for kind, folder in folders.items():
        before = _files(folder)
        assert main([*argv, str(folder)]) == 2
        err = capsys.readouterr().err
        assert f"is a {kind}" in err and "leaves it as it is" in err, err
        assert _files(folder) == before and not (folder / ".lock").exists()
