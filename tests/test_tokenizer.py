"""Byte-level BPE: training on real text, save/load, the GPT-2 BPE against transformers' tokenizer."""

import pytest

from tinygpt.model.tokenizer import EOT, Tokenizer, gpt2_tokenizer, train_bpe


@pytest.fixture(scope="module")
def bpe(shakespeare):
    return train_bpe([shakespeare[:300_000]], vocab_size=1000)


def test_trained_bpe_round_trips_any_text(bpe, shakespeare):
    assert bpe.vocab_size == 1000 and bpe.eot_id == bpe.tok.token_to_id(EOT)
    for text in [
        shakespeare[500_000:502_000],
        "naïve café — 日本語 🤖\n\tdef f(x): return x**2",
        " leading space",
    ]:
        assert bpe.decode(bpe.encode(text)) == text  # byte-level: nothing is out of vocabulary


def compression(tok, text: str) -> float:
    """Characters per token (higher is better compression)."""
    return len(text) / max(len(tok.encode(text)), 1)


def test_compression_improves_with_vocab_size(shakespeare):
    held_out = shakespeare[800_000:900_000]
    small = train_bpe([shakespeare[:300_000]], vocab_size=300)
    large = train_bpe([shakespeare[:300_000]], vocab_size=2000)
    assert 1.0 < compression(small, held_out) < compression(large, held_out)
    assert compression(large, held_out) > 2.5  # 2k merges on English: over 2.5 characters per token


def test_save_and_load_give_the_same_ids(bpe, tmp_path, shakespeare):
    bpe.save(tmp_path / "tokenizer.json")
    again = Tokenizer.load(tmp_path)
    text = shakespeare[:5000]
    assert again.encode(text) == bpe.encode(text) and again.fingerprint() == bpe.fingerprint()
    assert again.encode_batch([text, "x"]) == [bpe.encode(text), bpe.encode("x")]


def test_gpt2_bpe_matches_transformers(shared_data, shakespeare):
    transformers = pytest.importorskip("transformers")
    ours = gpt2_tokenizer(shared_data / "gpt2_vocab.json", shared_data / "gpt2_merges.txt")
    files = (str(shared_data / "gpt2_vocab.json"), str(shared_data / "gpt2_merges.txt"))
    if int(transformers.__version__.split(".")[0]) >= 5:  # v5 renamed the arguments
        ref = transformers.GPT2Tokenizer(vocab=files[0], merges=files[1])
    else:
        ref = transformers.GPT2TokenizerFast(vocab_file=files[0], merges_file=files[1])
    assert len(ref) == 50257
    assert ours.vocab_size == 50257 and ours.eot_id == 50256
    wiki = (shared_data / "wikitext2_test.txt").read_text(encoding="utf-8")[:20_000]
    for text in [shakespeare[:20_000], wiki, "Hello world<|endoftext|> and 'quotes' 123"]:
        assert ours.encode(text) == ref(text)["input_ids"]
    assert ours.encode("Hello world") == [15496, 995]  # the well-known GPT-2 ids


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe(["abc"], vocab_size=100)
