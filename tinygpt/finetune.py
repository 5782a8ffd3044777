"""LoRA and QLoRA finetuning through `peft` and `bitsandbytes`: recipes, base models, adapters, merge.

Every base is trained as a `transformers` causal LM. A tinygpt run folder is first exported to
``run_dir/base/`` as a `LlamaForCausalLM` (tinygpt already uses Llama's parameter names, so the
state_dict moves over unchanged and the logits are identical): one code path then serves tinygpt
and Hub models alike, QLoRA loads it through `BitsAndBytesConfig`, and the adapter that comes out
is a plain PEFT adapter whose `base_model_name_or_path` is a folder any `transformers` user can load.

A finetuning run folder holds ``finetune.json``, ``adapter_config.json`` and ``tinygpt_finetune.json``
(what any checkpoint needs to become an adapter), ``base/`` (tinygpt bases only), ``checkpoints/``
(adapter weights + optimizer + data position: small, so saved often), ``metrics.jsonl`` and, at
the end, ``adapter/`` (adapter_config.json + adapter_model.safetensors + tokenizer).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .config import TrainConfig
from .instruct import Codec, DataReport, build_instruct_data, format_prompt
from .model import IGNORE_INDEX

FINETUNE_INFO, ADAPTER_INFO = "finetune.json", "tinygpt_finetune.json"
BASE_DIR, ADAPTER_DIR, MERGED_DIR = "base", "adapter", "merged"
# Families whose logits are exactly lm_head(hidden): their loss goes through the chunked
# `losses.linear_cross_entropy` (no full (tokens, vocab) logits). Gemma-2 soft-caps its logits: not here.
PLAIN_HEAD_TYPES = {"llama", "qwen2", "qwen3", "mistral", "gemma", "phi3"}


class FinetuneError(RuntimeError):
    """Finetuning cannot start or go on; the message says what to do."""


def _need(module: str, what: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise FinetuneError(f"{what} needs `pip install {module}`") from e


# ----- recipes ------------------------------------------------------------------------------------
@dataclass
class LoraSettings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: tuple[str, ...] | None = None  # None: every linear layer but lm_head
    use_rslora: bool = False  # scale by alpha / sqrt(r) instead of alpha / r
    use_dora: bool = False

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise FinetuneError(f"LoRA needs r >= 1, alpha > 0 and 0 <= dropout < 1; got r={self.r}, "
                                f"alpha={self.alpha}, dropout={self.dropout}")
        if self.target_modules is not None:
            self.target_modules = tuple(self.target_modules)


@dataclass
class FinetuneRecipe:
    """LoRA settings plus a TrainConfig per hardware class ("cpu", "t4", "a100")."""

    name: str
    description: str
    lora: LoraSettings
    train: dict[str, TrainConfig]
    quantize: str = "none"  # "none" or "nf4" (QLoRA)
    activation_checkpointing: tuple[str, ...] = ("t4", "a100")  # hardware classes that recompute
    template: str = "alpaca"
    pack: bool = False

    def train_config(self, hardware: str, **overrides: Any) -> TrainConfig:
        if hardware not in self.train:
            raise FinetuneError(f"recipe {self.name!r} has no setting for hardware {hardware!r}; "
                                f"choose one of {', '.join(self.train)}")
        return dataclasses.replace(self.train[hardware], **overrides)

    def to_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in ("name", "description", "quantize", "template", "pack")},
                "lora": dataclasses.asdict(self.lora), "activation_checkpointing": list(self.activation_checkpointing),
                "train": {k: v.to_dict() for k, v in self.train.items()}}


def _settings() -> dict[str, TrainConfig]:
    common = dict(weight_decay=0.0, grad_clip=1.0, compile="off", eval_batches=8, log_every=10, keep_last=3)
    return {  # effective batch 16 sequences on both GPUs
        "t4": TrainConfig(micro_batch_size=4, grad_accum_steps=4, seq_len=512, lr=2e-4, min_lr=2e-5, warmup_steps=100,
                          max_steps=1000, eval_every=100, save_every=50, precision="auto", **common),
        "a100": TrainConfig(micro_batch_size=8, grad_accum_steps=2, seq_len=768, lr=2.5e-4, min_lr=2.5e-5,
                            warmup_steps=150, max_steps=1000, eval_every=100, save_every=50, precision="auto",
                            **common),
        "cpu": TrainConfig(micro_batch_size=4, grad_accum_steps=2, seq_len=256, lr=2e-3, min_lr=2e-4, warmup_steps=3,
                           max_steps=30, eval_every=10, save_every=10, precision="fp32",
                           **{**common, "eval_batches": 2, "log_every": 5, "keep_last": 2}),
    }


FINETUNE_RECIPES: dict[str, FinetuneRecipe] = {
    f"lora-r{r}": FinetuneRecipe(f"lora-r{r}", f"LoRA rank {r} (alpha {2 * r}) on every linear layer of attention "
                                 "and MLP; base weights in fp16 (T4) or bf16 (A100)", LoraSettings(r=r, alpha=2 * r),
                                 _settings()) for r in (8, 16, 32)}
FINETUNE_RECIPES["qlora-r16"] = FinetuneRecipe(
    "qlora-r16", "QLoRA: the base in 4-bit NF4 with double quantization, LoRA rank 16 in fp32; the one that fits "
    "a 2B model on a T4", LoraSettings(r=16, alpha=32), _settings(), quantize="nf4")


def get_finetune_recipe(name: str) -> FinetuneRecipe:
    if name not in FINETUNE_RECIPES:
        raise FinetuneError(f"unknown finetune recipe {name!r}; choose one of {', '.join(FINETUNE_RECIPES)}")
    r = FINETUNE_RECIPES[name]
    return dataclasses.replace(r, lora=dataclasses.replace(r.lora), train=dict(r.train))


def detect_hardware(device: torch.device) -> str:
    """"a100" for bf16 GPUs with 35 GB or more, "t4" for other CUDA GPUs, else "cpu"."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    return "a100" if props.major >= 8 and props.total_memory >= 35e9 else "t4"


