"""Ctrl-C at any moment of a command's start-up (issue 51): `python -m tinygpt pretrain` gets SIGINT while it
imports, parses, builds its run folder or trains; every time it says so in one line, exits 130 and leaves no
traceback and nothing half made: no run folder, or one that resumes (a checkpoint saved by the signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tinygpt" / "samples" / "wikitext2_test_sample.txt"


@pytest.mark.parametrize(
    "delay",
    [
        pytest.param(0.3, marks=pytest.mark.slow),
        1.0,
        pytest.param(2.0, marks=pytest.mark.slow),
        pytest.param(5.0, marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_during_start_up_is_one_line_exit_130_and_leaves_nothing_half_made(delay, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinygpt",
            "pretrain",
            str(run),
            "--recipe",
            "cpu-smoke",
            "--max-steps",
            "100000",
            "--device",
            "cpu",
            "--quiet",
            "--data",
            str(DATA),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert p.returncode == 130, (p.returncode, out[-500:], err[-2000:])
    if err.strip():  # stopped before training: the one line
        assert err.strip() == "interrupted", err
    else:  # training had begun: it saved a checkpoint first, and says how to go on
        assert "stopped by a signal; run the same command again to resume" in out, out
    # nothing half made: no run folder, or one with a checkpoint to resume from; no temporary anywhere
    assert not run.exists() or any((run / "checkpoints").glob("step_*")), sorted(run.rglob("*"))
    assert not [q for q in tmp_path.rglob("*") if ".tmp" in q.name], sorted(tmp_path.rglob("*"))
