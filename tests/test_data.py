"""Text sources, the token cache and the sampler, on real text."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tinygpt.cli import main
from tinygpt.core.config import ConfigError, DataConfig
from tinygpt.data.sampler import WindowSampler, fixed_batches
from tinygpt.data.shard_writer import token_dtype
from tinygpt.data.shards import build_token_cache
from tinygpt.data.sources import (
    DataError,
    builtin_files,
    iter_documents,
    resolve_source,
)
from tinygpt.model.tokenizer import train_bpe

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(shakespeare):
    return train_bpe([shakespeare[:200_000]], vocab_size=600)


def test_builtin_corpus_is_the_standard_library():
    files = builtin_files()
    names = {f.name for f in files}
    assert {"os.py", "json/__init__.py".split("/")[-1], "random.py"} <= names
    assert not any("site-packages" in str(f) for f in files)
    docs = list(iter_documents(DataConfig(source="builtin", max_chars=100_000)))
    assert sum(map(len, docs)) == 100_000 and any("def " in d for d in docs)


def test_token_cache_is_built_once_and_reused(tmp_path, tok, shared_data):
    cfg = DataConfig(source=str(shared_data / "tinyshakespeare.txt"), vocab_size=600)
    a = build_token_cache(cfg, tok, tmp_path)
    assert (
        a.train.dtype == np.uint16
        and a.meta["val_tokens"] > 0
        and a.meta["train_tokens"] > 10 * a.meta["val_tokens"]
    )
    # the cache holds exactly the encoding of each document followed by end-of-text
    docs = list(iter_documents(cfg))
    first = tok.encode(docs[0]) + [tok.eot_id]
    assert a.train[: len(first)].tolist() == first
    mtime = (a.path / "train_000000.bin").stat().st_mtime_ns
    b = build_token_cache(cfg, tok, tmp_path)
    assert b.path == a.path and (b.path / "train_000000.bin").stat().st_mtime_ns == mtime
    assert np.array_equal(a.val, b.val)
    # a different tokenizer or split is a different cache
    c = build_token_cache(
        DataConfig(source=cfg.source, vocab_size=600, val_fraction=0.1), tok, tmp_path
    )
    assert c.path != a.path and c.meta["val_tokens"] > a.meta["val_tokens"]


def test_local_folder_source(tmp_path, tok, shakespeare):
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text(shakespeare[:50_000])
    (tmp_path / "corpus" / "sub" / "b.md").write_text(shakespeare[50_000:100_000])
    (tmp_path / "corpus" / "image.png").write_bytes(b"\x89PNG")
    docs = list(iter_documents(DataConfig(source=str(tmp_path / "corpus"))))
    assert "".join(docs) == shakespeare[:100_000]


def test_hf_dataset_saved_to_disk(tmp_path, tok, shakespeare):
    datasets = pytest.importorskip("datasets")
    lines = [p for p in shakespeare[:60_000].split("\n\n") if p]
    datasets.Dataset.from_dict({"text": lines}).save_to_disk(str(tmp_path / "ds"))
    assert resolve_source(str(tmp_path / "ds"))[0] == "hf"
    docs = list(iter_documents(DataConfig(source=str(tmp_path / "ds"))))
    assert docs == lines
    with pytest.raises(DataError, match="no field 'content'"):
        list(iter_documents(DataConfig(source=str(tmp_path / "ds"), text_field="content")))


def test_sampler_is_deterministic_and_resumes_exactly():
    tokens = np.arange(10_001, dtype=np.uint16)
    a = WindowSampler(tokens, 100, seed=3)
    batches = [a.next_batch(7) for _ in range(30)]  # 210 windows: crosses two epochs of 100
    x, y = batches[0]
    assert x.shape == (7, 100) and torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == torch.int64
    b = WindowSampler(tokens, 100, seed=3)
    for _ in range(11):
        b.next_batch(7)
    state = json.loads(json.dumps(b.state_dict()))  # survives a JSON round trip
    c = WindowSampler(tokens, 100, seed=3)
    c.load_state_dict(state)
    for i in range(11, 30):
        assert torch.equal(c.next_batch(7)[0], batches[i][0])
    # every window is visited once per epoch
    d = WindowSampler(tokens, 100, seed=3)
    starts = torch.cat([d.next_batch(10)[0][:, 0] for _ in range(10)])
    assert sorted(starts.tolist()) == list(range(0, 10_000, 100))


def test_sampler_ranks_split_the_global_batch():
    tokens = np.arange(5_001, dtype=np.uint16)
    one = WindowSampler(tokens, 50, seed=0)
    r0, r1 = WindowSampler(tokens, 50, seed=0), WindowSampler(tokens, 50, seed=0)
    for _ in range(5):
        full = one.next_batch(8)[0]
        assert torch.equal(torch.cat([r0.next_batch(4, 0, 2)[0], r1.next_batch(4, 1, 2)[0]]), full)


def test_fixed_batches_are_the_same_every_time():
    tokens = np.arange(3_001, dtype=np.uint16)
    a, b = fixed_batches(tokens, 64, 4, 3), fixed_batches(tokens, 64, 4, 3)
    assert len(a) == 3 and all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, b))
    # 46 windows in batches of 8: the last batch keeps the shape, its 2 padding rows count for nothing
    part = fixed_batches(tokens, 64, 8, 10)
    assert len(part) == 6 and {tuple(x.shape) for x, _ in part} == {(8, 64)}
    assert (
        int((part[-1][1] == -100).all(dim=1).sum()) == 2
        and sum(int((y != -100).sum()) for _, y in part) == 46 * 64
    )


def test_bad_data_gets_clear_errors(tmp_path):
    with pytest.raises(DataError, match="neither 'builtin'"):
        resolve_source("no/such/thing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no text files"):
        resolve_source(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="fewer than one window"):
        WindowSampler(np.arange(50, dtype=np.uint16), 64, 0)
    with pytest.raises(DataError, match="fewer than one window"):
        fixed_batches(np.arange(10, dtype=np.uint16), 64, 4, 2)
    with pytest.raises(ConfigError, match="vocab_size"):
        DataConfig(vocab_size=100)
    with pytest.raises(ConfigError, match="vocab_size"):
        DataConfig(vocab_size=2**33)
    assert token_dtype(65536) == np.uint16 and token_dtype(70000) == np.uint32
    s = WindowSampler(np.arange(1000, dtype=np.uint16), 10, 0)
    with pytest.raises(DataError, match="seq_len=20"):
        s.load_state_dict({**s.state_dict(), "seq_len": 20})
    with pytest.raises(DataError, match="older tinygpt"):
        s.load_state_dict({"seq_len": 10, "n_windows": 99, "seed": 0, "epoch": 0, "index": 0})


def test_same_path_source_resolves_our_spelling_and_only_reads_theirs_as_words(
    tmp_path, monkeypatch
):
    from tinygpt.data.sources import same_path_source

    text = tmp_path / "text.txt"
    text.write_text("some words\n" * 10)
    (tmp_path / "link.txt").symlink_to(text)
    monkeypatch.chdir(tmp_path)
    assert same_path_source("text.txt", str(text)) and same_path_source(str(text), "text.txt")
    assert same_path_source("link.txt", str(text))  # our side is resolved, links and all
    assert not same_path_source(
        str(text), "link.txt"
    )  # theirs is never looked up: a link it names is not followed
    assert not same_path_source(str(text), str(tmp_path / "other.txt"))
    assert not same_path_source("builtin", "builtin") and not same_path_source(
        str(text), "hf:user/text.txt"
    )


@pytest.mark.parametrize(
    "make,why",
    [
        (lambda p: p.write_bytes(b""), "is empty"),
        (lambda p: p.write_bytes(b"\0" * 1000), "holds only NUL bytes"),
        (
            lambda p: p.write_bytes(b"text, then a NUL\0" * 100),
            "is a binary file (it has NUL bytes)",
        ),
    ],
)
def test_a_source_without_text_says_why_in_one_line_without_a_class_name(
    make, why, tmp_path, capsys
):
    data = tmp_path / "data.txt"
    make(data)
    assert (
        main(
            [
                "pretrain",
                str(tmp_path / "run"),
                "--recipe",
                "cpu-smoke",
                "--data",
                str(data),
                "--quiet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"data source {data} {why}" in err, err
    assert "Error:" not in err and "Warning" not in err and not (tmp_path / "run").exists()
    # a folder of such files (named as text)
    folder = tmp_path / "texts"
    folder.mkdir()
    for name in ("a.txt", "b.py"):
        make(folder / name)
    assert (
        main(
            [
                "pretrain",
                str(tmp_path / "run"),
                "--recipe",
                "cpu-smoke",
                "--data",
                str(folder),
                "--quiet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    words = "holds only empty files" if why == "is empty" else "holds only binary files (NUL bytes)"
    assert err.count("\n") == 1 and f"data source {folder} {words}" in err, err


def test_a_binary_file_beside_text_is_warned_once_as_tinygpts_line(tmp_path):
    """The tokenizer's pass over the source and the token cache's writer process both meet the binary file: one
    warning, tinygpt's line, not a second from the writer as Python's UserWarning with a source line."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"\0\1\2" * 1000)
    (folder / "b.txt").write_text(
        ("To be, or not to be: that is the question. " * 40 + "\n\n") * 60
    )
    for tokenizer in ("train", "gpt2"):  # gpt2: only the writer process reads the source
        sets = (
            ["--set", "data.tokenizer=gpt2", "model.vocab_size=50304"]
            if tokenizer == "gpt2"
            else []
        )
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tinygpt",
                "pretrain",
                str(tmp_path / tokenizer),
                "--recipe",
                "cpu-smoke",
                "--data",
                str(folder),
                "--max-steps",
                "1",
                "--quiet",
                "--device",
                "cpu",
                *sets,
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        warned = [line for line in out.stderr.splitlines() if "binary" in line]
        assert warned == [f"tinygpt: warning: {folder}: 1 file binary (NUL bytes), skipped"], (
            out.stderr[-3000:]
        )
        assert "UserWarning" not in out.stderr and "data.py" not in out.stderr
