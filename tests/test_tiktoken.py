"""The GPT-2 tokenizer through tiktoken (built from the package's own vocab and merges files) gives the ids
`tokenizers` gives, on text chosen to differ: unicode, whitespace runs, code, special tokens in the text; and the
shard writer, which now turns each batch into one array, writes the bytes the per-document writer wrote, on
either path. Trained tokenizers never take the tiktoken path."""

from __future__ import annotations

import hashlib
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from tinygpt.core.checkpoint import MANIFEST
from tinygpt.core.config import DataConfig
from tinygpt.core.rundir import read_json
from tinygpt.data.shard_writer import encode_documents, token_dtype, write_shards
from tinygpt.data.sources import is_validation_document, iter_documents
from tinygpt.model.tokenizer import (
    EOT,
    Tokenizer,
    find_gpt2_files,
    gpt2_ranks,
    load_gpt2,
    tiktoken_gpt2,
    train_bpe,
)

tiktoken = pytest.importorskip("tiktoken")


def varied_texts() -> list[str]:
    rng = random.Random(37)
    ranges = [
        (0x20, 0x7E),
        (0xA0, 0x24F),
        (0x370, 0x3FF),
        (0x400, 0x4FF),
        (0x590, 0x6FF),
        (0x900, 0x97F),
        (0x3040, 0x30FF),
        (0x4E00, 0x4FFF),
        (0xAC00, 0xAD00),
        (0x1F300, 0x1F64F),
        (0x300, 0x36F),
        (0x2000, 0x206F),
        (0xE000, 0xE0FF),
        (0x10000, 0x1007F),
    ]
    random_unicode = [
        "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 400)))
        for _ in range(60)
    ]
    pieces = [
        " ",
        "  ",
        "\t",
        "\n",
        "\n\n\n",
        "\r\n",
        "\u00a0",
        "\u3000",
        "x",
        "'s",
        "'ll",
        "'S",
        "12345",
        "<|endoftext|>",
        "<|endoftext|",
        "é",
        "e\u0301",
        "日本",
        "🙂",
        "def",
        "(",
        "):",
        "#",
        "\\",
        '"""',
    ]
    random_mix = [
        "".join(rng.choice(pieces) for _ in range(rng.randint(1, 300))) for _ in range(60)
    ]
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    return [
        "",
        " ",
        "  ",
        "\n",
        "hello world",
        "Hello  World   !",
        "trailing spaces   ",
        "   leading",
        "a\tb\t\tc",
        "line one\n\n\n\nline two\r\n\r\nthree",
        "don't I'll we've they're she'd it's He'S",
        "x" * 3000,
        " " * 1000 + "z",
        "\n" * 500,
        "1234567890 3.14159 1e-10 0x1F",
        "naïve café Ελληνικά русский 中文 日本語 한국어",
        "emoji 🙂👍🏽👨‍👩‍👧 flags 🇫🇷",
        "combining e\u0301 a\u0308 zero\u200bwidth",
        "مرحبا بالعالم",
        "नमस्ते",
        "<|endoftext|>",
        "before<|endoftext|>after",
        "a <|endoftext|> b<|endoftext|><|endoftext|>c",
        "<|endoftext|",
        "|endoftext|>",
        "<|startoftext|>",
        "def f(x):\n    return {'a': [1, 2]}  # comment\n",
        "for (int i = 0; i < n; ++i) { s += a[i]; }\n",
        "    \t  \n\t\t\n   mixed   \t whitespace",
        "\u00a0\u2003\u3000 unusual spaces \u2028\u2029",
        "\x00\x01\x7f control \x1b[0m",
        *random_unicode,
        *random_mix,
        *(f.read_text(encoding="utf-8") for f in stdlib),
    ]


def test_tiktoken_gives_the_ids_tokenizers_gives():
    gpt2 = load_gpt2()
    enc = gpt2.tiktoken()
    assert enc is tiktoken_gpt2() and enc is not None
    texts = varied_texts()
    hf = [e.ids for e in gpt2.tok.encode_batch(texts, add_special_tokens=False)]
    assert gpt2.encode_batch(texts) == hf  # the tiktoken path
    assert [gpt2.encode(t) for t in texts] == hf
    assert enc.encode("a<|endoftext|>b", allowed_special="all") == [64, 50256, 65]
    assert sum(len(i) for i in hf) > 50_000 and sum(i.count(50256) for i in hf) >= 6
    assert [enc.decode(i) for i in hf[:40]] == texts[:40]


