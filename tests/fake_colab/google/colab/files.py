"""Fake `google.colab.files`: `download` copies the file to $TINYGPT_FAKE_DOWNLOADS and records it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

downloaded: list[str] = []  # every path downloaded, for tests to look at


def download(filename: str) -> None:
    if not os.path.exists(filename):
        raise FileNotFoundError(f"Cannot find file: {filename}")
    target = Path(
        os.environ.get("TINYGPT_FAKE_DOWNLOADS")
        or os.path.join(tempfile.gettempdir(), "tinygpt-fake-downloads")
    )
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(filename, target / os.path.basename(filename))
    downloaded.append(str(filename))
