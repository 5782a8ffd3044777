"""The command line end to end: recipes, pretrain, generate, and the bad inputs a user will type."""

import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import INVALID

from tinygpt.cli import main
from tinygpt.core.config import ConfigError
from tinygpt.core.recipes import get_recipe

REPO = Path(__file__).resolve().parents[1]


def _tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if (
            p.is_file() and p.name != ".lock"
        ):  # the one-writer lock file holds no data (core/rundir.py)
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp("cli")
    run = root / "run"
    code = main(
        [
            "pretrain",
            "--recipe",
            "cpu-smoke",
            "--data",
            str(shared_data / "tinyshakespeare.txt"),
            "--run-dir",
            str(run),
            "--max-steps",
            "20",
            "--quiet",
            "--device",
            "cpu",
            "--set",
            "data.max_chars=300000",
        ]
    )
    assert code == 0
    return run


def test_recipes_lists_every_recipe(capsys):
    assert main(["recipes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = {r["name"] for r in rows}
    by_name = {r["name"]: r for r in rows}
    assert by_name["cpu"]["precision"] == "fp32" and by_name["t4-50m"]["precision"] == "fp16"
    assert by_name["cpu"]["data"] == "builtin" and by_name["a100-124m"]["data"].startswith("hf:")
    assert main(["recipes"]) == 0
    table = capsys.readouterr().out
    assert " 0M " not in table and "614k" in table and " auto " not in table
    assert {"cpu-smoke", "cpu", "t4-50m", "l4-124m", "a100-124m", "a100-350m", "h100-760m"} <= names
    flagship = next(r for r in rows if r["name"] == "a100-124m")
    assert (
        flagship["context"] == 1024
        and flagship["precision"] == "bf16"
        and 115e6 < flagship["params"] < 130e6
    )


def test_pretrain_writes_a_complete_run_folder(trained):
    for name in ("run.json", "tokenizer.json", "metrics.jsonl", "samples.txt"):
        assert (trained / name).is_file(), name
    info = json.loads((trained / "run.json").read_text())
    assert info["recipe"]["name"] == "cpu-smoke" and info["recipe"]["data"]["max_chars"] == 300000
    assert info["versions"]["torch"] and info["precision"]["name"] == "fp32"
    assert (trained / "checkpoints" / "step_000020" / "manifest.json").is_file()
    assert "=== step 20 ===" in (trained / "samples.txt").read_text()


def test_generate_from_the_run(trained, capsys):
    assert (
        main(
            [
                "generate",
                str(trained),
                "--prompt",
                "ROMEO:",
                "--max-new-tokens",
                "20",
                "--seed",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and len(out) > len("ROMEO:") + 5


def test_pretrain_again_resumes_and_extends(trained, shared_data, tmp_path, capsys):
    assert (
        main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--data",
                str(shared_data / "tinyshakespeare.txt"),
                "--run-dir",
                str(trained),
                "--max-steps",
                "25",
                "--quiet",
                "--set",
                "data.max_chars=300000",
            ]
        )
        == 0
    )
    steps = [
        m["step"]
        for m in map(json.loads, (trained / "metrics.jsonl").read_text().splitlines())
        if "loss" in m
    ]
    assert steps == sorted(set(steps)) and steps[-1] == 25
    # it ends by saying what to run next, and each suggested command works as printed
    out = capsys.readouterr().out
    nxt = out[out.index("next:\n") :].splitlines()[1:]
    assert [line.split()[1] for line in nxt] == ["generate", "eval", "export"]
    generate = shlex.split(nxt[0].split("#")[0])
    assert generate[:3] == ["tinygpt", "generate", str(trained)]
    assert main(
        generate[1:] + ["--max-new-tokens", "5"]
    ) == 0 and capsys.readouterr().out.startswith("def main(")
    assert (
        main(shlex.split(nxt[2].split("#")[0])[1:2] + [str(trained), str(tmp_path / "hf-model")])
        == 0
    )


def test_an_option_without_a_hugging_face_equivalent_is_declared_once_and_every_export_reads_it(
    trained, tmp_path, capsys, monkeypatch
):
    """A model option transformers cannot hold says so on its field ("lacks": ("hf",)); here the test
    declares it on max_seq_len (cpu-smoke sets it to 128, not the default). The run's closing hints then
    suggest no export, and both export formats refuse in one line before writing anything."""
    from types import MappingProxyType

    from tinygpt.cli_report import next_steps
    from tinygpt.core.config import ModelConfig
    from tinygpt.core.rundir import RunDir

    declared = ModelConfig.__dataclass_fields__["max_seq_len"]
    monkeypatch.setattr(
        declared, "metadata", MappingProxyType({**declared.metadata, "lacks": ("hf",)})
    )
    model = RunDir(trained).recipe().model
    assert model.export_gaps("hf") == model.export_gaps("gguf") == ["max_seq_len=128"]
    hints = next_steps(trained)
    assert (
        "tinygpt export" not in hints
        and "no export: transformers has no equivalent of max_seq_len=128" in hints
    )
    for fmt in ("hf", "gguf"):
        assert main(["export", str(trained), str(tmp_path / fmt), "--format", fmt]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cannot load a model with max_seq_len=128" in err, err
        assert "cannot be finetuned" in err and not (tmp_path / fmt).exists()
    monkeypatch.undo()
    assert "tinygpt export" in next_steps(trained) and model.export_gaps("gguf") == []


def test_a_mistyped_run_folder_suggests_the_closest_existing_one(trained, tmp_path, capsys):
    typo = trained.parent / (trained.name[:-1] + trained.name[-1] * 2 + "x")  # "run" -> "runnx"
    for argv in (
        ["generate", str(typo), "--prompt", "x"],
        ["eval", str(typo), "--task", "summary"],
        ["export", str(typo), str(tmp_path / "out")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"did you mean {trained}?" in err and err.count(str(typo)) == 1, (
            err
        )  # the typo is never the fix
    far = trained.parent / "zzzzzzzz"
    assert main(["generate", str(far), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err and err.count(str(far)) == 1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["pretrain", "--recipe", "gpt5"], "unknown recipe 'gpt5'"),
        (
            ["pretrain", "--data", "/no/such/corpus.txt"],
            "neither 'builtin', an existing file or folder",
        ),
        (["pretrain", "--set", "train.seq_len=100000"], "longer than the model's max_seq_len"),
        (
            ["pretrain", "--set", "data.vocab_size=100"],
            "data.vocab_size must be a whole number of at least 257 up to 4294967295, got 100",
        ),
        (
            ["pretrain", "--set", "data.vocab_size=5000000000"],
            "at least 257 up to 4294967295, got 5000000000: a byte-level BPE",
        ),
        (["pretrain", "--set", "train.lr"], "SECTION.FIELD=VALUE"),
        (
            ["pretrain", "--resume", "auto", "--set", "train.micro_batch_size=0"],
            "train.micro_batch_size must be a positive whole number, got 0",
        ),
    ],
)
def test_bad_input_fails_before_any_work(argv, message, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(argv + ["--run-dir", str(run), "--quiet"]) == 2
    assert message in capsys.readouterr().err
    assert not run.exists()  # nothing was started


@pytest.mark.parametrize(
    "typed,meant",
    [("--max-step", "--max-steps"), ("--hour", "--hours"), ("--temp", "--temperature")],
)
def test_a_flag_is_spelled_out_or_refused_with_the_one_meant(typed, meant, tmp_path, capsys):
    """argparse would take `--max-step 10` as `--max-steps 10` (an abbreviation): a typo of one flag would silently
    become another. Every parser refuses it instead, exit 2 before any work, naming the flag meant."""
    from tinygpt.cli import build_parser

    root = build_parser()
    assert not root.allow_abbrev and not any(
        p.allow_abbrev for p in root._subparsers._group_actions[0].choices.values()
    )
    command = "generate" if meant == "--temperature" else "pretrain"
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(
            [command, str(run), typed, "10", "--quiet"]
            + (["--prompt", "x"] if command == "generate" else [])
        )
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {typed}" in err and f"(did you mean '{meant}'?)" in err, err
    assert not run.exists()


def test_refusals_leave_an_existing_run_untouched(trained, shared_data, tmp_path, capsys):
    before = _tree_hash(trained)
    # a different configuration in the same folder
    assert main(["pretrain", "--recipe", "cpu", "--run-dir", str(trained), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "holds a different configuration" in err and "model.n_layer" in err
    # --resume never on a folder with checkpoints
    assert (
        main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--data",
                str(shared_data / "tinyshakespeare.txt"),
                "--run-dir",
                str(trained),
                "--resume",
                "never",
                "--quiet",
                "--set",
                "data.max_chars=300000",
            ]
        )
        == 2
    )
    assert "--resume never would overwrite" in capsys.readouterr().err
    # an empty prompt
    assert main(["generate", str(trained), "--prompt", ""]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert _tree_hash(trained) == before


def test_data_too_small_for_one_window(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("To be, or not to be: that is the question.\n" * 3)
    assert (
        main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--data",
                str(small),
                "--run-dir",
                str(tmp_path / "run"),
                "--quiet",
                "--set",
                "data.vocab_size=300",
                "model.vocab_size=300",
            ]
        )
        == 2
    )
    assert "fewer than one window" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_generate_on_a_folder_without_checkpoints(tmp_path, capsys):
    assert main(["generate", "--run-dir", str(tmp_path), "--prompt", "x"]) == 2
    assert "not a tinygpt run folder" in capsys.readouterr().err


def test_console_script_and_module_entry_point():
    # --help: the entry point without torch's import (`recipes`, in process, is test_docs.py's)
    out = subprocess.run(
        [sys.executable, "-m", "tinygpt", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0 and "pretrain" in out.stdout and "recipes" in out.stdout
    with pytest.raises(ConfigError):
        get_recipe(INVALID)


def test_pretrain_without_recipe_says_which_and_a_finished_run_says_it_is_complete(
    tmp_path, capsys
):
    """No --recipe: the hardware's default (the probe's choice), said in one line before training; a run
    folder brings its own. Run again once finished: 'complete', its figures, and how to go on."""
    from tinygpt.fit.hardware import hardware_report
    from tinygpt.pretrain.run_pretrain import pretrain

    run = tmp_path / "run"
    pretrain(
        "cpu-smoke",
        run,
        max_steps=2,
        save_every=2,
        eval_every=2,
        progress=False,
        device="cpu",
        cache_dir=tmp_path / "cache",
    )
    assert main(["pretrain", "--run-dir", str(run), "--quiet", "--max-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("recipe cpu-smoke: the recipe of the run in")
    assert "is complete: step 2 of 2" in out and "val_loss" in out and "--max-steps 4" in out
    assert "None" not in out
    from tinygpt.cli import default_pretrain_recipe

    assert default_pretrain_recipe(tmp_path / "new", say=True) == hardware_report().default_recipe
    assert (
        f"the default for this {hardware_report().hardware_class} machine"
        in capsys.readouterr().out
    )


def test_compile_is_an_option_that_reaches_the_run(tmp_path, capsys):
    """`--compile` (nanoGPT's `--compile=False`) is one field of PretrainOptions: it sets train.compile."""
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    assert "--compile {auto,on,regional,off}" in capsys.readouterr().out
    run = tmp_path / "run"
    assert (
        main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--run-dir",
                str(run),
                "--max-steps",
                "2",
                "--quiet",
                "--device",
                "cpu",
                "--compile",
                "off",
            ]
        )
        == 0
    )
    assert json.loads((run / "run.json").read_text())["recipe"]["train"]["compile"] == "off"


def test_a_signal_that_comes_while_a_failed_run_closes_does_not_hide_the_failure(
    tmp_path, monkeypatch, capsys
):
    """Under torchrun, once one rank dies the others fail ("lost its peers") and torchrun then sends them
    SIGTERM, which may land while the failure unwinds through the callbacks' close: the failure is what
    the command says (exit 2), not "interrupted"; a Ctrl-C on its own is still an interruption (130)."""
    from tinygpt.core.callback import Callback
    from tinygpt.pretrain import (
        run_pretrain as real,  # the command imports `pretrain` from here as it runs
    )
    from tinygpt.train.trainer import TrainingError

    pretrain = real.pretrain

    class PeersLost(Callback):
        def on_step(self, trainer):
            if trainer.step == 2:
                raise TrainingError("process 0 of 2 lost its peers at step 2")

        def close(self):
            if signal_on_close:
                raise KeyboardInterrupt  # the SIGTERM, through cli's handler

    def pretrain_failing(recipe, options):
        options.callbacks = [*options.callbacks, PeersLost()]
        return pretrain(recipe, options=options)

    monkeypatch.setattr(real, "pretrain", pretrain_failing)
    argv = [
        "pretrain",
        "--recipe",
        "cpu-smoke",
        "--device",
        "cpu",
        "--quiet",
        "--max-steps",
        "4",
        "--probe",
        "off",
    ]
    signal_on_close = True
    assert main([*argv, "--run-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "lost its peers at step 2" in err and "interrupted" not in err, err
    signal_on_close = False

    def interrupted(recipe, options):
        raise KeyboardInterrupt

    monkeypatch.setattr(real, "pretrain", interrupted)
    assert main([*argv, "--run-dir", str(tmp_path / "b")]) == 130
    assert "interrupted" in capsys.readouterr().err
