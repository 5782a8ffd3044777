"""The dated result file a benchmark script ends with: `benchmarks/results/<date>-<topic>.md`, or the folder
given by `--results` (`--results none`: no file). It holds the date (UTC), the device (CPU model and cores,
GPU name and count, torch and Python versions, the load), the command line that ran, the figures as a
markdown table and the reference they are set against. A file of the same date and topic is never
overwritten: the next one gets a suffix (-2, -3, ...)."""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import re
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]
# settings that change a run's figures, shown before the command when they are set
ENV = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TINYGPT_SHARED_DATA", "TINYGPT_TIKTOKEN")


def folder(value: str) -> Path | None:
    """--results: a folder (made when it is missing), or none."""
    if value == "none":
        return None
    if Path(value).exists() and not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a file: give a folder, or none")
    return Path(value)


def add_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--results",
        type=folder,
        default=RESULTS,
        metavar="DIR",
        help="folder for the dated result file <date>-<topic>.md (default: benchmarks/results/; "
        "none: write none)",
    )


class Report:
    """print() that keeps each line for the result file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, *values: object) -> None:
        line = " ".join(map(str, values))
        print(line, flush=True)
        self.lines.append(line)

    def text(self) -> str:
        return "\n".join(self.lines)


def cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.5g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v).replace("|", "/").replace("\n", " ")


def table(rows: list[dict], keys: list[str] | None = None) -> str:
    """Rows of figures as a markdown table, one column per key (of the first row by default)."""
    keys = keys or list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows])


def command(script: str, argv: list[str] | None) -> str:
    """The command line as typed in the repository root, with the settings of ENV that are set."""
    path = Path(script).resolve()
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    args = sys.argv[1:] if argv is None else argv
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ENV if k in os.environ]
    return " ".join([*env, "python", shlex.join([str(shown), *map(str, args)])])


def cpu_model() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    m = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    return m.group(1).strip() if m else platform.processor() or platform.machine()


def device() -> list[str]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [
        f"CPU {cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        f"GPU {torch.cuda.get_device_name(0)} x {gpus}" if gpus else "no GPU",
        f"torch {torch.__version__}, Python {platform.python_version()}",
    ]


def write(
    where: Path | None,
    script: str,
    topic: str,
    title: str,
    figures: str,
    argv: list[str] | None = None,
    reference: str | None = None,
) -> Path | None:
    """Write the result file (figures: markdown) into `where` (None: none); its path."""
    if where is None:
        return None
    now = datetime.datetime.now(datetime.timezone.utc)
    topic = re.sub(r"[^a-z0-9]+", "-", topic.lower()).strip("-")
    cpu, gpu, versions = device()
    head = [f"# {title}", "", f"Written by `{Path(script).name}`, {now:%Y-%m-%d %H:%M} UTC.", ""]
    head += [f"- command: `{command(script, argv)}`", f"- device: {cpu}; {gpu}"]
    head += [f"- versions: {versions}"] + ([f"- reference: {reference}"] if reference else [])
    text = "\n".join(head) + "\n\n" + figures.strip() + "\n"
    where.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = where / f"{now:%Y-%m-%d}-{topic}{f'-{n}' if n > 1 else ''}.md"
        try:
            with open(path, "x", encoding="utf-8") as f:  # never over a file of the same name
                f.write(text)
        except FileExistsError:
            continue
        print(f"result file: {path}", flush=True)
        return path
