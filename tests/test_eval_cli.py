"""`tinygpt eval` and `tinygpt export` in-process on a real tiny run trained once for the module."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tinygpt.cli import build_parser, main
from tinygpt.core.config import DataConfig
from tinygpt.core.options import from_args
from tinygpt.data.sources import validation_text
from tinygpt.evals import lm as ev
from tinygpt.evals.eval_options import EvalOptions
from tinygpt.evals.evaluate import evaluate
from tinygpt.evals.tasks import TASKS, stdlib_functions
from tinygpt.evals.texts import read_text
from tinygpt.model.loading import load_run
from tinygpt.pretrain.run_pretrain import pretrain
from tinygpt.publish.card import model_card


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_data) -> Path:
    """A cpu-smoke run of 30 steps on Tiny Shakespeare (a few seconds)."""
    tmp = tmp_path_factory.mktemp("evalcli")
    pretrain(
        "cpu-smoke",
        tmp / "run",
        data=str(shared_data / "tinyshakespeare.txt"),
        max_steps=30,
        progress=False,
        cache_dir=tmp / "cache",
    )
    return tmp / "run"


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_perplexity_table_and_json_match_the_library(run, shared_data, capsys):
    wikitext = shared_data / "wikitext2_test.txt"
    code, out, _ = _cli(
        capsys,
        "eval",
        run,
        "--task",
        "perplexity",
        "--data",
        wikitext,
        "--max-chars",
        3000,
        "--device",
        "cpu",
    )
    assert code == 0 and "bits_per_byte" in out and "step_000030" in out
    code, out, _ = _cli(
        capsys,
        "eval",
        run,
        "--task",
        "perplexity",
        "--data",
        wikitext,
        "--max-chars",
        3000,
        "--window",
        32,
        "--stride",
        16,
        "--device",
        "cpu",
        "--json",
    )
    res = json.loads(out)
    model, tok, _, _ = load_run(run)
    direct = ev.perplexity(model, tok, read_text(wikitext, 3000), window=32, stride=16)
    assert code == 0 and res["mode"] == "sliding" and res["tokens"] == direct["tokens"]
    assert res["bits_per_byte"] == pytest.approx(direct["bits_per_byte"], rel=1e-6)
    assert 1 < res["perplexity"] < 512  # trained a little: better than uniform over the 512 tokens


def test_hellaswag_prints_the_reference_table(run, shared_data, capsys):
    args = (
        "eval",
        run,
        "--task",
        "hellaswag",
        "--data",
        shared_data / "hellaswag_val.txt.bz2",
        "--limit",
        20,
    )
    code, out, _ = _cli(capsys, *args)
    assert code == 0
    assert "this model (n=20)" in out and "gpt2-124m" in out and "28.92%" in out and "random" in out
    code, out, _ = _cli(capsys, *args, "--json")
    res = json.loads(out)
    assert (
        code == 0
        and res["n"] == 20
        and 0 <= res["acc"] <= 1
        and res["reference"]["random"]["acc"] == 0.25
    )


def test_summary_needs_no_model_or_data(run, capsys):
    code, out, _ = _cli(capsys, "eval", run, "--task", "summary")
    assert code == 0 and "steps" in out and "val_loss_best" in out and out.count("\n- ") >= 1
    res = json.loads(_cli(capsys, "eval", run, "--task", "summary", "--json")[1])
    assert res["steps"] == 30 and res["recipe"] == "cpu-smoke"


def test_export_and_refused_re_export(run, tmp_path, capsys):
    out_dir = tmp_path / "hf"
    code, out, _ = _cli(capsys, "export", run, out_dir, "--which", "best")
    assert code == 0 and "from_pretrained" in out
    files = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files.keys()
    code, _, err = _cli(capsys, "export", run, out_dir)
    assert code == 2 and "not empty; nothing was written" in err
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == files  # nothing overwritten


def test_bad_input_exits_2_with_a_clear_message(run, tmp_path, shared_data, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "run.json").write_text((run / "run.json").read_text())
    wikitext = shared_data / "wikitext2_test.txt"
    code, _, err = _cli(capsys, "eval", empty, "--task", "perplexity", "--data", wikitext)
    assert code == 2 and "no valid checkpoint" in err and "tinygpt pretrain" in err
    code, _, err = _cli(
        capsys,
        "eval",
        run,
        "--task",
        "humaneval",
        "--data",
        shared_data / "HumanEval.jsonl.gz",
        "--n",
        2,
        "--k",
        1,
        10,
    )
    assert code == 2 and "pass@10" in err and "n=2" in err
    code, _, err = _cli(
        capsys, "eval", run, "--task", "perplexity", "--data", tmp_path / "nope.txt"
    )
    assert code == 2 and "no data file" in err and "wikitext-2-raw-v1" in err  # says what would do
    code, _, err = _cli(capsys, "eval", run, "--task", "hellaswag")
    assert code == 2 and "hellaswag_val.txt" in err and "klosax/hellaswag_text_data" in err
    code, _, err = _cli(capsys, "eval", run, "--task", "hellaswag", "--data", tmp_path / "nope.txt")
    assert code == 2 and "no data file" in err
    code, _, err = _cli(
        capsys, "eval", run, "--task", "hellaswag", "--data", wikitext, "--limit", 0
    )
    assert code == 2 and "limit" in err
    code, _, err = _cli(capsys, "eval", tmp_path / "missing", "--task", "summary")
    assert code == 2 and f"no run folder at {tmp_path / 'missing'}" in err
    (tmp_path / "missing").mkdir()
    code, _, err = _cli(capsys, "eval", tmp_path / "missing", "--task", "summary")
    assert code == 2 and "metrics.jsonl" in err


def _note(err: str, start: str) -> tuple[str, int]:
    """The one note in `err` that starts with `start`, and the number its suggestion names."""
    notes = [line for line in err.splitlines() if line.startswith(start)]
    assert len(notes) == 1, err
    return notes[0], int(notes[0].rsplit(" takes about", 1)[0].split()[-1])


def test_a_long_evaluation_says_its_time_first_and_how_to_shorten_it(
    run, shared_data, capsys, monkeypatch
):
    monkeypatch.setattr(
        ev, "LONG_SECONDS", 0.0
    )  # every evaluation counts as long here: the note is under test
    wikitext = shared_data / "wikitext2_test.txt"
    code, out, err = _cli(
        capsys,
        "eval",
        run,
        "--task",
        "perplexity",
        "--data",
        wikitext,
        "--max-chars",
        40000,
        "--device",
        "cpu",
    )
    note, chars = _note(err, "perplexity over 0.0 MB (")
    assert (
        code == 0
        and " windows of 64 tokens, non-overlapping): about " in note
        and "on this CPU" in note
    )
    assert 0 < chars < 40000 and len(str(chars).rstrip("0")) == 1  # a round number a person types
    code, out, err = _cli(
        capsys,
        "eval",
        run,
        "--task",
        "perplexity",
        "--data",
        wikitext,
        "--max-chars",
        chars,
        "--device",
        "cpu",
        "--json",
    )
    assert (
        code == 0 and json.loads(out)["bytes"] <= chars + 100
    )  # the suggestion is a valid, shorter run
    code, out, err = _cli(
        capsys,
        "eval",
        run,
        "--task",
        "hellaswag",
        "--data",
        shared_data / "hellaswag_val.txt.bz2",
        "--limit",
        40,
        "--batch-size",
        8,
        "--device",
        "cpu",
    )
    note, limit = _note(err, "hellaswag over 40 items: about ")
    assert code == 0 and 0 < limit < 40 and "--limit" in note
    monkeypatch.setattr(ev, "LONG_SECONDS", 1e9)  # a short evaluation says nothing of its time
    code, out, err = _cli(
        capsys, "eval", run, "--task", "perplexity", "--data", wikitext, "--max-chars", 3000
    )
    assert code == 0 and "about" not in err


def test_a_window_beyond_the_training_context_is_said_in_one_line(run, shared_data, capsys):
    wikitext = shared_data / "wikitext2_test.txt"
    code, out, err = _cli(
        capsys,
        "eval",
        run,
        "--task",
        "perplexity",
        "--data",
        wikitext,
        "--max-chars",
        3000,
        "--window",
        128,
    )  # cpu-smoke trains at 64 in a model of context 128
    notes = [line for line in err.splitlines() if "--window" in line]
    assert (
        code == 0
        and len(notes) == 1
        and "beyond the context this model was trained at (64 tokens)" in notes[0]
    )
    assert "--window 64" in notes[0]
    code, out, err = _cli(
        capsys,
        "eval",
        run,
        "--task",
        "perplexity",
        "--data",
        wikitext,
        "--max-chars",
        3000,
        "--window",
        64,
    )
    assert code == 0 and "--window" not in err
    code, out, err = _cli(
        capsys, "eval", run, "--task", "perplexity", "--data", wikitext, "--window", 256
    )
    assert (
        code == 2 and "window must be between 1 and the model's context 128" in err
    )  # beyond the model: refused


def test_hub_data_without_a_network_says_what_works_offline(run):
    pytest.importorskip("datasets")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }  # read when datasets is imported
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinygpt",
            "eval",
            str(run),
            "--task",
            "perplexity",
            "--data",
            "hf:wikitext:wikitext-2-raw-v1@test",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        "could not read hf:wikitext" in proc.stderr and "pass a local file instead" in proc.stderr
    )


def test_a_finetuning_run_is_evaluated_with_its_adapter(run, shared_data, tmp_path, capsys):
    pytest.importorskip("peft")
    from tinygpt.finetune.lora import load_finetuned
    from tinygpt.finetune.run_finetune import finetune

    ft = tmp_path / "ft"
    finetune(
        "lora-r8",
        str(run),
        str(shared_data / "code_alpaca_2k.json"),
        ft,
        max_steps=2,
        hardware="cpu",
        progress=False,
    )
    wikitext = shared_data / "wikitext2_test.txt"
    code, out, _ = _cli(
        capsys,
        "eval",
        ft,
        "--task",
        "perplexity",
        "--data",
        wikitext,
        "--max-chars",
        2000,
        "--window",
        32,
        "--device",
        "cpu",
        "--json",
    )
    assert code == 0
    model, tok = load_finetuned(ft, merge=True)
    direct = ev.perplexity(model, tok, read_text(wikitext, 2000), window=32)
    assert json.loads(out)["bits_per_byte"] == pytest.approx(direct["bits_per_byte"], rel=1e-6)


def test_perplexity_defaults_to_the_runs_validation_split_and_its_context(tmp_path, capsys):
    """A newcomer's `tinygpt eval RUN --task perplexity` needs no file: the run's own held-out text,
    scored with the window it trained with; `--data builtin` is the built-in corpus's split."""
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
    for data in ([], ["--data", "builtin"]):
        assert (
            main(
                ["eval", str(run), "--task", "perplexity", "--max-chars", "20000", "--json", *data]
            )
            == 0
        )
        res = json.loads(capsys.readouterr().out)
        assert res["window"] == 64 and res["tokens"] > 1000 and res["perplexity"] > 1, res


