"""The samples that ship with the package (tinygpt/samples/): each `sample:NAME` is a file in the package,
listed with its licence, installed by setup.py, and read by pretraining, finetuning and evaluation alike."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest

from tinygpt.core.paths import SAMPLES, SAMPLES_DIR, is_sample, sample_path
from tinygpt.data.sources import DataError, resolve_source
from tinygpt.evals.tasks import TASKS, eval_data
from tinygpt.evals.tasks.hellaswag import load_hellaswag
from tinygpt.evals.tasks.humaneval import load_humaneval
from tinygpt.evals.tasks.mbpp import load_mbpp
from tinygpt.finetune.records import load_records, record_segments

REPO = Path(__file__).resolve().parents[1]


def test_each_sample_is_a_file_with_its_licence_and_installed_by_setup():
    readme = (SAMPLES_DIR / "README.md").read_text(encoding="utf-8")
    setup = (REPO / "setup.py").read_text(encoding="utf-8")
    patterns = re.findall(r'"(samples/\*\.[a-z0-9]+)"', setup)
    for name, file in SAMPLES.items():
        assert (
            sample_path(f"sample:{name}") == SAMPLES_DIR / file and (SAMPLES_DIR / file).is_file()
        )
        row = next(line for line in readme.splitlines() if f"`sample:{name}`" in line)
        assert f"`{file}`" in row and re.search(r"MIT|CC BY", row), row  # its licence, on its row
        assert any(fnmatch.fnmatch(f"samples/{file}", p) for p in patterns), (
            f"setup.py does not install {file}"
        )
    assert sorted(p.name for p in SAMPLES_DIR.iterdir()) == sorted([*SAMPLES.values(), "README.md"])


def test_an_unknown_sample_names_the_samples():
    with pytest.raises(
        ValueError, match="sample:wikitext2, sample:hellaswag, sample:mbpp, sample:humaneval"
    ):
        sample_path("sample:alpaca")
    with pytest.raises(DataError, match="no sample 'x'"):
        resolve_source("sample:x")
    assert is_sample("sample:mbpp") and not is_sample("samples/x.txt")


def test_the_samples_are_what_the_tasks_read():
    assert len(load_mbpp(sample_path("sample:mbpp"))) == 52  # MBPP's evaluation ids in the sample
    ids = [
        json.loads(line)["task_id"] for line in sample_path("sample:mbpp").read_text().splitlines()
    ]
    assert sum(not 11 <= i <= 510 for i in ids) == 310  # its training ids: what finetuning reads
    assert len(load_hellaswag(sample_path("sample:hellaswag"))) == 200
    assert len(load_humaneval(sample_path("sample:humaneval"))) == 8
    assert resolve_source("sample:wikitext2") == ("local", sample_path("sample:wikitext2"))
    for name, task in TASKS.items():
        if task.sample is not None:
            assert eval_data(name, sample=True) == f"sample:{task.sample}"
            assert f"sample:{task.sample}" in task.data_help  # `tinygpt eval --help` names it


def test_finetuning_reads_the_mbpp_sample_and_builtin_instructions(tmp_path, monkeypatch):
    """`tinygpt finetune --data sample:mbpp` trains on the sample's training ids only; `--data builtin` on the
    standard library's functions as instructions, written once into the cache."""
    records = load_records("sample:mbpp")
    _, fmt, excluded = record_segments(records)
    assert len(records) == 362 and fmt == "mbpp" and excluded == 52
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path))
    stdlib = load_records("builtin")
    assert (tmp_path / "data" / "stdlib_instructions.json").is_file() and len(stdlib) > 100
    assert set(stdlib[0]) == {"instruction", "input", "output"} and load_records("stdlib") == stdlib
    with pytest.raises(DataError, match="sample:mbpp"):
        load_records("sample:alpaca")
