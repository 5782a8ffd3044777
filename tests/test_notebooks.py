"""The notebooks 00_setup and 01_pretrain, executed for real (as nbmake does, through nbclient) on the CPU
with TINYGPT_SMOKE=1 and the fake google.colab, so their Colab path runs: Drive mounts, the run
is mirrored, the zip is downloaded, and a new VM resumes from Drive. Also: nothing committed in them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from tinygpt.core.checkpoint import verify_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
FAKE_COLAB = Path(__file__).parent / "fake_colab"
OURS = ["00_setup.ipynb", "01_pretrain.ipynb"]
BADGE = "https://colab.research.google.com/github/tinygpt/tinygpt/blob/main/notebooks/"
MAX_CODE_LINES = 8  # notebooks hold no logic: each cell is a few calls into the library


@pytest.mark.parametrize("name", OURS)
def test_notebook_is_committed_clean_and_thin(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert BADGE + name in nb.cells[0].source, "the first cell opens the notebook in Colab"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"outputs committed in cell {cell.id}"
            )
            assert len(cell.source.splitlines()) <= MAX_CODE_LINES, f"cell {cell.id} holds logic"
    assert sum(c.cell_type == "markdown" for c in nb.cells) >= sum(
        c.cell_type == "code" for c in nb.cells
    )


class Colab:
    """A fake Colab VM for a notebook: /content, Drive's backing store and the browser's downloads
    are folders under tmp; Drive outlives the VM, the rest does not."""

    def __init__(self, tmp: Path):
        self.content, self.drive, self.downloads = (
            tmp / "content",
            tmp / "drive-backing",
            tmp / "downloads",
        )
        self.cache = tmp / "cache"

    def env(self) -> dict[str, str]:
        path = os.pathsep.join([str(FAKE_COLAB), str(REPO), os.environ.get("PYTHONPATH", "")])
        return {
            **os.environ,
            "TINYGPT_SMOKE": "1",
            "PYTHONPATH": path.rstrip(os.pathsep),
            "TINYGPT_WORKDIR": str(self.content),
            "TINYGPT_CACHE": str(self.cache),
            "TINYGPT_FAKE_DRIVE_ROOT": str(self.drive),
            "TINYGPT_FAKE_DOWNLOADS": str(self.downloads),
            "OMP_NUM_THREADS": "1",
            "JUPYTER_PLATFORM_DIRS": "1",
        }

    def run(self, name: str) -> dict[str, list[dict]]:
        """Execute a notebook top to bottom (an error in any cell fails the test); outputs by cell id."""
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        client = nbclient.NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
        )
        client.execute(env=self.env())
        return {c.id: c.get("outputs", []) for c in nb.cells}

    def lose_vm(self) -> None:
        shutil.rmtree(self.content)
        shutil.rmtree(self.cache, ignore_errors=True)


def text(outputs: list[dict]) -> str:
    """Everything a cell showed, as text (streams, text/plain and text/html)."""
    parts = []
    for o in outputs:
        parts.append(o.get("text", ""))
        data = o.get("data", {})
        parts += [data.get("text/plain", ""), data.get("text/html", "")]
    return "\n".join(parts)


def test_setup_notebook(tmp_path):
    vm = Colab(tmp_path)
    out = vm.run("00_setup.ipynb")
    assert (vm.content / "drive").is_symlink() and (
        vm.drive / "MyDrive"
    ).is_dir()  # Drive was mounted
    assert "MyDrive" in text(out["drive"])
    assert "cpu_cores" in text(out["hardware"])
    recipes = text(out["recipes"])
    assert (
        all(name in recipes for name in ("cpu-smoke", "a100-124m", "h100-760m"))
        and "<table" in recipes
    )
    summary = text(out["search"])
    assert "Trial search" in summary and "cpu-smoke" in summary and "time to finish" in summary


@pytest.mark.slow  # a notebook run twice
def test_pretrain_notebook_trains_mirrors_downloads_and_resumes_on_a_new_vm(tmp_path):
    vm = Colab(tmp_path)
    out = vm.run("01_pretrain.ipynb")
    mirror = vm.drive / "MyDrive" / "tinygpt" / "runs" / "my-first-gpt"
    assert verify_checkpoint(mirror / "checkpoints" / "step_000012")[0]
    assert json.loads((mirror / "run.json").read_text())["recipe"]["name"] == "cpu-smoke"
    assert "nothing on Drive yet" in text(out["run"])
    assert any("image/png" in o.get("data", {}) for o in out["train"])  # the live loss plot
    assert (vm.content / "runs" / "my-first-gpt" / "plots" / "loss.png").is_file()
    assert "no: a new run" in text(out["train"])
    assert "def " in text(out["samples"])
    assert (vm.downloads / "my-first-gpt.zip").is_file()

    vm.lose_vm()  # a disconnect: the VM's disk is gone, Drive is not
    out = vm.run("01_pretrain.ipynb")
    assert "on Drive: step 12 of recipe cpu-smoke" in text(out["run"])
    assert "from step 12" in text(out["train"])
    assert verify_checkpoint(vm.content / "runs" / "my-first-gpt" / "checkpoints" / "step_000012")[
        0
    ]
    assert (vm.downloads / "my-first-gpt.zip").is_file()
