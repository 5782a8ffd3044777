"""Byte-level BPE tokenizers through Hugging Face `tokenizers`: trained on a text source, loaded
from a `tokenizer.json`, or the GPT-2 BPE built from its vocab and merges files.

A tokenizer.json from a folder tinygpt did not write (a base, a mirror) is read bounded and never
through a link (`core.files.read_text_safe`), and is refused when any regular expression in it (a
`Split` pre-tokenizer's, a `Replace` normalizer's) is not one of `KNOWN_REGEXES`: `tokenizers` runs
them with a backtracking engine, and a crafted one spends hours on one line, then panics in every
encoding thread.

The GPT-2 tokenizer encodes batches through tiktoken when it is installed (`tiktoken_gpt2`: built
from the same local vocab and merges files, no download; the same ids, about 5x the speed);
TINYGPT_TIKTOKEN=0 turns that off. Tokenizers tinygpt trains, and every other, encode through
`tokenizers`."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tinygpt.core.files import RUN_FILE_LIMIT, read_text_safe, write_text_atomic
from tinygpt.core.rundir import TOKENIZER_JSON

EOT = "<|endoftext|>"

# The regular expressions a tokenizer.json may carry (as the `Split` pre-tokenizer of the tokenizers
# that use one writes them): every other is refused before anything is encoded. GPT-2's own (the
# `ByteLevel` pre-tokenizer's built-in pattern, which GPT-2's and tinygpt's trained tokenizers use
# without writing it out) and the same written as a `Split`; Llama-3's (tiktoken's cl100k); Qwen2's
# (also Qwen2.5's and Qwen3's); Qwen3.5's (Qwen2's with combining marks kept on their letters).
KNOWN_REGEXES = {
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+": "GPT-2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
    r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "Llama-3",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| "
    r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "Qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| "
    r"?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "Qwen3.5",
}


class UnsafeTokenizer(ValueError):
    """A tokenizer.json tinygpt will not run: the message names the file and what to do."""


def unknown_regexes(spec: Any, where: str = "") -> list[tuple[str, str]]:
    """(where, pattern) of every regular expression in a parsed tokenizer.json that is not in
    KNOWN_REGEXES; `where` is its place, e.g. "pre_tokenizer.pretokenizers[0]"."""
    found = []
    if isinstance(spec, dict):
        if "Regex" in spec and not (
            isinstance(spec["Regex"], str) and spec["Regex"] in KNOWN_REGEXES
        ):
            found.append((where.rsplit(".pattern", 1)[0] or "top level", str(spec["Regex"])))
        for k, v in spec.items():
            found += unknown_regexes(v, f"{where}.{k}" if where else str(k))
    elif isinstance(spec, list):
        for i, v in enumerate(spec):
            found += unknown_regexes(v, f"{where}[{i}]")
    return found


def check_regexes(text: str, name: str | Path) -> None:
    """Refuse (UnsafeTokenizer, one line naming `name`) a tokenizer.json text that is not JSON, or
    whose regular expressions are not all KNOWN_REGEXES."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise UnsafeTokenizer(f"{name} is not a tokenizer.json (not JSON: {e}): refused") from None
    bad = unknown_regexes(spec)
    if bad:
        where, pattern = bad[0]
        shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UnsafeTokenizer(
            f"{name}: its {where} regex {shown!r}{more} is not one tinygpt runs (those of "
            f"{', '.join(dict.fromkeys(KNOWN_REGEXES.values()))}): refused before any text was "
            "encoded, since a crafted regex can take hours on one line; use a model whose "
            "tokenizer is one of those, or that model's tokenizer.json in its place"
        )


def read_tokenizer_json(path: str | Path) -> str:
    """The text of a tokenizer.json from any folder, read the one safe way (no link, at most
    RUN_FILE_LIMIT bytes) and checked by `check_regexes`."""
    text = read_text_safe(path, RUN_FILE_LIMIT)
    check_regexes(text, path)
    return text


def _from_str(text: str, name: str | Path) -> _HFTokenizer:
    try:
        return _HFTokenizer.from_str(text)
    except Exception as e:  # tokenizers' own parse error: one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnsafeTokenizer(
            f"{name} is not a tokenizer.json that `tokenizers` reads ({first}): refused"
        ) from None


