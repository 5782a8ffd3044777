"""LoRA and QLoRA adapters through `peft` and `bitsandbytes`: the base loaded (in 4-bit NF4 for
QLoRA), adapters attached, their weights in and out of checkpoints, an adapter folder exported and
checked, and a finetuned model loaded back, or merged into its base.

Every base is a `transformers` causal LM. A tinygpt run folder is first exported to
``run_dir/base/`` as a `LlamaForCausalLM` (tinygpt already uses Llama's parameter names, so the
state_dict moves over unchanged and the logits are identical): one code path then serves tinygpt and
Hub models alike, QLoRA loads it through `BitsAndBytesConfig`, and the adapter that comes out is a
plain PEFT adapter whose `base_model_name_or_path` is a folder any `transformers` user can load.

The run that trains the adapters, and full finetuning, are `finetune.run_finetune`'s.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors

from tinygpt.core.checkpoint import (
    MANIFEST,
    MODEL_FILE,
    find_run_checkpoint,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from tinygpt.core.files import FileTooLarge, UnsafePathError, atomic_output, write_json_atomic
from tinygpt.core.rundir import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_INFO,
    BASE_DIR,
    FULL_MODEL_DIR,
    MERGED_DIR,
    RunDir,
    read_json,
)
from tinygpt.finetune.loss import inner_model
from tinygpt.finetune.memory_plan import base_config, is_tinygpt_run
from tinygpt.finetune.presets import FinetuneError, LoraSettings, require_package
from tinygpt.model.attention import hf_attention
from tinygpt.model.hf import UntrustedModel, export_model, from_pretrained
from tinygpt.model.loading import load_run
from tinygpt.model.tokenizer import UnsafeTokenizer

ADAPTER_WEIGHTS = "adapter_model.safetensors"


# ----- base models --------------------------------------------------------------------------------
@contextlib.contextmanager
def _peft_on_transformers_5():
    """PEFT reads `model.is_gradient_checkpointing`, which transformers 5 deprecates with a
    FutureWarning on every finetune; the user can do nothing about it, so it is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        yield


def export_tinygpt_base(run_dir: str | Path, out_dir: str | Path, which: str = "latest") -> Path:
    """A tinygpt run's model as a `LlamaForCausalLM` folder, through the one exporter (`model.hf`),
    atomically (a folder that exists is complete), tinygpt_source.json naming the checkpoint."""
    model, tok, _, ckpt = load_run(run_dir, which)
    out = export_model(model, tok, out_dir)
    source = {"run_dir": str(Path(run_dir).resolve()), "checkpoint": str(ckpt)}
    write_json_atomic(out / "tinygpt_source.json", source)
    return out


def _bnb_config(compute_dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def _cpu_safe_4bit(model: torch.nn.Module) -> None:
    """On CPUs with AVX512-BF16, bitsandbytes 0.50 repacks a 4-bit weight in place the first time it
    runs in eval mode (e.g. a validation pass), with bf16 scales and a kernel that has no backward:
    outputs shift and later gradients through the layer are wrong. Keep the standard layout."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def load_tokenizer(path: str):
    """A base's (or an adapter's) tokenizer through transformers, its folder checked first and its
    own code never run (`model.hf.from_pretrained`)."""
    require_package("transformers", "finetuning")
    try:
        return from_pretrained("AutoTokenizer", path)
    except (UntrustedModel, UnsafeTokenizer, UnsafePathError, FileTooLarge):
        raise  # one line that names the file already
    except Exception as e:
        raise FinetuneError(f"could not load the tokenizer of base {path!r}: {e}") from e


def load_base(
    path: str,
    *,
    quantize: str = "none",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
):
    """A Hugging Face causal LM from a local folder or a Hub id, optionally in 4-bit NF4; its folder
    checked first and its own code never run (`base_config`, `model.hf.from_pretrained`). On a GPU
    packed records are kept apart by FlexAttention (`hf_attention`)."""
    config = base_config(path)
    flex = torch.device(device).type == "cuda"
    try:
        kw: dict[str, Any] = {"dtype": dtype, "attn_implementation": hf_attention(config, flex)}
        if quantize == "nf4":
            dev = torch.device(device)
            on = (
                torch.cuda.current_device()
                if dev.type == "cuda" and dev.index is None
                else (dev.index if dev.type == "cuda" else dev.type)
            )
            # quantized as it loads, straight onto the device
            kw.update(quantization_config=_bnb_config(dtype), device_map={"": on})
        model = from_pretrained("AutoModelForCausalLM", path, **kw)
    except (UntrustedModel, UnsafeTokenizer, UnsafePathError, FileTooLarge):
        raise  # one line that names the file already
    except Exception as e:
        raise FinetuneError(f"could not load base model {path!r}: {type(e).__name__}: {e}") from e
    if quantize == "nf4":
        model.is_loaded_in_4bit = True  # peft wraps 4-bit layers only when the model says so
        _cpu_safe_4bit(model)
    return model


def base_signature(model: torch.nn.Module) -> dict[str, Any]:
    """Shape fields and a few embedding values: enough to tell one base from another cheaply."""
    c = model.config.to_dict()
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "n_embd",
        "num_hidden_layers",
        "n_layer",
        "intermediate_size",
    )
    probe = model.get_input_embeddings().weight[:4, :8].detach().float().cpu()
    return {"config": {k: c[k] for k in keys if k in c}, "embed_probe": probe.flatten().tolist()}


def check_signature(expected: dict[str, Any], model: torch.nn.Module, what: str) -> None:
    got = base_signature(model)
    if got["config"] != expected["config"]:
        diffs = [
            f"{k}: {expected['config'].get(k)} vs {got['config'].get(k)}"
            for k in sorted(set(expected["config"]) | set(got["config"]))
            if expected["config"].get(k) != got["config"].get(k)
        ]
        raise FinetuneError(
            f"{what} was trained on a different base (adapter's base vs this one: "
            f"{'; '.join(diffs)})"
        )
    a, b = torch.tensor(expected["embed_probe"]), torch.tensor(got["embed_probe"])
    if not torch.allclose(a, b, rtol=1e-2, atol=1e-6):  # loose enough for fp32 vs bf16 loads
        raise FinetuneError(
            f"{what} was trained on a different base: same shapes, different weights"
        )


# ----- adapters -----------------------------------------------------------------------------------
def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """Names (last component) of the linear layers LoRA can adapt; the output head is left out."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D") and m is not head and n
    }
    return sorted(names - {"lm_head"})


