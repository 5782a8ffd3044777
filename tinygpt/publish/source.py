"""What a run is to an export: pretraining, a LoRA finetune (its adapter folded in) or a full
finetune; the context it was trained at (`trained_context`); the token its training prompts began
with (`prompt_start`) and its instruction format as Ollama and Jinja templates; its model loaded.

Invariant: a finetune's prompt format travels whole. The token its training prompts began with
(`Codec.bos_id`: end-of-text for a tinygpt base) is the one the exported tokenizer adds, and the
chat template (`jinja_template`, the Modelfile's TEMPLATE) renders a user turn exactly as
`model.prompts.format_prompt` does."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from tinygpt.core.checkpoint import STATE_FILE, find_run_checkpoint
from tinygpt.core.paths import is_hub
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import FULL_MODEL_DIR, MERGED_DIR, RunDir, missing_run_message
from tinygpt.finetune.full import export_full, is_full_finetune
from tinygpt.finetune.lora import merge_adapter
from tinygpt.finetune.presets import FinetuneError
from tinygpt.model.hf import from_pretrained
from tinygpt.model.hf_import import import_hf
from tinygpt.model.loading import load_run
from tinygpt.model.prompts import TEMPLATES, Codec


def run_kind(run_dir: Path) -> str:
    """ "pretrain", "finetune" (LoRA / QLoRA: an adapter to fold in) or "full" (full finetuning: a
    whole model)."""
    run = RunDir(run_dir)
    if is_full_finetune(run_dir):
        return "full"
    if run.is_finetune_run():
        return "finetune"
    if run.is_pretrain_run():
        return "pretrain"
    if not run_dir.exists():  # a mistyped path: the closest run folder, if any
        raise FileNotFoundError(missing_run_message(run_dir))
    raise FileNotFoundError(
        f"{run_dir} is neither a tinygpt run (run.json) nor a finetuning run (finetune.json); give "
        "the folder `tinygpt pretrain` or `tinygpt finetune` wrote"
    )


def run_template(run_dir: Path) -> str:
    return RunDir(run_dir).adapter_info().get("template") or "alpaca"


def prompt_start(folder: str | Path) -> int | None:
    """The token a finetune's training prompts began with (`Codec.bos_id` of the tokenizer it
    trained with, here the one in the merged model `folder`): end-of-text for a tinygpt base; None
    when none was put there."""
    return Codec(from_pretrained("AutoTokenizer", folder)).bos_id


def trained_context(run_dir: str | Path) -> int | None:
    """The context a run's model was trained at: a pretraining run's train.seq_len (its position
    tables, model.max_seq_len, may be longer: positions past seq_len were never trained); a finetune
    of a tinygpt base, the longer of the base's and the finetune's seq_len; None for a finetune of
    another base (its config.json's max_position_embeddings is the base's own)."""
    run = RunDir(run_dir)
    if run.is_pretrain_run():
        recipe = Recipe.from_dict(run.recipe_dict())
        return min(recipe.train.seq_len, recipe.model.max_seq_len)
    info = run.finetune_info() or {}
    base = info.get("base")
    if not (base and isinstance(base, str)) or is_hub(base) or not RunDir(base).is_pretrain_run():
        return None
    base_ctx, ft = trained_context(base), _finetune_seq_len(run.path, info)
    return max(base_ctx, ft) if isinstance(ft, int) and base_ctx else base_ctx


def _finetune_seq_len(run_dir: Path, info: dict[str, Any]) -> int | None:
    """The seq_len a finetune trained at: its newest checkpoint's training config (overrides
    included, read weights-only and memory-mapped), else its recipe's for its hardware."""
    try:
        import torch

        path = find_run_checkpoint(run_dir) / STATE_FILE
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        seq_len = (state.get("train_config") or {}).get("seq_len")
        if isinstance(seq_len, int):
            return seq_len
    except Exception:  # no checkpoint left, an older layout: the recipe's
        pass
    train = ((info.get("recipe") or {}).get("train") or {}).get(info.get("hardware"))
    return train.get("seq_len") if isinstance(train, dict) else None


def load_for_export(run_dir: Path, which: str):
    """(tinygpt GPT, tinygpt Tokenizer, prompt start) of a run; a finetune is merged and brought
    back through `import_hf`. The prompt start is the token a finetune's training prompts began with
    (`prompt_start`), None for a pretraining run (`tinygpt generate` continues a prompt as it
    is)."""
    kind = run_kind(run_dir)
    if kind == "pretrain":
        model, tok, _, _ = load_run(run_dir, which)
        return model, tok, None
    with tempfile.TemporaryDirectory(prefix="tinygpt-merge-") as tmp:
        if kind == "finetune":
            merged = merge_adapter(run_dir, Path(tmp) / MERGED_DIR)
        else:
            merged = export_full(run_dir, which, Path(tmp) / FULL_MODEL_DIR)
        bos = prompt_start(merged)
        try:
            model, tok = import_hf(merged)
        except ValueError as e:  # a base llama.cpp's llama/qwen3 would not be (Gemma, GPT-2...)
            raise FinetuneError(
                f"GGUF export of this finetune: {e}; export it with --format hf "
                "and convert that with llama.cpp's convert_hf_to_gguf.py"
            ) from e
    if tok is None:
        raise FinetuneError(
            f"the merged model of {run_dir} has no tokenizer.json; GGUF needs a fast tokenizer"
        )
    return model, tok, bos


