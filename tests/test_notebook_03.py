"""notebooks/03_evaluate.ipynb: runs top to bottom with nbmake in smoke mode, offline with no data folder (the
samples that ship with the package), on its Colab path (the fake google.colab: Drive mounts, the runs are read
from it), and is committed thin and without outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "03_evaluate.ipynb"
BADGE = (
    "https://colab.research.google.com/github/tinygpt/tinygpt/blob/main/notebooks/03_evaluate.ipynb"
)
MAX_CODE_LINES = 8  # notebooks hold no logic: each cell is a few calls into the library


def test_committed_thin_and_without_outputs():
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert BADGE in "".join(nb["cells"][0]["source"]), "the first cell opens the notebook in Colab"
    for c in code:
        assert c["outputs"] == [] and c["execution_count"] is None, (
            f"outputs committed in cell {c['id']}"
        )
        assert len("".join(c["source"]).splitlines()) <= MAX_CODE_LINES, (
            f"cell {c['id']} holds logic"
        )
    assert len(nb["cells"]) - len(code) >= len(code)  # as much explanation as code


@pytest.mark.slow  # a notebook (test_notebooks.py::test_setup_notebook is the fast one)
def test_notebook_runs_in_smoke_mode_on_its_colab_path(tmp_path):
    """With no data folder and no network: smoke mode evaluates on the samples that ship with the package."""
    pytest.importorskip("nbmake")
    fake_colab = str(REPO / "tests" / "fake_colab")
    env = {
        **os.environ,
        "TINYGPT_SMOKE": "1",
        "TINYGPT_SHARED_DATA": str(tmp_path / "no-data-folder"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [fake_colab, str(REPO), os.environ.get("PYTHONPATH")])
        ),
        "TINYGPT_WORKDIR": str(tmp_path / "content"),
        "TINYGPT_CACHE": str(tmp_path / "cache"),
        "TINYGPT_FAKE_DRIVE_ROOT": str(tmp_path / "drive-backing"),
        # a tiny model on a busy 2-core machine: a second thread only spin-waits (7 s against 50 s measured)
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--nbmake",
            "--nbmake-timeout=300",
            "-q",
            "-p",
            "no:cacheprovider",
            str(NOTEBOOK),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    runs = tmp_path / "drive-backing" / "MyDrive" / "tinygpt" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == [
        "smoke-lr0.001",
        "smoke-lr0.003",
    ]  # read from "Drive"
    assert (
        json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"][2]["outputs"] == []
    )  # nothing written back
