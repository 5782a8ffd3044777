"""Shared fixtures: the offline data sets in ../shared/data where a machine has them, else a stand-in
folder with the same file names, built from the Python standard library and the small samples the
package ships (tinygpt/samples/README.md), so that the whole suite runs on a fresh clone with no network."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("TINYGPT_SHARED_DATA", REPO.parent / "shared" / "data"))
# A value no option, recipe or template will ever take: the one example of bad input (`from conftest import
# INVALID`), so that adding a schedule, a precision or a recipe never turns a test's bad value into a good one.
INVALID = "no-such-value"


def _stdlib_prose(chars: int) -> str:
    """English prose every machine has: the standard library's docstrings, in a fixed order."""
    import ast

    from tinygpt.data.sources import builtin_files

    out, n = [], 0
    for path in builtin_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and (
                doc := ast.get_docstring(node)
            ):
                out.append(doc.strip() + "\n\n")
                n += len(out[-1])
                if n >= chars:
                    return "".join(out)
    return "".join(out)


def build_stand_in(folder: Path) -> Path:
    """The stand-in data folder: same names as ../shared/data, content every machine can make."""
    from tinygpt.core.config import DataConfig
    from tinygpt.core.paths import sample_path
    from tinygpt.data.sources import validation_text
    from tinygpt.finetune.stdlib_instructions import write_stdlib_instructions
    from tinygpt.model.tokenizer import find_gpt2_files

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tinyshakespeare.txt").write_text(_stdlib_prose(1_100_000), encoding="utf-8")
    (folder / "wikitext2_test.txt").write_text(
        validation_text(DataConfig(source="builtin"), 400_000), encoding="utf-8"
    )
    write_stdlib_instructions(folder / "code_alpaca_2k.json")
    for name, sample in (
        ("HumanEval.jsonl.gz", "humaneval"),
        ("mbpp.jsonl", "mbpp"),
        ("hellaswag_val.txt.bz2", "hellaswag"),
    ):
        shutil.copyfile(
            sample_path("sample:" + sample), folder / name
        )  # the samples the package ships
    vocab, merges = find_gpt2_files()
    shutil.copyfile(vocab, folder / "gpt2_vocab.json")
    shutil.copyfile(merges, folder / "gpt2_merges.txt")
    assert gzip.open(folder / "HumanEval.jsonl.gz").read()
    return folder


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory) -> Path:
    """The folder of public data sets (Tiny Shakespeare, WikiText-2, HellaSwag, HumanEval, MBPP...):
    ../shared/data when present, else the stand-in (`build_stand_in`)."""
    if (SHARED_DATA / "tinyshakespeare.txt").is_file():
        return SHARED_DATA
    return build_stand_in(tmp_path_factory.mktemp("stand-in-data"))


@pytest.fixture(scope="session")
def shakespeare(shared_data) -> str:
    return (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def tokens(shared_data, tmp_path_factory):
    """Tiny Shakespeare's first 300k characters as token shards (a 512-token BPE), for trainer tests."""
    from tinygpt.core.config import DataConfig
    from tinygpt.data.shards import build_token_cache
    from tinygpt.model.tokenizer import train_bpe

    text = (shared_data / "tinyshakespeare.txt").read_text()
    tok = train_bpe([text[:200_000]], 512)
    cfg = DataConfig(
        source=str(shared_data / "tinyshakespeare.txt"), vocab_size=512, max_chars=300_000
    )
    return build_token_cache(cfg, tok, tmp_path_factory.mktemp("cache"))


def pytest_configure(config):
    # the two tiers (docs/TESTING.md): `-m "not slow"` is the inner loop, the README's command runs both
    config.addinivalue_line(
        "markers",
        "slow: real processes killed, mirrors filled, notebooks, the browser, pip, "
        "torch.compile against eager, llama.cpp: tests that a faster one covers in "
        "short form; the full suite (no -m) runs them",
    )
    # Tiny models on a 2-core CI machine run fastest with one thread per test process
    # (pytest-xdist runs two); more threads only contend.
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """Modules holding a slow test run first, each kept whole (a module fixture is set up once
    per worker): longest first, so that short tests, not a 2-minute one begun last, fill the end
    of a run on two workers."""
    slow = {getattr(i, "module", None) for i in items if i.get_closest_marker("slow")} - {None}
    items.sort(
        key=lambda item: getattr(item, "module", None) not in slow
    )  # stable: each module's order kept


def read_gguf(path: str | Path) -> tuple[dict, dict]:
    """(metadata {key: value}, tensors {name: float32 array in numpy (torch) order, dequantized}) of
    a GGUF file, through gguf's own reader: what llama.cpp will find there."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.asarray(data, dtype=np.float32).reshape(
            tuple(int(d) for d in reversed(t.shape))
        )
    return meta, tensors


def export_run(run_dir: str | Path, out_dir: str | Path, which: str = "latest") -> Path:
    """A run's checkpoint ("latest", "best" or a folder) and tokenizer as a Hugging Face folder."""
    from tinygpt.model.hf import check_export_target, export_model
    from tinygpt.model.loading import load_run

    check_export_target(out_dir)  # fail before loading anything
    model, tokenizer, _, _ = load_run(run_dir, which)
    return export_model(model, tokenizer, out_dir)


def wait_for_step(run_dir: Path, step: int, proc, timeout: float = 120) -> None:
    """Until `run_dir`'s metrics.jsonl has logged `step` (a training process `proc` writes it); the
    process's output if it ended before, TimeoutError after `timeout` seconds."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        metrics = Path(run_dir) / "metrics.jsonl"
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            if lines and json.loads(lines[-1] or "{}").get("step", 0) >= step:
                return
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.005)
    raise TimeoutError
