"""Where things live outside a run folder: the cache root and the optional offline data sets.

One definition each: `TINYGPT_CACHE` (default ~/.cache/tinygpt) holds token caches, probe results
and downloaded evaluation data; `TINYGPT_SHARED_DATA` (default ../shared/data beside a source
checkout) holds the larger offline data sets when a machine has them; `sample:NAME` names a small
sample of a public data set that ships with the package (tinygpt/samples/).
"""

from __future__ import annotations

import os
from pathlib import Path

# a source checkout's root (meaningless for a wheel install)
REPO_ROOT = Path(__file__).resolve().parents[2]


def cache_root(kind: str | None = None) -> Path:
    """$TINYGPT_CACHE (default ~/.cache/tinygpt), or its sub-folder `kind` (tokens, probe, eval)."""
    root = Path(os.environ.get("TINYGPT_CACHE") or Path.home() / ".cache" / "tinygpt")
    return root / kind if kind else root


def shared_data_dir() -> Path | None:
    """The folder of offline data sets: $TINYGPT_SHARED_DATA, else
    ../shared/data beside a source checkout (or beside the working
    directory); None where there is none (a pip install in Colab)."""
    env = os.environ.get("TINYGPT_SHARED_DATA")
    candidates = (
        [Path(env)]
        if env
        else [REPO_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    )
    return next((d for d in candidates if d.is_dir()), None)


# ships with the package (tinygpt/samples/README.md)
SAMPLES_DIR = Path(__file__).resolve().parents[1] / "samples"
SAMPLE_PREFIX = "sample:"
SAMPLES = {
    "wikitext2": "wikitext2_test_sample.txt",
    "hellaswag": "hellaswag_val_sample.txt.bz2",
    "mbpp": "mbpp_sample.jsonl",
    "humaneval": "HumanEval_sample.jsonl.gz",
}


def is_sample(source: object) -> bool:
    """Whether a data source names a sample that ships with the package (``sample:NAME``)."""
    return str(source).startswith(SAMPLE_PREFIX)


def sample_path(source: str | Path) -> Path:
    """The file of a shipped sample, ``sample:NAME`` (NAME one of `SAMPLES`: wikitext2, hellaswag,
    mbpp, humaneval), for ``--data`` on a fresh clone or a pip install with no network; a ValueError
    naming the samples for any other name."""
    name = str(source).removeprefix(SAMPLE_PREFIX)
    if name not in SAMPLES:
        raise ValueError(
            f"no sample {name!r}; the samples are " + ", ".join(SAMPLE_PREFIX + n for n in SAMPLES)
        )
    return SAMPLES_DIR / SAMPLES[name]


HUB_PREFIX = "hf:"


def is_hub(source: object) -> bool:
    """Whether a data set, model or base is written as a Hugging Face Hub reference (``hf:...``)."""
    return str(source).startswith(HUB_PREFIX)


def hub_spec(source: str, at: str | None = None) -> tuple[str, str | None, str | None]:
    """(name, config, at) of a Hugging Face Hub reference written
    ``hf:NAME[:CONFIG][@AT]``: the one parser of that form, for data sets (AT a split,
    `at` its default) and models (AT a revision, no CONFIG). The prefix is optional
    here; callers decide what a bare name means. A ValueError for an empty name."""
    spec = source[len(HUB_PREFIX) :] if source.startswith(HUB_PREFIX) else source
    if "@" in spec:
        spec, at = spec.split("@", 1)
    name, _, config = spec.partition(":")
    if not name:
        raise ValueError(
            f"empty name in {source!r}; write hf:NAME[:CONFIG][@SPLIT] (a data set) or "
            "hf:NAME[@REVISION] (a model)"
        )
    return name, config or None, at