class Tokenizer:
    """A thin wrapper: encode/decode, the end-of-text id, save/load, and a fingerprint."""

    def __init__(self, tok: _HFTokenizer, eot: str = EOT):
        self.tok = tok
        eot_id = tok.token_to_id(eot)
        if eot_id is None:
            raise ValueError(
                f"tokenizer has no end-of-text token {eot!r}; add it as a special token"
            )
        self.eot = eot
        self.eot_id: int = eot_id
        # not yet decided; then tiktoken's Encoding for this tokenizer, or None
        self._tiktoken: Any = False
        # built by `gpt2_tokenizer` (or known to serialise as it does): no check needed
        self.gpt2 = False

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encodes in parallel threads: through tiktoken for the GPT-2 tokenizer when it is
        installed (the same ids, special tokens in the text included), else inside `tokenizers`."""
        fast = self.tiktoken()
        if fast is not None:
            return fast.encode_batch(texts, allowed_special="all")
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def tiktoken(self) -> Any:
        """tiktoken's Encoding that gives this tokenizer's ids, or None: only the GPT-2 tokenizer
        has one (built by `gpt2_tokenizer`, or serialising exactly as `load_gpt2()` does), only when
        tiktoken is installed and TINYGPT_TIKTOKEN is not 0. Decided once per tokenizer."""
        if self._tiktoken is False:
            self._tiktoken = None
            if (
                self.vocab_size == GPT2_VOCAB
                and self.eot_id == GPT2_VOCAB - 1
                and os.environ.get("TINYGPT_TIKTOKEN", "1") != "0"
            ):
                enc = tiktoken_gpt2()
                if enc is not None and (self.gpt2 or self.fingerprint() == _gpt2_fingerprint()):
                    self._tiktoken = enc
        return self._tiktoken

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tok.to_str()

    def save(self, path: str | Path) -> None:
        """Written whole or not at all, never through a link (a run folder's tokenizer.json)."""
        write_text_atomic(path, self.to_json())

    @classmethod
    def from_json(cls, text: str, name: str = "the tokenizer") -> "Tokenizer":
        check_regexes(text, name)
        return cls(_from_str(text, name))

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """A tokenizer.json (or a folder holding one), read
        bounded, never through a link, its regexes checked."""
        p = Path(path)
        if p.is_dir():
            p = p / TOKENIZER_JSON
        if not p.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        return cls(_from_str(read_tokenizer_json(p), p))

    def fingerprint(self) -> str:
        """sha256 of the serialised tokenizer: part of the token cache's key."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def _byte_level(tok: _HFTokenizer) -> _HFTokenizer:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_bpe(texts: Iterator[str] | Iterable[str], vocab_size: int, eot: str = EOT) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` entries (256 byte tokens and `eot` included)."""
    if vocab_size < 257:
        raise ValueError(
            f"vocab_size must be at least 257 (256 bytes + end-of-text), got {vocab_size}"
        )
    tok = _byte_level(_HFTokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eot],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, eot)


def gpt2_tokenizer(vocab_json: str | Path, merges_txt: str | Path) -> Tokenizer:
    """The GPT-2 BPE (50257 entries, `<|endoftext|>` 50256) from OpenAI's vocab and merges files."""
    # outside run folders: the package's own
    vocab = json.loads(Path(vocab_json).read_text(encoding="utf-8"))
    merges = []
    # outside run folders: the package's
    for line in Path(merges_txt).read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#version"):
            a, b = line.split(" ")
            merges.append((a, b))
    tok = _byte_level(_HFTokenizer(models.BPE(vocab=vocab, merges=merges)))
    tok.add_special_tokens([EOT])
    out = Tokenizer(tok, EOT)
    out.gpt2 = True
    return out


# the GPT-2 BPE files ship with the package (MIT)
ASSETS = Path(__file__).resolve().parent / "assets"


