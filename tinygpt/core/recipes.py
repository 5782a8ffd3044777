"""The named recipes and model sizes: what `tinygpt recipes` lists and `--recipe NAME` trains.

`Recipe` is a model, a training and a data section checked together (the sections' dataclasses
and rules are `core.config`'s); a recipe is one `Recipe` constant here plus its name in `RECIPES`.
`MODEL_SIZES` names the model shapes the recipes (and the benchmarks) build on. How a command
chooses one (`RecipeChoice`, `--set` overrides) is `core.recipe_choice`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tinygpt.core.batch_schedule import tokens_through
from tinygpt.core.config import (
    FUSED_PROJ_MUON,
    GPT2_VOCAB,
    GPT2_VOCAB_PADDED,
    INIT_TOKENIZER,
    ConfigError,
    DataConfig,
    ModelConfig,
    TrainConfig,
    _require,
)
from tinygpt.core.gpu_classes import HARDWARE
from tinygpt.core.options import did_you_mean

# Named model sizes. Parameter counts are for the GPT-2 vocabulary padded to 50304;
# `tinygpt recipes` prints the exact count for each recipe's vocabulary. The two largest have 24
# layers, grouped-query attention with 8 KV heads and a tied embedding.
_GQA_24 = dict(n_layer=24, n_head=16, n_kv_head=8, tie_embeddings=True)
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=2, n_head=2, d_model=64, d_ff=192, max_seq_len=128),
    "cpu": dict(n_layer=4, n_head=4, d_model=192, d_ff=512, max_seq_len=256),
    "16m": dict(n_layer=6, n_head=4, d_model=256, d_ff=704, tie_embeddings=True, max_seq_len=512),
    "50m": dict(n_layer=8, n_head=8, d_model=512, d_ff=1408, tie_embeddings=True, max_seq_len=1024),
    "124m": dict(
        n_layer=12, n_head=12, d_model=768, d_ff=2048, tie_embeddings=True, max_seq_len=1024
    ),
    "350m": dict(_GQA_24, d_model=1024, d_ff=3072, max_seq_len=1024),
    "760m": dict(_GQA_24, d_model=1536, d_ff=4608, max_seq_len=2048),
}


@dataclass
class Recipe:
    """A named, ready configuration for one class of hardware."""

    name: str
    description: str
    hardware: str  # the class it is made for: a key of `core.gpu_classes.HARDWARE`
    model: ModelConfig
    train: TrainConfig
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        _require(
            self.train.seq_len <= self.model.max_seq_len,
            f"recipe {self.name!r}: seq_len {self.train.seq_len} is longer than the model's "
            f"max_seq_len {self.model.max_seq_len}; lower seq_len or raise max_seq_len",
        )
        _require(
            self.model.vocab_size >= self.data.vocab_size,
            f"recipe {self.name!r}: the model's vocab_size {self.model.vocab_size} is smaller than "
            f"the tokenizer's {self.data.vocab_size}",
        )
        _require(
            not (self.model.fused_proj and self.train.optimizer == "muon"),
            f"recipe {self.name!r}: {FUSED_PROJ_MUON}",
        )
        # the tokenizers this knows before one is read: GPT-2's size, and that a base's needs a base
        _require(
            self.data.tokenizer != "gpt2" or self.model.vocab_size >= GPT2_VOCAB,
            f"recipe {self.name!r}: data.tokenizer=gpt2 has {GPT2_VOCAB} tokens but the model's "
            f"vocab_size is {self.model.vocab_size}: add model.vocab_size={GPT2_VOCAB_PADDED}",
        )
        _require(
            self.data.tokenizer != INIT_TOKENIZER or self.model.init is not None,
            f"data.tokenizer={INIT_TOKENIZER} takes the tokenizer of the base, but model.init "
            "names none: use --init BASE, or data.tokenizer=train",
        )

    @property
    def token_budget(self) -> int:
        return tokens_through(self.train, self.train.max_steps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Recipe":
        return cls(
            name=d["name"],
            description=d.get("description", ""),
            hardware=d.get("hardware", "cpu"),
            model=ModelConfig.from_dict(d["model"]),
            train=TrainConfig.from_dict(d["train"]),
            data=DataConfig.from_dict(d.get("data", {})),
        )

    def identity(self) -> dict[str, Any]:
        """What makes two runs the same run, for the mirror's identity: the
        recipe's name, the model (less what the probe may choose otherwise on
        another GPU: `ModelConfig.identity`) and the data. Training settings are
        compared against run.json instead, where some may change on resume."""
        return {"recipe": self.name, "model": self.model.identity(), "data": self.data.to_dict()}

    def replace(
        self, model: dict | None = None, train: dict | None = None, data: dict | None = None
    ) -> "Recipe":
        """A copy with some fields changed, validated again."""
        return replace(
            self,
            model=replace(self.model, **(model or {})),
            train=replace(self.train, **(train or {})),
            data=replace(self.data, **(data or {})),
        )


def model_config(size: str, **overrides: Any) -> ModelConfig:
    """A named model size, e.g. ``model_config("124m", vocab_size=50304)``."""
    if size not in MODEL_SIZES:
        raise ConfigError(f"unknown model size {size!r}; choose one of {', '.join(MODEL_SIZES)}")
    return ModelConfig(**{**MODEL_SIZES[size], **overrides})


def _train(
    micro_batch_size: int, seq_len: int, grad_accum_steps: int, every: int, **kw: Any
) -> TrainConfig:
    """A recipe's training: a batch of micro_batch_size x seq_len x grad_accum_steps tokens,
    evaluated where it saves, `every` steps (each checkpoint's val_loss is known, and `best/` is
    never older than the newest step)."""
    batch = dict(micro_batch_size=micro_batch_size, seq_len=seq_len)
    return TrainConfig(
        **batch, grad_accum_steps=grad_accum_steps, eval_every=every, save_every=every, **kw
    )


# The named recipes: one constant each, then its name in RECIPES (`tinygpt recipes` lists them in
# this order). The CPU recipes train their own BPE on the standard library's source (offline).
CPU_SMOKE = Recipe(
    "cpu-smoke",
    "A few seconds on any CPU: a 2-layer model, for tests and the notebooks' smoke mode.",
    "cpu",
    model_config("tiny", vocab_size=512),
    replace(
        _train(8, 64, 1, every=10, max_steps=30, lr=3e-3, min_lr=3e-4, warmup_steps=5),
        eval_batches=2,
        log_every=5,
        keep_last=2,
        precision="fp32",
    ),
    DataConfig(source="builtin", vocab_size=512, max_chars=400_000),
)
CPU = Recipe(
    "cpu",
    "The default on a CPU: a 3M-parameter model on the standard library's source, ~2 min on "
    "2 idle cores.",
    "cpu",
    model_config("cpu", vocab_size=4096),
    _train(
        16, 128, 1, every=100, max_steps=300, lr=2e-3, min_lr=2e-4, warmup_steps=30, keep_last=2
    ),
    DataConfig(source="builtin", vocab_size=4096, max_chars=4_000_000),
)
# The modded-nanoGPT changes the fast recipes make: in the network (QK-norm, zero-initialised
# projections) and in training (Muon for the hidden matrices, warmup-stable-decay to zero).
FAST_NETWORK = dict(qk_norm=True, zero_init_proj=True)
MUON_WSD = dict(optimizer="muon", schedule="wsd", decay_fraction=0.4, min_lr=0.0)
CPU_FAST = replace(
    CPU,
    name="cpu-fast",
    description="The cpu recipe's model made faster to a good loss: QK-norm, zero-initialised "
    "projections, Muon for the hidden matrices, warmup-stable-decay, 3 layers, half the batch: "
    "half the tokens, ~1 min.",
    model=model_config("cpu", vocab_size=4096, n_layer=3, **FAST_NETWORK),
    train=replace(CPU.train, micro_batch_size=8, lr=4e-3, warmup_steps=20, **MUON_WSD),
)

# The GPU recipes stream a Hub data set large enough for their token budget (a model trained for
# thousands of epochs on a few MB only memorises it); `--data builtin` trains offline instead.
TINYSTORIES = "hf:roneneldan/TinyStories"  # ~470M GPT-2 tokens of simple stories, easy to learn
FINEWEB_EDU = "hf:HuggingFaceFW/fineweb-edu:sample-10BT"  # ~10B tokens of educational web pages


def _gpu_recipe(
    name: str,
    description: str,
    train: TrainConfig,
    source: str = FINEWEB_EDU,
    max_chars: int | None = None,
    **model: Any,
) -> Recipe:
    """A GPU recipe, named HARDWARE-SIZE[-VARIANT] for its hardware class and model size: a model of
    that size (`model_config`, `model` overriding its fields) on a Hub data set (FineWeb-Edu unless
    `source` says otherwise) read through the GPT-2 tokenizer (50257 tokens, the embedding padded
    to GPT2_VOCAB_PADDED for the tensor cores), trained in its hardware class's precision (bf16,
    or fp16 with a GradScaler on a T4: `HardwareClass`)."""
    hardware, size = name.split("-")[:2]
    return Recipe(
        name,
        description,
        hardware,
        model_config(size, vocab_size=GPT2_VOCAB_PADDED, **model),
        replace(train, precision=HARDWARE[hardware].precision),
        DataConfig(source=source, tokenizer="gpt2", vocab_size=GPT2_VOCAB, max_chars=max_chars),
    )


# A T4's 16 GB and ~65 TFLOP/s suit 50M parameters at context 512 on TinyStories, a corpus such a
# model learns to write fluently within one Colab session.
T4_50M = _gpu_recipe(
    "t4-50m",
    "Colab's free T4 (fp16 + GradScaler): 50M parameters, context 512, GPT-2 tokenizer.",
    _train(16, 512, 8, every=250, max_steps=4000, lr=6e-4, min_lr=6e-5, warmup_steps=200),
    source=TINYSTORIES,
    max_seq_len=512,
)
# An L4 (24 GB, bf16) fits GPT-2 small at half the A100's micro-batch; its token budget is what it
# trains in about one 3-hour session.
L4_124M = _gpu_recipe(
    "l4-124m",
    "Colab's L4 (bf16): GPT-2-small scale, context 1024.",
    _train(16, 1024, 16, every=250, max_steps=5000, lr=6e-4, min_lr=6e-5, warmup_steps=300),
    max_chars=6_500_000_000,
)
# nanoGPT's GPT-2 small reproduction scaled to a Colab session: ~0.5M tokens per step
# (32 x 1024 x 16).
A100_124M = _gpu_recipe(
    "a100-124m",
    "The flagship: GPT-2-small scale (124M) at context 1024 in bf16, tuned for Colab's A100; 0.5M "
    "tokens per step.",
    _train(32, 1024, 16, every=250, max_steps=10000, lr=6e-4, min_lr=6e-5, warmup_steps=700),
    max_chars=25_000_000_000,
)
# The modded-nanoGPT changes that hold at this size (QK-norm, untied head, zero-init projections,
# Muon, WSD): the flagship's loss in half its steps and tokens; Muon's orthogonalised updates take a
# 2.5x learning rate.
A100_124M_FAST = _gpu_recipe(
    "a100-124m-fast",
    "GPT-2-small quality in half the flagship's tokens: the same size with QK-norm, an untied "
    "head, zero-initialised projections, Muon and warmup-stable-decay (exports as Qwen3).",
    _train(32, 1024, 16, every=250, max_steps=5000, lr=1.5e-3, warmup_steps=250, **MUON_WSD),
    max_chars=13_000_000_000,
    tie_embeddings=False,
    **FAST_NETWORK,
)
# The fast recipe with what modded-nanogpt's records changed in training rather than in the network
# (docs/RECIPES.md, benchmarks/results/2026-11-29-speedrun-ablation.md): the embedding's and the
# head's own AdamW rates (4.5e-2 and 6e-3, 60x and 8x train.lr), Adam's beta1 0.8, an attention
# window growing from a quarter of the context to all of it by the cool-down and NorMuon's
# per-neuron normalisation of Muon's update. train.lr, Muon's and the norms' rate, is half the fast
# recipe's: with the embedding and the head that fast, half lowered the loss of runs five times as
# long (the fast recipe's own loss it left level). 60% of the fast recipe's steps: at the ladder's
# small shape a run planned that short ended below the fast recipe's final loss on every corpus
# measured, on two seeds in runs five times as long.
# Polar Express (train.muon_coeffs), document masking (train.doc_mask) and the batch-size warm-up
# (train.batch_warmup) are options it leaves off: none lowered the loss at equal tokens there. The
# network is the fast recipe's: it exports as Qwen3.
A100_124M_SPEEDRUN = replace(
    A100_124M_FAST.replace(
        train=dict(
            max_steps=3000,
            warmup_steps=150,
            lr=7.5e-4,
            embed_lr_scale=60.0,
            head_lr_scale=8.0,
            beta1=0.8,
            window_start=256,
            normuon=True,
        ),
        data=dict(max_chars=8_000_000_000),
    ),
    name="a100-124m-speedrun",
    description="The fast recipe in 60% of its tokens: the embedding and the head learn at their "
    "own rates and the attention window grows during training; the same network, exports as "
    "Qwen3.",
)
# Three times the flagship's parameters: half the micro-batch, twice the accumulation (the same
# tokens per step), and a lower peak learning rate as the model grows (GPT-3's table: 6e-4, 3e-4,
# 2.5e-4).
A100_350M = _gpu_recipe(
    "a100-350m",
    "A larger model for an A100 or H100: 350M parameters, GQA, context 1024, bf16.",
    _train(16, 1024, 32, every=500, max_steps=20000, lr=3e-4, min_lr=3e-5, warmup_steps=1000),
)
# 80 GB holds 760M parameters at context 2048; GQA keeps the KV cache of its generation small.
H100_760M = _gpu_recipe(
    "h100-760m",
    "An H100 (80 GB): 760M parameters, GQA, context 2048, bf16.",
    _train(16, 2048, 16, every=500, max_steps=20000, lr=2.5e-4, min_lr=2.5e-5, warmup_steps=1000),
)

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        CPU_SMOKE,
        CPU,
        CPU_FAST,
        T4_50M,
        L4_124M,
        A100_124M,
        A100_124M_FAST,
        A100_124M_SPEEDRUN,
        A100_350M,
        H100_760M,
    )
}


def get_recipe(name: str) -> Recipe:
    """A fresh copy of a named recipe (safe to modify)."""
    if name not in RECIPES:
        raise ConfigError(
            f"unknown recipe {name!r}{did_you_mean(name, RECIPES)}; `tinygpt recipes` lists "
            f"them: {', '.join(RECIPES)}"
        )
    return Recipe.from_dict(RECIPES[name].to_dict())
