"""Hugging Face format: export a tinygpt run to a `LlamaForCausalLM` folder (`Qwen3ForCausalLM` for
a model with QK-norm); the one way a Hugging Face folder reaches transformers (`from_pretrained`:
its own code never runs). Importing a Llama or Qwen3 folder as a GPT is `model.hf_import`.

tinygpt's parameter names are those of `LlamaForCausalLM`, so the weights move as they are; only
config.json and the tokenizer files are written here, config.json from the Hugging Face names that
`ModelConfig`'s fields carry (`to_hf_llama`, `from_hf_llama`, `family`). An exported folder loads
with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` and gives the
same logits and token ids as the run it came from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from tinygpt.core.checkpoint import model_state
from tinygpt.core.config import ModelConfig
from tinygpt.core.families import FAMILIES
from tinygpt.core.files import atomic_output, read_json_safe, write_json_atomic
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import Tokenizer, check_regexes, read_tokenizer_json


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("Hugging Face export needs transformers: pip install transformers") from e
    return transformers


# --- what tinygpt loads of a Hugging Face folder ------------------------------------------------
# A model folder is data: transformers runs its own code for it, never the folder's.
# The model types tinygpt loads through transformers (a finetuning base, `tinygpt eval`
# of a model folder): its own families (FAMILIES, which it exports and imports) and
# those finetuning trains (finetune.memory_plan's PLAIN_HEAD_TYPES and SOFTCAP_HEAD_TYPES, and
# GPT-2); each must also be one the installed transformers ships.
HF_MODEL_TYPES = frozenset(FAMILIES) | {"qwen2", "mistral", "gemma", "gemma2", "phi3", "gpt2"}


class UntrustedModel(ValueError):
    """A Hugging Face folder (or Hub model) tinygpt will not load: it names code of its own, or a
    model type tinygpt does not load. The message names the file and what to do."""


def check_hf_config(cfg: Any, where: str | Path) -> None:
    """Refuse (UntrustedModel, one line naming `where`) a config (config.json as read, or a
    transformers config) that names custom code (`auto_map`) or a model_type that is not in
    HF_MODEL_TYPES and transformers' own."""
    if not isinstance(cfg, dict) and not hasattr(cfg, "to_dict"):
        raise UntrustedModel(f"{where} is not a model config (a JSON object): refused")
    auto_map = getattr(cfg, "auto_map", None)  # of a transformers config: as its attribute says
    d = cfg if isinstance(cfg, dict) else {**cfg.to_dict(), "auto_map": auto_map}
    if d.get("auto_map"):
        raise UntrustedModel(
            f"{where} names code of its own (auto_map: {_code_names(d['auto_map'])}): refused "
            "before anything was loaded; tinygpt never runs a model folder's code, only the model "
            "code transformers ships: use a model whose model_type is one of "
            f"{', '.join(sorted(HF_MODEL_TYPES))} without auto_map (if its model_type is one of "
            "those, deleting auto_map from config.json and tokenizer_config.json is enough)"
        )
    kind = d.get("model_type")
    if (
        not isinstance(kind, str)
        or kind not in HF_MODEL_TYPES
        or kind not in _transformers().CONFIG_MAPPING
    ):
        what = f"model_type {kind!r}" if kind else "no model_type"
        raise UntrustedModel(
            f"{where} has {what}, not one tinygpt loads through transformers "
            f"({', '.join(sorted(HF_MODEL_TYPES))}): refused before anything was loaded; use a "
            "model of one of those families (or export it again)"
        )


def _code_names(auto_map: Any) -> str:
    names = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    flat = [n for v in names for n in (v if isinstance(v, (list, tuple)) else [v]) if n]
    text = ", ".join(map(str, flat)) or repr(auto_map)
    return text if len(text) <= 120 else text[:117] + "..."


def hf_file(folder: str | Path, name: str) -> Path:
    """folder/name as tinygpt reads it: that path, or in huggingface_hub's cache (a
    snapshots/REVISION/ folder, whose files link to ../../blobs/) the blob it links to. Any other
    link stays a link, which every reader refuses (`core.files.read_bytes_safe`)."""
    folder = Path(folder)
    p = folder / name
    if p.is_symlink() and folder.parent.name == "snapshots":
        blobs, target = os.path.realpath(folder.parent.parent / "blobs"), os.path.realpath(p)
        if os.path.commonpath([blobs, target]) == blobs:
            return Path(target)
    return p


