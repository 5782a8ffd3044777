"""A run, ready to share: exported to Hugging Face format or GGUF (llama.cpp, Ollama) with a model card,
and pushed to the Hugging Face Hub.

Invariants:
- `export` takes a pretraining run or a finetuning run (its adapter folded into the base first) and
  writes a new folder atomically: nothing under the target name until everything is written.
  Bad input (target taken, unknown format or quantization, no checkpoint) is refused before any model loads.
- Every export folder has a `README.md` model card whose figures come from the run folder itself
  (run.json / finetune.json, metrics.jsonl, evals.jsonl) and describe the exported checkpoint (its step, the
  tokens and losses up to it), and a GGUF export has an Ollama `Modelfile`.
- Every context a client reads (config.json's max_position_embeddings, the tokenizer's model_max_length, the
  GGUF's context_length, the Modelfile's num_ctx, the card) is the one the model was trained at
  (`trained_context`), unless the user asks for another (`--context`).
- A finetune's prompt format travels whole: the token its training prompts began with (`Codec.bos_id`:
  end-of-text for a tinygpt base) is the one the exported tokenizer adds (config.json, tokenizer_config.json,
  tokenizer.json and the GGUF agree), and the chat template (`jinja_template`, the Modelfile's TEMPLATE)
  renders a user turn exactly as `finetune.instruct.format_prompt` does.
  Every string in the card that a user or a run folder chose (the run's name, data, base, recipe, tasks, score
  names) goes through `card_text`: one line, inert (no heading, HTML, link or emphasis comes from it).
- `push` needs a token (`HF_TOKEN`, or Colab's secret of that name) and the Hub; without either it stops
  with one line before exporting anything. What it uploads is exactly `upload_folder`'s folder.
"""
from __future__ import annotations

import math
import os
import re
import string
import sys
import tempfile
import unicodedata
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from tinygpt.core.checkpoint import STATE_FILE, RunCheckpoint, find_run_checkpoint, read_manifest, step_of
from tinygpt.core.config import Recipe
from tinygpt.core.files import atomic_output, read_text_safe
from tinygpt.core.options import option
from tinygpt.core.paths import is_hub
from tinygpt.core.rundir import (
    EVALS_JSONL,
    FULL_MODEL_DIR,
    MERGED_DIR,
    METRICS,
    RunDir,
    missing_run_message,
    parse_jsonl,
)
from tinygpt.evals.tasks import TASKS
from tinygpt.finetune.instruct import TEMPLATES, Codec
from tinygpt.finetune.lora import FinetuneError, _adapter_dir, export_full, is_full_finetune, merge_adapter
from tinygpt.finetune.recipes import ADAPTER_INFO
from tinygpt.model import gguf as gg
from tinygpt.model.hf import check_export_target, export_model, from_pretrained, import_hf, set_prompt_format
from tinygpt.model.loading import load_run

FORMATS = ("hf", "gguf")
CARD = "README.md"


def gguf_name(quant: str) -> str:
    """The GGUF file's name: the quantization in it, as Ollama's `hf.co/USER/REPO:Q8_0` tags expect."""
    return f"model-{quant.upper()}.gguf"


# --- what a run is ----------------------------------------------------------------------------

def _kind(run_dir: Path) -> str:
    """"pretrain", "finetune" (LoRA / QLoRA: an adapter to fold in) or "full" (full finetuning: a whole model)."""
    run = RunDir(run_dir)
    if is_full_finetune(run_dir):
        return "full"
    if run.is_finetune_run():
        return "finetune"
    if run.is_pretrain_run():
        return "pretrain"
    if not run_dir.exists():
        raise FileNotFoundError(missing_run_message(run_dir))  # a mistyped path: the closest run folder, if any
    raise FileNotFoundError(f"{run_dir} is neither a tinygpt run (run.json) nor a finetuning run (finetune.json); "
                            "give the folder `tinygpt pretrain` or `tinygpt finetune` wrote")


def _template(run_dir: Path) -> str:
    return RunDir(run_dir).adapter_info().get("template") or "alpaca"


def prompt_start(folder: str | Path) -> int | None:
    """The token a finetune's training prompts began with (`Codec.bos_id` of the tokenizer it trained with, here
    the one in the merged model `folder`): end-of-text for a tinygpt base; None when none was put there."""
    return Codec(from_pretrained("AutoTokenizer", folder)).bos_id


