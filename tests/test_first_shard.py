"""On a fresh token cache the first step waits for the first shard alone, and the writer has written
it before it has read 5 MB of the source (issue 37). Counted in bytes read (the kernel's `rchar` of
this process, /proc/self/io: every read() of the source, its read-ahead included), never timed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tinygpt.core.config import DataConfig
from tinygpt.core.recipes import get_recipe
from tinygpt.data.sampler import WindowSampler
from tinygpt.data.shard_writer import FIRST_SHARD_TOKENS, SHARD_TOKENS, write_shards
from tinygpt.data.shards import MANIFEST, StreamedShards
from tinygpt.model.tokenizer import load_gpt2

pytestmark = pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="needs Linux's /proc")


def bytes_read() -> int:
    return int(
        next(
            x for x in Path("/proc/self/io").read_text().splitlines() if x.startswith("rchar:")
        ).split()[1]
    )


def big_source(path: Path, mb: int) -> Path:
    """`mb` MB of varied code-like text (GPT-2 reads it at about 3 characters a token)."""
    rng = random.Random(0)
    words = [
        "def",
        "return",
        "self",
        "value",
        "items",
        "for",
        "in",
        "if",
        "else",
        "print",
        "x",
        "y",
    ]
    with path.open("w", encoding="utf-8") as f:
        while f.tell() < mb * 1_000_000:
            f.write(
                "".join(
                    f"def f{rng.randrange(10**6)}({rng.choice(words)}):\n    return "
                    f"{' '.join(rng.choices(words, k=rng.randrange(3, 12)))} "
                    f"{rng.random():.6f}\n\n"
                    for _ in range(500)
                )
            )
    return path


def test_the_first_step_needs_only_a_first_shard_written_before_5_mb_are_read(tmp_path):
    source = big_source(tmp_path / "big.txt", 16)
    tok = load_gpt2()
    tok.encode_batch(["the encoder built before counting"])
    folder = tmp_path / "cache"
    before = bytes_read()
    manifest = write_shards(
        DataConfig(source=str(source), tokenizer="gpt2"), tok, folder, max_shards=1
    )  # what the writer has done once the first shard is there
    read = bytes_read() - before
    assert len(manifest["shards"]) == 1 and not manifest["done"]
    assert manifest["first_shard_tokens"] == FIRST_SHARD_TOKENS < SHARD_TOKENS
    assert manifest["shards"][0]["chars"] < read < 5_000_000, read
    # the first step's batch and the validation batches come from that shard: nothing more is asked
    # for (a StreamedShards whose writer is gone raises on any shard not written)
    t = get_recipe("cpu-smoke").train
    shards = StreamedShards(folder, alive=lambda: False)
    x, _ = WindowSampler(shards, t.seq_len, t.seed).next_batch(t.micro_batch_size)
    assert tuple(x.shape) == (t.micro_batch_size, t.seq_len)
    assert len(shards.validation(t.eval_batches * t.micro_batch_size * t.seq_len + 1)) > 0
    with pytest.raises(Exception, match="stopped before shard 1"):
        shards.shard(1)


def test_a_cache_begun_before_the_small_first_shard_goes_on_as_it_began(tmp_path):
    """A manifest without "first_shard_tokens" (written before it) keeps its first shard's size."""
    source = tmp_path / "text.txt"
    source.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(4000)))
    cfg, tok = DataConfig(source=str(source), tokenizer="gpt2"), load_gpt2()
    write_shards(cfg, tok, tmp_path / "new", shard_tokens=8_000)
    assert json.loads((tmp_path / "new" / MANIFEST).read_text())["first_shard_tokens"] == 8_000
    old = tmp_path / "old"
    old.mkdir()
    manifest = json.loads((tmp_path / "new" / MANIFEST).read_text())
    del manifest["first_shard_tokens"]
    (old / MANIFEST).write_text(json.dumps({**manifest, "shards": [], "done": False}))
    write_shards(cfg, tok, old, shard_tokens=8_000)
    shards = json.loads((old / MANIFEST).read_text())["shards"]
    assert shards == json.loads((tmp_path / "new" / MANIFEST).read_text())["shards"]
