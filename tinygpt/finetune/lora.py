"""LoRA and QLoRA finetuning through `peft` and `bitsandbytes`: base models, adapters, the run, merge.
The recipes and memory estimates live in `tinygpt.finetune.recipes` (re-exported here).

Every base is trained as a `transformers` causal LM. A tinygpt run folder is first exported to
``run_dir/base/`` as a `LlamaForCausalLM` (tinygpt already uses Llama's parameter names, so the
state_dict moves over unchanged and the logits are identical): one code path then serves tinygpt
and Hub models alike, QLoRA loads it through `BitsAndBytesConfig`, and the adapter that comes out
is a plain PEFT adapter whose `base_model_name_or_path` is a folder any `transformers` user can load.

A finetuning run folder holds ``finetune.json``, ``adapter_config.json`` and ``tinygpt_finetune.json``
(what any checkpoint needs to become an adapter), ``base/`` (tinygpt bases only), ``checkpoints/``
(adapter weights + optimizer + data position: small, so saved often), ``metrics.jsonl`` and, at
the end, ``adapter/`` (adapter_config.json + adapter_model.safetensors + tokenizer). With a mirror
(Drive) all of it but ``base/`` is copied there, the adapter last, checked file by file.

Full finetuning (recipe ``full``, `FinetuneRecipe.lora` None) trains the base itself in fp32 through the same
`FinetuneLoss` and Trainer: its checkpoints hold the whole model under transformers' names (`full_state`), and
the result is ``model/``, a folder `from_pretrained` loads (`export_full`), instead of an adapter.
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tinygpt.core.checkpoint import MODEL_FILE, find_run_checkpoint, list_checkpoints
from tinygpt.core.config import TrainConfig
from tinygpt.core.files import FileTooLarge, UnsafePathError, atomic_output, refuse_links_in, write_json_atomic
from tinygpt.core.folders import refuse_other_kind
from tinygpt.core.precision import choose_precision, resolve_device
from tinygpt.core.rundir import ADAPTER_CONFIG, RunDir, read_json
from tinygpt.finetune.instruct import (
    Codec,
    DataReport,
    build_instruct_data,
    format_prompt,
    load_records,
)

# Recipes, memory estimates, hardware checks, a base's config and the run folder's files: finetune/recipes.py.
from tinygpt.finetune.recipes import (  # noqa: F401
    ADAPTER_DIR,
    ADAPTER_INFO,
    BASE_DIR,
    FINETUNE_INFO,
    FINETUNE_RECIPES,
    FULL_MODEL_DIR,
    MERGED_DIR,
    PLAIN_HEAD_TYPES,
    SOFTCAP_HEAD_TYPES,
    FinetuneError,
    FinetunePlan,
    FinetuneRecipe,
    LoraSettings,
    _adapter_dir,
    _need,
    base_config,
    base_config_dict,
    check_qlora,
    check_same_run,
    chunked_loss,
    default_finetune_recipe,
    detect_hardware,
    export_adapter,
    get_finetune_recipe,
    is_tinygpt_run,
    memory_gb_of,
    memory_table,
    packing_supported,
    plan_finetune,
    qlora_compile,
    resumed_plan,
    this_hardware,
    verify_adapter,
)
from tinygpt.model.attention import use_expanding_sdpa
from tinygpt.model.hf import UntrustedModel, export_model, from_pretrained
from tinygpt.model.loading import load_run
from tinygpt.model.losses import IGNORE_INDEX, default_chunk_rows, linear_cross_entropy
from tinygpt.model.tokenizer import UnsafeTokenizer
from tinygpt.sync.mirror import mirror_adapter
from tinygpt.sync.mirrored import mirrored
from tinygpt.train.callbacks import Progress
from tinygpt.train.hardware import check_device
from tinygpt.train.step import ModelIO
from tinygpt.train.trainer import TrainData, Trainer


# ----- base models --------------------------------------------------------------------------------
@contextlib.contextmanager
def _peft_on_transformers_5():
    """PEFT reads `model.is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning
    on every finetune; the user can do nothing about it, so that one warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def export_tinygpt_base(run_dir: str | Path, out_dir: str | Path, which: str = "latest") -> Path:
    """A tinygpt run's model as a `LlamaForCausalLM` folder, through the one exporter (`model.hf`),
    atomically (a folder that exists is complete), with tinygpt_source.json naming the checkpoint."""
    model, tok, _, ckpt = load_run(run_dir, which)
    out = export_model(model, tok, out_dir)
    write_json_atomic(out / "tinygpt_source.json", {"run_dir": str(Path(run_dir).resolve()), "checkpoint": str(ckpt)})
    return out


def _bnb_config(compute_dtype: torch.dtype):
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def _cpu_safe_4bit(model: torch.nn.Module) -> None:
    """On CPUs with AVX512-BF16, bitsandbytes 0.50 repacks a 4-bit weight in place the first time it
    runs in eval mode (e.g. a validation pass), with bf16 scales and a kernel that has no backward:
    outputs shift and later gradients through the layer are wrong. Keep the standard layout."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def load_tokenizer(path: str):
    """A base's (or an adapter's) tokenizer through transformers, its folder checked first and its own code never
    run (`model.hf.from_pretrained`)."""
    _need("transformers", "finetuning")
    try:
        return from_pretrained("AutoTokenizer", path)
    except (UntrustedModel, UnsafeTokenizer, UnsafePathError, FileTooLarge):
        raise  # one line that names the file already
    except Exception as e:
        raise FinetuneError(f"could not load the tokenizer of base {path!r}: {e}") from e


def load_base(path: str, *, quantize: str = "none", dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu"):
    """A Hugging Face causal LM from a local folder or a Hub id, optionally in 4-bit NF4; its folder checked
    first and its own code never run (`base_config`, `model.hf.from_pretrained`)."""
    config = base_config(path)
    try:
        kw: dict[str, Any] = {"dtype": dtype}
        if getattr(config, "final_logit_softcapping", None):  # Gemma-2: sdpa ignores its soft-capping
            kw["attn_implementation"] = "eager"
        else:  # sdpa, with GQA keys/values expanded where no fused kernel takes them grouped (a T4)
            kw["attn_implementation"] = use_expanding_sdpa()
        if quantize == "nf4":
            dev = torch.device(device)
            kw.update(quantization_config=_bnb_config(dtype),  # quantized as it loads, straight onto the device
                      device_map={"": torch.cuda.current_device() if dev.type == "cuda" and dev.index is None
                                      else (dev.index if dev.type == "cuda" else dev.type)})
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
    keys = ("model_type", "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "intermediate_size")
    probe = model.get_input_embeddings().weight[:4, :8].detach().float().cpu()
    return {"config": {k: c[k] for k in keys if k in c}, "embed_probe": probe.flatten().tolist()}


def check_signature(expected: dict[str, Any], model: torch.nn.Module, what: str) -> None:
    got = base_signature(model)
    if got["config"] != expected["config"]:
        diffs = [f"{k}: {expected['config'].get(k)} vs {got['config'].get(k)}"
                 for k in sorted(set(expected["config"]) | set(got["config"]))
                 if expected["config"].get(k) != got["config"].get(k)]
        raise FinetuneError(f"{what} was trained on a different base (adapter's base vs this one: {'; '.join(diffs)})")
    a, b = torch.tensor(expected["embed_probe"]), torch.tensor(got["embed_probe"])
    if not torch.allclose(a, b, rtol=1e-2, atol=1e-6):  # loose enough for fp32 vs bf16 loads
        raise FinetuneError(f"{what} was trained on a different base: same shapes, different weights")


# ----- adapters -----------------------------------------------------------------------------------
def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """Names (last component) of the linear layers LoRA can adapt; the output head is left out."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D") and m is not head and n}
    return sorted(names - {"lm_head"})


def attach_lora(model: torch.nn.Module, lora: LoraSettings, *, activation_checkpointing: bool = False,
                seed: int = 0):
    """Freeze the base and wrap it in a `peft` LoRA model with fp32 adapters."""
    _need("peft", "LoRA finetuning")
    from peft import LoraConfig, get_peft_model

    available = linear_layer_names(model)
    targets = list(lora.target_modules or available)
    full = [n for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in available]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in full)]
    if missing:
        raise FinetuneError(f"LoRA target module(s) {missing} match no linear layer of this model; its linear "
                            f"layers are: {', '.join(available)} (the output head is never adapted)")
    for p in model.parameters():
        p.requires_grad_(False)
    if activation_checkpointing:
        checkpoint_activations(model)
        # Without this, checkpointed blocks whose inputs do not require grad give the adapters none.
        model.enable_input_require_grads()
        model.config.use_cache = False
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        use_rslora=lora.use_rslora, use_dora=lora.use_dora, bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(seed)  # lora_A's initialisation draws from torch's RNG: same seed, same start
    with _peft_on_transformers_5():
        pm = get_peft_model(model, config)
    for p in pm.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # fp16 adapters break the GradScaler ("Attempting to unscale FP16 gradients")
    return pm


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant), under the name the installed
    transformers has (`activation_checkpointing_enable` from 5.x; 5.0, Colab's, has only the older name)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# ----- full finetuning ----------------------------------------------------------------------------
def prepare_full(model: torch.nn.Module, *, activation_checkpointing: bool = False) -> torch.nn.Module:
    """Every weight of `model` trainable, in fp32: the optimizer's master copy (autocast computes in half
    precision on a GPU, and the fp16 GradScaler needs fp32 parameters)."""
    model = model.float()
    for p in model.parameters():
        p.requires_grad_(True)
    if activation_checkpointing:
        checkpoint_activations(model)
        model.config.use_cache = False
    return model


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights under transformers' names (what `from_pretrained` reads); of tied weights
    (one tensor under two names, e.g. embeddings and head) only the first name, as `save_pretrained` does."""
    out, seen = {}, set()
    for k, v in _peft_model(model).state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        out[k] = v.detach().to("cpu").contiguous()
    return out


def load_full_state(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    hf = _peft_model(model)
    res = hf.load_state_dict(sd, strict=False)
    missing = set(res.missing_keys) - (set(hf.state_dict()) - set(full_state(hf)))  # tied names come back tied
    if res.unexpected_keys or missing:
        raise FinetuneError(f"checkpoint does not fit the model: missing {sorted(missing)[:4]}, "
                            f"unexpected {list(res.unexpected_keys)[:4]}")


def is_full_finetune(run_dir: str | Path) -> bool:
    """Whether a folder is a full finetuning run's (its finetune.json's recipe has no LoRA settings)."""
    recipe = (RunDir(run_dir).finetune_info() or {}).get("recipe") or {}
    return "lora" in recipe and recipe["lora"] is None


def export_full(run_dir: str | Path, which: str = "latest", out_dir: str | Path | None = None) -> Path:
    """A full finetuning run's checkpoint ("latest", "best" or a folder) as a standalone transformers model folder
    (config.json, model.safetensors, tokenizer; run_dir/model by default): the checkpoint's weights already carry
    transformers' names, so they are copied as they are. An existing folder is replaced whole."""
    run_dir = Path(run_dir)
    info = RunDir(run_dir).adapter_info()
    if not is_full_finetune(run_dir) or not info:
        raise FinetuneError(f"{run_dir} is not a full finetuning run folder (finetune.json with recipe full)")
    ckpt = find_run_checkpoint(run_dir, which)
    base = info["base_path"]
    if not (Path(base) / "config.json").is_file():  # a Hub id; or a new VM, where a tinygpt base is exported again
        base = (str(export_tinygpt_base(info["base"], run_dir / BASE_DIR)) if is_tinygpt_run(info["base"])
                else info["base"])
    config = base_config(base)  # checked: no code of its own, a model type tinygpt loads
    config.torch_dtype = torch.float32
    out = Path(out_dir) if out_dir is not None else run_dir / FULL_MODEL_DIR
    with atomic_output(out, folder=True) as tmp:
        config.save_pretrained(tmp)
        shutil.copyfile(ckpt / MODEL_FILE, tmp / "model.safetensors")  # named as transformers reads it
        load_tokenizer(base).save_pretrained(tmp)
        write_json_atomic(tmp / ADAPTER_INFO, {**info, "checkpoint": str(ckpt)})
    return out


def causal_lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, position_ids: torch.Tensor | None = None,
                   *, chunk_rows: int | None = None) -> torch.Tensor:
    """Summed fp32 cross-entropy over targets that are not IGNORE_INDEX (x and y are already shifted).
    position_ids: of packed rows (0 again at each record's start: attention stays inside each record).
    chunk_rows: as in `losses.linear_cross_entropy` (None picks by size, 0 takes the full logits)."""
    # A DDP wrapper (no get_base_model) must see the forward call: wrapped models take the plain path.
    hf = (model.get_base_model() if hasattr(model, "get_base_model")
          else model if hasattr(model, "get_output_embeddings") and hasattr(model, "base_model")  # full finetuning
          else None)
    head = hf.get_output_embeddings() if hf is not None else None
    pos = {"position_ids": position_ids} if position_ids is not None else {}
    if (hf is not None and chunked_loss({"model_type": hf.config.model_type})
            and isinstance(head, torch.nn.Linear) and head.bias is None):
        hidden = hf.base_model(input_ids=x, use_cache=False, **pos).last_hidden_state
        cap = getattr(hf.config, "final_logit_softcapping", None)
        if cap and hf.config.model_type in SOFTCAP_HEAD_TYPES:
            return softcapped_loss(hidden, head.weight, y, float(cap), chunk_rows=chunk_rows)
        return linear_cross_entropy(hidden, head.weight, y, reduction="sum", ignore_index=IGNORE_INDEX,
                                    chunk_rows=chunk_rows)
    logits = model(input_ids=x, use_cache=False, **pos).logits.float()
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


class FinetuneLoss(torch.nn.Module):
    """A PEFT model and its loss as one module: what the Trainer trains and compiles, so that the forward
    pass and the loss (`causal_lm_loss`, hidden states through the head) are one compiled graph; nothing
    reaches around the compiled wrapper to the base model. Its parameters are the PEFT model's.
    full_logits: the head's logits for every token at once (fastest; `FinetunePlan` decides whether they
    fit), else chunked by size (`losses.default_chunk_rows`)."""

    def __init__(self, model: torch.nn.Module, *, full_logits: bool = True):
        super().__init__()
        self.model = model
        self.chunk_rows = 0 if full_logits else None

    def forward(self, x: torch.Tensor, y: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return causal_lm_loss(self.model, x, y, position_ids, chunk_rows=self.chunk_rows)


def module_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
    """The Trainer's loss_fn for a `FinetuneLoss` (or its compiled wrapper): the module computes it."""
    return model(x, y, *extra)


def _peft_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.model if isinstance(model, FinetuneLoss) else model


def softcapped_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cap: float, *,
                    chunk_rows: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of Gemma-2's logits cap * tanh(hidden @ weight.T / cap), a chunk of rows at a
    time. Each chunk's logits are recomputed in the backward pass instead of kept: one more head matmul
    buys the (tokens, 256k vocab) logits that would not fit a T4 next to the model."""

    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    rows = default_chunk_rows(h.shape[0], weight.shape[0]) if chunk_rows is None else chunk_rows

    def part(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        z = F.linear(hc, weight).float()
        return F.cross_entropy(cap * torch.tanh(z / cap), tc, ignore_index=IGNORE_INDEX, reduction="sum")

    if rows <= 0 or rows >= h.shape[0]:
        return part(h, t)
    return sum(checkpoint(part, h[i:i + rows], t[i:i + rows], use_reentrant=False)
               for i in range(0, h.shape[0], rows))


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter weights, with PEFT's key names: what goes into a checkpoint."""
    from peft import get_peft_model_state_dict
    return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(_peft_model(model)).items()}


def load_adapter_state(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict
    res = set_peft_model_state_dict(_peft_model(model), sd)
    missing = [k for k in res.missing_keys if "lora_" in k]
    if res.unexpected_keys or missing:
        raise FinetuneError(f"checkpoint does not fit the adapters: missing {missing[:4]}, "
                            f"unexpected {list(res.unexpected_keys)[:4]}")


def _base_of(adir: Path, info: dict[str, Any]) -> str:
    """The base an adapter was trained on: its exported folder if it is still there; on a new VM (an adapter
    on Drive) the same tinygpt run exported again beside the adapter; else the Hub id or folder PEFT saved."""
    path = info.get("base_path")
    if path and (Path(path) / "config.json").is_file():
        return path
    if info.get("base") and is_tinygpt_run(info["base"]):
        out = adir.parent / BASE_DIR
        return str(out if (out / "config.json").is_file() else export_tinygpt_base(info["base"], out))
    return info.get("base") or read_json(adir / ADAPTER_CONFIG)["base_model_name_or_path"]


def full_model_dir(path: str | Path) -> Path | None:
    """The model folder of a full finetuning run (or that folder itself); None for anything else."""
    p = Path(path)
    for d in (p / FULL_MODEL_DIR, p):
        if (d / "config.json").is_file() and (d / ADAPTER_INFO).is_file():
            return d
    return None


def load_finetuned(path: str | Path, *, base: str | None = None, merge: bool = False,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) of a finetuning run folder or adapter folder. merge=True folds the
    adapter into the base; for QLoRA it folds into the dequantized 4-bit base, the weights it was trained on
    (folding into 4-bit weights would round the sum back to 4 bits)."""
    full = full_model_dir(path)
    if full is not None:  # full finetuning: a whole model, nothing to merge
        return load_base(str(full), dtype=dtype, device=device).eval(), load_tokenizer(str(full))
    _need("peft", "loading an adapter")
    from peft import PeftModel

    adir = _adapter_dir(path)
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
        raise FinetuneError(f"adapter {adir} does not fit base {base!r}; it was trained on another model: "
                            f"{str(e).splitlines()[1] if len(str(e).splitlines()) > 1 else e}") from e
    if merge:
        model = model.merge_and_unload()
    tok = load_tokenizer(str(adir) if (adir / "tokenizer_config.json").is_file() else base)
    return model.to(device).eval(), tok


def merge_adapter(path: str | Path, out_dir: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> Path:
    """Fold the adapter into its base and save a standalone model (config.json + safetensors + tokenizer)."""
    model, tok = load_finetuned(path, merge=True, dtype=dtype)
    out = Path(out_dir) if out_dir is not None else _adapter_dir(path).parent / MERGED_DIR
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@torch.no_grad()
def generate_response(model, tokenizer, instruction: str, input: str = "", *, template: str = "alpaca",
                      max_new_tokens: int = 128, temperature: float = 0.0, top_p: float | None = None) -> str:
    """The model's answer to one instruction (greedy when temperature is 0)."""
    codec = Codec(tokenizer)
    ids = codec.encode_examples([[(format_prompt(instruction, input, template), False)]])[0][0]
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    kw: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        kw.update(temperature=temperature, top_p=top_p)
    context = getattr(model.config, "max_position_embeddings", None)
    if context:  # past the context the base was trained on, tokens are noise (and transformers warns)
        max_new_tokens = max(1, min(max_new_tokens, context - len(ids)))
    # use_cache: training with activation checkpointing switched the config's default off
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                         eos_token_id=codec.eos_id, pad_token_id=codec.pad_id, use_cache=True, **kw)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


@dataclass
class Generations:
    """Answers to a few instructions before and after finetuning; prints as text."""
    rows: list[tuple[str, str, str]]  # (instruction, before, after)

    def __str__(self) -> str:
        return "\n\n".join(f"### {i}\n--- before (the base) ---\n{b.strip()}\n--- after (with the adapter) ---\n"
                           f"{a.strip()}" for i, b, a in self.rows)

    __repr__ = __str__


def compare_generations(model, tokenizer, instructions: Sequence[str], *, template: str = "alpaca",
                        max_new_tokens: int = 96, base: str | None = None) -> Generations:
    """Greedy answers of a PEFT model with its adapter switched off (exactly the base: LoRA leaves the base
    weights alone, and no second copy of the base is loaded) and on. A fully finetuned model has no adapter to
    switch off: `base` (`FinetuneResult.base_path`) is then loaded beside it to answer first."""
    rows = []
    if not hasattr(model, "disable_adapter"):
        if base is None:
            raise FinetuneError("a fully finetuned model has no adapter to switch off: pass base=result.base_path")
        dev = next(model.parameters()).device
        original = load_base(base, device=dev).eval()
    for instruction in instructions:
        with model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext():
            before = generate_response(model if hasattr(model, "disable_adapter") else original, tokenizer,
                                       instruction, template=template, max_new_tokens=max_new_tokens)
        after = generate_response(model, tokenizer, instruction, template=template, max_new_tokens=max_new_tokens)
        rows.append((instruction, before, after))
    return Generations(rows)


# ----- the whole run ------------------------------------------------------------------------------
@dataclass
class FinetuneResult:
    run_dir: Path
    adapter_dir: Path | None  # None when training was interrupted by a signal
    train: Any  # trainer.TrainResult
    data: DataReport
    hardware: str
    trainable_params: int
    total_params: int
    memory: list[dict[str, Any]] = field(default_factory=list)
    model: Any = field(default=None, repr=False)  # the PeftModel, ready for generate_response
    tokenizer: Any = field(default=None, repr=False)
    mirrored_adapter: Path | None = None  # the adapter's verified copy on the mirror
    plan: FinetunePlan | None = None  # checkpointing, logits and packing as this run trained
    model_dir: Path | None = None  # full finetuning: the finished model folder (None for LoRA, or when interrupted)
    base_path: str | None = None  # the base as it was loaded (a Hub id or a folder)


def finetune(recipe: str | FinetuneRecipe, base: str, data: str, run_dir: str | Path, max_steps: int | None = None,
             hardware: str | None = None, resume: str = "auto", callbacks=(), *, train: dict | None = None,
             device: str | None = None, progress: bool = True, mirror: str | Path | None = None) -> FinetuneResult:
    """LoRA / QLoRA / full finetune `base` (tinygpt run folder, model folder or Hub id) on instruction `data`
    into `run_dir`, resuming from its newest valid checkpoint; the adapter lands in run_dir/adapter (recipe
    full: the whole model in run_dir/model).
    With `mirror` (a folder on Drive) checkpoints are copied there as they are written, the run resumes
    from there on a new VM, and the final adapter is copied to mirror/adapter."""
    refuse_links_in(run_dir)  # a link in the run folder (.lock, metrics.jsonl, checkpoints/) is never followed
    refuse_other_kind(run_dir, "finetuning run", "finetune")  # a pretraining run, an export: untouched
    run = RunDir(run_dir)
    # one writer per run folder; a failed first try (bad data, no device) leaves no base/ nor finetune.json
    with run.lock(), run.undo_if_first_try_fails(FINETUNE_INFO):
        return _finetune(recipe, base, data, run_dir, max_steps, hardware, resume, callbacks, train=train,
                         device=device, progress=progress, mirror=mirror)


def _finetune(recipe: str | FinetuneRecipe, base: str, data: str, run_dir: str | Path, max_steps: int | None = None,
              hardware: str | None = None, resume: str = "auto", callbacks=(), *, train: dict | None = None,
              device: str | None = None, progress: bool = True, mirror: str | Path | None = None) -> FinetuneResult:
    """The finetuning run itself; `finetune` holds the run folder's lock around it: the data read first (a missing
    or bad file fails in seconds, before anything of the base is read), the settings decided once (`_settle`),
    the base exported and the records tokenized (a bad record fails before a 5 GB download),
    the model made trainable, trained, then the adapter (or the whole model) written out."""
    rec = get_finetune_recipe(recipe) if isinstance(recipe, str) else recipe
    if resume not in ("auto", "never"):
        raise FinetuneError(f"resume must be 'auto' or 'never', got {resume!r}")
    run_dir = Path(run_dir)
    check_device(dev := resolve_device(device or "auto"))
    # --data is read (and a missing or unreadable one refused) before anything of the base is: its config,
    # tokenizer and weights
    records = load_records(data) if isinstance(data, str) else data
    base_id = str(Path(base).resolve()) if is_tinygpt_run(base) else base
    overrides = {**(train or {}), **({"max_steps": max_steps} if max_steps is not None else {})}
    # the mirror's newest valid checkpoint and run files (finetune.json among them) come home before anything
    # is decided: a resumed run on a new VM keeps its own settings
    with mirrored(run_dir, mirror, {"recipe": rec.name, "data": data, "base": base_id}) as run_mirror:
        run = _settle(rec, base, base_id, data, run_dir, dev, hardware, overrides, resume)
        base_path = _base_folder(run, base, run_dir)
        tok = load_tokenizer(base_path)
        dataset = build_instruct_data(records, tok, run.cfg.seq_len, template=rec.template, pack=run.plan.pack,
                                      seed=run.cfg.seed, val_batch_size=run.cfg.micro_batch_size,
                                      eval_batches=run.cfg.eval_batches)
        model, pm, io = _trainable_model(run, base_path, dev, run_dir)
        callbacks = [*([Progress()] if progress else []), *callbacks]
        # The Trainer compiles the loss module as a whole (compile "auto": on CUDA): forward and loss in one graph.
        trainer = Trainer(FinetuneLoss(pm, full_logits=run.plan.full_logits),
                          dataclasses.replace(run.cfg, device=str(dev)), TrainData(dataset.train, dataset.val_batches),
                          run_dir, run_info=run.info, io=io,
                          callbacks=[*callbacks, run_mirror])  # the mirror acts last, and is closed last
        result = trainer.fit(resume)
    adapter_dir, mirrored_adapter, model_dir = _write_result(run, run_dir, result, tok, mirror)
    mem = memory_table(run.planned, run.hardware, model.config.to_dict(),
                       activation_checkpointing=run.plan.activation_checkpointing, full_logits=run.plan.full_logits)
    n_train = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    return FinetuneResult(run_dir, adapter_dir, result, dataset.report, run.hardware, n_train,
                          sum(p.numel() for p in pm.parameters()), mem, pm.eval(), tok, mirrored_adapter, run.plan,
                          model_dir, base_path)


@dataclass
class _Settled:
    """A finetuning run's settings, decided once before anything is written (`_settle`)."""
    rec: FinetuneRecipe
    hardware: str               # the hardware class whose settings the run trains with
    cfg: TrainConfig            # the recipe's train settings for it, with the caller's overrides
    overrides: dict
    planned: FinetuneRecipe     # the recipe as the memory estimate sees it (the overrides included)
    plan: FinetunePlan          # checkpointing, full logits, packing
    info: dict                  # finetune.json
    resuming: bool              # the run folder has checkpoints


def _settle(rec: FinetuneRecipe, base: str, base_id: str, data: str, run_dir: Path, dev: torch.device,
            hardware: str | None, overrides: dict, resume: str) -> _Settled:
    """The hardware class (Colab may hand a resumed run another GPU: it keeps the settings it started with, so
    the same data rows), the train settings, QLoRA's compile, and the plan from the memory estimate against this
    device, once (a resumed run keeps its own, from finetune.json). Refuses, before anything is written, a base
    that cannot be loaded, a folder holding another run, and checkpoints that resume 'never' would overwrite."""
    old = RunDir(run_dir).finetune_info()
    hardware = hardware or (old or {}).get("hardware") or detect_hardware(dev)
    cfg = rec.train_config(hardware, **overrides)
    if rec.quantize == "nf4":
        check_qlora(dev)
        import bitsandbytes
        compile_, note = qlora_compile(cfg.compile, dev.type, bitsandbytes.__version__, torch.__version__)
        if note:
            warnings.warn(note, stacklevel=4)
            cfg = dataclasses.replace(cfg, compile=compile_)
    if not is_tinygpt_run(base):
        base_config(base)  # a missing or unloadable base fails here, before anything is written
    planned = dataclasses.replace(rec, train={**rec.train, hardware: cfg})  # the estimate sees the overrides
    config_dict, memory_gb = base_config_dict(base), memory_gb_of(dev)
    plan = (resumed_plan(old, planned, hardware, config_dict, memory_gb) if old
            else plan_finetune(planned, hardware, config_dict, memory_gb))
    info = {"recipe": rec.to_dict(), "base": base_id, "data": data, "hardware": hardware, "plan": plan.to_dict()}
    check_same_run(run_dir, old, info)
    resuming = bool(list_checkpoints(RunDir(run_dir).checkpoints))
    if resume == "never" and resuming:
        raise FinetuneError(f"run folder {run_dir} already has checkpoints; resume='never' would overwrite them")
    return _Settled(rec, hardware, cfg, overrides, planned, plan, info, resuming)


def _base_folder(run: _Settled, base: str, run_dir: Path) -> str:
    """Write finetune.json and return the base to load: a tinygpt run exported once to run_dir/base, else the base
    as given. A recipe's context longer than the base knows is cut to it (one asked for is refused)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / FINETUNE_INFO, run.info)
    base_path = base
    if is_tinygpt_run(base):
        base_path = str((run_dir / BASE_DIR).resolve())
        if not (run_dir / BASE_DIR / "config.json").is_file():
            export_tinygpt_base(base, base_path)
    config = base_config(base_path)
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_pos and run.cfg.seq_len > max_pos:
        if "seq_len" in run.overrides:
            raise FinetuneError(f"seq_len {run.cfg.seq_len} is longer than the base's context of {max_pos} tokens")
        run.cfg = dataclasses.replace(run.cfg, seq_len=max_pos)  # the recipe's default, cut to what the base knows
    return base_path


def _trainable_model(run: _Settled, base_path: str, dev: torch.device, run_dir: Path):
    """(the base as loaded, the model that trains, how checkpoints hold it): LoRA adapters on a frozen base, or
    (recipe full) the base itself in fp32; then tinygpt_finetune.json, with the base's signature."""
    rec = run.rec
    old_adapter = RunDir(run_dir).adapter_info()
    # full finetuning keeps fp32 weights (the optimizer's updates would vanish in half precision); autocast computes
    dtype = (choose_precision(dev, run.cfg.precision).dtype if dev.type == "cuda" and rec.lora is not None
             else torch.float32)
    model = load_base(base_path, quantize=rec.quantize, dtype=dtype, device=dev)
    if run.resuming and "signature" in old_adapter:  # e.g. a tinygpt base that trained on since, exported anew
        check_signature(old_adapter["signature"], model, f"the checkpoints in {run_dir}")
    if rec.lora is None:  # full finetuning: the base itself trains, and every checkpoint holds all of it
        pm = prepare_full(model, activation_checkpointing=run.plan.activation_checkpointing)
        io = ModelIO(loss_fn=module_loss, state_fn=full_state, load_state_fn=load_full_state)
    else:
        pm = attach_lora(model, rec.lora, activation_checkpointing=run.plan.activation_checkpointing, seed=run.cfg.seed)
        peft_config = dataclasses.replace(pm.peft_config["default"], inference_mode=True)  # as PEFT saves it
        peft_config.save_pretrained(str(run_dir))  # adapter_config.json + any checkpoint = an adapter (export_adapter)
        io = ModelIO(loss_fn=module_loss, state_fn=adapter_state, load_state_fn=load_adapter_state)
    write_json_atomic(run_dir / ADAPTER_INFO, {"base": run.info["base"], "base_path": base_path,
                                               "quantize": rec.quantize, "template": rec.template,
                                               "signature": base_signature(model)})
    return model, pm, io


def _write_result(run: _Settled, run_dir: Path, result: Any, tok: Any,
                  mirror: str | Path | None) -> tuple[Path | None, Path | None, Path | None]:
    """(adapter folder, its copy on the mirror, whole-model folder) of a run that was not interrupted: the adapter
    with the tokenizer (copied to the mirror), or, recipe full, a whole model folder (the mirrored checkpoints
    hold it already); Nones for an interrupted one."""
    if result.interrupted:
        return None, None, None
    which = str(result.checkpoint or "latest")
    if run.rec.lora is None:
        return None, None, export_full(run_dir, which)
    adapter_dir = export_adapter(run_dir, which)
    tok.save_pretrained(adapter_dir)
    mirrored_adapter = mirror_adapter(adapter_dir, Path(mirror), result.step) if mirror is not None else None
    return adapter_dir, mirrored_adapter, None