def test_the_ranks_come_from_the_shipped_files_and_are_checked(tmp_path):
    vocab, merges = find_gpt2_files()
    ranks = gpt2_ranks(vocab, merges)
    assert len(ranks) == 50256 and ranks[b"!"] == 0 and ranks[b" the"] == 262
    lines = merges.read_text(encoding="utf-8").splitlines()
    swapped = tmp_path / "merges.txt"  # two merges out of id order: tiktoken would merge otherwise
    swapped.write_text(
        "\n".join([lines[0], lines[2], lines[1], *lines[3:]]) + "\n", encoding="utf-8"
    )
    with pytest.raises(ValueError, match="merge order"):
        gpt2_ranks(vocab, swapped)


def test_only_the_gpt2_tokenizer_takes_tiktoken(monkeypatch):
    trained = train_bpe(["some text to train on, some more text"] * 50, 300)
    assert trained.tiktoken() is None
    assert (
        Tokenizer.from_json(load_gpt2().to_json()).tiktoken() is tiktoken_gpt2()
    )  # as the writer process loads it
    monkeypatch.setenv("TINYGPT_TIKTOKEN", "0")
    assert load_gpt2().tiktoken() is None


def per_document_shards(
    cfg: DataConfig, tokenizer: Tokenizer, shard_tokens: int
) -> list[tuple[bytes, bytes]]:
    """The shards as the writer wrote them before (one array per document), from the same rule: a group ends
    with the document that brings its training tokens to shard_tokens."""
    dtype = token_dtype(tokenizer.vocab_size)
    docs = list(iter_documents(cfg))
    ids = [e.ids for e in tokenizer.tok.encode_batch(docs, add_special_tokens=False)]
    groups, train, val, n = [], [], [], 0
    for k, doc_ids in enumerate(ids):
        arr = np.asarray(doc_ids + [tokenizer.eot_id], dtype=dtype)
        if is_validation_document(k, cfg.val_fraction):
            val.append(arr)
        else:
            train.append(arr)
            n += len(arr)
        if n >= shard_tokens:
            groups.append((train, val))
            train, val, n = [], [], 0
    if train or val:
        groups.append((train, val))
    return [tuple(np.concatenate(p).tobytes() if p else b"" for p in g) for g in groups]


def written(folder: Path) -> tuple[list[tuple[bytes, bytes]], dict]:
    manifest = read_json(folder / MANIFEST)
    files = [
        tuple((folder / s[split]["name"]).read_bytes() for split in ("train", "val"))
        for s in manifest["shards"]
    ]
    return files, manifest


@pytest.mark.parametrize("source", ["builtin", "varied"])
def test_shards_are_byte_identical_on_either_path_and_to_the_per_document_writer(
    tmp_path, monkeypatch, source
):
    if source == "varied":
        (tmp_path / "text").mkdir()
        for i, t in enumerate(varied_texts()):
            (tmp_path / "text" / f"{i:03d}.txt").write_text(t + "\n", encoding="utf-8")
        source = str(tmp_path / "text")
    cfg = DataConfig(source=source, tokenizer="gpt2", max_chars=400_000, val_fraction=0.2)
    fast, slow = load_gpt2(), load_gpt2()
    monkeypatch.setenv("TINYGPT_TIKTOKEN", "0")
    assert slow.tiktoken() is None
    monkeypatch.delenv("TINYGPT_TIKTOKEN")
    assert fast.tiktoken() is not None
    shard_tokens = 3000  # many shards, most ending inside a batch of documents
    write_shards(cfg, fast, tmp_path / "fast", shard_tokens)
    write_shards(cfg, slow, tmp_path / "slow", shard_tokens)
    files_fast, man_fast = written(tmp_path / "fast")
    files_slow, man_slow = written(tmp_path / "slow")
    assert len(files_fast) > 10
    assert files_fast == files_slow and man_fast == man_slow
    assert files_fast == per_document_shards(cfg, slow, shard_tokens)
    assert man_fast["documents"] == sum(1 for _ in iter_documents(cfg))
    assert all(
        s["train"]["sha256"] == hashlib.sha256(f[0]).hexdigest()
        for s, f in zip(man_fast["shards"], files_fast)
    )


def test_one_array_per_batch():
    gpt2 = load_gpt2()
    texts = ["a b", "", "<|endoftext|>", "ü"]
    flat, ends = encode_documents(gpt2, texts, np.dtype(np.uint16))
    expected = [i for t in texts for i in gpt2.encode(t) + [gpt2.eot_id]]
    assert flat.dtype == np.uint16 and flat.tolist() == expected
    assert ends.tolist() == np.cumsum([len(gpt2.encode(t)) + 1 for t in texts]).tolist()
    assert encode_documents(gpt2, [], np.dtype(np.uint16))[0].size == 0
    assert EOT == "<|endoftext|>"