def trained_context(run_dir: str | Path) -> int | None:
    """The context a run's model was trained at: a pretraining run's train.seq_len (its position tables,
    model.max_seq_len, may be longer: positions past seq_len were never trained); a finetune of a tinygpt base,
    the longer of the base's and the finetune's seq_len; None for a finetune of another base (its config.json's
    max_position_embeddings is the base's own)."""
    run_dir = Path(run_dir)
    run = RunDir(run_dir)
    if run.is_pretrain_run():
        recipe = Recipe.from_dict(run.recipe_dict())
        return min(recipe.train.seq_len, recipe.model.max_seq_len)
    info = run.finetune_info() or {}
    base = info.get("base")
    if not isinstance(base, str) or not base or is_hub(base) or not RunDir(Path(base)).is_pretrain_run():
        return None
    base_ctx, ft = trained_context(base), _finetune_seq_len(run_dir, info)
    return max(base_ctx, ft) if isinstance(ft, int) and base_ctx else base_ctx


def _finetune_seq_len(run_dir: Path, info: dict[str, Any]) -> int | None:
    """The seq_len a finetune trained at: its newest checkpoint's training config (overrides included, read
    weights-only and memory-mapped), else its recipe's for its hardware."""
    try:
        import torch

        state = torch.load(find_run_checkpoint(run_dir) / STATE_FILE, map_location="cpu", weights_only=True,
                           mmap=True)
        seq_len = (state.get("train_config") or {}).get("seq_len")
        if isinstance(seq_len, int):
            return seq_len
    except Exception:  # no checkpoint left, an older layout: the recipe's
        pass
    train = ((info.get("recipe") or {}).get("train") or {}).get(info.get("hardware"))
    return train.get("seq_len") if isinstance(train, dict) else None


def _load(run_dir: Path, which: str):
    """(tinygpt GPT, tinygpt Tokenizer, prompt start) of a run; a finetune is merged and brought back through
    `import_hf`. The prompt start is the token a finetune's training prompts began with (`prompt_start`), None
    for a pretraining run (`tinygpt generate` continues a prompt as it is)."""
    kind = _kind(run_dir)
    if kind == "pretrain":
        model, tok, _, _ = load_run(run_dir, which)
        return model, tok, None
    with tempfile.TemporaryDirectory(prefix="tinygpt-merge-") as tmp:
        merged = (merge_adapter(run_dir, Path(tmp) / MERGED_DIR) if kind == "finetune"
                  else export_full(run_dir, which, Path(tmp) / FULL_MODEL_DIR))
        bos = prompt_start(merged)
        try:
            model, tok = import_hf(merged)
        except ValueError as e:  # a base llama.cpp's llama/qwen3 would not be (Gemma, GPT-2...)
            raise FinetuneError(f"GGUF export of this finetune: {e}; export it with --format hf and convert that with "
                                "llama.cpp's convert_hf_to_gguf.py") from e
    if tok is None:
        raise FinetuneError(f"the merged model of {run_dir} has no tokenizer.json; GGUF needs a fast tokenizer")
    return model, tok, bos


# --- prompt formats ---------------------------------------------------------------------------

def ollama_template(template: str) -> str:
    """A finetuned run's instruction prompt (no input) as an Ollama Go template. The token training put before
    the prompt is not in it: Ollama adds it, as the GGUF's add_bos_token says."""
    return TEMPLATES[template][1].replace("{instruction}", "{{ .Prompt }}")


def jinja_template(template: str, eot: str, bos: bool = False) -> str:
    """The same prompt as a Jinja chat template (transformers' `apply_chat_template`, llama.cpp's `--jinja`
    chat mode): `bos_token` first when training put one before the prompt (`bos`; llama.cpp drops it from the
    text when it adds the token itself), each user turn in the instruction format with its content as
    `format_prompt` puts it (trimmed), each answer followed by end-of-text, as the run was trained."""
    pre, post = TEMPLATES[template][1].split("{instruction}")
    return (("{{ bos_token }}" if bos else "")
            + "{% for message in messages %}{% if message['role'] == 'user' %}" + pre
            + "{{ message['content'] | trim }}"
            + post + "{% elif message['role'] == 'assistant' %}{{ message['content'] }}" + eot
            + "{% endif %}{% endfor %}")


# --- the model card ---------------------------------------------------------------------------