def test_the_eval_command_parses_into_eval_options():
    """`tinygpt eval`'s options are EvalOptions' fields (core/options.py): each flag lands on its field, and
    what is not given keeps the field's default, the command's default of before."""

    def parsed(*argv: str) -> EvalOptions:
        return from_args(EvalOptions, build_parser().parse_args(["eval", *argv]))

    assert parsed(
        "r",
        "--task",
        "hellaswag",
        "--data",
        "d",
        "--which",
        "best",
        "--device",
        "cpu",
        "--limit",
        "5",
        "--window",
        "32",
        "--stride",
        "16",
        "--max-chars",
        "900",
        "--batch-size",
        "8",
        "--n",
        "5",
        "--k",
        "1",
        "5",
        "--max-new-tokens",
        "64",
        "--temperature",
        "0.2",
        "--json",
        "--unsafe-exec",
    ) == EvalOptions(
        run_dir="r",
        task="hellaswag",
        data="d",
        which="best",
        device="cpu",
        limit=5,
        window=32,
        stride=16,
        max_chars=900,
        batch_size=8,
        n=5,
        k=[1, 5],
        max_new_tokens=64,
        temperature=0.2,
        as_json=True,
        unsafe_exec=True,
    )
    default = parsed("r", "--task", "summary")
    assert default == EvalOptions(run_dir="r", task="summary")
    assert (default.which, default.device, default.n, default.k, default.as_json) == (
        "latest",
        "auto",
        1,
        (1,),
        False,
    )
    for task in TASKS:  # the registry is the choice
        assert parsed("r", "--task", task).task == task
    with pytest.raises(SystemExit):
        parsed("r", "--task", "mmlu")


