"""nanoGPT and llm.c token folders, on real GPT-2 tokens of the standard library's textwrap.py: written,
read back exactly, and every bad folder refused with a one-line DataError before training."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from tinygpt.data.sources import DataError
from tinygpt.data.token_files import (
    check_shard_ids,
    detect_token_folder,
    open_token_folder,
    write_llmc_shard,
)
from tinygpt.model.tokenizer import load_gpt2

GPT2_PADDED = 50304


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text(encoding="utf-8")
    ids = np.array(load_gpt2().encode(text), dtype=np.int64)
    assert len(ids) > 4000 and ids.max() >= 4096  # real GPT-2 ids, many beyond a small vocabulary
    return ids


def _reference_llmc(path: Path, toks, model_desc: str = "gpt-2") -> None:
    """llm.c's own Python writer (dev/data/data_common.py, write_datafile with its HEADERS_INFO), written
    out independently: gpt-2 is magic 20240520, version 1, uint16; llama-3 is magic 20240801, version 7, uint32."""
    magic, version, dtype = {
        "gpt-2": (20240520, 1, np.uint16),
        "llama-3": (20240801, 7, np.uint32),
    }[model_desc]
    header = np.zeros(256, dtype=np.int32)
    header[0] = magic
    header[1] = version
    header[2] = len(toks)
    path.write_bytes(header.tobytes() + np.array(toks, dtype=dtype).tobytes())


def write_nanogpt_bin(path: Path, toks) -> None:
    """A .bin as nanoGPT's prepare.py writes one: the ids as raw uint16, no header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.array(toks, dtype=np.uint16).tofile(path)


def _error(path, vocab_size=GPT2_PADDED) -> str:
    with pytest.raises(DataError) as e:
        open_token_folder(path, vocab_size)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _llmc_folder(tmp_path: Path, tokens, n_train=3) -> Path:
    """n_train train shards and one val shard, written out of order (the reader sorts by name)."""
    val, train = tokens[:1000], np.array_split(tokens[1000:], n_train)
    for i in reversed(range(n_train)):
        write_llmc_shard(tmp_path / f"fineweb_train_{i + 1:06d}.bin", train[i])
    write_llmc_shard(tmp_path / "fineweb_val_000000.bin", val)
    return tmp_path


def test_llmc_shards_round_trip_in_order(tmp_path, tokens):
    folder = _llmc_folder(tmp_path, tokens)
    (folder / "README.txt").write_text("not a shard")  # other files are ignored
    assert detect_token_folder(folder) == "llmc"
    tf = open_token_folder(folder, GPT2_PADDED)
    assert tf.kind == "llmc" and tf.vocab_hint == 50257
    assert [p.name for p in tf.files] == [f"fineweb_train_{i:06d}.bin" for i in (1, 2, 3)] + [
        "fineweb_val_000000.bin"
    ]
    assert len(tf.train) == 3 and tf.train_tokens == len(tokens) - 1000
    np.testing.assert_array_equal(np.concatenate(tf.train), tokens[1000:])
    np.testing.assert_array_equal(tf.val, tokens[:1000])
    assert all(
        a.dtype == np.uint16 and isinstance(a, np.memmap) and not a.flags.writeable
        for a in tf.train + [tf.val]
    )


def test_nanogpt_bins_round_trip(tmp_path, tokens):
    write_nanogpt_bin(tmp_path / "train.bin", tokens[1000:])
    write_nanogpt_bin(tmp_path / "val.bin", tokens[:1000])
    assert (tmp_path / "train.bin").stat().st_size == 2 * (
        len(tokens) - 1000
    )  # raw uint16, no header
    assert detect_token_folder(tmp_path) == "nanogpt"
    tf = open_token_folder(tmp_path, GPT2_PADDED)
    assert (
        tf.kind == "nanogpt"
        and tf.vocab_hint == 50257
        and [p.name for p in tf.files] == ["train.bin", "val.bin"]
    )
    assert len(tf.train) == 1 and not tf.train[0].flags.writeable
    np.testing.assert_array_equal(tf.train[0], tokens[1000:])
    np.testing.assert_array_equal(tf.val, tokens[:1000])


