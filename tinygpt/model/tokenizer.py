"""Byte-level BPE tokenizers through Hugging Face `tokenizers`: trained on a text source, loaded
from a `tokenizer.json`, or the GPT-2 BPE built from its vocab and merges files."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tinygpt.core.rundir import TOKENIZER_JSON

EOT = "<|endoftext|>"


class Tokenizer:
    """A thin wrapper: encode/decode, the end-of-text id, save/load, and a fingerprint."""

    def __init__(self, tok: _HFTokenizer, eot: str = EOT):
        self.tok = tok
        eot_id = tok.token_to_id(eot)
        if eot_id is None:
            raise ValueError(f"tokenizer has no end-of-text token {eot!r}; add it as a special token")
        self.eot = eot
        self.eot_id: int = eot_id

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encodes in parallel threads inside `tokenizers` (Rust)."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tok.to_str()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        return cls(_HFTokenizer.from_str(text))

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        p = Path(path)
        if p.is_dir():
            p = p / TOKENIZER_JSON
        if not p.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        return cls(_HFTokenizer.from_file(str(p)))

    def fingerprint(self) -> str:
        """sha256 of the serialised tokenizer: part of the token cache's key."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def compression(self, texts: Iterable[str]) -> float:
        """Characters per token over the given texts (higher is better compression)."""
        chars = tokens = 0
        for t in texts:
            chars += len(t)
            tokens += len(self.encode(t))
        return chars / max(tokens, 1)


def _byte_level(tok: _HFTokenizer) -> _HFTokenizer:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_bpe(texts: Iterator[str] | Iterable[str], vocab_size: int, eot: str = EOT) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` entries (256 byte tokens and `eot` included)."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + end-of-text), got {vocab_size}")
    tok = _byte_level(_HFTokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eot], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, eot)


def gpt2_tokenizer(vocab_json: str | Path, merges_txt: str | Path) -> Tokenizer:
    """The GPT-2 BPE (50257 entries, `<|endoftext|>` = 50256) from OpenAI's vocab and merges files."""
    vocab = json.loads(Path(vocab_json).read_text(encoding="utf-8"))
    merges = []
    for line in Path(merges_txt).read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#version"):
            a, b = line.split(" ")
            merges.append((a, b))
    tok = _byte_level(_HFTokenizer(models.BPE(vocab=vocab, merges=merges)))
    tok.add_special_tokens([EOT])
    return Tokenizer(tok, EOT)


ASSETS = Path(__file__).resolve().parent / "assets"  # the GPT-2 BPE files ship with the package (MIT)


def find_gpt2_files() -> tuple[Path, Path]:
    """The GPT-2 vocab/merges files: $TINYGPT_GPT2_DIR when set, else the copy shipped in the package,
    so the GPT-2 tokenizer never needs the network."""
    for c in (os.environ.get("TINYGPT_GPT2_DIR"), ASSETS):
        if c and (Path(c) / "gpt2_vocab.json").is_file() and (Path(c) / "gpt2_merges.txt").is_file():
            return Path(c) / "gpt2_vocab.json", Path(c) / "gpt2_merges.txt"
    raise FileNotFoundError(f"the GPT-2 BPE files are missing from {ASSETS} (a broken install?); reinstall "
                            "tinygpt, or set TINYGPT_GPT2_DIR to a folder with gpt2_vocab.json and gpt2_merges.txt")


def load_gpt2() -> Tokenizer:
    """The GPT-2 tokenizer, built from the vocab and merges files (offline)."""
    return gpt2_tokenizer(*find_gpt2_files())