def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluations `run_eval` recorded in the run folder (evals.jsonl), oldest first; [] when none."""
    p = Path(run_dir) / EVALS_JSONL
    try:
        text = read_text_safe(p)  # never through a link or a hard link: the card (and a push) would carry it
    except FileNotFoundError:
        return []
    return parse_jsonl(text, p)


def _scores(e: dict[str, Any]) -> str:
    """A recorded evaluation's scores as its card shows them: its task's headline (`Task.headline`), else every
    number."""
    s = e.get("scores") if isinstance(e.get("scores"), dict) else {}
    task = TASKS.get(e["task"]) if isinstance(e.get("task"), str) else None
    keys = [k for pattern in (task.headline if task else ()) for k in s if fnmatchcase(str(k), pattern)]
    return (", ".join(f"{card_text(k, code=False)} {_num(s[k])}" for k in keys)
            or ", ".join(f"{card_text(k, code=False)} {_num(v)}" for k, v in s.items() if isinstance(v, (int, float))))


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return f"{v:,}" if isinstance(v, int) else card_text(v, code=False)


CARD_TEXT_LIMIT = 200  # characters of one user string in a card (a longer one is cut, with an ellipsis)
# in text: every ASCII punctuation character is backslash-escaped (markdown reads none of them then), but for
# these, which start nothing inline; & < > become entities (no HTML, no entity, no autolink)
_PLAIN = set(",-")
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")  # a Hub repository: USER/NAME


def card_text(value: Any, code: bool = True) -> str:
    """A string a user or a run folder chose (a run's name, a data spec, a base, a recipe, a task, a score's name)
    as a model card writes it: one line (control, format and line-separator characters become spaces), at most
    CARD_TEXT_LIMIT characters, and inert. `code`: a code span fenced by more backticks than it holds, `|`
    escaped (a table cell); else text with every markdown character backslash-escaped and & < > as entities,
    an underscore inside a word (`bits_per_byte`) left as it is. No heading, HTML, link or emphasis comes
    from it either way."""
    text = "".join(" " if unicodedata.category(c)[0] in "CZ" and c != " " else c for c in str(value))
    text = " ".join(text.split())
    if len(text) > CARD_TEXT_LIMIT:
        text = text[:CARD_TEXT_LIMIT - 1] + "…"
    if code:
        text = text.replace("|", "\\|")
        fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
        pad = " " if text[:1] == "`" or text[-1:] == "`" else ""
        return f"{fence}{pad}{text}{pad}{fence}" if text else ""
    out = []
    for i, c in enumerate(text):
        inner = c == "_" and text[i - 1:i].isalnum() and text[i + 1:i + 2].isalnum()
        out.append(_ENTITIES.get(c) or (f"\\{c}" if c in string.punctuation and c not in _PLAIN and not inner
                                        else c))
    return "".join(out)


def _is_local(source: Any) -> bool:
    text = str(source or "")
    return not is_hub(text) and (text.startswith(("/", ".", "~")) or Path(text).exists())


def _shown(source: Any) -> Any:
    """A data set or base as a card shows it: a Hub id or `hf:` source as it is, a local path by its name only
    (the card is public; the machine's folders are not)."""
    return Path(str(source)).name if source and _is_local(source) else source


def checkpoint_step(run_dir: str | Path, which: str = "latest") -> int | None:
    """The step of the checkpoint an export of `which` holds: its manifest's step (a finetune's adapter: the
    newest checkpoint's), None for a run without one."""
    try:
        ckpt = find_run_checkpoint(run_dir, which)
    except Exception:  # a LoRA run whose checkpoints were pruned, an older layout: no step to state
        return None
    try:
        step = read_manifest(ckpt).get("step")
    except Exception:
        step = None
    return step if isinstance(step, int) else step_of(ckpt)


def card_facts(run_dir: str | Path, which: str = "latest", context: int | None = None) -> dict[str, Any]:
    """The figures a card states, all read from the run folder, of the exported checkpoint (`which`): recipe,
    data, model shape, its step, the tokens seen and the last training and validation losses up to that step,
    the context the export advertises, and the recorded evaluations. A figure the run folder does not hold is
    None (the card leaves it out, or says "not evaluated")."""
    run_dir = Path(run_dir)
    kind = _kind(run_dir)
    metrics = RunDir(run_dir).metrics()
    step = checkpoint_step(run_dir, which)
    upto = [m for m in metrics if isinstance(m.get("step"), int) and (step is None or m["step"] <= step)]
    train = [m for m in upto if m.get("loss") is not None]
    val = [m for m in upto if m.get("val_loss") is not None]
    at = next((m for m in reversed(train) if m["step"] == step), None)
    facts: dict[str, Any] = {"kind": kind, "run": run_dir.resolve().name, "evals": read_evals(run_dir),
                             "steps": step if step is not None else (train[-1]["step"] if train else None),
                             "train_loss": train[-1]["loss"] if train else None,
                             "train_loss_step": train[-1]["step"] if train else None,
                             "val_loss": val[-1]["val_loss"] if val else None,
                             "val_loss_step": val[-1]["step"] if val else None,
                             "tokens": (at or {}).get("tokens"),
                             "trained_context": trained_context(run_dir)}
    facts["context"] = context or facts["trained_context"]
    if kind == "pretrain":
        recipe = Recipe.from_dict(RunDir(run_dir).recipe_dict())
        if facts["tokens"] is None and facts["steps"] is not None:
            facts["tokens"] = facts["steps"] * recipe.train.tokens_per_step
        facts.update(recipe=recipe.name, data=_shown(recipe.data.source), tokenizer=recipe.data.tokenizer,
                     model=recipe.model, max_steps=recipe.train.max_steps)
    else:
        info = RunDir(run_dir).finetune_info() or {}
        facts.update(recipe=info.get("recipe", {}).get("name"), data=_shown(info.get("data")),
                     base=_shown(info.get("base")), hub_base=not _is_local(info.get("base")),
                     template=_template(run_dir))
    return facts


def _tokenizer_words(tokenizer: str, m: Any) -> str:
    if getattr(m, "init", None):
        return "the base's tokenizer"
    return "GPT-2 BPE" if tokenizer == "gpt2" else "a byte-level BPE trained on its data"


def _at(f: dict[str, Any], key: str) -> str:
    """" (step N)" when a loss was logged before the exported checkpoint's step, else ""."""
    return f" (step {f[key]:,})" if f.get(key) is not None and f[key] != f.get("steps") else ""


def _step_words(f: dict[str, Any]) -> str:
    return f" (step {f['steps']:,})" if f.get("steps") is not None else ""


def _context_words(f: dict[str, Any], max_seq_len: int | None) -> str:
    """The context an export advertises, in words: the trained one, or the one the user set and the trained one."""
    ctx, trained = f.get("context") or max_seq_len, f.get("trained_context")
    if trained and ctx != trained:
        return f"{ctx:,} tokens as exported (`--context`; it was trained at {trained:,})"
    more = (f" (its position tables reach {max_seq_len:,}; positions past {ctx:,} were never trained)"
            if max_seq_len and max_seq_len > ctx else "")
    return f"{ctx:,} tokens, the length it was trained at{more}"


def model_card(run_dir: str | Path, *, hf: bool, gguf_file: str | None, repo_id: str | None = None,
               which: str = "latest", context: int | None = None) -> str:
    """The README.md of an export: what the model is, how it was trained (figures from the run folder, of the
    exported checkpoint `which`), its evaluations, and how to load it (transformers when `hf`, Ollama and
    llama.cpp when `gguf_file`). context: the context the export advertises (the trained one when None)."""
    f = card_facts(run_dir, which, context)
    repo_id = repo_id if repo_id and _HUB_ID.fullmatch(repo_id) else None  # a Hub repository's name, or none
    where = repo_id or "PATH/TO/THIS/FOLDER"
    tags = ["tinygpt", "text-generation"] + (["gguf"] if gguf_file else [])
    front = ["---", "library_name: transformers" if hf else "library_name: gguf", "pipeline_tag: text-generation",
             "tags:", *[f"- {t}" for t in tags]]
    if f["kind"] != "pretrain" and isinstance(f.get("base"), str) and f["hub_base"] and _HUB_ID.fullmatch(f["base"]):
        front.append(f"base_model: {f['base']}")  # a Hub id (a local base has no page to link)
    lines = [*front, "---", "", f"# {card_text(f['run'], code=False)}", ""]
    if f["kind"] == "pretrain":
        m = f["model"]
        start = f"continued from {card_text(_shown(m.init))}" if getattr(m, "init", None) else "from scratch"
        lines += [f"A {m.family.title}-architecture language model pretrained {start} with "
                  f"[tinygpt](https://github.com/tinygpt/tinygpt): {m.n_layer} layers, width {m.d_model}, "
                  f"{m.n_head} heads ({m.n_kv_head or m.n_head} key/value), "
                  f"context {_context_words(f, m.max_seq_len)}, "
                  f"vocabulary {m.vocab_size:,} "
                  f"({_tokenizer_words(f['tokenizer'], m)}).", ""]
    else:
        how = "every weight trained" if f["kind"] == "full" else "the adapter folded into the base"
        lines += [f"[tinygpt](https://github.com/tinygpt/tinygpt)'s {card_text(f['recipe'])} finetune of "
                  f"{card_text(f['base'])}, {how}. "
                  "Prompts use the instruction format it was trained on:", "",
                  "```", TEMPLATES[f["template"]][1].format(instruction="<your instruction>") + "<answer>", "```", ""]
    if f["kind"] != "pretrain" and f["context"]:
        lines += [f"Context: {_context_words(f, None)}.", ""]
    rows = [("recipe", card_text(f["recipe"])), ("data", card_text(f["data"])),
            ("steps", _num(f["steps"]) if f["steps"] is not None else None),
            ("tokens seen", _num(f["tokens"]) if f["tokens"] is not None else None),
            ("training loss" + _at(f, "train_loss_step"),
             _num(f["train_loss"]) if f["train_loss"] is not None else None),
            ("validation loss" + _at(f, "val_loss_step"),
             _num(f["val_loss"]) if f["val_loss"] is not None else "not evaluated")]
    lines += ["## Training", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows if v],
              "", f"Figures of the exported checkpoint{_step_words(f)}; losses are mean cross-entropy per token in "
              f"nats, from the run's `{METRICS}`.", "", "## Evaluations", ""]
    if f["evals"]:
        lines += ["| task | data | scores |", "|---|---|---|"]
        lines += [f"| {card_text(e.get('task'), code=False)} | {card_text(_shown(e.get('data')))} | {_scores(e)} |"
                  for e in f["evals"]]
    else:
        lines.append("No evaluation recorded in the run folder (`tinygpt eval RUN --task ...` records each one).")
    lines += ["", "## Use it", ""]
    if hf:
        lines += ["With transformers:", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  f'model = AutoModelForCausalLM.from_pretrained("{where}")',
                  f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
                  *(['ids = tokenizer("def main(", return_tensors="pt").input_ids',
                     "print(tokenizer.decode(model.generate(ids, max_new_tokens=64, do_sample=True)[0]))"]
                    if f["kind"] == "pretrain" else
                    ['messages = [{"role": "user", "content": "Write a function that adds two numbers."}]',
                     "prompt = tokenizer.apply_chat_template(messages, tokenize=False)  # the format it learned",
                     'ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids',
                     "print(tokenizer.decode(model.generate(ids, max_new_tokens=128)[0, ids.shape[1]:], "
                     "skip_special_tokens=True))"]),
                  "```", ""]
    if gguf_file:
        ollama = (f"ollama run hf.co/{repo_id}:{gguf_file.split('-', 1)[1].removesuffix('.gguf')}" if repo_id
                  else "ollama create mymodel -f Modelfile && ollama run mymodel")
        lines += [f"With Ollama (`{gguf_file}` and the `Modelfile` beside it, which sets the prompt format, the "
                  "stop token and the model's context):", "", "```bash", ollama, "```", "",
                  "With llama.cpp:", "", "```bash", f'llama-cli -m {gguf_file} -p "def main(" -n 64 --temp 0.8',
                  "```", ""]
        if f["kind"] != "pretrain":
            lines += ["In llama.cpp's chat mode, `--jinja` applies the instruction format stored in the file.", ""]
        if "Q8_0" in gguf_file:
            lines += [f"Note: {AMX_NOTE}.", ""]
    return "\n".join(lines)


