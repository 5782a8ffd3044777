"""HellaSwag (Zellers et al. 2019): the sensible ending of a short story out of four, scored as
lm-evaluation-harness scores it (acc and acc_norm on its query text), beside its published figures.
The data: the six-line offline file (klosax/hellaswag_text_data), rowanz/hellaswag's JSONL, or the
Hub."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Any, Sequence

from tinygpt.core.datafiles import DataFile, DataFormatError, json_object
from tinygpt.core.files import safe_name, write_text_atomic
from tinygpt.core.paths import cache_root, hub_spec, is_hub
from tinygpt.evals.harness import Loaded, Request, Task, context_length, default_data
from tinygpt.evals.lm import ChoiceItem, as_causal_lm, multiple_choice
from tinygpt.evals.texts import from_hub

HELLASWAG_HUB = "hf:Rowan/hellaswag@validation"
OFFLINE = (
    "the validation file hellaswag_val.txt[.bz2] (six lines per item, from the Hub dataset "
    "klosax/hellaswag_text_data), rowanz/hellaswag's hellaswag_val.jsonl, or sample:hellaswag (200 "
    "items that ship with tinygpt)"
)

# Published zero-shot numbers to put beside a model's own: GPT-2 124M through lm-evaluation-harness
# on all 10,042 validation items, so on the query text `hellaswag_query` builds (lm-eval's), scored
# as `multiple_choice` does.
HELLASWAG_REFERENCE = {
    "random": {"acc": 0.25, "acc_norm": 0.25},
    "gpt2-124m": {"acc": 0.2892, "acc_norm": 0.3114},
}
HELLASWAG_REFERENCE_SOURCE = "lm-evaluation-harness, zero-shot, all 10,042 validation items"


def hellaswag_preprocess(text: str) -> str:
    """lm-evaluation-harness's clean-up of HellaSwag text (its hellaswag task's ``preprocess``),
    rule for rule: strip; " [title]" (a WikiHow step title) becomes ". "; every other ``[...]``
    fragment goes (the layout markers [header], [step], [substeps] and bracketed asides alike); then
    one pass that turns each double space into one."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_query(activity_label: str, ctx_a: str, ctx_b: str) -> str:
    """The text an item's endings are scored after, built as lm-evaluation-harness builds it:
    ``preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())``."""
    return hellaswag_preprocess(f"{activity_label}: {ctx_a} {ctx_b.capitalize()}")


def hellaswag_item(record: dict[str, Any]) -> ChoiceItem:
    """A HellaSwag record (rowanz/hellaswag's JSONL, or the Hub's Rowan/hellaswag: activity_label,
    ctx_a, ctx_b, endings, label) as the item lm-evaluation-harness scores: its query and its four
    preprocessed endings."""
    try:
        endings, label = record["endings"], str(record["label"]).strip()
        query = hellaswag_query(record["activity_label"], record["ctx_a"], record["ctx_b"])
    except KeyError as e:
        raise DataFormatError(
            f"HellaSwag record {record.get('ind')} has no {e.args[0]!r}; records need "
            "activity_label, ctx_a, ctx_b, endings and label (rowanz/hellaswag's format)"
        ) from None
    if len(endings) != 4 or label not in ("0", "1", "2", "3"):
        raise DataFormatError(
            f"HellaSwag record {record.get('ind')} needs four endings and a label 0-3"
        )
    return ChoiceItem(query, [hellaswag_preprocess(e) for e in endings], int(label))


_SENTENCE_END = re.compile(r"[.!?] ")
# The activity labels of HellaSwag's WikiHow items (WikiHow's categories); every other label is an
# ActivityNet activity. A WikiHow item's ctx_b is empty.
WIKIHOW_LABELS = frozenset(
    "Arts and Entertainment|Cars & Other Vehicles|Computers and Electronics|Education and "
    "Communications|Family Life|Finance and Business|Food and Entertaining|Health|Hobbies and "
    "Crafts|Holidays and Traditions|Home and Garden|Home,Categories|Personal Care and Style|Pets "
    "and Animals|Philosophy and Religion|Relationships|Sports and Fitness|Travel|Uncategorized|"
    "Work World|Youth".split("|")
)