def find_gpt2_files() -> tuple[Path, Path]:
    """The GPT-2 vocab/merges files: $TINYGPT_GPT2_DIR when set, else the copy shipped in the
    package, so the GPT-2 tokenizer never needs the network."""
    for c in (os.environ.get("TINYGPT_GPT2_DIR"), ASSETS):
        files = (Path(c) / "gpt2_vocab.json", Path(c) / "gpt2_merges.txt") if c else ()
        if files and all(f.is_file() for f in files):
            return files
    raise FileNotFoundError(
        f"the GPT-2 BPE files are missing from {ASSETS} (a broken install?); reinstall "
        "tinygpt, or set TINYGPT_GPT2_DIR to a folder with gpt2_vocab.json and gpt2_merges.txt"
    )


def load_gpt2() -> Tokenizer:
    """The GPT-2 tokenizer, built from the vocab and merges files (offline)."""
    return gpt2_tokenizer(*find_gpt2_files())


GPT2_VOCAB = 50257
# the ByteLevel pre-tokenizer's
GPT2_PATTERN = next(k for k, v in KNOWN_REGEXES.items() if v == "GPT-2")


def _bytes_of_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character that stands for each byte ->
    the byte (OpenAI's `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, the other
    68 for 256, 257, ...)."""
    kept = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(moved)}}


def gpt2_ranks(vocab_json: str | Path, merges_txt: str | Path) -> dict[bytes, int]:
    """tiktoken's mergeable ranks for GPT-2 from OpenAI's vocab and merges files: every entry but
    `<|endoftext|>` as its bytes, ranked by its id. tiktoken applies the merge whose result ranks
    lowest, `tokenizers` the merge listed first; the two agree because GPT-2's ids follow its merge
    order (merge i makes id 256 + i), which is checked here (ValueError if not)."""
    to_byte = _bytes_of_chars()
    # outside run folders: the package's own
    vocab = json.loads(Path(vocab_json).read_text(encoding="utf-8"))
    ranks = {bytes(to_byte[c] for c in token): i for token, i in vocab.items() if token != EOT}
    # outside run folders: the package's
    lines = Path(merges_txt).read_text(encoding="utf-8").splitlines()
    # "a b" -> ab
    merged = [line.replace(" ", "") for line in lines if line and not line.startswith("#version")]
    if (
        sorted(ranks.values()) != list(range(len(ranks)))
        or vocab.get(EOT) != len(ranks)
        or [vocab.get(m) for m in merged] != list(range(256, 256 + len(merged)))
    ):
        raise ValueError(
            f"{vocab_json} and {merges_txt} are not GPT-2's layout (ids in merge order)"
        )
    return ranks


@functools.lru_cache(maxsize=1)
def tiktoken_gpt2() -> Any:
    """The GPT-2 BPE as a tiktoken Encoding built from the local files (`find_gpt2_files`, no
    download), or None when tiktoken is not installed or the files are not laid out as GPT-2's
    (TINYGPT_GPT2_DIR). `<|endoftext|>` is its special token, 50256."""
    try:
        import tiktoken
    except ImportError:
        return None
    try:
        ranks = gpt2_ranks(*find_gpt2_files())
    except ValueError:
        return None
    return tiktoken.Encoding(
        name="tinygpt-gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOT: len(ranks)},
        explicit_n_vocab=len(ranks) + 1,
    )


class TiktokenGPT2:
    """The GPT-2 tokenizer as the shard writer's process uses it (ids, end-of-text, vocabulary size,
    fingerprint) on tiktoken alone: its parent built and checked the `Tokenizer` and sends the
    fingerprint, so the writer parses no tokenizer.json and builds no `tokenizers` object."""

    gpt2 = True
    eot_id = GPT2_VOCAB - 1
    vocab_size = GPT2_VOCAB

    def __init__(self, fingerprint: str):
        self.enc = tiktoken_gpt2()
        if self.enc is None:
            raise ValueError("tiktoken cannot build the GPT-2 tokenizer here")
        self._fingerprint = fingerprint

    def fingerprint(self) -> str:
        return self._fingerprint

    def tiktoken(self) -> Any:
        return self.enc

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_batch(texts, allowed_special="all")


@functools.lru_cache(maxsize=1)
def _gpt2_fingerprint() -> str:
    return load_gpt2().fingerprint()
