"""Perplexity and bits per byte of a text (`lm.perplexity`): by default the run's own validation
split (text it never trained on), `builtin` the built-in corpus's, else a file or a Hub data set;
WikiText-2's test set is the standard one."""

from __future__ import annotations

import dataclasses
from typing import Any

from tinygpt.data.sources import validation_text
from tinygpt.evals import lm, texts
from tinygpt.evals.harness import Loaded, Request, Task

WIKITEXT2_TEST_HUB = "hf:wikitext:wikitext-2-raw-v1@test"
OFFLINE = (
    "a text file, e.g. the WikiText-2 test file wikitext2_test.txt, or sample:wikitext2 (its first "
    "77 KB, which ship with tinygpt)"
)


def score(m: Loaded, r: Request) -> dict[str, Any]:
    """On `data`; with no data, on the run's own validation split; `builtin`: the built-in corpus's
    validation split. The window defaults to the context the run trained at."""
    if r.data is None or str(r.data) in TASK.keywords:
        if m.recipe is None:
            raise ValueError(f"perplexity of {m.source} needs --data: {TASK.data_help}")
        cfg = m.recipe.data
        if r.data is not None:  # a keyword: the built-in corpus's validation split
            cfg = dataclasses.replace(cfg, source="builtin", max_chars=None)
        text = validation_text(cfg, r.max_chars)
    else:
        text = texts.load_eval_text(r.data, r.max_chars, OFFLINE)
    trained = m.recipe.train.seq_len if m.recipe is not None else None
    if r.window and trained and r.window > trained and r.say is not None:
        r.say(
            f"--window {r.window} is beyond the context this model was trained at ({trained} "
            f"tokens): positions past {trained} were never trained, so the perplexity will be "
            f"worse than the model's; --window {trained} measures the model as trained"
        )
    window = r.window or trained
    return lm.perplexity(
        m.model, m.tokenizer, text, window, r.stride, r.batch_size, r.progress, r.say
    )


TASK = Task(
    "perplexity",
    "perplexity and bits per byte of a text (default: the run's own validation split)",
    score,
    data_help=f"{OFFLINE}, or {WIKITEXT2_TEST_HUB} to read it from the Hugging Face Hub (needs "
    "datasets)",
    offline_file="wikitext2_test.txt",
    hub=WIKITEXT2_TEST_HUB,
    sample="wikitext2",
    data_default="the run's validation split",
    keywords=("builtin", "stdlib"),
    defaults={"batch_size": 4},
    headline=("perplexity", "bits_per_byte", "tokens"),
)
