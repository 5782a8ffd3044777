"""Training progress as a reader finds it: in a log file (no carriage-return bar), and in a saved notebook
(the bar's final state, under the newest Jupyter packages and under Colab's pins)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a 300-step run in a subprocess
def test_a_300_step_run_logged_to_a_file_writes_lines_not_a_bar(tmp_path):
    """stdout and stderr to a file, as under CI, nohup or a Colab %%capture: no carriage return, at most one
    line per logged step, and the last step's line."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TINYGPT_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tinygpt",
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--max-steps",
                "300",
                "--run-dir",
                str(tmp_path / "run"),
                "--device",
                "cpu",
            ],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=600,
            check=True,
        )
    text = log.read_text()
    assert "\r" not in text
    logged = [
        m
        for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "loss" in m or "val_loss" in m
    ]
    lines = [line for line in text.splitlines() if line.startswith("training step ")]
    assert 1 <= len(lines) <= len({m["step"] for m in logged}) and lines[-1].startswith(
        "training step 300/300:"
    )
    assert len(text) < 20_000  # a few dozen lines, not a bar redrawn 300 times


NOTEBOOK_RUNNER = textwrap.dedent("""
    import sys, nbformat
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from tinygpt.train.callbacks import progress_bar\\n"
        "bar = progress_bar(total=6, desc='training', unit='step')\\n"
        "for _ in range(6):\\n"
        "    bar.update(1)\\n"
        "bar.close()")]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    nbformat.write(nb, sys.argv[1])
""")


def _saved_bar(python: str, tmp_path: Path) -> list[str]:
    """Execute a notebook whose cell shows the training bar, in a kernel of `python`; the saved outputs' text."""
    out = tmp_path / "executed.ipynb"
    subprocess.run(
        [python, "-c", NOTEBOOK_RUNNER, str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
        timeout=300,
        capture_output=True,
    )
    nb = json.loads(out.read_text())
    texts = [o.get("data", {}).get("text/plain", "") for o in nb["cells"][0]["outputs"]]
    return [
        "".join(t) if isinstance(t, list) else t for t in texts
    ]  # the file keeps text as a list of lines


def _check_final_state(texts: list[str]) -> None:
    bars = [t for t in texts if "training" in t]
    assert bars and all(re.search(r"training: 100%.*6/6", t) for t in bars), texts


@pytest.mark.slow  # a notebook kernel
def test_the_saved_notebook_shows_the_bar_finished_with_these_packages(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipywidgets")
    _check_final_state(_saved_bar(sys.executable, tmp_path))


@pytest.mark.slow  # a notebook kernel
def test_the_saved_notebook_shows_the_bar_finished_under_colab_s_jupyter_pins(tmp_path):
    """ipywidgets 7 (Colab's) displays a widget itself and used to drop the display id the bar's last state
    is written under, so the saved cell read 0%. TINYGPT_PINNED_PYTHON: a Python whose ipykernel,
    jupyter_client and ipywidgets are constraints/colab.txt's."""
    python = os.environ.get("TINYGPT_PINNED_PYTHON")
    if not python:
        pytest.skip(
            "set TINYGPT_PINNED_PYTHON to a Python with constraints/colab.txt's Jupyter packages"
        )
    pins = dict(
        re.findall(
            r"^(ipykernel|jupyter_client|ipywidgets)==(\S+)",
            (REPO / "constraints" / "colab.txt").read_text(),
            re.M,
        )
    )
    found = subprocess.run(
        [
            python,
            "-c",
            "import ipykernel, jupyter_client, ipywidgets; print(ipykernel.__version__,"
            " jupyter_client.__version__, ipywidgets.__version__)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert found == [pins["ipykernel"], pins["jupyter_client"], pins["ipywidgets"]], found
    _check_final_state(_saved_bar(python, tmp_path))
