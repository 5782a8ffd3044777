"""notebooks/02_finetune.ipynb: committed clean and thin, and run for real by nbmake in a subprocess on the CPU
(TINYGPT_SMOKE=1, no network) with the fake google.colab, so its Colab path runs: Drive mounts, a tiny base is
pretrained onto Drive, the adapter's checkpoints and the adapter are mirrored there, and a new VM resumes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbmake")
pytest.importorskip("peft")

from tinygpt.core.checkpoint import list_checkpoints, read_manifest, sha256_file, verify_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "02_finetune.ipynb"
FAKE_COLAB = Path(__file__).parent / "fake_colab"
BADGE = (
    "https://colab.research.google.com/github/tinygpt/tinygpt/blob/main/notebooks/02_finetune.ipynb"
)
MAX_CODE_LINES = 8  # notebooks hold no logic: each cell is a few calls into the library


def test_notebook_is_committed_clean_thin_and_guarded():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert BADGE in nb.cells[0].source, "the first cell opens the notebook in Colab"
    code = [c for c in nb.cells if c.cell_type == "code"]
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, (
            f"outputs committed in cell {cell.id}"
        )
        assert len(cell.source.splitlines()) <= MAX_CODE_LINES, f"cell {cell.id} holds logic"
        if "%pip" in cell.source or "google.colab import" in cell.source:
            assert '"google.colab" in sys.modules' in cell.source or "in_colab()" in cell.source, (
                f"cell {cell.id} runs Colab-only code unguarded"
            )
    assert sum(c.cell_type == "markdown" for c in nb.cells) >= len(code)  # every step explained


def run_notebook(tmp: Path, shared_data: Path) -> dict[str, str]:
    """Execute a copy of the notebook with nbmake (a new 'VM' under tmp/content, Drive at tmp/drive-backing);
    everything each code cell showed, as text, by cell id."""
    copy = tmp / "02_finetune.ipynb"
    shutil.copyfile(NOTEBOOK, copy)
    path = os.pathsep.join([str(FAKE_COLAB), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env = {
        **os.environ,
        "TINYGPT_SMOKE": "1",
        "PYTHONPATH": path,
        "TINYGPT_WORKDIR": str(tmp / "content"),
        "TINYGPT_CACHE": str(tmp / "cache"),
        "TINYGPT_FAKE_DRIVE_ROOT": str(tmp / "drive-backing"),
        "TINYGPT_FAKE_DOWNLOADS": str(tmp / "downloads"),
        "TINYGPT_SHARED_DATA": str(shared_data),
        "OMP_NUM_THREADS": "1",
        "JUPYTER_PLATFORM_DIRS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",  # the smoke run must need no network
        # the kernel is this interpreter's: the kernelspec says "python3", found on PATH
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--nbmake",
            "--overwrite",
            "--nbmake-timeout=300",
            "-q",
            "-p",
            "no:cacheprovider",
            str(copy),
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    shown = {}
    for cell in nbformat.read(copy, as_version=4).cells:
        parts = []
        for o in cell.get("outputs", []):
            parts.append(o.get("text", ""))
            parts += [
                o.get("data", {}).get(k, "") for k in ("text/plain", "text/html", "image/png")
            ]
        shown[cell.id] = "\n".join(parts)
    return shown


@pytest.mark.slow  # a notebook run twice
def test_notebook_finetunes_mirrors_to_drive_and_resumes_on_a_new_vm(tmp_path, shared_data):
    out = run_notebook(tmp_path, shared_data)
    drive = tmp_path / "drive-backing" / "MyDrive" / "tinygpt" / "runs"
    mirror = drive / "my-first-finetune"
    assert "Mounted at" in out["run"] and "nothing on Drive yet" in out["run"]
    assert verify_checkpoint(drive / "smoke-base" / "checkpoints" / "step_000020")[
        0
    ]  # the base, on Drive
    assert "llama" in out["base"] and "lora-r8" in out["recipe"] and "<table" in out["recipe"]
    n = len(json.loads((shared_data / "code_alpaca_2k.json").read_text()))
    assert f"{n:,} records" in out["data"]
    assert (
        "no: a new run" in out["train"] and "iVBOR" in out["train"]
    )  # the result table and the live plot (PNG)
    # the progress bar's saved output (what GitHub and nbviewer show) is its last state, not 0%
    assert "training: 100%" in out["train"] and "training:   0%" not in out["train"], out["train"][
        :600
    ]
    assert (tmp_path / "content" / "runs" / "my-first-finetune" / "plots" / "loss.png").is_file()
    assert out["generations"].count("--- before (the base) ---") == 3
    on_drive = [s for s, _ in list_checkpoints(mirror / "checkpoints")]
    assert on_drive[-1] == 6 and set(on_drive) <= {3, 6}, (
        on_drive
    )  # step 3 may be superseded by 6 while it waits
    assert all(verify_checkpoint(p)[0] for _, p in list_checkpoints(mirror / "checkpoints"))
    for name, info in read_manifest(mirror / "adapter")["files"].items():
        assert sha256_file(mirror / "adapter" / name) == info["sha256"]
    assert (
        "on Drive: step 6 of recipe lora-r8" in out["drive"] and "adapter on Drive" in out["drive"]
    )

    shutil.rmtree(tmp_path / "content")  # a disconnect: the VM's disk is gone, Drive is not
    shutil.rmtree(tmp_path / "cache")
    out = run_notebook(tmp_path, shared_data)
    assert "on Drive: step 6 of recipe lora-r8" in out["run"]
    assert "the recipe of the run on Drive" in out["recipe"]
    assert "from step 6" in out["train"]
    assert verify_checkpoint(
        tmp_path / "content" / "runs" / "my-first-finetune" / "checkpoints" / "step_000006"
    )[0]
