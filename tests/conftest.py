"""Shared fixtures: the offline data sets in ../shared/data, skipped with a reason when absent."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("TINYGPT_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder of real public data sets (Tiny Shakespeare, WikiText-2, HellaSwag, HumanEval, MBPP...)."""
    if not (SHARED_DATA / "tinyshakespeare.txt").is_file():
        pytest.skip(f"offline data sets not found at {SHARED_DATA} (set TINYGPT_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def shakespeare(shared_data) -> str:
    return (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")


def pytest_configure(config):
    # Tiny models on a 2-core CI machine run fastest with one thread per test process
    # (pytest-xdist runs two); more threads only contend.
    import torch

    torch.set_num_threads(1)