def test_evaluate_from_options_is_what_the_command_prints(run, shared_data, capsys):
    wikitext = shared_data / "wikitext2_test.txt"
    code, out, _ = _cli(
        capsys,
        "eval",
        run,
        "--task",
        "perplexity",
        "--data",
        wikitext,
        "--max-chars",
        2000,
        "--window",
        32,
        "--json",
    )
    res = evaluate(
        EvalOptions(run_dir=run, task="perplexity", data=str(wikitext), max_chars=2000, window=32)
    )
    assert code == 0 and json.loads(out)["nll_nats"] == pytest.approx(res["nll_nats"], rel=1e-6)


def test_stdlib_functions_on_a_tiny_run_of_the_builtin_corpus(tmp_path, capsys):
    """The task added as one module (tasks/stdlib_functions.py): its functions are from the validation split of
    `builtin`, their real bodies score perfectly, and on a run pretrained on `builtin` the command prints the
    model's scores, records them, and the model card shows them."""
    problems = stdlib_functions.held_out_functions(limit=6)
    held_out = stdlib_functions._normal(validation_text(DataConfig(source="builtin")))
    assert len(problems) == 6 and all(
        stdlib_functions._normal(p.prompt + p.canonical_solution) in held_out for p in problems
    )
    perfect = stdlib_functions.grade(problems, [p.canonical_solution for p in problems])
    assert perfect["syntax_accuracy"] == perfect["exact_match"] == 1 and perfect[
        "bleu"
    ] == pytest.approx(100)
    run = tmp_path / "run"
    pretrain(
        "cpu-smoke", run, max_steps=30, progress=False, device="cpu", cache_dir=tmp_path / "cache"
    )
    code, out, _ = _cli(
        capsys,
        "eval",
        run,
        "--task",
        "stdlib-functions",
        "--limit",
        6,
        "--max-new-tokens",
        48,
        "--json",
    )
    res = json.loads(out)
    assert code == 0 and res["problems"] == 6 and res["python"] == platform.python_version(), res
    assert 0 <= res["syntax_accuracy"] <= 1 and 0 <= res["bleu"] < 100 and res["exact_match"] < 1
    assert (
        res["data"] == f"Python {platform.python_version()}'s standard library (held-out functions)"
    )
    card = model_card(run, hf=True, gguf_file=None)
    assert (
        f"| stdlib-functions | `{res['data']}` | syntax_accuracy {res['syntax_accuracy']:.4g}"
        in card
    )
    code, out, _ = _cli(capsys, "eval", run, "--task", "stdlib-functions", "--limit", 2)
    assert code == 0 and "syntax_accuracy" in out and "bleu_signature" in out
    code, _, err = _cli(
        capsys, "eval", run, "--task", "stdlib-functions", "--data", tmp_path / "x.txt"
    )
    assert code == 2 and "reads no data file" in err


