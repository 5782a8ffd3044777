"""The notebooks' install cell, as Colab runs it: one TINYGPT_SOURCE variable at the top, the same in
every notebook, and the pip requirement it builds installs this checkout (built as a wheel here,
where a Colab user gets it from GitHub) into a fresh environment that then works offline."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def install_cell(nb: Path) -> tuple[str, str]:
    """(the TINYGPT_SOURCE value, the %pip requirement template) of a notebook's first code cell."""
    cell = next(c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
    src = "".join(cell["source"])
    source = re.search(r'^TINYGPT_SOURCE = "([^"]+)"', src, re.M)
    pip = re.search(r'^\s+%pip install -q "([^"]+)"$', src, re.M)
    assert source and pip, (
        f"{nb.name}: the install cell lost its TINYGPT_SOURCE line or its %pip line"
    )
    return source.group(1), pip.group(1)


def test_every_notebook_installs_from_one_source_variable():
    cells = {nb.name: install_cell(nb) for nb in NOTEBOOKS}
    assert len(cells) == 4 and len({s for s, _ in cells.values()}) == 1, cells
    for name, (_, template) in cells.items():
        assert template.startswith("tinygpt[notebooks") and template.endswith(
            " @ {TINYGPT_SOURCE}"
        ), name


def build_wheel(out: Path) -> Path:
    """This checkout as a wheel in `out`. pip builds in the tree (build/, tinygpt.egg-info/), so two builds at
    once (the two test workers) would write over each other's files: one at a time, by a lock."""
    from filelock import FileLock  # a dependency of torch

    lock = (
        Path(tempfile.gettempdir())
        / f"tinygpt-wheel-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]}.lock"
    )
    with FileLock(str(lock), timeout=600):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                str(out),
                str(ROOT),
            ],
            check=True,
            timeout=300,
        )
    return next(out.glob("tinygpt-*.whl"))


@pytest.mark.slow  # pip installs into a fresh environment
def test_the_install_cell_installs_this_checkout_into_a_fresh_environment(tmp_path):
    wheel = build_wheel(tmp_path / "dist")
    _, template = install_cell(ROOT / "notebooks" / "01_pretrain.ipynb")
    requirement = template.format(
        TINYGPT_SOURCE=wheel.as_uri()
    )  # what IPython expands in the %pip line
    venv = tmp_path / "venv"
    # the dependencies come from this environment (Colab has them preinstalled), tinygpt from the wheel:
    # a .pth line adds this environment's packages after the new one's (its own .pth files, such as an
    # editable install of this checkout, are not run, so the wheel's copy is the one imported)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # --ignore-installed: pip would otherwise take this environment's own tinygpt (seen through the .pth) as
    # already there, and install nothing
    here = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "outer-env.pth").write_text("\n".join(here) + "\n")
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", requirement],
        check=True,
        timeout=300,
    )
    probe = (
        "import tinygpt, pathlib; from tinygpt.model.tokenizer import load_gpt2\n"
        "t = load_gpt2(); assert t.decode(t.encode('Hello world')) == 'Hello world'\n"
        "print(pathlib.Path(tinygpt.__file__).resolve())"
    )
    out = subprocess.run(
        [str(py), "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert str(venv) in out.stdout  # the wheel's copy, GPT-2 BPE files included (package data)


def test_the_notebooks_extra_keeps_colabs_preinstalled_widgets():
    """Colab ships ipywidgets 7.7.1 and does not render 8: installing tinygpt[notebooks] must not upgrade it."""
    from importlib.metadata import metadata

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in metadata("tinygpt").get_all("Requires-Dist") or []]
    widgets = [
        r
        for r in reqs
        if r.name == "ipywidgets" and r.marker and r.marker.evaluate({"extra": "notebooks"})
    ]
    assert widgets and all(r.specifier.contains("7.7.1") for r in widgets), widgets
