"""The model card (README.md) of every export.

Invariants:
- Its figures come from the run folder itself (run.json / finetune.json, metrics.jsonl,
  evals.jsonl) and describe the exported checkpoint (its step, the tokens and losses up to it).
- The context it states is the one the export advertises (`trained_context` unless `--context`).
- Every string in it that a user or a run folder chose (the run's name, data, base, recipe, tasks,
  score names) goes through `card_text`: one line, inert (no heading, HTML, link or emphasis comes
  from it).
"""

from __future__ import annotations

import math
import re
import string
import unicodedata
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from tinygpt.core.checkpoint import find_run_checkpoint, read_manifest, step_of
from tinygpt.core.files import read_text_safe
from tinygpt.core.paths import is_hub
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import EVALS_JSONL, METRICS, RunDir, parse_jsonl
from tinygpt.evals.tasks import TASKS
from tinygpt.model.prompts import TEMPLATES
from tinygpt.publish.source import run_kind, run_template, trained_context

CARD = "README.md"
AMX_NOTE = (
    "q8_0 on a CPU with AMX (Intel Xeon 4th generation and later): llama.cpp's CPU weight "
    "repacking crashes on q8_0 files (any q8_0, llama-quantize's too); run llama.cpp with "
    "--no-repack, or export f16"
)
INPUT_NOTE = (
    "An instruction with an input (Alpaca's `### Input:` form) is two user messages in "
    "chat: the instruction, then the input. Ollama joins them with a blank line, so there "
    "the first blank line of a prompt ends the instruction."
)


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluations `run_eval` recorded in the run folder (evals.jsonl), oldest first, or []."""
    p = Path(run_dir) / EVALS_JSONL
    try:  # never through a link or a hard link: the card (and a push) would carry it
        text = read_text_safe(p)
    except FileNotFoundError:
        return []
    return parse_jsonl(text, p)


def _scores(e: dict[str, Any]) -> str:
    """A recorded evaluation's scores as its card shows them: its task's headline
    (`Task.headline`), else every number."""
    s = e.get("scores") if isinstance(e.get("scores"), dict) else {}
    task = TASKS.get(e["task"]) if isinstance(e.get("task"), str) else None
    patterns = task.headline if task else ()
    keys = [k for p in patterns for k in s if fnmatchcase(str(k), p)] or [
        k for k, v in s.items() if isinstance(v, (int, float))
    ]
    return ", ".join(f"{card_text(k, code=False)} {_num(s[k])}" for k in keys)


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return f"{v:,}" if isinstance(v, int) else card_text(v, code=False)


# characters of one user string in a card (a longer one is cut, with an ellipsis)
CARD_TEXT_LIMIT = 200
# in text: every ASCII punctuation character is backslash-escaped (markdown reads none of them
# then), but for these, which start nothing inline; & < > become entities (no HTML, no entity, no
# autolink)
_PLAIN = set(",-")
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
# a Hub repository: USER/NAME
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def card_text(value: Any, code: bool = True) -> str:
    """A string a user or a run folder chose (a run's name, a data spec, a base, a recipe, a task,
    a score's name) as a model card writes it: one line (control, format and line-separator
    characters become spaces), at most CARD_TEXT_LIMIT characters, and inert. `code`: a code span
    fenced by more backticks than it holds, `|` escaped (a table cell); else text with every
    markdown character backslash-escaped and & < > as entities, an underscore inside a word
    (`bits_per_byte`) left as it is. No heading, HTML, link or emphasis comes from it either way."""
    text = "".join(
        " " if unicodedata.category(c)[0] in "CZ" and c != " " else c for c in str(value)
    )
    text = " ".join(text.split())
    if len(text) > CARD_TEXT_LIMIT:
        text = text[: CARD_TEXT_LIMIT - 1] + "…"
    if code:
        text = text.replace("|", "\\|")
        fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
        pad = " " if text[:1] == "`" or text[-1:] == "`" else ""
        return f"{fence}{pad}{text}{pad}{fence}" if text else ""
    out = []
    for i, c in enumerate(text):
        inner = c == "_" and text[i - 1 : i].isalnum() and text[i + 1 : i + 2].isalnum()
        escaped = c in string.punctuation and c not in _PLAIN and not inner
        out.append(_ENTITIES.get(c) or (f"\\{c}" if escaped else c))
    return "".join(out)


def _is_local(source: Any) -> bool:
    text = str(source or "")
    return not is_hub(text) and (text.startswith(("/", ".", "~")) or Path(text).exists())


def _shown(source: Any) -> Any:
    """A data set or base as a card shows it: a Hub id or `hf:` source as it is, a local path by its
    name only (the card is public; the machine's folders are not)."""
    return Path(str(source)).name if source and _is_local(source) else source


def checkpoint_step(run_dir: str | Path, which: str = "latest") -> int | None:
    """The step of the checkpoint an export of `which` holds: its manifest's step (a finetune's
    adapter: the newest checkpoint's), None for a run without one."""
    try:
        ckpt = find_run_checkpoint(run_dir, which)
    except Exception:  # a LoRA run whose checkpoints were pruned, an older layout: no step
        return None
    try:
        step = read_manifest(ckpt).get("step")
    except Exception:
        step = None
    return step if isinstance(step, int) else step_of(ckpt)


def card_facts(
    run_dir: str | Path, which: str = "latest", context: int | None = None
) -> dict[str, Any]:
    """The figures a card states, all read from the run folder, of the exported checkpoint
    (`which`): recipe, data, model shape, its step, the tokens seen and the last training and
    validation losses up to that step, the context the export advertises, and the recorded
    evaluations. A figure the run folder does not hold is None (the card leaves it out, or says "not
    evaluated")."""
    run_dir = Path(run_dir)
    kind = run_kind(run_dir)
    metrics = RunDir(run_dir).metrics()
    step = checkpoint_step(run_dir, which)
    upto = [
        m for m in metrics if isinstance(m.get("step"), int) and (step is None or m["step"] <= step)
    ]
    train = [m for m in upto if m.get("loss") is not None]
    val = [m for m in upto if m.get("val_loss") is not None]
    at = next((m for m in reversed(train) if m["step"] == step), None)
    facts: dict[str, Any] = {
        "kind": kind,
        "run": run_dir.resolve().name,
        "evals": read_evals(run_dir),
        "steps": (step if step is not None else (train[-1]["step"] if train else None)),
        "train_loss": train[-1]["loss"] if train else None,
        "train_loss_step": train[-1]["step"] if train else None,
        "val_loss": val[-1]["val_loss"] if val else None,
        "val_loss_step": val[-1]["step"] if val else None,
        "tokens": (at or {}).get("tokens"),
        "trained_context": trained_context(run_dir),
    }
    facts["context"] = context or facts["trained_context"]
    if kind == "pretrain":
        recipe = Recipe.from_dict(RunDir(run_dir).recipe_dict())
        if facts["tokens"] is None and facts["steps"] is not None:
            facts["tokens"] = facts["steps"] * recipe.train.tokens_per_step
        facts.update(
            recipe=recipe.name,
            data=_shown(recipe.data.source),
            tokenizer=recipe.data.tokenizer,
            model=recipe.model,
            max_steps=recipe.train.max_steps,
        )
    else:
        info = RunDir(run_dir).finetune_info() or {}
        facts.update(
            recipe=info.get("recipe", {}).get("name"),
            data=_shown(info.get("data")),
            base=_shown(info.get("base")),
            hub_base=not _is_local(info.get("base")),
            template=run_template(run_dir),
        )
    return facts


def _tokenizer_words(tokenizer: str, m: Any) -> str:
    if getattr(m, "init", None):
        return "the base's tokenizer"
    return "GPT-2 BPE" if tokenizer == "gpt2" else "a byte-level BPE trained on its data"


def _at(f: dict[str, Any], key: str) -> str:
    """ " (step N)" when a loss was logged before the exported checkpoint's step, else ""."""
    return f" (step {f[key]:,})" if f.get(key) is not None and f[key] != f.get("steps") else ""


def _context_words(f: dict[str, Any], max_seq_len: int | None) -> str:
    """The context an export advertises, in words: the trained one, or the one the user set and the
    trained one."""
    ctx, trained = f.get("context") or max_seq_len, f.get("trained_context")
    if trained and ctx != trained:
        return f"{ctx:,} tokens as exported (`--context`; it was trained at {trained:,})"
    more = (
        f" (its position tables reach {max_seq_len:,}; positions past {ctx:,} were never trained)"
        if max_seq_len and max_seq_len > ctx
        else ""
    )
    return f"{ctx:,} tokens, the length it was trained at{more}"


def model_card(
    run_dir: str | Path,
    *,
    hf: bool,
    gguf_file: str | None,
    repo_id: str | None = None,
    which: str = "latest",
    context: int | None = None,
) -> str:
    """The README.md of an export: what the model is, how it was trained (figures from the run
    folder, of the exported checkpoint `which`), its evaluations, and how to load it (transformers
    when `hf`, Ollama and llama.cpp when `gguf_file`). context: the context the export advertises
    (the trained one when None)."""
    f = card_facts(run_dir, which, context)
    # a Hub repository's name, or none
    repo_id = repo_id if repo_id and _HUB_ID.fullmatch(repo_id) else None
    lines = [
        *_front_matter(f, hf, gguf_file),
        "---",
        "",
        f"# {card_text(f['run'], code=False)}",
        "",
    ]
    lines += _what_it_is(f) + _training(f) + _evaluations(f) + ["", "## Use it", ""]
    if hf:
        lines += _use_in_transformers(f, repo_id or "PATH/TO/THIS/FOLDER")
    if gguf_file:
        lines += _use_gguf(f, gguf_file, repo_id)
    return "\n".join(lines)


def _front_matter(f: dict[str, Any], hf: bool, gguf_file: str | None) -> list[str]:
    """The card's YAML header, but its closing line: library, tags, the base's Hub id."""
    tags = ["tinygpt", "text-generation"] + (["gguf"] if gguf_file else [])
    front = [
        "---",
        "library_name: transformers" if hf else "library_name: gguf",
        "pipeline_tag: text-generation",
        "tags:",
        *[f"- {t}" for t in tags],
    ]
    base = f.get("base")
    if f.get("hub_base") and isinstance(base, str) and _HUB_ID.fullmatch(base):  # finetunes only
        front.append(f"base_model: {base}")  # a Hub id (a local base has no page to link)
    return front


def _what_it_is(f: dict[str, Any]) -> list[str]:
    """A pretrained model's architecture, or a finetune's base and prompt format."""
    lines = []
    if f["kind"] == "pretrain":
        m = f["model"]
        init = getattr(m, "init", None)
        start = f"continued from {card_text(_shown(init))}" if init else "from scratch"
        lines += [
            f"A {m.family.title}-architecture language model pretrained {start} with "
            f"[tinygpt](https://github.com/tinygpt/tinygpt): {m.n_layer} layers, width "
            f"{m.d_model}, {m.n_head} heads ({m.n_kv_head or m.n_head} key/value), context "
            f"{_context_words(f, m.max_seq_len)}, vocabulary {m.vocab_size:,} "
            f"({_tokenizer_words(f['tokenizer'], m)}).",
            "",
        ]
    else:
        how = "every weight trained" if f["kind"] == "full" else "the adapter folded into the base"
        lines += [
            f"[tinygpt](https://github.com/tinygpt/tinygpt)'s {card_text(f['recipe'])} "
            f"finetune of {card_text(f['base'])}, {how}. "
            "Prompts use the instruction format it was trained on:",
            "",
            "```",
            TEMPLATES[f["template"]][1].format(instruction="<your instruction>") + "<answer>",
            "```",
            "",
            INPUT_NOTE,
            "",
        ]
    if f["kind"] != "pretrain" and f["context"]:
        lines += [f"Context: {_context_words(f, None)}.", ""]
    return lines


def _training(f: dict[str, Any]) -> list[str]:
    """The training table: recipe, data, steps, tokens and losses of the exported checkpoint."""

    def num(key: str) -> str | None:
        return _num(f[key]) if f[key] is not None else None

    rows = [
        ("recipe", card_text(f["recipe"])),
        ("data", card_text(f["data"])),
        ("steps", num("steps")),
        ("tokens seen", num("tokens")),
        ("training loss" + _at(f, "train_loss_step"), num("train_loss")),
        ("validation loss" + _at(f, "val_loss_step"), num("val_loss") or "not evaluated"),
    ]
    step = f" (step {f['steps']:,})" if f.get("steps") is not None else ""
    return [
        "## Training",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows if v],
        "",
        f"Figures of the exported checkpoint{step}; losses are mean "
        f"cross-entropy per token in nats, from the run's `{METRICS}`.",
        "",
    ]