def _six_line_query(line: str) -> str:
    """lm-evaluation-harness's query from a six-line file's context line
    (klosax/hellaswag_text_data).

    That line is ``activity_label + ": " + ctx``, where ctx is the data set's ``ctx_a + " " +
    ctx_b`` with ctx_b as written (lower case) and " [title]" already a sentence end, but other
    brackets kept. So lm-eval's ``preprocess`` is applied again (it changes nothing it already did),
    and ctx_b is capitalised. The line does not mark where ctx_b begins. In HellaSwag a WikiHow
    item's ctx_b is empty (its label is one of `WIKIHOW_LABELS`), and an ActivityNet item's is the
    start of the sentence after ctx_a, which ends a sentence: so ctx_b is what follows the last
    sentence end of an ActivityNet context. A JSONL file of the records (`hellaswag_item`) needs no
    such rule."""
    label, sep, ctx = hellaswag_preprocess(line).partition(": ")
    ends = [m.end() for m in _SENTENCE_END.finditer(ctx)]
    if sep and ends and label not in WIKIHOW_LABELS:
        ctx = ctx[: ends[-1]] + ctx[ends[-1] :].capitalize()
    return label + sep + ctx


ONE_RECORD = "one HellaSwag record per line (rowanz/hellaswag's hellaswag_val.jsonl)"


def load_hellaswag(path: str | Path, limit: int | None = None) -> list[ChoiceItem]:
    """HellaSwag items, their text as lm-evaluation-harness builds it (`hellaswag_query`), from
    either a JSONL file of the data set's records (rowanz/hellaswag's hellaswag_val.jsonl, .gz or
    .bz2; exact), or a text file of six lines per item: context, gold index (0-3), four endings
    (klosax/hellaswag_text_data, the offline copy; see `_six_line_query`)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of items or None, got {limit}")
    path = Path(path)
    items: list[ChoiceItem] = []
    if ".jsonl" in path.suffixes or ".json" in path.suffixes:
        with DataFile(path) as f:
            for n, line in enumerate(f, 1):
                if limit is not None and len(items) >= limit:
                    break
                if not line.strip():
                    continue
                record = json_object(line, path, n, f"expected {ONE_RECORD}")
                items.append(hellaswag_item(record))
        return items
    hint = (
        "expected six lines per item: the context, the gold index (0-3), then the four endings "
        "(the format of klosax/hellaswag_text_data), or a .jsonl file of HellaSwag records"
    )
    with DataFile(path) as f:
        lines = (line.rstrip("\n") for line in f)
        # streamed: a small limit reads only what it needs
        while limit is None or len(items) < limit:
            group = list(itertools.islice(lines, 6))
            if not group or group == [""]:
                break
            first = 6 * len(items) + 1
            if len(group) < 6:
                raise DataFormatError(
                    f"{path} ends with an incomplete item of {len(group)} lines at line "
                    f"{first}; {hint}"
                )
            if group[1].strip() not in ("0", "1", "2", "3"):
                raise DataFormatError(
                    f"{path} line {first + 1}: gold index {group[1][:40]!r} is not 0-3; {hint}"
                )
            endings = [hellaswag_preprocess(e) for e in group[2:]]
            items.append(ChoiceItem(_six_line_query(group[0]), endings, int(group[1])))
    return items


def hellaswag_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Table rows: each HellaSwag result (of `run_eval`) above the published reference numbers."""
    keys = ("acc", "acc_norm", "acc_norm_stderr")
    rows = [
        {"model": r.get("run", "model"), "items": r["n"], **{k: r[k] for k in keys}}
        for r in results
    ]
    return rows + [
        {"model": f"{name} (published)", "items": 10042, **ref}
        for name, ref in HELLASWAG_REFERENCE.items()
    ]


