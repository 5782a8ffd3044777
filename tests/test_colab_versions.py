"""The notebooks' install lines keep Colab's preinstalled packages (constraints/colab.txt) as they are, and
constraints/colab.txt is Colab's list as last read (tools/colab_versions.py against tests/fixtures' copy).

Two checks of the install lines: the requirement ranges of tinygpt and its notebook extras admit every pinned version (no network),
and pip itself resolves each notebook's install line for Colab's Python and platform with the pinned versions
as constraints (metadata only, nothing installed), which also covers what the dependencies require in turn.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from test_install import NOTEBOOKS, build_wheel, install_cell

ROOT = Path(__file__).resolve().parents[1]
COLAB = ROOT / "constraints" / "colab.txt"
sys.path.insert(0, str(ROOT / "tools"))
import colab_versions  # noqa: E402 (tools/ is no package)

# Colab's interpreter (colab.txt's `# python` line) and platform, for markers and for pip's wheel choice
# (glibc 2.35: Ubuntu 22.04)
COLAB_PYTHON = colab_versions.pinned_python(COLAB.read_text())
COLAB_PYTHON_MINOR = ".".join(COLAB_PYTHON.split(".")[:2])
COLAB_ENV = {
    "python_version": COLAB_PYTHON_MINOR,
    "python_full_version": COLAB_PYTHON,
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(35, 16, -1)] + [
    "manylinux2014_x86_64",
    "linux_x86_64",
]
NETWORK_ERRORS = (
    "NewConnectionError",
    "Failed to establish",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeout",
    "ReadTimeout",
    "ProxyError",
    "SSLError",
)


def colab_pins() -> dict[str, Version]:
    """{canonical name: version} from constraints/colab.txt (a local label such as +cu126 dropped)."""
    pins = {}
    for line in COLAB.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version.split("+")[0])
    return pins


def notebook_extras() -> list[tuple[str, ...]]:
    """The extras each notebook's install cell asks for, e.g. ('notebooks', 'finetune')."""
    found = {
        tuple(re.match(r"tinygpt\[([\w,]+)\]", install_cell(nb)[1]).group(1).split(","))
        for nb in NOTEBOOKS
    }
    return sorted(found)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """This checkout as a wheel: its metadata is what pip and Colab see (setup.py as it is now)."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def requirements(wheel: Path, extras: tuple[str, ...]) -> list[Requirement]:
    """What installing tinygpt[extras] asks for directly on Colab."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [
        Requirement(r) for r in email.parser.Parser().parsestr(meta).get_all("Requires-Dist") or []
    ]
    return [
        r
        for r in reqs
        if r.marker is None
        or any(r.marker.evaluate({**COLAB_ENV, "extra": e}) for e in ("",) + extras)
    ]


def test_the_pinned_list_covers_what_the_notebooks_use():
    pins = colab_pins()
    for name in (
        "torch",
        "ipywidgets",
        "matplotlib",
        "pandas",
        "transformers",
        "datasets",
        "numpy",
    ):
        assert name in pins, f"constraints/colab.txt lost {name}"
    assert pins["ipywidgets"] < Version("8"), "Colab's front end renders ipywidgets 7 only"
    assert re.search(r"^# Read \d{4}-\d\d-\d\d", COLAB.read_text(), re.M), (
        "the list says when it was read"
    )
    assert notebook_extras() and all("notebooks" in e for e in notebook_extras())


@pytest.mark.parametrize("extras", notebook_extras(), ids=",".join)
def test_the_requirement_ranges_admit_colabs_versions(wheel, extras):
    """No network: every direct requirement that Colab already satisfies must accept the version it has."""
    pins = colab_pins()
    refused = [
        f"{r} refuses Colab's {pins[canonicalize_name(r.name)]}"
        for r in requirements(wheel, extras)
        if canonicalize_name(r.name) in pins
        and not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)
    ]
    assert not refused, f"tinygpt[{','.join(extras)}] would change Colab's packages: {refused}"