# --- export -----------------------------------------------------------------------------------

def check_format(fmt: str, quant: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    gg.check_quant(quant)


AMX_NOTE = ("q8_0 on a CPU with AMX (Intel Xeon 4th generation and later): llama.cpp's CPU weight repacking "
            "crashes on q8_0 files (any q8_0, llama-quantize's too); run llama.cpp with --no-repack, or export f16")


def _write_gguf(run_dir: Path, model: Any, tok: Any, folder: Path, quant: str, bos: int | None,
                context: int | None) -> str:
    """The GGUF and its Modelfile into `folder`; returns the GGUF's name. bos: the token a finetune's training
    prompts began with (`prompt_start`), added by llama.cpp and Ollama; context: what clients read."""
    name = gguf_name(quant)
    finetuned = _kind(run_dir) != "pretrain"
    template = _template(run_dir) if finetuned else None
    ctx = context or model.config.max_seq_len
    gg.write_gguf(model, tok, folder / name, quant, name=run_dir.resolve().name, context=ctx, bos_id=bos,
                  add_bos=bos is not None,
                  chat_template=jinja_template(template, tok.eot, bos is not None) if template else None)
    # outside run folders: the export folder this call made, fresh
    (folder / gg.MODELFILE).write_text(gg.modelfile(
        name, tok, ctx, template=ollama_template(template) if template else None,
        stops=("### Instruction:",) if template else ()), encoding="utf-8")
    return name


def _context(run_dir: Path, context: int | None) -> int | None:
    """The context an export advertises: `context` when the user set one, else the trained one."""
    if context is not None and context < 1:
        raise ValueError(f"--context must be a positive number of tokens, got {context}")
    return context or trained_context(run_dir)


@dataclass(kw_only=True)
class ExportOptions(RunCheckpoint):
    """`tinygpt export`: each field is one of its options (core/options.py)."""
    out_dir: str = option(flag="OUT_DIR", help="a new or empty folder; nothing is overwritten")
    format: str = option("hf", choices=FORMATS, help="hf: config.json + model.safetensors + tokenizer; gguf: one "
                         ".gguf file + an Ollama Modelfile")
    quant: str = option("f16", choices=gg.QUANTS, help="GGUF only: the weights' type")
    context: int = option(0, help="the context clients are told (config.json, GGUF, Modelfile, card); 0: the one "
                          "the model was trained at (train.seq_len). More is your choice: positions past the "
                          "trained context were never trained")

    def run(self) -> Path:
        out = export(self.run_dir, self.out_dir, self.format, self.quant, self.which, context=self.context or None)
        if self.format == "gguf" and self.quant == "q8_0":
            print(f"note: {AMX_NOTE}", file=sys.stderr)
        return out


def export(run_dir: str | Path, out_dir: str | Path, fmt: str = "hf", quant: str = "f16",
           which: str = "latest", *, context: int | None = None) -> Path:
    """A run (pretraining, or finetuning merged) as a new folder at `out_dir`: Hugging Face files
    (`hf`) or a GGUF with its Modelfile (`gguf`), with a model card either way. context: the context clients
    are told (the trained one, `trained_context`, when None)."""
    run_dir = Path(run_dir)
    check_format(fmt, quant)
    out = check_export_target(out_dir)
    kind = _kind(run_dir)
    ctx = _context(run_dir, context)
    if kind == "finetune":
        _adapter_dir(run_dir)  # no adapter yet: say so before merging anything
    if fmt == "hf" and kind != "pretrain":
        with atomic_output(out, folder=True) as tmp:
            if kind == "finetune":
                merge_adapter(run_dir, tmp)
            else:
                _move_up(export_full(run_dir, which, tmp / FULL_MODEL_DIR))
                (tmp / ADAPTER_INFO).unlink(missing_ok=True)  # this machine's paths: not for a shared folder
            bos = prompt_start(tmp)
            eot = from_pretrained("AutoTokenizer", tmp).eos_token
            set_prompt_format(tmp, bos_id=bos, chat_template=jinja_template(_template(run_dir), eot, bos is not None),
                              context=ctx)
            # outside run folders: atomic_output's fresh temporary
            (tmp / CARD).write_text(model_card(run_dir, hf=True, gguf_file=None, which=which, context=context),
                                    encoding="utf-8")
        return out
    model, tok, bos = _load(run_dir, which)
    if fmt == "hf":
        with atomic_output(out, folder=True) as tmp:
            _move_up(export_model(model, tok, tmp / "hf", context=ctx))
            # outside run folders: atomic_output's fresh temporary
            (tmp / CARD).write_text(model_card(run_dir, hf=True, gguf_file=None, which=which, context=context),
                                    encoding="utf-8")
        return out
    gg.tokenizer_tables(tok, model.config.vocab_size)  # a tokenizer llama.cpp would split otherwise: refused now
    with atomic_output(out, folder=True) as tmp:
        name = _write_gguf(run_dir, model, tok, tmp, quant, bos, ctx)
        # outside run folders: atomic_output's fresh temporary
        (tmp / CARD).write_text(model_card(run_dir, hf=False, gguf_file=name, which=which, context=context),
                                encoding="utf-8")
    return out


def _move_up(folder: Path) -> None:
    """The files of `folder` into its parent, and the folder gone."""
    for p in folder.iterdir():
        p.rename(folder.parent / p.name)
    folder.rmdir()


def upload_folder(run_dir: str | Path, out_dir: str | Path, repo_id: str, *, gguf: str | None = "q8_0",
                  which: str = "latest") -> Path:
    """The folder `push` uploads: the Hugging Face files, a GGUF (`gguf` quantization; None for none) with
    its Modelfile, and one card for both."""
    run_dir = Path(run_dir)
    check_format("hf", gguf or "f16")
    hf_out = export(run_dir, out_dir, "hf", which=which)
    name = None
    if gguf:
        model, tok, bos = _load(run_dir, which)
        name = _write_gguf(run_dir, model, tok, hf_out, gguf, bos, _context(run_dir, None))
    # outside run folders: the export folder this call made, fresh
    (hf_out / CARD).write_text(model_card(run_dir, hf=True, gguf_file=name, repo_id=repo_id, which=which),
                               encoding="utf-8")
    return hf_out


# --- the Hub ----------------------------------------------------------------------------------

class PushError(RuntimeError):
    """A push that cannot start or finish: the message says what to do."""


def hub_token() -> str | None:
    """HF_TOKEN from the environment, else from Colab's secrets (the key icon in Colab's side bar)."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        return token
    try:
        from google.colab import userdata
    except ImportError:
        return None
    try:
        return userdata.get("HF_TOKEN")
    except Exception:  # not added, or this notebook not granted access: both mean "no token"
        return None


@dataclass(kw_only=True)
class PushOptions(RunCheckpoint):
    """`tinygpt push`: each field is one of its options (core/options.py)."""
    repo_id: str = option(flag="REPO_ID", help="USER/NAME or ORG/NAME (created if it does not exist)")
    private: bool = option(False, help="create the repository private")
    gguf: str = option("q8_0", choices=(*gg.QUANTS, "none"),
                       help="also upload a GGUF of this type, for `ollama run hf.co/REPO_ID`")

    def run(self) -> str:
        return push(self.run_dir, self.repo_id, private=self.private, gguf=None if self.gguf == "none" else self.gguf,
                    which=self.which)


def push(run_dir: str | Path, repo_id: str, *, token: str | None = None, private: bool = False,
         gguf: str | None = "q8_0", which: str = "latest") -> str:
    """Upload `upload_folder`'s folder to the Hub repository `repo_id` (created if needed); returns its URL.
    The token and the Hub are checked first, so a missing token or no network costs no export."""
    if "/" not in repo_id or repo_id.count("/") != 1:
        raise PushError(f"repository {repo_id!r} is not USER/NAME (or ORG/NAME), e.g. alice/tinygpt-124m")
    _kind(Path(run_dir))
    if gguf:
        gg.check_quant(gguf)
    token = token or hub_token()
    if not token:
        raise PushError("no Hugging Face token: set HF_TOKEN to a write token from "
                        "https://huggingface.co/settings/tokens (in Colab: add a secret named HF_TOKEN)")
    try:
        from huggingface_hub import HfApi
    except ImportError as e:
        raise PushError("pushing needs huggingface_hub: pip install huggingface_hub") from e
    api = HfApi(token=token)
    try:
        user = api.whoami()["name"]
    except Exception as e:
        raise PushError(f"could not sign in to the Hugging Face Hub ({_short(e)}); check the network and that "
                        "HF_TOKEN is a valid write token") from e
    with tempfile.TemporaryDirectory(prefix="tinygpt-push-") as tmp:
        folder = upload_folder(run_dir, Path(tmp) / "upload", repo_id, gguf=gguf, which=which)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            api.upload_folder(folder_path=str(folder), repo_id=repo_id,
                              commit_message=f"tinygpt push of {Path(run_dir).resolve().name} by {user}")
        except Exception as e:
            raise PushError(f"the upload to {repo_id} failed ({_short(e)}); run the same command again") from e
    return f"https://huggingface.co/{repo_id}"


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


__all__ = ["FORMATS", "PushError", "card_facts", "export", "hub_token", "model_card", "push", "read_evals",
           "upload_folder"]