def hellaswag_path(data: str | Path | None = None, cache_dir: str | Path | None = None) -> Path:
    """A HellaSwag file for `load_hellaswag`: `data` when it is a path; the offline copy (or the
    Hub) when it is None; for hf:NAME[@SPLIT], that dataset's records written once into `cache_dir`
    as JSONL (each checked by `hellaswag_item`), so the query text is built from ctx_a and ctx_b
    exactly."""
    spec = str(data) if data is not None else default_data(TASK)
    if not is_hub(spec):
        return Path(spec)
    name, _, split = hub_spec(spec, "validation")
    root = Path(cache_dir or cache_root("eval"))
    # one file name, from a spec the user typed: a split such as "../x" cannot leave the cache
    out = root / safe_name(f"hellaswag-{name.replace('/', '--')}-{split}.jsonl", spec, plain=True)
    if not out.is_file():
        try:
            import datasets
        except ImportError as e:
            raise ImportError(
                f"{spec} needs `pip install datasets`; or pass {TASK.data_help}"
            ) from e
        with from_hub(spec, OFFLINE):
            fields = ("ind", "activity_label", "ctx_a", "ctx_b", "label", "endings")
            rows = datasets.load_dataset(name, split=split)
            records = [{k: rec[k] for k in fields if k in rec} for rec in rows]
        for rec in records:  # one that cannot be scored (the test split has no labels): refused now
            hellaswag_item(rec)
        text = "".join(json.dumps(rec) + "\n" for rec in records)
        out.parent.mkdir(parents=True, exist_ok=True)
        # whole or not at all: a cut-off download is not taken for the data set
        write_text_atomic(out, text)
    return out


def score(m: Loaded, r: Request) -> dict[str, Any]:
    """HellaSwag accuracy on the first `limit` items (all 10,042 of the validation file by default),
    on lm-evaluation-harness's query text (`load_hellaswag`), with the published reference figures.
    Scored within the context the run trained at (`context_length`): a longer item loses its left,
    as lm-evaluation-harness cuts one longer than a model's context, rather than reaching positions
    of the table that training never used (only an ending longer than that context does)."""
    lm = dataclasses.replace(as_causal_lm(m.model), trained=context_length(m))
    items = load_hellaswag(hellaswag_path(r.data), r.limit)
    return {
        **multiple_choice(lm, m.tokenizer, items, r.batch_size, r.progress, r.say, "hellaswag"),
        "reference": HELLASWAG_REFERENCE,
        "reference_source": HELLASWAG_REFERENCE_SOURCE,
    }


def reference_table(res: dict[str, Any]) -> list[str]:
    """This model's accuracy above the published figures, as `tinygpt eval` prints it."""
    lines = [
        "",
        f"{'model':<22} {'acc':>7} {'acc_norm':>9}",
        f"{'this model (n=' + str(res['n']) + ')':<22} {res['acc']:>7.2%} {res['acc_norm']:>9.2%}",
    ]
    lines += [
        f"{name:<22} {ref['acc']:>7.2%} {ref['acc_norm']:>9.2%}"
        for name, ref in res["reference"].items()
    ]
    return lines + [f"(published figures: {res['reference_source']}; the same query text)"]


TASK = Task(
    "hellaswag",
    "HellaSwag accuracy (acc and acc_norm)",
    score,
    data_help=f"{OFFLINE}, or {HELLASWAG_HUB} to download it (needs datasets)",
    offline_file="hellaswag_val.txt.bz2",
    hub=HELLASWAG_HUB,
    sample="hellaswag",
    defaults={"batch_size": 16},
    hidden=("reference",),
    more=reference_table,
    headline=("acc", "acc_norm", "n"),
)
