"""Configuration dataclasses: the model, the training run, the data (the named recipes made of them
are `core.recipes`).

Every dataclass validates itself in ``__post_init__`` so that a bad configuration fails with a
message that says what to change, before any tokenizer is trained or any memory is allocated. A
field's allowed values are declared once, on the field: a `Literal` annotation for a fixed set of
words, bounds in its metadata for a number (`core.fields`, which checks them and gives the command
line its choices). What relates two fields stays an explicit rule in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from tinygpt.core.families import FAMILIES, Family
from tinygpt.core.fields import bounded, field_problem


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""


# Muon orthogonalises each hidden matrix; on a fused
# q/k/v or gate/up matrix that would be other math.
FUSED_PROJ_MUON = (
    "fused_proj=True does not work with optimizer='muon' (Muon orthogonalises q/k/v and gate/up "
    "as separate matrices): set fused_proj=False, or use optimizer='adamw'"
)


# GPT-2's BPE: what the gpt2 tokenizer, nanoGPT's files and llm.c's GPT-2 shards hold
GPT2_VOCAB = 50257
GPT2_VOCAB_PADDED = 50304  # 50257 rounded up to a multiple of 128: faster matmuls, same tokenizer
INIT_TOKENIZER = "init"  # DataConfig.tokenizer of a continued run: the base's own tokenizer


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_fields(obj: Any, where: str) -> None:
    """Each field of `obj` as declared (a Literal's values,
    a number's type and bounds): `field_problem`."""
    if (problem := field_problem(obj, where)) is not None:
        raise ConfigError(problem)


# --- the model -------------------------------------------------------------------------------
# Each ModelConfig field says beside its declaration how it reads in a transformers config (`hf`)
# and in a GGUF file (`gguf`), and whether it is part of the network (`network`: two configs that
# differ there are different networks; the rest are context, initialisation, speed and memory
# choices). `to_hf_llama`, `from_hf_llama`, `to_gguf` and `network_fields` read these; nothing else
# spells the fields' names in those formats. An option that a format cannot hold says so in its
# metadata: "lacks" names the formats that have no equivalent of it when it is set (not its
# default): "hf" (transformers, and so llama.cpp and finetuning, which go through transformers'
# families), "gguf" (llama.cpp), "gguf:FAMILY" (llama.cpp's architecture of that family).
# `ModelConfig.export_gaps` reads it; export, GGUF, finetuning and the hints a run ends with ask it.
REQUIRED = dataclasses.MISSING  # a config.json without this key does not describe a model
AttnImpl = Literal["sdpa", "fa3"]  # the attention kernel (`tinygpt.model.attention`)
# The SwiGLU gate's activation (`ModelConfig.mlp_act`); relu2 is ReLU squared, as transformers'
# ACT2FN names it
MlpAct = Literal["silu", "relu2"]


def _hf(
    key: str, missing: Any = REQUIRED, network: bool = True, gguf: str | None = None, **rules: Any
) -> dict[str, Any]:
    """A field's metadata: its transformers config key, the value a config.json without the key
    means (transformers' own default), whether it is part of the network, how a GGUF file says it
    (gguf's writer method `GGUFWriter.add_{gguf}`, which knows llama.cpp's key and type), and its
    other rules (bounds, "lacks", "identity")."""
    return {
        "hf": key,
        "hf_missing": missing,
        "network": network,
        **({"gguf": gguf} if gguf else {}),
        **rules,
    }


def _arch(**rules: Any) -> dict[str, Any]:
    """The metadata of an architecture option transformers has no layer for (so neither has
    llama.cpp): part of the network, and in a run's identity only where set."""
    return {"network": True, "identity": "when_set", "lacks": ("hf",), **rules}


class _Section:
    """A recipe section (model, train, data) as a plain dict and back. A key this version does not
    know (a run.json written by a newer tinygpt) is left out rather than refused."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class ModelConfig(_Section):
    """A Llama-style decoder. Field names follow nanoGPT; each field's Hugging Face name stands beside it,
    and the choices are resolved once: `family` (which transformers / llama.cpp architecture),
    `head_dim`; `tinygpt.model.gpt` builds the layers from them (`norm_class`, `rope_tables`)."""

    vocab_size: int = field(default=4096, metadata=_hf("vocab_size", gguf="vocab_size", min=2))
    n_layer: int = field(default=4, metadata=_hf("num_hidden_layers", gguf="block_count", min=1))
    n_head: int = field(default=4, metadata=_hf("num_attention_heads", gguf="head_count", min=1))
    # None: as many as n_head (no grouped-query attention)
    n_kv_head: int | None = field(
        default=None, metadata=_hf("num_key_value_heads", None, gguf="head_count_kv", min=1)
    )
    d_model: int = field(default=256, metadata=_hf("hidden_size", gguf="embedding_length", min=1))
    # None: about 8/3 d_model rounded up to a multiple of 64 (SwiGLU)
    d_ff: int | None = field(
        default=None, metadata=_hf("intermediate_size", gguf="feed_forward_length", min=1)
    )
    max_seq_len: int = field(
        default=256,
        metadata=_hf("max_position_embeddings", 2048, network=False, gguf="context_length", min=1),
    )
    rope_theta: float = field(
        default=10000.0, metadata=_hf("rope_theta", 10000.0, gguf="rope_freq_base", above=0)
    )
    norm_eps: float = field(
        default=1e-5, metadata=_hf("rms_norm_eps", 1e-6, gguf="layer_norm_rms_eps", above=0)
    )
    tie_embeddings: bool = field(default=False, metadata=_hf("tie_word_embeddings", False))
    init_std: float = field(
        default=0.02, metadata=_hf("initializer_range", 0.02, network=False, above=0)
    )
    # A bias on each attention projection (q, k, v and o; initialised at zero),
    # as Llama's and Qwen3's attention_bias; the MLP stays without (Llama's
    # mlp_bias is a separate key, Qwen3 has none). Newer than identity.json: in
    # a run's identity only where set. llama.cpp's qwen3 has no such bias.
    attention_bias: bool = field(
        default=False,
        metadata=_hf("attention_bias", False, identity="when_set", lacks=("gguf:qwen3",)),
    )
    activation_checkpointing: bool = field(default=False, metadata={"identity": "never"})
    # Speed-run choices (modded-nanogpt), each kept only where it measured better
    # at our scale (docs/BENCHMARKS.md): an RMSNorm on each head's queries and
    # keys before RoPE (Qwen3's q_norm and k_norm: in Hugging Face terms the
    # family, see `family`), and the projections into the residual stream (o_proj,
    # down_proj) initialised at zero, so that every block starts as the identity.
    qk_norm: bool = field(default=False, metadata={"network": True})
    zero_init_proj: bool = False
    # One matmul for q/k/v and one for gate/up instead of five: fewer, larger kernels, which a GPU
    # runs faster. The same math and, with the same seed, the same initial weights, so it changes
    # speed, not the run; saved files keep the separate Hugging Face names. Off until measured
    # faster (docs/BENCHMARKS.md).
    fused_proj: bool = field(default=False, metadata={"identity": "never"})
    # Speed options, off until a GPU measures each faster with the same loss curve
    # (`tinygpt.model.fast_options`): the residual stream in bf16 under bf16 autocast (a rounding
    # choice, as train.precision is, so not the run's identity); the attention kernel, "fa3":
    # FlashAttention-3 from the Hugging Face kernels hub on Hopper (the same math as SDPA's).
    bf16_residual: bool = field(default=False, metadata={"identity": "never"})
    attn_impl: AttnImpl = field(default="sdpa", metadata={"identity": "never"})
    # modded-nanogpt's architecture changes, each off by default (docs/RECIPES.md).
    # logit_softcap: logits = c * tanh(logits / c), in the loss and in generation
    # (Gemma 2's final_logit_softcapping). mlp_act: the SwiGLU gate's activation
    # (transformers' hidden_act; llama.cpp's gated MLP has no relu2). value_embeds:
    # N token-embedding tables, each mixed by a learned weight into the attention
    # values of one of the first N blocks and of its mirror among the last N.
    # unet_skips: each block of the first half hands its output, by a learned
    # weight, to the input of its mirror in the second half.
    logit_softcap: float | None = field(default=None, metadata=_arch(above=0))
    mlp_act: MlpAct = field(
        default="silu",
        metadata=_hf("hidden_act", "silu", identity="when_set", lacks=("gguf",)),
    )
    value_embeds: int = field(default=0, metadata=_arch(min=0))
    unet_skips: bool = field(default=False, metadata=_arch())
    # Where the weights start (continued pretraining, `tinygpt.pretrain.init`): None,
    # a seeded random initialisation; else hf:NAME[@REVISION], a Hugging Face
    # model folder or a tinygpt run folder, whose architecture the fields above
    # then repeat. Read once, at a run's first step; a resume does not read it.
    init: str | None = None

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_ff is None and isinstance(self.d_model, int):
            self.d_ff = 64 * math.ceil(8 * self.d_model / 3 / 64)
        _check_fields(self, "model.")
        _require(
            self.d_model % self.n_head == 0,
            f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})",
        )
        _require(
            self.head_dim % 2 == 0,
            f"head_dim = d_model / n_head must be even for RoPE, got {self.head_dim}",
        )
        _require(
            self.n_kv_head <= self.n_head and self.n_head % self.n_kv_head == 0,
            f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})",
        )
        _require(
            2 * self.value_embeds <= self.n_layer,
            f"model.value_embeds ({self.value_embeds}) must be at most n_layer / 2 "
            f"({self.n_layer // 2}): its tables feed the first and the last value_embeds blocks",
        )
        _require(
            not self.unet_skips or self.n_layer >= 2,
            "model.unet_skips needs n_layer >= 2: it joins the first half of the blocks to the second",
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def family(self) -> Family:
        """The transformers (and llama.cpp) architecture
        with these layers: Llama, or Qwen3 with QK-norm."""
        return next(f for f in FAMILIES.values() if f.qk_norm == self.qk_norm)

    @classmethod
    def network_fields(cls) -> tuple[str, ...]:
        """The fields that make two configs the same network (and so the same weights' meaning)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("network"))

    def identity(self) -> dict[str, Any]:
        """The fields that make a run the same run (the mirror's identity.json hashes them, with the
        data): not the speed and memory choices a probe may make otherwise on another GPU
        (`identity` "never"), and an option added since identity.json began only where it is set
        ("when_set"), so that a run begun before the option existed keeps its identity."""
        out = {}
        for f in dataclasses.fields(self):
            rule, value = f.metadata.get("identity", "always"), getattr(self, f.name)
            if rule == "always" or (rule == "when_set" and value != f.default):
                out[f.name] = value
        return out

    def export_gaps(self, target: Literal["hf", "gguf"] = "hf") -> list[str]:
        """The options set here that `target` has no equivalent of, as NAME=VALUE ([] when the model
        exports to it): the fields whose metadata "lacks" names it (a GGUF lacks what transformers
        lacks too), set to other than their default."""
        names = {"hf"} | ({"gguf", f"gguf:{self.family.model_type}"} if target == "gguf" else set())
        return [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if names & set(f.metadata.get("lacks", ())) and getattr(self, f.name) != f.default
        ]

    def check_exports(self, target: Literal["hf", "gguf"] = "hf") -> None:
        """Refuse, in one line, a model that `target` cannot hold (`export_gaps`)."""
        if gaps := self.export_gaps("hf"):
            raise ConfigError(
                f"transformers' {self.family.title} (and llama.cpp) cannot load a model with "
                f"{', '.join(gaps)}: it has no export and cannot be finetuned; tinygpt "
                "generate and eval use it as it is (every named recipe exports: tinygpt recipes)"
            )
        if gaps := self.export_gaps(target):
            raise ConfigError(
                f"llama.cpp's {self.family.model_type} architecture cannot load a model "
                f"with {', '.join(gaps)}: export to Hugging Face format instead (tinygpt "
                "export RUN OUT)"
            )

    def _by_metadata(self, key: str) -> dict[str, Any]:
        """{a field's name in a format (metadata `key`): its value}, for the fields it has."""
        fields = dataclasses.fields(self)
        return {f.metadata[key]: getattr(self, f.name) for f in fields if key in f.metadata}

    def to_hf_llama(self) -> dict[str, Any]:
        """The keyword arguments of the equivalent transformers config
        (`family.config_class`: `LlamaConfig`, or `Qwen3Config` with
        QK-norm); a model it cannot hold is refused (`check_exports`)."""
        self.check_exports("hf")
        mapped = self._by_metadata("hf")
        fixed = {key: value for key, (value, _) in self.family.hf_fixed.items()}
        return {**mapped, **fixed, "head_dim": self.head_dim}

    def to_gguf(self) -> dict[str, int | float]:
        """The model's llama.cpp metadata: {name: value} for gguf's writer method
        `GGUFWriter.add_{name}`; a model llama.cpp cannot load is refused (`check_exports`)."""
        self.check_exports("gguf")
        mapped = self._by_metadata("gguf")
        head = self.head_dim  # keys and values as wide as the queries, all of each head rotated
        return {**mapped, "key_length": head, "value_length": head, "rope_dimension_count": head}

    @classmethod
    def from_hf_llama(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Llama or Qwen3 `config.json`
        dictionary (a missing required key: KeyError)."""
        kw, cast = {}, {"float": float, "bool": bool}
        for f in dataclasses.fields(cls):
            if "hf" in f.metadata:
                value = _hf_value(hf, f.metadata["hf"], f.metadata["hf_missing"])
                kw[f.name] = cast.get(str(f.type), lambda v: v)(value)
        head_dim = hf.get("head_dim") or kw["d_model"] // kw["n_head"]
        _require(
            head_dim * kw["n_head"] == kw["d_model"],
            "tinygpt needs head_dim * num_attention_heads == hidden_size",
        )
        family = FAMILIES.get(hf.get("model_type"), FAMILIES["llama"])
        return cls(**kw, qk_norm=family.qk_norm)


def _hf_value(hf: dict[str, Any], key: str, missing: Any) -> Any:
    """`hf[key]`, or where transformers >= 5 keeps it (rope
    settings under rope_parameters), or `missing`."""
    for where in (hf, hf.get("rope_parameters") or {}):
        if where.get(key) is not None:
            return where[key]
    if missing is REQUIRED:
        raise KeyError(key)
    return missing


# The words a TrainConfig field takes (each one Literal:
# the command line's choices are read from it).
Optimizer = Literal["adamw", "muon"]  # muon: Muon for the hidden matrices, AdamW for the rest
# both reach min_lr at the last step run (max_steps - 1, `lr_at`): cosine from the end of the warmup;
# wsd: warmup, stable, then a linear decay over decay_fraction
Schedule = Literal["cosine", "wsd"]
PrecisionName = Literal["auto", "bf16", "fp16", "fp32"]  # auto: the device's best (core.precision)
# Muon's orthogonalisation: torch's quintic Newton-Schulz (one coefficient triple, 5 steps), or Polar
# Express (Amsel et al. 2025: a tuned triple per step, modded-nanogpt's choice since 2025)
MuonCoeffs = Literal["newton-schulz", "polar-express"]
# auto: on CUDA, by regions for a tinygpt GPT (each block, then the head and the loss), else the whole
# model; on: the whole model; regional: by regions; off
CompileMode = Literal["auto", "on", "regional", "off"]
# How the loss is taken (`tinygpt.model.losses.resolve_loss`): auto, on a GPU the full logits where
# they fit its free memory at the micro-batch, else in chunks (elsewhere by size); full; chunked.
LossMode = Literal["auto", "full", "chunked"]


@dataclass
class TrainConfig(_Section):
    """How to train: batch geometry, schedule, optimizer, and how often to evaluate and save."""

    micro_batch_size: int = bounded(8, min=1)
    seq_len: int = bounded(256, min=1)
    grad_accum_steps: int = bounded(1, min=1)
    max_steps: int = bounded(200, min=1)
    lr: float = bounded(1e-3, above=0)
    min_lr: float = bounded(1e-4, min=0)  # at most lr
    warmup_steps: int = bounded(20, min=0)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    optimizer: Optimizer = "adamw"
    schedule: Schedule = "cosine"
    # wsd: the last fraction of the steps decays
    decay_fraction: float = bounded(0.2, above=0, max=1)
    precision: PrecisionName = "auto"
    compile: CompileMode = "auto"
    loss: LossMode = "auto"
    fp8_head: bool = False  # the head's matmul in FP8 (torchao, sm89+): `model.fast_options`
    device: str = "auto"  # auto, cpu, cuda, cuda:1, mps...
    seed: int = 1337
    eval_every: int = bounded(50, min=0)  # 0: off
    eval_batches: int = bounded(8, min=1)
    log_every: int = bounded(10, min=1)
    save_every: int = bounded(100, min=0)  # 0: off
    keep_last: int = bounded(3, min=1)
    sample_every: int = bounded(0, min=0)  # 0: one sample at the end only
    # Training-time attention (`tinygpt.model.masks`; the saved model stays a plain causal LM and
    # is evaluated as one): doc_mask keeps each training window's documents apart (no attention
    # across an end-of-text token); window_start > 0 limits attention to that many tokens at the
    # first step, growing linearly to seq_len when the decay begins (cosine: at the last step).
    doc_mask: bool = False
    window_start: int = bounded(0, min=0)  # 0: the full context throughout
    # AdamW's rates for the input embedding and the untied head, relative to lr (modded-nanogpt
    # gives the embedding a far larger rate than the head); Muon's orthogonalisation
    embed_lr_scale: float = bounded(1.0, above=0)
    head_lr_scale: float = bounded(1.0, above=0)
    muon_coeffs: MuonCoeffs = "newton-schulz"
    # NorMuon: each output neuron's (row's) share of Muon's orthogonalised update divided by its
    # own running RMS, the update's norm kept (`optim.normalize_rows`)
    normuon: bool = False
    # Batch-size warm-up (`core.batch_schedule`): a step's sequences grow linearly from batch_start
    # of the global batch to all of it at batch_warmup of max_steps (optimizer steps, so fewer tokens).
    batch_warmup: float = bounded(0.0, min=0, below=1)  # 0: the full batch from the first step
    batch_start: float = bounded(0.25, above=0, max=1)

    def __post_init__(self) -> None:
        _check_fields(self, "train.")
        _require(
            self.min_lr <= self.lr,
            f"train.min_lr must be at most lr ({self.lr}), got {self.min_lr}",
        )
        _require(
            self.optimizer == "muon"
            or (
                self.embed_lr_scale == self.head_lr_scale == 1.0
                and self.muon_coeffs == "newton-schulz"
                and not self.normuon
            ),
            "train.embed_lr_scale, head_lr_scale, muon_coeffs and normuon apply to "
            "optimizer='muon': set train.optimizer=muon or leave them at their defaults",
        )
        _require(
            self.batch_warmup > 0 or self.batch_start == 0.25,
            "train.batch_start is the batch warm-up's first fraction of the batch: set "
            "train.batch_warmup (a fraction of max_steps) too, or leave batch_start at 0.25",
        )
        _require(
            self.window_start <= self.seq_len,
            f"train.window_start must be at most seq_len ({self.seq_len}), got "
            f"{self.window_start}; 0 keeps the full context throughout",
        )

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step: the global batch
        (under torchrun it is split over the processes)."""
        return self.micro_batch_size * self.seq_len * self.grad_accum_steps


@dataclass
class DataConfig(_Section):
    """Where the text comes from and how it becomes tokens.

    ``source``: ``builtin`` (the Python standard library's own source, always offline), a local file
    or folder, or a Hugging Face dataset as ``hf:NAME[:CONFIG][@SPLIT]``. ``tokenizer``: ``train``
    (a byte-level BPE of ``vocab_size`` trained on the source), ``gpt2`` (the GPT-2 BPE from
    vocab/merges files), ``init`` (the base's own, in continued pretraining: `model.init`), or a
    path to a ``tokenizer.json``.
    """

    source: str = "builtin"
    tokenizer: str = "train"
    vocab_size: int = bounded(
        4096,
        min=256 + 1,
        max=2**32 - 1,
        why="a byte-level BPE needs at least 257 (256 bytes + end-of-text) and the "
        "token cache holds at most 2**32 - 1 ids",
    )
    max_chars: int | None = bounded(None, min=1)  # read at most this many characters of the source
    val_fraction: float = bounded(0.05, above=0, below=0.5)
    text_field: str = "text"

    def __post_init__(self) -> None:
        _require(
            isinstance(self.source, str) and self.source.strip() != "",
            "data source must not be empty",
        )
        _check_fields(self, "data.")
