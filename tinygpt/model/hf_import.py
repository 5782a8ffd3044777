"""Hugging Face format, the import side: a Llama or Qwen3 folder (or a Hub model, `hf:NAME`) read as
a tinygpt `GPT` with the same logits, and its `Tokenizer`.

A config.json the GPT cannot represent (another architecture, a Llama or Qwen3 feature it lacks) is
refused before any weights are read, naming each field (`representation_gaps`); every file is read
bounded and never through a link (`core.files.read_json_safe`, `hf_file`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import torch

from tinygpt.core.checkpoint import CheckpointError, load_model_state, load_safetensors
from tinygpt.core.config import MlpAct, ModelConfig
from tinygpt.core.families import FAMILIES
from tinygpt.core.files import read_json_safe, safe_name
from tinygpt.core.paths import hub_spec
from tinygpt.model.gpt import GPT, rope_tables
from tinygpt.model.hf import hf_file
from tinygpt.model.tokenizer import EOT, Tokenizer, _from_str, read_tokenizer_json

SAFETENSORS_INDEX = "model.safetensors.index.json"

# what a model family has that tinygpt's GPT lacks, said where its config.json names the family
FAMILY_DIFFERENCES = {
    "qwen2": "biases on q/k/v",
    "mistral": "sliding-window attention",
    "gemma": "GeGLU and scaled embeddings",
    "gemma2": "soft-capped logits and sliding windows",
    "phi3": "fused projections",
    "gpt2": "learned positions, LayerNorm and GELU",
}


def representation_gaps(cfg: dict[str, Any]) -> list[str]:
    """What in a Hugging Face `config.json` tinygpt's GPT cannot represent ([] when it can): another
    architecture, or a Llama / Qwen3 feature the GPT lacks, each naming the field and value."""
    arch = cfg.get("architectures") or []
    kind = cfg.get("model_type")
    family = (
        FAMILIES.get(kind)
        if kind
        else next((f for f in FAMILIES.values() if f.model_class in arch), None)
    )
    if family is None:
        what = kind or (arch[0] if arch else "an unknown model type")
        why = FAMILY_DIFFERENCES.get(kind or "")
        return [
            f"model_type {what!r}{f' ({why})' if why else ''}, not "
            f"{' or '.join(map(repr, FAMILIES))}"
        ]
    gaps = [
        (f"{key}={json.dumps(cfg[key])}" if isinstance(value, bool) else f"{key} {cfg[key]!r}")
        + f" ({why})"
        for key, (value, why) in family.hf_fixed.items()
        if cfg.get(key) is not None and cfg[key] != value
    ]
    if cfg.get("hidden_act", "silu") not in get_args(MlpAct):
        acts = " or ".join(get_args(MlpAct))
        gaps.append(f"hidden_act {cfg['hidden_act']!r} (tinygpt's MLP gates with {acts})")
    rope = cfg.get("rope_scaling") or {}
    rope_type = (
        rope.get("rope_type")
        or rope.get("type")
        or (cfg.get("rope_parameters") or {}).get("rope_type", "default")
    )
    if rope_type not in (None, "default"):
        gaps.append(f"RoPE scaling {rope_type!r} (tinygpt's attention does not implement it)")
    if family.model_type == "llama" and cfg.get("sliding_window"):
        gaps.append("sliding-window attention (tinygpt's attention is full)")
    if cfg.get("attention_dropout"):
        gaps.append(
            f"attention_dropout {cfg['attention_dropout']} (tinygpt trains without dropout)"
        )
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // heads if heads and hidden else None)
    if heads and hidden and head_dim * heads != hidden:
        gaps.append(
            f"head_dim {head_dim} x {heads} heads = {head_dim * heads}, not hidden_size {hidden} "
            "(tinygpt's heads split the hidden size)"
        )
    return gaps


def _check_llama(cfg: dict[str, Any], path: Path | str) -> None:
    gaps = representation_gaps(cfg)
    if gaps:
        raise ValueError(
            f"{path} holds a model tinygpt's GPT cannot represent: {'; '.join(gaps)}. tinygpt "
            "imports Llama-architecture models (model_type 'llama', or 'qwen3') without these"
        )


# What continued pretraining needs of a Hub model: config and tokenizer first (checked before any
# download of weights), then the weights.
HUB_META_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
HUB_WEIGHT_FILES = ("*.safetensors", SAFETENSORS_INDEX)


def hub_model_folder(spec: str, weights: bool = True) -> Path:
    """The local folder of a Hub model written ``hf:NAME[@REVISION]``: its files in the Hugging Face
    cache, downloaded there once through `huggingface_hub` (offline, HF_HUB_OFFLINE=1, the cached
    copy serves). weights=False fetches config and tokenizer only."""
    name, config, revision = hub_spec(spec)
    if config is not None:
        raise ValueError(f"{spec!r}: a model is written hf:NAME[@REVISION], with no :CONFIG")
    try:
        from huggingface_hub import snapshot_download

        files = HUB_META_FILES + (HUB_WEIGHT_FILES if weights else ())
        return Path(snapshot_download(name, revision=revision, allow_patterns=list(files)))
    except Exception as e:  # not found, gated, offline: the user's to fix, in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"could not get model {name!r} from the Hugging Face Hub ({type(e).__name__}: "
            f"{first}); check the name and the network (gated models need `hf auth login`), or "
            "give a local model folder"
        ) from None


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face folder but RoPE's inv_freq (which older exports saved, and the
    GPT computes): model.safetensors or shards listed in its index, each header checked before the
    library reads it (`load_safetensors`: a bad one is named), each shard's name a plain file name
    of the folder (an index is anyone's: "../x" would read outside it)."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        sd = load_safetensors(hf_file(path, "model.safetensors"))
    elif (path / SAFETENSORS_INDEX).is_file():
        index = read_json_safe(hf_file(path, SAFETENSORS_INDEX))
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{path / SAFETENSORS_INDEX} has no weight_map: save the model again")
        sd = {}
        for shard in sorted(set(map(str, index["weight_map"].values()))):
            name = safe_name(shard, path / SAFETENSORS_INDEX, plain=True)
            sd.update(load_safetensors(hf_file(path, name)))
    else:
        raise FileNotFoundError(
            f"{path} has no model.safetensors or {SAFETENSORS_INDEX}; if it holds "
            "pytorch_model.bin, load it with transformers and save_pretrained() it again "
            "(safetensors is the default)"
        )
    return {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}


def import_hf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> tuple[GPT, Tokenizer | None]:
    """A tinygpt `GPT` (same logits) and its tokenizer (None without a tokenizer.json) from a
    Hugging Face Llama folder, e.g. to continue training. `max_seq_len` caps the RoPE tables of a
    long-context model to what you will train on."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face model folder?")
    hf_cfg = read_json_safe(hf_file(path, "config.json"))
    if not isinstance(hf_cfg, dict):
        raise ValueError(f"{path / 'config.json'} is not a model config (a JSON object)")
    _check_llama(hf_cfg, path)
    config = ModelConfig.from_hf_llama(hf_cfg)
    if max_seq_len:
        config.max_seq_len = max_seq_len
    model = gpt_from_state(config, read_hf_state_dict(path), device, f"{path}'s config.json")
    model = model.to(dtype=dtype).eval()
    return model, import_tokenizer(path)