@pytest.mark.slow  # pip resolves
def test_pip_resolves_every_install_line_without_changing_colabs_packages(wheel, tmp_path):
    """pip's own resolver, for Colab's Python (3.13) on Colab's platform, with the pinned versions as constraints: it
    fails when anything tinygpt pulls in (directly or not) needs a version of a preinstalled package other
    than Colab's. One resolution of all the notebooks' extras together covers each install line (a subset of
    satisfiable requirements under the same constraints is satisfiable)."""
    extras = sorted({e for group in notebook_extras() for e in group})
    report = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--isolated",
        "--dry-run",
        "--quiet",
        "--retries",
        "1",
        "--timeout",
        "30",
        "--target",
        str(tmp_path / "target"),
        "--report",
        str(report),
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        COLAB_PYTHON_MINOR,
        *[a for p in PLATFORMS for a in ("--platform", p)],
        "-c",
        str(COLAB),
        f"tinygpt[{','.join(extras)}] @ {wheel.as_uri()}",
    ]
    # --isolated and no PIP_* variables: this machine's pip settings (its own constraints, local indexes)
    # must not decide what Colab would get
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {
        "PIP_CONFIG_FILE": os.devnull
    }
    cert = "/etc/ssl/certs/ca-certificates.crt"  # the system's CA bundle where there is one (proxies add theirs)
    if Path(cert).is_file():
        cmd[4:4] = ["--cert", cert]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0 and any(e in out.stderr for e in NETWORK_ERRORS):
        pytest.skip(
            "the package index is not reachable from here: the ranges are checked offline above"
        )
    assert out.returncode == 0, (
        f"tinygpt[{','.join(extras)}] conflicts with Colab's packages:\n{out.stderr[-3000:]}"
    )
    pins = colab_pins()
    chosen = {
        canonicalize_name(i["metadata"]["name"]): Version(i["metadata"]["version"])
        for i in json.loads(report.read_text())["install"]
    }
    assert chosen["tinygpt"] and chosen["ipywidgets"] == pins["ipywidgets"]
    changed = {n: (pins[n], v) for n, v in chosen.items() if n in pins and v != pins[n]}
    assert not changed, changed  # -c guarantees it; a pin pip ignored would show here


# ---- has Colab moved? constraints/colab.txt against Colab's own list ------------------------------------------


def test_colab_txt_is_colabs_list_as_last_read():
    """constraints/colab.txt and the copy of Colab's pip-freeze.gpu.txt / os-info-gpu.txt in tests/fixtures were
    read from the same commit of googlecolab/backend-info: refreshing one without the other fails here, with each
    package that differs (the README's "Versions" says how to refresh both)."""
    found = colab_versions.differences(
        COLAB.read_text(), colab_versions.FREEZE.read_text(), colab_versions.OS_INFO.read_text()
    )
    assert not found, (
        "constraints/colab.txt differs from tests/fixtures' copy of Colab's list:\n"
        + "\n".join(found)
    )
    assert COLAB_PYTHON_MINOR == "3.13" and colab_versions.pins(COLAB.read_text())[
        "torch"
    ] == Version("2.11.0")


def test_a_moved_colab_is_reported_package_by_package(tmp_path):
    """The tool names each package whose version moved, one that left the list, and a new Python; local labels
    (+cu128) are not differences. Its exit status says whether anything moved."""
    freeze = colab_versions.FREEZE.read_text()
    moved = (
        freeze.replace("torch==2.11.0+cu128", "torch==2.12.0+cu130")
        .replace("peft==0.20.0\n", "")
        .replace("ipywidgets==7.7.1", "ipywidgets==8.1.5")
    )
    os_info = colab_versions.OS_INFO.read_text().replace("Python 3.13.15", "Python 3.14.2")
    found = colab_versions.differences(COLAB.read_text(), moved, os_info)
    assert found == [
        "torch: constraints/colab.txt 2.11.0, Colab 2.12.0",
        "peft: constraints/colab.txt 0.20.0, not in Colab's list (removed or renamed)",
        "ipywidgets: constraints/colab.txt 7.7.1, Colab 8.1.5",
        "python: constraints/colab.txt 3.13.15, Colab 3.14.2",
    ]
    (tmp_path / "freeze.txt").write_text(moved)
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "colab_versions.py"), str(tmp_path / "freeze.txt")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "torch: constraints/colab.txt 2.11.0, Colab 2.12.0" in out.stdout
    assert "3 pinned package(s) differ" in out.stdout  # no os-info given: Python is not compared
    same = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "colab_versions.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert same.returncode == 0 and "matches" in same.stdout, same.stdout + same.stderr