def check_hf_folder(path: str | Path) -> None:
    """A local Hugging Face folder, checked before transformers sees it (nothing where `path` is not
    a folder: a Hub id is checked as its files arrive, `from_pretrained`): config.json (when there)
    by `check_hf_config`; tokenizer_config.json naming no code; tokenizer.json's regexes known
    (`tokenizer.check_regexes`). Each is read bounded and never through a link
    (`core.files.read_json_safe`); a refusal names the file."""
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        return
    config = folder / "config.json"
    if config.is_file() or config.is_symlink():
        check_hf_config(read_json_safe(hf_file(folder, "config.json")), config)
    tok_config = folder / "tokenizer_config.json"
    if tok_config.is_file() or tok_config.is_symlink():
        d = read_json_safe(hf_file(folder, "tokenizer_config.json"))
        if isinstance(d, dict) and d.get("auto_map"):
            raise UntrustedModel(
                f"{tok_config} names code of its own (auto_map: {_code_names(d['auto_map'])}): "
                "refused before anything was loaded; tinygpt never runs a model folder's code: "
                "delete auto_map there (the tokenizer.json beside it is what tinygpt reads), or "
                "use another model"
            )
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.json").is_symlink():
        read_tokenizer_json(hf_file(folder, "tokenizer.json"))


def from_pretrained(auto_class: str, path: str | Path, **kw: Any) -> Any:
    """`transformers.<auto_class>.from_pretrained(path, **kw)` (AutoConfig, AutoTokenizer,
    AutoModelForCausalLM), the one way tinygpt calls it: a local folder is checked first
    (`check_hf_folder`), the folder's own code is never run (trust_remote_code=False, so
    transformers neither asks nor imports it), a Hub model's config is checked before its weights or
    tokenizer load, and a tokenizer's regexes before it encodes anything."""
    tf = _transformers()
    check_hf_folder(path)
    kw["trust_remote_code"] = False
    # a Hub model: its config says what it is before any weights come
    if (
        auto_class not in ("AutoConfig", "AutoTokenizer")
        and not Path(str(path)).expanduser().is_dir()
    ):
        from_pretrained("AutoConfig", path)
    loaded = getattr(tf, auto_class).from_pretrained(str(path), **kw)
    if auto_class == "AutoConfig":
        check_hf_config(loaded, f"{path}'s config.json")
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is not None:
        check_regexes(backend.to_str(), f"{path}'s tokenizer")
    return loaded