def gpt_from_state(
    config: ModelConfig,
    sd: dict[str, torch.Tensor],
    device: str | torch.device = "cpu",
    what: str = "the config",
) -> GPT:
    """A GPT of `config` holding the weights `sd` (Hugging Face names), built without a random
    initialisation of weights that are about to be replaced; a ValueError when they do not fit."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    # the RoPE tables are buffers that no state dict
    # holds: to_empty left them as uninitialised memory
    model.rope_cos, model.rope_sin = rope_tables(config, device=device)
    try:
        load_model_state(model, sd)
    except CheckpointError as e:
        raise ValueError(f"the weights do not fit {what}: {e}") from e
    if config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def import_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face model folder (its tokenizer.json through `tokenizers`,
    end-of-text = the model's eos token); None without a tokenizer.json. Every file is read bounded
    and never through a link, and a tokenizer.json whose regexes are not known ones is refused
    (`tokenizer.read_tokenizer_json`)."""
    path = Path(path)
    hf_cfg = read_json_safe(hf_file(path, "config.json"))
    if not isinstance(hf_cfg, dict):
        raise ValueError(f"{path / 'config.json'} is not a model config (a JSON object)")
    if not (path / "tokenizer.json").is_file():
        return None
    tok = _from_str(read_tokenizer_json(hf_file(path, "tokenizer.json")), path / "tokenizer.json")
    eos = hf_cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    names = [tok.id_to_token(eos)] if isinstance(eos, int) else []
    for f in ("tokenizer_config.json", "special_tokens_map.json"):
        if (path / f).is_file():
            d = read_json_safe(hf_file(path, f))
            v = d.get("eos_token") if isinstance(d, dict) else None
            names.append(v.get("content") if isinstance(v, dict) else v)
    for name in [n for n in names if n and isinstance(n, str)] + [EOT]:
        if tok.token_to_id(name) is not None:
            return Tokenizer(tok, name)
    return None