# ----- memory -------------------------------------------------------------------------------------
def memory_table(recipe: FinetuneRecipe, hardware: str, base_config: dict[str, Any]) -> list[dict[str, Any]]:
    """Estimated GPU memory (GB) of finetuning a base with a Llama-like `config.json` dict.
    Activations: 2 bytes x tokens x (17 d_model + 5 d_ff) per layer (a layer with LoRA dropout and
    flash attention); with activation checkpointing only the layer inputs plus one layer are held."""
    c, cfg = base_config, recipe.train_config(hardware)
    h = c.get("hidden_size") or c["n_embd"]
    L = c.get("num_hidden_layers") or c["n_layer"]
    nh = c.get("num_attention_heads") or c["n_head"]
    hd = c.get("head_dim") or h // nh
    nkv = c.get("num_key_value_heads") or nh
    ff = c.get("intermediate_size") or c.get("n_inner") or 4 * h
    V = c["vocab_size"]
    shapes = {"q_proj": (h, nh * hd), "k_proj": (h, nkv * hd), "v_proj": (h, nkv * hd), "o_proj": (nh * hd, h),
              "gate_proj": (h, ff), "up_proj": (h, ff), "down_proj": (ff, h)}
    linear = L * sum(a * b for a, b in shapes.values())
    targets = recipe.lora.target_modules or tuple(shapes)
    lora = L * sum(recipe.lora.r * sum(shapes[t]) for t in targets if t in shapes)
    emb = V * h * (1 if c.get("tie_word_embeddings", True) else 2)
    half = 4 if hardware == "cpu" else 2
    nf4 = recipe.quantize == "nf4"
    tokens = cfg.micro_batch_size * cfg.seq_len
    layer_act = 2 * tokens * (17 * h + 5 * ff)
    ckpt = hardware in recipe.activation_checkpointing
    act = (L * 2 * tokens * h + layer_act) if ckpt else L * layer_act
    chunked = c.get("model_type") in PLAIN_HEAD_TYPES
    logits = (2**25 * 8) if chunked else tokens * V * 12  # fp16 logits + fp32 copy + fp32 log-softmax/grad
    gb = 1e9
    rows = [
        ("base weights", (linear * (0.516 if nf4 else half) + emb * half) / gb,
         "NF4: 4 bits + double-quantized scales (0.127 bits) per linear weight; embeddings stay 16-bit" if nf4
         else f"{half} bytes per weight"),
        ("adapters", lora * 4 / gb, f"{lora / 1e6:.1f}M LoRA weights in fp32"),
        ("gradients + AdamW", lora * 12 / gb, "fp32 gradient and two moments per adapter weight"),
        ("activations", act / gb, f"micro-batch {cfg.micro_batch_size} x {cfg.seq_len}, "
         f"{'with' if ckpt else 'without'} activation checkpointing"),
        ("logits + loss", logits / gb, "chunked cross-entropy" if chunked else "full (tokens, vocab) logits"),
    ]
    out = [{"part": p, "gb": round(v, 3), "how": how} for p, v, how in rows]
    return out + [{"part": "total", "gb": round(sum(r["gb"] for r in out), 3), "how": "+ ~1 GB CUDA context"}]