def check_export_target(out_dir: str | Path) -> Path:
    """The target as a Path; refused unless new or an empty folder (nothing is overwritten)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"export target {out} already exists and is not empty; nothing was written. "
            "Choose a new folder, or delete this one first"
        )
    return out


def hf_llama_config(config: ModelConfig, eot_id: int | None = None) -> Any:
    """The `transformers` config of a tinygpt model config, of its family's class
    (`ModelConfig.family`: a `LlamaConfig`, or with QK-norm a `Qwen3Config`)."""
    tf = _transformers()
    family = config.family
    return getattr(tf, family.config_class)(
        **config.to_hf_llama(),
        architectures=[family.model_class],
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        torch_dtype="float32",
    )


def hf_tokenizer(tokenizer: Tokenizer, max_seq_len: int | None = None) -> Any:
    """A `PreTrainedTokenizerFast` around the same `tokenizers` object, with bos = eos = pad =
    end-of-text (it separates tinygpt's documents, so a prompt starts as a document does; batched
    finetuning and generation need a pad token, and end-of-text carries no loss there)."""
    tf = _transformers()
    kw = {"model_max_length": max_seq_len} if max_seq_len else {}
    kw.update(dict.fromkeys(("bos_token", "eos_token", "pad_token"), tokenizer.eot))
    return tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer.tok, **kw)


def _update_json(path: Path, **values: Any) -> None:
    # outside run folders: the export's temporary folder, which this process made and fills
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}, indent=2))


def export_model(
    model: GPT, tokenizer: Tokenizer | None, out_dir: str | Path, *, context: int | None = None
) -> Path:
    """Write `model` (and `tokenizer`) as a Hugging Face Llama folder at `out_dir` (new or empty).
    The folder is written beside the target and renamed into place, so a failure leaves nothing.
    context: the context clients read (config.json's max_position_embeddings, the tokenizer's
    model_max_length): the one the model was trained at; the model's max_seq_len when None."""
    out = check_export_target(out_dir)
    from safetensors.torch import save_file

    with atomic_output(out, folder=True) as tmp:  # a failure leaves nothing under the real name
        eot_id = tokenizer.eot_id if tokenizer is not None else None
        hf_llama_config(model.config, eot_id).save_pretrained(tmp)
        # transformers 5 keeps rope_theta under rope_parameters; 4.x reads it at the top level and
        # would silently fall back to 10000 without it. Both keys: both versions load one model.
        _update_json(
            tmp / "config.json",
            rope_theta=model.config.rope_theta,
            max_position_embeddings=context or model.config.max_seq_len,
        )
        save_file(model_state(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            hf_tokenizer(tokenizer, context or model.config.max_seq_len).save_pretrained(tmp)
            # transformers 5 writes its own class name;
            # "PreTrainedTokenizerFast" loads in 4.x and 5.x.
            _update_json(
                tmp / "tokenizer_config.json",
                tokenizer_class="PreTrainedTokenizerFast",
                add_bos_token=False,
                add_eos_token=False,
            )
            gen = {
                "bos_token_id": eot_id,
                "eos_token_id": eot_id,
                "transformers_version": _transformers().__version__,
            }
            write_json_atomic(tmp / "generation_config.json", gen)
        check_export_target(out)  # still free? (someone may have written there meanwhile)
    return out


def set_prompt_format(
    folder: str | Path,
    *,
    bos_id: int | None,
    chat_template: str | None = None,
    context: int | None = None,
) -> None:
    """Make an exported Hugging Face folder (written by this process) start every prompt as its
    training did: with token `bos_id` added by the tokenizer (tokenizer.json's post-processor, which
    transformers 4.x and 5.x and `tokenizers` all apply; `add_bos_token` in tokenizer_config.json,
    which converters such as llama.cpp's read; bos_token_id in config.json and
    generation_config.json), or with nothing added when `bos_id` is None. chat_template: the prompt
    format for `apply_chat_template`; context: the trained context (max_position_embeddings,
    model_max_length)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    folder = Path(folder)
    tj = folder / "tokenizer.json"
    tok = HFTokenizer.from_str(read_tokenizer_json(tj))
    bos = tok.id_to_token(bos_id) if bos_id is not None else None
    if bos_id is not None and bos is None:
        raise ValueError(f"token id {bos_id} is not in {tj}")
    adds = tok.encode("a").ids[:1] == [bos_id] if bos_id is not None else False
    if bos_id is not None and not adds:
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
        old = tok.post_processor
        tok.post_processor = processors.Sequence([old, template]) if old is not None else template
    # outside run folders: the export's temporary folder, which this process made and fills
    tj.write_text(tok.to_str(), encoding="utf-8")
    tc = {"add_bos_token": bos_id is not None, "add_eos_token": False}
    if bos is not None:
        tc["bos_token"] = bos
    if chat_template is not None:
        tc["chat_template"] = chat_template
        if (folder / "chat_template.jinja").is_file():  # transformers 5 reads this file first
            # outside run folders: the export's temporary folder, which this process made and fills
            (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    if context:
        tc["model_max_length"] = context
    _update_json(folder / "tokenizer_config.json", **tc)
    _update_json(
        folder / "config.json",
        bos_token_id=bos_id,
        **({"max_position_embeddings": context} if context else {}),
    )
    if (folder / "generation_config.json").is_file():
        _update_json(folder / "generation_config.json", bos_token_id=bos_id)


# --- a transformers model for evaluation ------------------------------------------------------
def load_hf_causal_lm(
    path: str | Path, device: str | torch.device = "cpu", **from_pretrained_kw: Any
) -> tuple[Any, Any]:
    """A transformers causal LM (eval mode) and its tokenizer from a folder or Hub name, for
    `tinygpt.evals` (an export, a merged finetune, any causal LM); the folder is checked first and
    its own code never runs (`from_pretrained`)."""
    check_hf_folder(path)  # the whole folder, tokenizer included, before any weights load
    model = from_pretrained("AutoModelForCausalLM", path, **from_pretrained_kw).to(device).eval()
    return model, from_pretrained("AutoTokenizer", path)
