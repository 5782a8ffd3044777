"""A run's tokens: a folder of token ids as it is, or the token cache, filled by a background
process and copied to the mirror as it grows.

The token cache lives outside the run folder (`cache_root("tokens")`, one folder per source,
tokenizer and split: `shards.cache_key`), so runs on the same data share it; beside a run's mirror
it sits in `TOKEN_CACHE/`, so a new VM restores the shards instead of tokenizing again.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinygpt.core.config import DataConfig
from tinygpt.core.paths import cache_root
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import TOKEN_CACHE
from tinygpt.data.shards import (
    ShardStream,
    StreamedShards,
    TokenShards,
    cache_key,
    check_token_cache,
    stream_token_cache,
)
from tinygpt.data.sources import source_fingerprint
from tinygpt.data.token_files import check_shard_ids, open_token_folder
from tinygpt.model.tokenizer import Tokenizer
from tinygpt.sync.token_cache import ShardMirror, restore_shards


@dataclass
class RunData:
    """A run's tokens and what keeps them coming: the tokenizing process and the copy to the mirror."""

    tokenizer: Tokenizer
    tokens: TokenShards
    meta: dict  # where the tokens come from, as run.json says
    mirror: ShardMirror | None = None

    def __enter__(self) -> RunData:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop tokenizing (the next run goes on from the first missing shard); finish the copy."""
        if isinstance(self.tokens, ShardStream):
            self.tokens.stop()
        if self.mirror is not None and not self.mirror.close():
            warnings.warn(
                f"some token shards are not yet on the mirror ({self.mirror.mirror}); a new VM "
                "tokenizes them again",
                stacklevel=2,
            )


def open_tokens(
    recipe: Recipe,
    tokenizer: Tokenizer,
    token_ids: bool,
    *,
    writer: bool,
    cache_dir: str | Path | None = None,
    mirror: str | Path | None = None,
) -> RunData:
    """A folder of token ids as it is; otherwise the token cache. The `writer` (rank 0) first takes
    the mirror's complete shards, then starts a background process that tokenizes on from the first
    shard missing, about as far as the run reads (a resume with more steps asks for more); the
    shards it writes go to the mirror (`mirror`: the run's mirror folder) as they are done. Other
    ranks read what it writes."""
    if token_ids:  # nothing to tokenize
        tokens = open_token_shards(recipe.data.source, recipe.model.vocab_size)
        return RunData(tokenizer, tokens, {"source": recipe.data.source, **tokens.meta})
    cache = Path(cache_dir or cache_root("tokens"))
    key = cache_key(recipe.data, tokenizer)
    data = RunData(
        tokenizer, StreamedShards(cache / key), {"cache": key, "source": recipe.data.source}
    )
    if writer:
        mirror_cache = Path(mirror).parent / TOKEN_CACHE / key if mirror is not None else None
        before = data.tokens.n_shards
        # a new VM
        restored = restore_shards(mirror_cache, cache / key) if mirror_cache is not None else 0
        # a shard with ids past the vocabulary (another tokenizer's) is tokenized again
        check_token_cache(
            cache / key, tokenizer.vocab_size, mirror_cache, range(before, before + restored)
        )
        data.tokens = stream_token_cache(
            recipe.data, tokenizer, cache, key, max_train_tokens=recipe.token_budget
        )
        if mirror_cache is not None:
            data.mirror = ShardMirror(cache / key, mirror_cache)
    return data


def open_token_shards(folder: str, vocab_size: int) -> TokenShards:
    """nanoGPT's or llm.c's token files as shards; each
    train shard's ids are checked on first use."""
    files = open_token_folder(folder, vocab_size)
    names = [str(p) for p in files.files]

    def check(i: int, arr) -> None:  # shard i's ids fit the model's vocabulary
        check_shard_ids(arr, vocab_size, names[i], files.vocab_hint)

    return TokenShards(
        files.train,
        files.val,
        source_fingerprint(DataConfig(source=folder)),
        {"format": files.kind, "train_tokens": files.train_tokens, "val_tokens": len(files.val)},
        check=check,
    )