def test_llmc_reference_writer_is_read_and_matches_ours(tmp_path, tokens):
    ref, ours = tmp_path / "ref", tmp_path / "ours"
    ref.mkdir()
    _reference_llmc(ref / "tinyshakespeare_train.bin", tokens[1000:])
    _reference_llmc(ref / "tinyshakespeare_val.bin", tokens[:1000])
    tf = open_token_folder(ref, GPT2_PADDED)
    np.testing.assert_array_equal(tf.train[0], tokens[1000:])
    np.testing.assert_array_equal(tf.val, tokens[:1000])
    write_llmc_shard(ours / "x.bin", tokens[1000:])
    assert (ours / "x.bin").read_bytes() == (ref / "tinyshakespeare_train.bin").read_bytes()


def test_llmc_llama3_shards_are_read_as_uint32(tmp_path, tokens):
    """llm.c's Llama-3 shards (magic 20240801, version 7, uint32 ids) as its write_datafile writes them."""
    llama = tokens + 70_000  # ids past uint16, as Llama 3's 128256-token vocabulary has
    _reference_llmc(tmp_path / "fineweb_train_000001.bin", llama[1000:], "llama-3")
    _reference_llmc(tmp_path / "fineweb_val_000000.bin", llama[:1000], "llama-3")
    assert (tmp_path / "fineweb_val_000000.bin").stat().st_size == 1024 + 4 * 1000
    assert detect_token_folder(tmp_path) == "llmc"
    tf = open_token_folder(tmp_path, 128256)
    assert tf.vocab_hint == 128256
    assert all(a.dtype == np.uint32 and not a.flags.writeable for a in tf.train + [tf.val])
    np.testing.assert_array_equal(tf.train[0], llama[1000:])
    np.testing.assert_array_equal(tf.val, llama[:1000])
    ours = tmp_path / "ours"
    write_llmc_shard(ours / "x.bin", llama[1000:], kind="llama-3")
    assert (ours / "x.bin").read_bytes() == (tmp_path / "fineweb_train_000001.bin").read_bytes()
    msg = _error(tmp_path)  # a GPT-2-sized model: the ids do not fit, and the message names Llama 3
    assert "Llama-3" in msg and "model.vocab_size=128256" in msg and "GPT-2" not in msg


def test_a_folder_mixing_llmc_kinds_is_refused(tmp_path, tokens):
    _reference_llmc(tmp_path / "fineweb_train_000001.bin", tokens[1000:], "gpt-2")
    _reference_llmc(tmp_path / "fineweb_val_000000.bin", tokens[:1000], "llama-3")
    msg = _error(tmp_path, vocab_size=128256)
    assert "fineweb_val_000000.bin" in msg and "llama-3" in msg and "gpt-2" in msg


def test_train_bin_with_the_llmc_magic_is_llmc(tmp_path, tokens):
    write_llmc_shard(tmp_path / "train.bin", tokens[1000:])
    write_llmc_shard(tmp_path / "val.bin", tokens[:1000])
    assert detect_token_folder(tmp_path) == "llmc"
    tf = open_token_folder(tmp_path, GPT2_PADDED)
    np.testing.assert_array_equal(tf.train[0], tokens[1000:])  # the header is not read as tokens
    np.testing.assert_array_equal(tf.val, tokens[:1000])


def test_a_text_folder_is_not_a_token_folder(tmp_path):
    src = Path(sysconfig.get_paths()["stdlib"], "textwrap.py")
    (tmp_path / "textwrap.py").write_text(src.read_text(encoding="utf-8"))
    (tmp_path / "notes.txt").write_text("plain text\n")
    assert detect_token_folder(tmp_path) is None
    assert detect_token_folder(tmp_path / "notes.txt") is None  # a file, not a folder
    assert detect_token_folder(tmp_path / "missing") is None
    assert "neither nanoGPT's train.bin/val.bin nor llm.c shards" in _error(tmp_path)
    assert "does not exist" in _error(tmp_path / "missing")


def test_wrong_magic_names_the_file_and_the_value(tmp_path, tokens):
    folder = _llmc_folder(tmp_path, tokens, n_train=2)
    bad = folder / "fineweb_train_000002.bin"
    data = bytearray(bad.read_bytes())
    data[:4] = np.array([12345], dtype="<i4").tobytes()
    bad.write_bytes(bytes(data))
    msg = _error(folder)
    assert str(bad) in msg and "12345" in msg and "20240520" in msg and "20240801" in msg