def _evaluations(f: dict[str, Any]) -> list[str]:
    """The run's recorded evaluations as a table, or how to record one."""
    lines = ["## Evaluations", ""]
    if f["evals"]:
        lines += ["| task | data | scores |", "|---|---|---|"]
        lines += [
            f"| {card_text(e.get('task'), code=False)} | "
            f"{card_text(_shown(e.get('data')))} | {_scores(e)} |"
            for e in f["evals"]
        ]
    else:
        lines.append(
            "No evaluation recorded in the run folder (`tinygpt eval RUN --task ...` "
            "records each one)."
        )
    return lines


def _use_in_transformers(f: dict[str, Any], where: str) -> list[str]:
    """Loading the export with transformers: a prompt to complete, or a chat message."""
    if f["kind"] == "pretrain":
        run = [
            'ids = tokenizer("def main(", return_tensors="pt").input_ids',
            "print(tokenizer.decode(model.generate(ids, max_new_tokens=64, do_sample=True)[0]))",
        ]
    else:
        run = [
            'messages = [{"role": "user", "content": "Write a function that adds two numbers."}]',
            "prompt = tokenizer.apply_chat_template(messages, tokenize=False)  "
            "# the format it learned",
            'ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids',
            "print(tokenizer.decode(model.generate(ids, max_new_tokens=128)[0, ids.shape[1]:], "
            "skip_special_tokens=True))",
        ]
    return [
        "With transformers:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{where}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
        *run,
        "```",
        "",
    ]


def _use_gguf(f: dict[str, Any], gguf_file: str, repo_id: str | None) -> list[str]:
    """Running the GGUF file with Ollama and llama.cpp."""
    ollama = (
        f"ollama run hf.co/{repo_id}:{gguf_file.split('-', 1)[1].removesuffix('.gguf')}"
        if repo_id
        else "ollama create mymodel -f Modelfile && ollama run mymodel"
    )
    lines = [
        f"With Ollama (`{gguf_file}` and the `Modelfile` beside it, which sets the "
        "prompt format, the stop token and the model's context):",
        "",
        "```bash",
        ollama,
        "```",
        "",
        "With llama.cpp:",
        "",
        "```bash",
        f'llama-cli -m {gguf_file} -p "def main(" -n 64 --temp 0.8',
        "```",
        "",
    ]
    if f["kind"] != "pretrain":
        lines += [
            "In llama.cpp's chat mode, `--jinja` applies the instruction format stored in the "
            "file.",
            "",
        ]
    if "Q8_0" in gguf_file:
        lines += [f"Note: {AMX_NOTE}.", ""]
    return lines
