"""benchmarks/gpu_finetune.py in its CPU mode: a tiny base made locally, a couple of steps each of
tinygpt's finetuning step and a plain transformers + PEFT loop, both rows and their ratio printed.
Counts only: timings on a shared CI machine prove nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_finetune  # noqa: E402

CPU = [
    "--device",
    "cpu",
    "--size",
    "tiny",
    "--seq-len",
    "128",
    "--micro-batch",
    "2",
    "--grad-accum",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--records",
    "300",
    "--threads",
    "1",
    "--reference",
    "peft",
]


def test_cpu_mode_prints_both_rows_and_the_ratio_counting_real_tokens(capsys, tmp_path):
    result = gpu_finetune.main(
        CPU + ["--json", str(tmp_path / "r.json"), "--results", str(tmp_path)]
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    table = [r for r in map(str.split, lines) if r and r[1:2] and r[1].replace(",", "").isdigit()]
    assert [r[0] for r in table] == ["tinygpt", "hf+peft"]
    assert "tinygpt / hf+peft: tokens/s x" in out and (tmp_path / "r.json").is_file()
    ours, ref = result["rows"]
    assert (ours["impl"], ref["impl"]) == ("tinygpt", "hf+peft")
    assert (
        ours["trainable_params"] == ref["trainable_params"] > 0
    )  # the same adapters on the same layers
    for row in (
        ours,
        ref,
    ):  # real tokens: records only, never padding, at most the batch's positions
        assert 0 < row["real_tokens_per_step"] <= 2 * 128 * 2 and row["tokens_per_s"] > 0
    assert result["ratio"]["tokens_per_s"] == pytest.approx(
        ours["tokens_per_s"] / ref["tokens_per_s"]
    )
    assert result["plan"]["pack"] and not result["compile"]  # packed rows; no compile on a CPU
    assert result["same_batch_base_loss_diff"] < 1e-4  # the same model on the same tokens


def test_random_rows_count_every_position_and_the_script_runs_from_the_command_line(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_finetune.py"),
            *CPU,
            "--data",
            "random",
            "--pack",
            "off",
            "--full-logits",
            "off",
            "--results",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [
        r
        for r in map(str.split, run.stdout.splitlines())
        if r and r[0] in ("tinygpt", "hf+peft") and r[1].replace(",", "").isdigit()
    ]  # the table's rows
    assert [r[0] for r in rows] == ["tinygpt", "hf+peft"]
    assert [r[3] for r in rows] == ["512", "512"]  # 2 x 128 x 2 real tokens per step on both sides
    assert "full logits False, packed False" in run.stdout and "tokens/s x" in run.stdout
    # the dated result file: both rows, and the reference named with the ratio
    [written] = tmp_path.glob("*-finetune-speed.md")
    text = written.read_text()
    assert "| tinygpt |" in text and "| hf+peft |" in text and "full logits False" in text
    assert "- reference: a plain transformers + PEFT loop" in text and "tokens/s x" in text