def test_hellaswag_reads_no_position_past_the_trained_context(run, tmp_path, monkeypatch):
    """cpu-smoke trains at 64 tokens in a 128-position table: an item longer than 64 loses its left (as
    lm-evaluation-harness cuts one longer than the context) instead of reaching positions 64-127; only an
    ending longer than 64 tokens is scored past it (its own tokens need the room)."""
    import bz2

    from tinygpt.core.paths import sample_path
    from tinygpt.evals.evaluate import run_eval
    from tinygpt.model.gpt import GPT

    _, tok, recipe, _ = load_run(run)
    trained = recipe.train.seq_len
    with bz2.open(sample_path("sample:hellaswag"), "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    items = [lines[i : i + 6] for i in range(0, len(lines) - 5, 6)]
    fit = [it for it in items if max(len(tok.encode(" " + e)) for e in it[2:]) < trained][:20]
    longest = max(len(tok.encode(it[0] + " " + e)) for it in fit for e in it[2:])
    assert (
        len(fit) == 20 and trained == 64 < recipe.model.max_seq_len < longest
    )  # the test tells the two apart
    data = tmp_path / "hellaswag_fit.txt"
    data.write_text("\n".join(line for it in fit for line in it) + "\n", encoding="utf-8")
    lengths = []
    forward = GPT.forward
    monkeypatch.setattr(
        GPT,
        "forward",
        lambda self, idx, *a, **k: lengths.append(idx.shape[1]) or forward(self, idx, *a, **k),
    )
    assert run_eval(run, "hellaswag", data=str(data))["n"] == 20
    assert max(lengths) == trained
    lengths.clear()  # the shipped sample's first 20 hold an ending of 70 tokens: scored, in the table's room
    assert run_eval(run, "hellaswag", data="sample:hellaswag", limit=20)["n"] == 20
    assert trained < max(lengths) <= recipe.model.max_seq_len