def attach_lora(
    model: torch.nn.Module,
    lora: LoraSettings,
    *,
    activation_checkpointing: bool = False,
    seed: int = 0,
):
    """Freeze the base and wrap it in a `peft` LoRA model with fp32 adapters."""
    require_package("peft", "LoRA finetuning")
    from peft import LoraConfig, get_peft_model

    available = linear_layer_names(model)
    targets = list(lora.target_modules or available)
    full = [n for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in available]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in full)]
    if missing:
        raise FinetuneError(
            f"LoRA target module(s) {missing} match no linear layer of this model; "
            f"its linear layers are: {', '.join(available)} (the output head is never adapted)"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    if activation_checkpointing:
        checkpoint_activations(model)
        # Without this, checkpointed blocks whose inputs do not require grad give the adapters none.
        model.enable_input_require_grads()
        model.config.use_cache = False
    rank = dict(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
    variant = dict(use_rslora=lora.use_rslora, use_dora=lora.use_dora)
    config = LoraConfig(**rank, **variant, bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(seed)  # lora_A's initialisation draws from torch's RNG: same seed, same start
    with _peft_on_transformers_5():
        pm = get_peft_model(model, config)
    for p in pm.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            # fp16 adapters break the GradScaler ("Attempting to unscale FP16 gradients")
            p.data = p.data.float()
    return pm


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant), under the name the
    installed transformers has (`activation_checkpointing_enable` from 5.x; 5.0, Colab's, has only
    the older name)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter weights, with PEFT's key names: what goes into a checkpoint."""
    from peft import get_peft_model_state_dict

    return {
        k: v.detach().to("cpu").contiguous()
        for k, v in get_peft_model_state_dict(inner_model(model)).items()
    }


def load_adapter_state(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    res = set_peft_model_state_dict(inner_model(model), sd)
    missing = [k for k in res.missing_keys if "lora_" in k]
    if res.unexpected_keys or missing:
        raise FinetuneError(
            f"checkpoint does not fit the adapters: missing {missing[:4]}, "
            f"unexpected {list(res.unexpected_keys)[:4]}"
        )


# ----- adapter folders ----------------------------------------------------------------------------
def adapter_folder(path: str | Path) -> Path:
    """The adapter folder of a finetuning run folder (its ``adapter/``), or `path` itself when it is
    one; a FinetuneError when it holds no adapter weights."""
    p = Path(path)
    p = p / ADAPTER_DIR if (p / ADAPTER_DIR).is_dir() else p
    if not (p / ADAPTER_WEIGHTS).is_file():
        raise FinetuneError(
            f"{path} holds no adapter (no adapter_model.safetensors); finetune "
            "first, or export_adapter(run_dir) to make one from a checkpoint"
        )
    return p


def verify_adapter(adapter_dir: Path) -> None:
    """Refuse a damaged adapter before it is used: with a manifest (every adapter tinygpt writes has
    one) sizes and sha256 of its files; without one (a PEFT folder from elsewhere) at least that the
    weights file reads back whole."""
    if (adapter_dir / MANIFEST).is_file():
        ok, why = verify_checkpoint(adapter_dir, required=ADAPTER_WEIGHTS)
    else:
        try:
            load_safetensors(str(adapter_dir / ADAPTER_WEIGHTS))
            ok, why = True, "ok"
        except Exception as e:  # a truncated or garbled file: safetensors says so in its own words
            first = str(e).splitlines()[0][:120]
            ok, why = False, f"{ADAPTER_WEIGHTS} does not read back ({first})"
    if not ok:
        raise FinetuneError(
            f"adapter {adapter_dir} is damaged: {why}; export it again from the "
            "run's checkpoints (export_adapter(run_dir)) or copy it again from Drive"
        )


def export_adapter(
    run_dir: str | Path, which: str = "latest", out_dir: str | Path | None = None
) -> Path:
    """A PEFT adapter folder from one of a run's checkpoints ("latest", "best" or a folder), whose
    model.safetensors holds exactly PEFT's adapter weights under PEFT's names."""
    run_dir = Path(run_dir)
    if not RunDir(run_dir).is_finetune_run():
        raise FinetuneError(f"{run_dir} is not a finetuning run folder (no adapter_config.json)")
    ckpt = find_run_checkpoint(run_dir, which)
    out = Path(out_dir) if out_dir is not None else run_dir / ADAPTER_DIR
    # an old adapter is replaced whole: a crash leaves one of the two
    with atomic_output(out, folder=True) as tmp:
        shutil.copyfile(ckpt / MODEL_FILE, tmp / ADAPTER_WEIGHTS)
        for name in (ADAPTER_CONFIG, ADAPTER_INFO):
            shutil.copyfile(run_dir / name, tmp / name)
        # checked like a checkpoint before every use (sizes and sha256)
        write_manifest(tmp, {"step": int(read_manifest(ckpt).get("step", 0)), "kind": "adapter"})
    return out


# ----- a finetuned model, loaded back -------------------------------------------------------------
def _base_of(adir: Path, info: dict[str, Any]) -> str:
    """The base an adapter was trained on: its exported folder if it is still there; on a new VM (an
    adapter on Drive) the same tinygpt run exported again beside the adapter; else the Hub id or
    folder PEFT saved."""
    path = info.get("base_path")
    if path and (Path(path) / "config.json").is_file():
        return path
    if info.get("base") and is_tinygpt_run(info["base"]):
        out = adir.parent / BASE_DIR
        if (out / "config.json").is_file():
            return str(out)
        return str(export_tinygpt_base(info["base"], out))
    return info.get("base") or read_json(adir / ADAPTER_CONFIG)["base_model_name_or_path"]


def full_model_dir(path: str | Path) -> Path | None:
    """The model folder of a full finetuning run (or that folder itself); None for anything else."""
    p = Path(path)
    for d in (p / FULL_MODEL_DIR, p):
        if (d / "config.json").is_file() and (d / ADAPTER_INFO).is_file():
            return d
    return None


def load_finetuned(
    path: str | Path,
    *,
    base: str | None = None,
    merge: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """(model in eval mode, tokenizer) of a finetuning run folder or adapter folder. merge=True
    folds the adapter into the base; for QLoRA it folds into the dequantized 4-bit base, the weights
    it was trained on (folding into 4-bit weights would round the sum back to 4 bits)."""
    full = full_model_dir(path)
    if full is not None:  # full finetuning: a whole model, nothing to merge
        return load_base(str(full), dtype=dtype, device=device).eval(), load_tokenizer(str(full))
    require_package("peft", "loading an adapter")
    from peft import PeftModel

    adir = adapter_folder(path)
    verify_adapter(adir)
    info = RunDir(adir).adapter_info()
    base = base or _base_of(adir, info)
    quantize = info.get("quantize", "none")
    model = load_base(base, quantize=quantize, dtype=dtype, device=device)
    if "signature" in info:
        check_signature(info["signature"], model, f"adapter {adir}")
    if merge and quantize == "nf4":
        model = model.dequantize()
        model.is_loaded_in_4bit = False
    try:
        with _peft_on_transformers_5():
            model = PeftModel.from_pretrained(model, str(adir))
    except RuntimeError as e:
        lines = str(e).splitlines()
        raise FinetuneError(
            f"adapter {adir} does not fit base {base!r}; it was trained on another "
            f"model: {lines[1] if len(lines) > 1 else e}"
        ) from e
    if merge:
        model = model.merge_and_unload()
    tok = load_tokenizer(str(adir) if (adir / "tokenizer_config.json").is_file() else base)
    return model.to(device).eval(), tok


def merge_adapter(
    path: str | Path, out_dir: str | Path | None = None, *, dtype: torch.dtype = torch.float32
) -> Path:
    """Fold the adapter into its base and save the model (config.json, safetensors, tokenizer)."""
    model, tok = load_finetuned(path, merge=True, dtype=dtype)
    out = Path(out_dir) if out_dir is not None else adapter_folder(path).parent / MERGED_DIR
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