# --- prompt formats ---------------------------------------------------------------------------

# ASCII whitespace as Python's str.strip() (so format_prompt) sees it, as byte values
_GO_SPACE = "9 10 11 12 13 28 29 30 31 32"


def _go_trim(src: str, dst: str, n: str) -> str:
    """Go template actions that set $dst to $src without leading and trailing ASCII whitespace:
    Ollama's templates have no trim function, so a loop over the bytes (range over an integer:
    Ollama 0.5.13 or later) finds the first and the end of the last non-space byte."""
    s, e, c = f"$s{n}", f"$e{n}", f"$c{n}"
    return (
        f"{{{{{s} := -1}}}}{{{{{e} := 0}}}}{{{{{c} := false}}}}{{{{range $i := len {src}}}}}"
        f"{{{{if {c}}}}}{{{{{e} = $i}}}}{{{{end}}}}"
        f"{{{{{c} = not (eq (index {src} $i) {_GO_SPACE})}}}}"
        f"{{{{if and {c} (lt {s} 0)}}}}{{{{{s} = $i}}}}{{{{end}}}}{{{{end}}}}"
        f"{{{{if {c}}}}}{{{{{e} = len {src}}}}}{{{{end}}}}"
        f"{{{{{dst} := slice {src} 0 0}}}}{{{{if ge {s} 0}}}}{{{{{dst} = slice {src} {s} {e}}}}}"
        "{{end}}"
    )


def ollama_template(template: str) -> str:
    """A finetuned run's instruction prompt as an Ollama Go template, both record forms. Ollama
    joins consecutive user messages with a blank line before its template sees them, so the first
    blank line of the prompt separates the instruction from the input (the chat convention: the
    input is a second user message); each is trimmed as `format_prompt` trims it, and an input
    that is empty after trimming gives the form without one. The token training put before the
    prompt is not in it: Ollama adds it, as the GGUF's add_bos_token says."""
    with_input, without = TEMPLATES[template]
    # $a: the prompt up to its first blank line, $b: from there on (the whole prompt and "")
    split = (
        "{{$p := .Prompt}}{{$a := $p}}{{$b := slice $p 0 0}}{{$nl := -1}}{{$cut := false}}"
        "{{range $i := len $p}}{{if not $cut}}{{if eq (index $p $i) 10}}"
        "{{if ge $nl 0}}{{$cut = true}}{{$a = slice $p 0 $nl}}{{$b = slice $p $i}}"
        "{{else}}{{$nl = $i}}{{end}}{{else}}{{$nl = -1}}{{end}}{{end}}{{end}}"
    )
    fill = {"instruction": "{{$inst}}", "input": "{{$input}}"}
    trims = _go_trim("$a", "$inst", "1") + _go_trim("$b", "$input", "2")
    forms = (with_input.format(**fill), without.format(instruction=fill["instruction"]))
    return split + trims + "{{if $input}}%s{{else}}%s{{end}}" % forms


def jinja_template(template: str, eot: str, bos: bool = False) -> str:
    """The same prompt as a Jinja chat template (transformers' `apply_chat_template`, llama.cpp's
    `--jinja` chat mode): `bos_token` first when training put one before the prompt (`bos`;
    llama.cpp drops it from the text when it adds the token itself), each user turn in the
    instruction format with its content as `format_prompt` puts it (trimmed), each answer followed
    by end-of-text, as the run was trained. A user message right after another one is the first
    one's input (Alpaca's "### Input:" form; an input empty after trimming gives the form without
    one)."""
    with_input, without = TEMPLATES[template]
    fill = {"instruction": "{{ message['content'] | trim }}", "input": "{{ inp }}"}
    return (
        ("{{ bos_token }}" if bos else "")
        + "{% for message in messages %}{% if message['role'] == 'user' %}{% if loop.first or "
        "messages[loop.index0 - 1]['role'] != 'user' %}{% set inp = '' %}{% if not loop.last and "
        "messages[loop.index0 + 1]['role'] == 'user' %}{% set inp = messages[loop.index0 + 1]"
        "['content'] | trim %}{% endif %}{% if inp %}"
        + with_input.format(**fill)
        + "{% else %}"
        + without.format(instruction=fill["instruction"])
        + "{% endif %}{% endif %}{% elif message['role'] == 'assistant' %}{{ message['content'] }}"
        + eot
        + "{% endif %}{% endfor %}"
    )
