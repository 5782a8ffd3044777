"""GGUF export (llama.cpp, Ollama): a tinygpt model and its byte-level BPE as one `.gguf` file,
written with `gguf`, llama.cpp's own Python writer.

Invariants:
- The architecture is llama.cpp's `llama`, or `qwen3` for a model with QK-norm
  (`ModelConfig.family`, the same two that `model.hf` exports to transformers); tensor names come
  from gguf's own `TensorNameMap`, the metadata from the config's fields (`ModelConfig.to_gguf`). An
  option llama.cpp's architecture cannot load (declared on its field: `ModelConfig.export_gaps`) is
  refused before anything is written.
- llama.cpp's `llama` applies RoPE to adjacent pairs, tinygpt (like transformers) to the two halves
  of each head; q_proj and k_proj rows (and biases) are permuted here exactly as llama.cpp's
  `convert_hf_to_gguf.py` does, so the attention scores are the same. `qwen3` uses the halves
  itself: nothing is permuted.
- The tokenizer is stored as llama.cpp's `gpt2` BPE: tokens in id order (padded with unused
  `[PAD<i>]` entries up to the model's vocabulary, which llama.cpp requires), the merges in rank
  order, and the pre-tokenizer `gpt-2`, whose split pattern is the one `tokenizers`' ByteLevel
  pre-tokenizer uses (`smollm` for SmolLM's single digits before it, so that runs continued from
  SmolLM export too). `check_tokenizer` refuses a tokenizer llama.cpp would split differently
  (another pre-tokenizer, a normalizer, byte fallback...) rather than writing a file that tokenizes
  otherwise.
- End-of-text is eos, and llama.cpp stops on it. A pretrained run's GGUF adds no
  beginning-of-sequence token (`tinygpt generate` continues a prompt as it is); a finetune's adds
  the one its training prompts began with (`bos_id`, `add_bos`: end-of-text for a tinygpt base), so
  llama.cpp and Ollama start a prompt as training did.
- `context_length` is the context the run was trained at (`context`), not the size of its position
  tables.
- Quantization goes through `gguf.quants`: f32, f16, bf16 and q8_0. Like llama.cpp's converter, 1-D
  tensors (norms, biases) stay f32 and a matrix whose rows are not a whole number of blocks stays
  f16."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinygpt.core.checkpoint import model_state
from tinygpt.core.config import ModelConfig
from tinygpt.core.files import atomic_output
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import Tokenizer

QUANTS = ("f32", "f16", "bf16", "q8_0")
PRE_TOKENIZER = "gpt-2"  # llama.cpp's name for GPT-2's split pattern (ByteLevel with use_regex)
GGUF_FILE = "model.gguf"
MODELFILE = "Modelfile"


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError(
            "GGUF export needs the gguf package: pip install 'tinygpt[export]' (or pip install "
            "gguf)"
        ) from e
    return gguf


def check_quant(quant: str) -> str:
    if quant not in QUANTS:
        raise ValueError(
            f"unknown GGUF quantization {quant!r}; choose one of {', '.join(QUANTS)} (for "
            "q4/q5/k-quants, run llama.cpp's llama-quantize on the f16 file)"
        )
    return quant


def check_architecture(config: ModelConfig) -> ModelConfig:
    """`config`, checked: llama.cpp's architecture of its family loads every option it has on."""
    config.check_exports("gguf")
    return config


# --- tokenizer --------------------------------------------------------------------------------
def _byte_level(pre: dict[str, Any]) -> bool:
    return (
        pre.get("type") == "ByteLevel"
        and not pre.get("add_prefix_space")
        and pre.get("use_regex", True)
    )


def pre_tokenizer_name(pre: dict[str, Any] | None) -> str | None:
    """llama.cpp's name for a `tokenizers` pre-tokenizer it splits identically: `gpt-2` for the
    ByteLevel pre-tokenizer (tinygpt's, GPT-2's), `smollm` for single digits first, then ByteLevel
    (SmolLM's); else None."""
    pre = pre or {}
    if _byte_level(pre):
        return PRE_TOKENIZER
    parts = pre.get("pretokenizers") or []
    if (
        pre.get("type") == "Sequence"
        and len(parts) == 2
        and parts[0] == {"type": "Digits", "individual_digits": True}
        and _byte_level(parts[1])
    ):
        return "smollm"
    return None


def check_tokenizer(tokenizer: Tokenizer) -> dict[str, Any]:
    """The tokenizer's JSON, checked: llama.cpp's `gpt2` BPE with the pre-tokenizer
    `pre_tokenizer_name` splits and merges as it does; else a ValueError naming what differs."""
    spec = json.loads(tokenizer.to_json())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    problems = []
    if model.get("type") != "BPE":
        problems.append(f"model {model.get('type')}, not BPE")
    if spec.get("normalizer"):
        problems.append(f"a {spec['normalizer'].get('type')} normalizer")
    if pre_tokenizer_name(pre) is None:
        problems.append(f"pre-tokenizer {json.dumps(pre, sort_keys=True)}")
    for key in (
        "byte_fallback",
        "ignore_merges",
        "dropout",
        "continuing_subword_prefix",
        "end_of_word_suffix",
    ):
        if model.get(key):
            problems.append(f"BPE {key}={model[key]!r}")
    if problems:
        raise ValueError(
            f"this tokenizer does not tokenize as llama.cpp's GPT-2 BPE ({'; '.join(problems)}); "
            "export to Hugging Face format instead (tinygpt export RUN OUT) and convert it with "
            "llama.cpp's convert_hf_to_gguf.py"
        )
    return spec


