"""`tinygpt export`: a run as a new folder of Hugging Face files or a GGUF with its Ollama
`Modelfile`, with a model card (card.py) either way; and the folder `push` uploads.

Invariants:
- `export` takes a pretraining run or a finetuning run (its adapter folded into the base first) and
  writes a new folder atomically: nothing under the target name until everything is written. Bad
  input (target taken, unknown format or quantization, no checkpoint) is refused before any model
  loads.
- Every export folder has a `README.md` model card, and a GGUF export has an Ollama `Modelfile`.
- Every context a client reads (config.json's max_position_embeddings, the tokenizer's
  model_max_length, the GGUF's context_length, the Modelfile's num_ctx, the card) is the one the
  model was trained at (`trained_context`), unless the user asks for another (`--context`).
- A finetune's prompt format travels whole (source.py): config.json, tokenizer_config.json,
  tokenizer.json and the GGUF agree on the token its prompts begin with.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinygpt.core.checkpoint import RunCheckpoint
from tinygpt.core.files import atomic_output
from tinygpt.core.options import option
from tinygpt.core.rundir import ADAPTER_INFO, FULL_MODEL_DIR
from tinygpt.finetune.full import export_full
from tinygpt.finetune.lora import adapter_folder, merge_adapter
from tinygpt.model import gguf as gg
from tinygpt.model.hf import check_export_target, export_model, from_pretrained, set_prompt_format
from tinygpt.publish.card import AMX_NOTE, CARD, model_card
from tinygpt.publish.source import (
    jinja_template,
    load_for_export,
    ollama_template,
    prompt_start,
    run_kind,
    run_template,
    trained_context,
)

FORMATS = ("hf", "gguf")


def gguf_name(quant: str) -> str:
    """The GGUF file's name: the quantization in it, as Ollama's `hf.co/USER/REPO:Q8_0` tags
    expect."""
    return f"model-{quant.upper()}.gguf"


def check_format(fmt: str, quant: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    gg.check_quant(quant)


def _write_gguf(
    run_dir: Path, model: Any, tok: Any, folder: Path, quant: str, bos: int | None, ctx: int | None
) -> str:
    """The GGUF and its Modelfile into `folder`; returns the GGUF's name. bos: the token a
    finetune's training prompts began with (`prompt_start`), added by llama.cpp and Ollama; ctx:
    the context clients read (None: the model's)."""
    name = gguf_name(quant)
    template = run_template(run_dir) if run_kind(run_dir) != "pretrain" else None
    ctx = ctx or model.config.max_seq_len
    chat = jinja_template(template, tok.eot, bos is not None) if template else None
    gg.write_gguf(
        model,
        tok,
        folder / name,
        quant,
        name=run_dir.resolve().name,
        context=ctx,
        bos_id=bos,
        add_bos=bos is not None,
        chat_template=chat,
    )
    ollama = ollama_template(template) if template else None
    stops = ("### Instruction:",) if template else ()
    modelfile = gg.modelfile(name, tok, ctx, template=ollama, stops=stops)
    # outside run folders: the export folder this call made, fresh
    (folder / gg.MODELFILE).write_text(modelfile, encoding="utf-8")
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
    format: str = option(
        "hf",
        choices=FORMATS,
        help="hf: config.json + model.safetensors + "
        "tokenizer; gguf: one .gguf file + an Ollama Modelfile",
    )
    quant: str = option("f16", choices=gg.QUANTS, help="GGUF only: the weights' type")
    context: int = option(
        0,
        help="the context clients are told (config.json, GGUF, Modelfile, "
        "card); 0: the one the model was trained at (train.seq_len). More is "
        "your choice: positions past the trained context were never trained",
    )

    def run(self) -> Path:
        context = self.context or None
        out = export(
            self.run_dir, self.out_dir, self.format, self.quant, self.which, context=context
        )
        if self.format == "gguf" and self.quant == "q8_0":
            print(f"note: {AMX_NOTE}", file=sys.stderr)
        return out


def export(
    run_dir: str | Path,
    out_dir: str | Path,
    fmt: str = "hf",
    quant: str = "f16",
    which: str = "latest",
    *,
    context: int | None = None,
) -> Path:
    """A run (pretraining, or finetuning merged) as a new folder at `out_dir`: Hugging Face files
    (`hf`) or a GGUF with its Modelfile (`gguf`), with a model card either way. context: the context
    clients are told (the trained one, `trained_context`, when None)."""
    run_dir = Path(run_dir)
    check_format(fmt, quant)
    out = check_export_target(out_dir)
    kind = run_kind(run_dir)
    ctx = _context(run_dir, context)
    if kind == "finetune":
        adapter_folder(run_dir)  # no adapter yet: say so before merging anything
    if fmt == "hf" and kind != "pretrain":
        with atomic_output(out, folder=True) as tmp:
            if kind == "finetune":
                merge_adapter(run_dir, tmp)
            else:
                _move_up(export_full(run_dir, which, tmp / FULL_MODEL_DIR))
                # this machine's paths: not for a shared folder
                (tmp / ADAPTER_INFO).unlink(missing_ok=True)
            bos = prompt_start(tmp)
            eot = from_pretrained("AutoTokenizer", tmp).eos_token
            chat = jinja_template(run_template(run_dir), eot, bos is not None)
            set_prompt_format(tmp, bos_id=bos, chat_template=chat, context=ctx)
            _write_card(tmp, run_dir, hf=True, gguf_file=None, which=which, context=context)
        return out
    model, tok, bos = load_for_export(run_dir, which)
    if fmt == "hf":
        with atomic_output(out, folder=True) as tmp:
            _move_up(export_model(model, tok, tmp / "hf", context=ctx))
            _write_card(tmp, run_dir, hf=True, gguf_file=None, which=which, context=context)
        return out
    # a tokenizer llama.cpp would split otherwise: refused now
    gg.tokenizer_tables(tok, model.config.vocab_size)
    with atomic_output(out, folder=True) as tmp:
        name = _write_gguf(run_dir, model, tok, tmp, quant, bos, ctx)
        _write_card(tmp, run_dir, hf=False, gguf_file=name, which=which, context=context)
    return out


def _write_card(folder: Path, run_dir: Path, **card: Any) -> None:
    """The model card (`model_card(run_dir, **card)`) into `folder`: an export folder this call
    made, fresh (atomic_output's temporary), never a run folder."""
    # outside run folders: atomic_output's fresh temporary
    (folder / CARD).write_text(model_card(run_dir, **card), encoding="utf-8")


def _move_up(folder: Path) -> None:
    """The files of `folder` into its parent, and the folder gone."""
    for p in folder.iterdir():
        p.rename(folder.parent / p.name)
    folder.rmdir()


def upload_folder(
    run_dir: str | Path,
    out_dir: str | Path,
    repo_id: str,
    *,
    gguf: str | None = "q8_0",
    which: str = "latest",
) -> Path:
    """The folder `push` uploads: the Hugging Face files, a GGUF (`gguf` quantization; None for
    none) with its Modelfile, and one card for both."""
    run_dir = Path(run_dir)
    check_format("hf", gguf or "f16")
    hf_out = export(run_dir, out_dir, "hf", which=which)
    name = None
    if gguf:
        model, tok, bos = load_for_export(run_dir, which)
        name = _write_gguf(run_dir, model, tok, hf_out, gguf, bos, _context(run_dir, None))
    _write_card(hf_out, run_dir, hf=True, gguf_file=name, repo_id=repo_id, which=which)
    return hf_out