# ----- base models --------------------------------------------------------------------------------
def is_tinygpt_run(base: str | Path) -> bool:
    return (Path(base).expanduser() / "run.json").is_file()


def export_tinygpt_base(run_dir: str | Path, out_dir: str | Path, which: str = "latest") -> Path:
    """Write a tinygpt run's model as a `LlamaForCausalLM` folder (config.json, model.safetensors,
    tokenizer files), atomically: a folder that exists is complete."""
    from .checkpoint import load_model_state, load_run
    _need("transformers", "finetuning")
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model, tok, recipe, ckpt = load_run(run_dir, which)
    hf = LlamaForCausalLM(LlamaConfig(**recipe.model.to_hf_llama()))
    load_model_state(hf, model.state_dict())
    out = Path(out_dir)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    hf.save_pretrained(tmp)
    # bos = end-of-text: tinygpt documents are separated by it, so a prompt starts the way a document does
    PreTrainedTokenizerFast(tokenizer_object=tok.tok, bos_token=tok.eot, eos_token=tok.eot,
                            pad_token=tok.eot).save_pretrained(tmp)
    (tmp / "tinygpt_source.json").write_text(json.dumps({"run_dir": str(Path(run_dir).resolve()),
                                                        "checkpoint": str(ckpt)}))
    os.replace(tmp, out)
    return out


def _bnb_config(compute_dtype: torch.dtype):
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def check_qlora(device: torch.device) -> None:
    """Raise a FinetuneError unless bitsandbytes can run an NF4 layer forward and backward on `device`."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # ImportError, or a broken CUDA setup raising at import
        raise FinetuneError(f"QLoRA needs bitsandbytes, which cannot be imported ({e}): `pip install bitsandbytes`, "
                            "or choose a LoRA recipe such as lora-r16") from e
    if device.type not in ("cuda", "cpu", "xpu"):
        raise FinetuneError(f"QLoRA: bitsandbytes has no 4-bit kernels for {device.type}; "
                            "use a LoRA recipe (lora-r16) or a CUDA GPU")
    try:
        layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4").to(device)
        x = torch.randn(2, 64, device=device, requires_grad=True)
        layer(x).sum().backward()
    except Exception as e:
        raise FinetuneError(f"QLoRA: bitsandbytes {bnb.__version__} cannot run a 4-bit NF4 layer on {device}: "
                            f"{type(e).__name__}: {e}. Use a LoRA recipe (lora-r16) instead") from e


def _cpu_safe_4bit(model: torch.nn.Module) -> None:
    """On CPUs with AVX512-BF16, bitsandbytes 0.50 repacks a 4-bit weight in place the first time it
    runs in eval mode (e.g. a validation pass), with bf16 scales and a kernel that has no backward:
    outputs shift and later gradients through the layer are wrong. Keep the standard layout."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def load_tokenizer(path: str):
    _need("transformers", "finetuning")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise FinetuneError(f"could not load the tokenizer of base {path!r}: {e}") from e