def tokenizer_tables(tokenizer: Tokenizer, n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens in id order padded to `n_vocab`, their llama.cpp types, merges "a b" by rank)."""
    gguf = _gguf()
    spec = check_tokenizer(tokenizer)
    vocab = tokenizer.tok.get_vocab(with_added_tokens=True)
    if len(vocab) > n_vocab or sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(
            f"the tokenizer's {len(vocab)} ids are not 0..{len(vocab) - 1} within the model's "
            f"vocabulary of {n_vocab}"
        )
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    types = [
        (gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        if i in added
        else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    pad = n_vocab - len(tokens)  # the model's rows past the tokenizer (vocabulary padded for speed)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [gguf.TokenType.UNUSED] * pad
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    return tokens, [int(t) for t in types], merges


# --- weights ----------------------------------------------------------------------------------
def _rope_pairs(w: np.ndarray, n_head: int) -> np.ndarray:
    """q/k rows from rotate-half order (transformers, tinygpt) to llama.cpp's adjacent pairs; the
    same permutation as convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(model: GPT) -> dict[str, np.ndarray]:
    """The model's weights (and biases) under llama.cpp's names, as float32 arrays (q/k rows
    permuted where the family's llama.cpp architecture rotates adjacent pairs)."""
    gguf = _gguf()
    config, family = model.config, model.config.family
    arch = family.model_type  # llama.cpp's architecture of the same name
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.n_layer
    )
    out = {}
    for key, t in model_state(model).items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no llama.cpp tensor for {key!r} in architecture {arch}")
        w = t.to(torch.float32).numpy()
        if family.rope_pairs and key.endswith(
            ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
        ):
            heads = config.n_head if "q_proj" in key else config.n_kv_head or config.n_head
            w = _rope_pairs(w, heads)
        out[name] = w
    return out


def _encode(gguf: Any, name: str, w: np.ndarray, quant: str) -> tuple[np.ndarray, Any]:
    """(data, ggml type) of a tensor in `quant`; as the converter: norms f32, odd rows f16."""
    Q = gguf.GGMLQuantizationType
    if quant == "f32" or w.ndim == 1:
        return w.astype(np.float32), Q.F32
    if quant == "f16":
        return w.astype(np.float16), Q.F16
    qtype = {"bf16": Q.BF16, "q8_0": Q.Q8_0}[quant]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if w.shape[-1] % block:
        return w.astype(np.float16), Q.F16
    return gguf.quants.quantize(w, qtype), qtype


_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


def write_gguf(
    model: GPT,
    tokenizer: Tokenizer,
    path: str | Path,
    quant: str = "f16",
    *,
    name: str = "tinygpt",
    chat_template: str | None = None,
    context: int | None = None,
    bos_id: int | None = None,
    add_bos: bool = False,
) -> Path:
    """Write `model` and `tokenizer` as one GGUF file at `path` (written beside it and renamed into
    place). chat_template: a Jinja template for llama.cpp's chat mode (a finetuned run's prompt
    format). context: the `context_length` clients read (the trained context; the model's
    max_seq_len when None). bos_id / add_bos: the token a prompt starts with, and whether llama.cpp
    adds it (end-of-text, not added, by default)."""
    gguf = _gguf()
    check_quant(quant)
    config = check_architecture(model.config)
    if context is not None and context < 1:
        raise ValueError(f"context must be a positive number of tokens, got {context}")
    # refused before anything is written
    tokens, types, merges = tokenizer_tables(tokenizer, config.vocab_size)
    tensors = gguf_tensors(model)
    path = Path(path)
    with atomic_output(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), config.family.model_type)
        w.add_name(name)
        w.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[quant]))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        meta = config.to_gguf()
        meta["context_length"] = context or config.max_seq_len
        for name, value in meta.items():  # gguf's own writer knows llama.cpp's key and type
            getattr(w, f"add_{name}")(value)
        w.add_tokenizer_model("gpt2")
        pre = json.loads(tokenizer.to_json()).get("pre_tokenizer")
        w.add_tokenizer_pre(pre_tokenizer_name(pre))
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokenizer.eot_id if bos_id is None else bos_id)
        w.add_eos_token_id(tokenizer.eot_id)
        w.add_pad_token_id(tokenizer.eot_id)
        w.add_add_bos_token(bool(add_bos))
        w.add_add_eos_token(False)
        if chat_template:
            w.add_chat_template(chat_template)
        for tname, t in tensors.items():
            data, qtype = _encode(gguf, tname, t, quant)
            w.add_tensor(tname, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path


# --- Ollama -----------------------------------------------------------------------------------
def modelfile(
    gguf_name: str,
    tokenizer: Tokenizer,
    context: int,
    *,
    template: str | None = None,
    stops: tuple[str, ...] = (),
    temperature: float = 0.8,
    top_k: int = 50,
) -> str:
    """An Ollama Modelfile for the GGUF beside it. template: Ollama's Go template of the prompt (a
    finetuned run's instruction format); without one the prompt is continued as it is, as `tinygpt
    generate` does. The context is the model's own (Ollama's default is longer than a small model
    was trained on), and the repeat penalty is off, as in tinygpt's sampling."""

    def q(s: str) -> str:
        return json.dumps(s)  # a Go-style quoted string: newlines and quotes escaped

    lines = [f"FROM ./{gguf_name}", "", f'TEMPLATE """{template or "{{ .Prompt }}"}"""', ""]
    for s in (tokenizer.eot, *stops):
        lines.append(f"PARAMETER stop {q(s)}")
    lines += [
        f"PARAMETER num_ctx {context}",
        f"PARAMETER temperature {temperature:g}",
        f"PARAMETER top_k {top_k}",
        "PARAMETER repeat_penalty 1",
        "",
    ]
    return "\n".join(lines)