def test_unsupported_version_is_refused(tmp_path, tokens):
    folder = _llmc_folder(tmp_path, tokens, n_train=1)
    shard = folder / "fineweb_val_000000.bin"
    data = bytearray(shard.read_bytes())
    data[4:8] = np.array(
        [2], dtype="<i4"
    ).tobytes()  # llm.c writes version 1 with the GPT-2 magic, never 2
    shard.write_bytes(bytes(data))
    msg = _error(folder)
    assert str(shard) in msg and "version 2" in msg and "version 1" in msg


def test_truncated_shard_names_expected_and_actual_bytes(tmp_path, tokens):
    folder = _llmc_folder(tmp_path, tokens, n_train=2)
    shard = folder / "fineweb_train_000001.bin"
    n = len(np.array_split(tokens[1000:], 2)[0])
    expected = 1024 + 2 * n
    assert shard.stat().st_size == expected
    shard.write_bytes(shard.read_bytes()[: expected - 100])  # an interrupted download
    msg = _error(folder)
    assert str(shard) in msg and "truncated" in msg and f"{n} tokens" in msg
    assert str(expected) in msg and str(expected - 100) in msg
    shard.write_bytes(shard.read_bytes()[:500])  # not even a whole header
    assert "truncated" in _error(folder) and "500 bytes" in _error(folder)


def test_nanogpt_file_with_an_odd_byte_count(tmp_path, tokens):
    write_nanogpt_bin(tmp_path / "train.bin", tokens[1000:])
    (tmp_path / "val.bin").write_bytes(
        np.asarray(tokens[:1000], dtype=np.uint16).tobytes() + b"\x00"
    )
    msg = _error(tmp_path)
    assert str(tmp_path / "val.bin") in msg and "2001 bytes" in msg and "odd" in msg


def test_missing_validation_or_train_files(tmp_path, tokens):
    llmc, nano, only_val = tmp_path / "llmc", tmp_path / "nano", tmp_path / "only_val"
    write_llmc_shard(llmc / "fineweb_train_000001.bin", tokens)
    write_nanogpt_bin(nano / "train.bin", tokens)
    write_nanogpt_bin(only_val / "val.bin", tokens)
    msg = _error(llmc)
    assert "no validation tokens" in msg and "'val' in its name" in msg
    msg = _error(nano)
    assert "no validation tokens" in msg and "val.bin" in msg
    msg = _error(only_val)
    assert "no train tokens" in msg and "train.bin" in msg


def test_ids_beyond_the_vocabulary_are_found_before_training(tmp_path, tokens):
    write_nanogpt_bin(tmp_path / "train.bin", tokens[1000:])
    write_nanogpt_bin(tmp_path / "val.bin", tokens[:1000])
    msg = _error(tmp_path, vocab_size=4096)
    top = int(tokens[:1000].max())  # the validation tokens are checked first
    assert str(tmp_path / "val.bin") in msg and f"token id {top}" in msg and "4096" in msg
    assert (
        "GPT-2" in msg
        and f"at least {top + 1}" in msg
        and "data.tokenizer=gpt2 model.vocab_size=50304" in msg
    )


def test_later_shards_are_checked_as_they_are_opened(tmp_path, tokens):
    """Only the validation tokens and the first train shard are scanned up front; the caller checks the rest."""
    small = tokens[tokens < 4096]  # real ids that fit a 4096 vocabulary
    write_llmc_shard(tmp_path / "data_train_000001.bin", small[1000:])
    write_llmc_shard(tmp_path / "data_train_000002.bin", tokens)
    write_llmc_shard(tmp_path / "data_val_000000.bin", small[:1000])
    tf = open_token_folder(tmp_path, 4096)
    check_shard_ids(tf.train[0], 4096, "shard 1")
    with pytest.raises(DataError, match=f"shard 2 holds token id {tokens.max()}.*GPT-2"):
        check_shard_ids(tf.train[1], 4096, "shard 2")
    check_shard_ids(tf.train[1], GPT2_PADDED, "shard 2")


def test_writers_refuse_ids_that_do_not_fit_uint16(tmp_path, tokens):
    with pytest.raises(DataError, match="65535"):
        write_llmc_shard(tmp_path / "x.bin", [1, 2, 65536])
    with pytest.raises(DataError, match="65535"):
        write_llmc_shard(tmp_path / "x.bin", [-1, 2])
    assert not (tmp_path / "x.bin").exists()  # nothing half-written is left