def base_config(path: str):
    """The `transformers` config of a base (a local folder or a Hub id): the cheap check that it exists."""
    _need("transformers", "finetuning")
    from transformers import AutoConfig

    p = Path(path).expanduser()
    if p.exists() and not (p / "config.json").is_file():
        raise FinetuneError(f"base {path!r} is a folder with neither run.json (a tinygpt run) nor config.json "
                            "(a Hugging Face model)")
    if not p.exists() and (path.startswith(("/", ".", "~")) or path.count("/") > 1):
        raise FinetuneError(f"base {path!r} does not exist: give a tinygpt run folder, a model folder or a "
                            "Hub id such as google/gemma-2-2b")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:
        raise FinetuneError(f"could not load base model {path!r}: {type(e).__name__}: {e}\nCheck the folder or "
                            "the Hub id and the network; gated models (Gemma, Llama) need their licence accepted on "
                            "the Hub and `hf auth login` (or HF_TOKEN set)") from e


def load_base(path: str, *, quantize: str = "none", dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu"):
    """A Hugging Face causal LM from a local folder or a Hub id, optionally in 4-bit NF4."""
    from transformers import AutoModelForCausalLM

    config = base_config(path)
    try:
        kw: dict[str, Any] = {"dtype": dtype}
        if getattr(config, "final_logit_softcapping", None):  # Gemma-2: sdpa ignores its soft-capping
            kw["attn_implementation"] = "eager"
        if quantize == "nf4":
            dev = torch.device(device)
            kw.update(quantization_config=_bnb_config(dtype),  # quantized as it loads, straight onto the device
                      device_map={"": torch.cuda.current_device() if dev.type == "cuda" and dev.index is None
                                      else (dev.index if dev.type == "cuda" else dev.type)})
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
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
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Without this, checkpointed blocks whose inputs do not require grad give the adapters none.
        model.enable_input_require_grads()
        model.config.use_cache = False
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        use_rslora=lora.use_rslora, use_dora=lora.use_dora, bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(seed)  # lora_A's initialisation draws from torch's RNG: same seed, same start
    pm = get_peft_model(model, config)
    for p in pm.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # fp16 adapters break the GradScaler ("Attempting to unscale FP16 gradients")
    return pm


def causal_lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed fp32 cross-entropy over targets that are not IGNORE_INDEX (x and y are already shifted)."""
    # A DDP wrapper (no get_base_model) must see the forward call: wrapped models take the plain path.
    hf = model.get_base_model() if hasattr(model, "get_base_model") else None
    head = hf.get_output_embeddings() if hf is not None else None
    if hf is not None and hf.config.model_type in PLAIN_HEAD_TYPES and isinstance(head, torch.nn.Linear) \
            and head.bias is None:
        from .losses import linear_cross_entropy
        hidden = hf.base_model(input_ids=x, use_cache=False).last_hidden_state
        return linear_cross_entropy(hidden, head.weight, y, reduction="sum", ignore_index=IGNORE_INDEX)
    logits = model(input_ids=x, use_cache=False).logits.float()
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter weights, with PEFT's key names: what goes into a checkpoint."""
    from peft import get_peft_model_state_dict
    return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict
    res = set_peft_model_state_dict(model, sd)
    missing = [k for k in res.missing_keys if "lora_" in k]
    if res.unexpected_keys or missing:
        raise FinetuneError(f"checkpoint does not fit the adapters: missing {missing[:4]}, "
                            f"unexpected {list(res.unexpected_keys)[:4]}")


def _adapter_dir(path: str | Path) -> Path:
    p = Path(path)
    p = p / ADAPTER_DIR if (p / ADAPTER_DIR).is_dir() else p
    if not (p / "adapter_model.safetensors").is_file():
        raise FinetuneError(f"{path} holds no adapter (no adapter_model.safetensors); finetune first, or "
                            "export_adapter(run_dir) to make one from a checkpoint")
    return p


def export_adapter(run_dir: str | Path, which: str = "latest", out_dir: str | Path | None = None) -> Path:
    """A PEFT adapter folder from one of a run's checkpoints ("latest", "best" or a folder): the checkpoint's
    model.safetensors already holds exactly PEFT's adapter weights under PEFT's names."""
    from .checkpoint import find_run_checkpoint
    run_dir = Path(run_dir)
    if not (run_dir / "adapter_config.json").is_file():
        raise FinetuneError(f"{run_dir} is not a finetuning run folder (no adapter_config.json)")
    ckpt = find_run_checkpoint(run_dir, which)
    out = Path(out_dir) if out_dir is not None else run_dir / ADAPTER_DIR
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(ckpt / "model.safetensors", tmp / "adapter_model.safetensors")
    for name in ("adapter_config.json", ADAPTER_INFO):
        shutil.copyfile(run_dir / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def load_finetuned(path: str | Path, *, base: str | None = None, merge: bool = False,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) of a finetuning run folder or adapter folder. merge=True folds the
    adapter into the base; for QLoRA it folds into the dequantized 4-bit base, the weights it was trained on
    (folding into 4-bit weights would round the sum back to 4 bits)."""
    _need("peft", "loading an adapter")
    from peft import PeftModel

    adir = _adapter_dir(path)
    info = json.loads((adir / ADAPTER_INFO).read_text()) if (adir / ADAPTER_INFO).is_file() else {}
    base = base or info.get("base_path") or json.loads((adir / "adapter_config.json").read_text())[
        "base_model_name_or_path"]
    quantize = info.get("quantize", "none")
    model = load_base(base, quantize=quantize, dtype=dtype, device=device)
    if "signature" in info:
        check_signature(info["signature"], model, f"adapter {adir}")
    if merge and quantize == "nf4":
        model = model.dequantize()
        model.is_loaded_in_4bit = False
    try:
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
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                         eos_token_id=codec.eos_id, pad_token_id=codec.pad_id, **kw)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


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


def finetune(recipe: str | FinetuneRecipe, base: str, data: str, run_dir: str | Path, max_steps: int | None = None,
             hardware: str | None = None, resume: str = "auto", callbacks=(), *, train: dict | None = None,
             device: str | None = None, progress: bool = True, mirror: str | Path | None = None) -> FinetuneResult:
    """LoRA / QLoRA finetune `base` (tinygpt run folder, model folder or Hub id) on instruction `data`
    into `run_dir`, resuming from its newest valid checkpoint; the adapter lands in run_dir/adapter."""
    from .precision import choose_precision, resolve_device
    from .trainer import Trainer, config_differences

    rec = get_finetune_recipe(recipe) if isinstance(recipe, str) else recipe
    if resume not in ("auto", "never"):
        raise FinetuneError(f"resume must be 'auto' or 'never', got {resume!r}")
    run_dir = Path(run_dir)
    if mirror is not None:
        from .drive import Mirror, restore_latest
        restore_latest(run_dir, Path(mirror))
    old = json.loads((run_dir / FINETUNE_INFO).read_text()) if (run_dir / FINETUNE_INFO).is_file() else None
    dev = resolve_device(device or "auto")
    # Colab may hand a resumed run another GPU: it keeps the settings it started with (same data rows).
    hardware = hardware or (old or {}).get("hardware") or detect_hardware(dev)
    overrides = {**(train or {}), **({"max_steps": max_steps} if max_steps is not None else {})}
    cfg = rec.train_config(hardware, **overrides)
    precision = choose_precision(dev, cfg.precision)
    if rec.quantize == "nf4":
        check_qlora(dev)
    tinygpt_base = is_tinygpt_run(base)
    if not tinygpt_base:
        base_config(base)  # a missing or unloadable base fails here, before anything is written
    info = {"recipe": rec.to_dict(), "base": str(Path(base).resolve()) if tinygpt_base else base, "data": data,
            "hardware": hardware}
    if old is not None:
        def identity(i: dict) -> dict:  # what makes two runs the same run (the Trainer checks TrainConfig)
            return {k: i.get(k) for k in ("base", "data", "hardware")} | {
                k: i["recipe"].get(k) for k in ("lora", "quantize", "template", "pack")}
        diffs = config_differences(identity(old), identity(info))
        if diffs:
            raise FinetuneError(f"run folder {run_dir} holds another finetuning run:\n  " + "\n  ".join(diffs)
                                + "\nuse a new run folder, or the same settings to resume")
    from .checkpoint import list_checkpoints
    if resume == "never" and list_checkpoints(run_dir / "checkpoints"):
        raise FinetuneError(f"run folder {run_dir} already has checkpoints; resume='never' would overwrite them")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / FINETUNE_INFO).write_text(json.dumps(info, indent=1))
    base_path = base
    if tinygpt_base:
        base_path = str((run_dir / BASE_DIR).resolve())
        if not (run_dir / BASE_DIR / "config.json").is_file():
            export_tinygpt_base(base, base_path)
    config = base_config(base_path)
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_pos and cfg.seq_len > max_pos:
        if "seq_len" in overrides:
            raise FinetuneError(f"seq_len {cfg.seq_len} is longer than the base's context of {max_pos} tokens")
        cfg = dataclasses.replace(cfg, seq_len=max_pos)  # the recipe's default, cut to what the base knows
    # Tokenizer and data first: a bad record fails in seconds, not after a 5 GB download.
    tok = load_tokenizer(base_path)
    dataset = build_instruct_data(data, tok, cfg.seq_len, template=rec.template, pack=rec.pack, seed=cfg.seed,
                                  val_batch_size=cfg.micro_batch_size, eval_batches=cfg.eval_batches)
    dtype = precision.dtype if dev.type == "cuda" else torch.float32
    model = load_base(base_path, quantize=rec.quantize, dtype=dtype, device=dev)
    pm = attach_lora(model, rec.lora, activation_checkpointing=hardware in rec.activation_checkpointing, seed=cfg.seed)
    peft_config = dataclasses.replace(pm.peft_config["default"], inference_mode=True)  # as PEFT saves it
    peft_config.save_pretrained(str(run_dir))  # adapter_config.json + any checkpoint = an adapter (export_adapter)
    (run_dir / ADAPTER_INFO).write_text(json.dumps(
        {"base": info["base"], "base_path": base_path, "quantize": rec.quantize, "template": rec.template,
         "signature": base_signature(model)}, indent=1))
    n_train = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in pm.parameters())
    callbacks = list(callbacks)
    if mirror is not None:
        callbacks.append(Mirror(run_dir, Path(mirror), keep_last=cfg.keep_last))
    trainer = Trainer(pm, cfg, dataset.train, dataset.val_batches, run_dir, device=dev, precision=precision,
                      loss_fn=causal_lm_loss, state_fn=adapter_state, load_state_fn=load_adapter_state,
                      callbacks=callbacks, run_info=info, progress=progress)
    try:
        result = trainer.fit(resume)
    finally:
        for cb in callbacks:
            if hasattr(cb, "close"):
                cb.close()
    adapter_dir = None
    if not result.interrupted:
        adapter_dir = export_adapter(run_dir, str(result.checkpoint or "latest"))
        tok.save_pretrained(adapter_dir)
    mem = memory_table(rec, hardware, model.config.to_dict())
    return FinetuneResult(run_dir, adapter_dir, result, dataset.report, hardware, n_train, n_total, mem, pm.eval(), tok)
