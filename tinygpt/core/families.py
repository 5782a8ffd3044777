"""The transformers (and llama.cpp) architectures that are exactly the GPT: `Family` and the
`FAMILIES` table (llama, qwen3), which `ModelConfig.family` looks up, each with the keys of a
transformers config whose value the GPT always has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """A transformers architecture with exactly the GPT's layers and parameter names (and the llama.cpp
    architecture of the same name): the one place an export, an import, a GGUF file and a model card
    look up what the model is called."""

    model_type: str  # config.json's model_type, and llama.cpp's architecture
    title: str  # `{title}Config` and `{title}ForCausalLM` in transformers; the model card's name
    qk_norm: bool  # the ModelConfig.qk_norm of this family's models
    # What the GPT always is, as a transformers config says it: key -> (the GPT's
    # value, why another value is not this GPT). `to_hf_llama` writes these;
    # `tinygpt.model.hf_import.representation_gaps` refuses a config.json that differs. A
    # new option that makes one of them a choice moves it from here into a field.
    hf_fixed: dict[str, tuple[Any, str]]
    rope_pairs: bool  # llama.cpp rotates adjacent pairs (not halves): GGUF q/k rows are permuted

    @property
    def config_class(self) -> str:
        return f"{self.title}Config"

    @property
    def model_class(self) -> str:
        return f"{self.title}ForCausalLM"


FAMILIES = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "Llama",
            False,
            {"mlp_bias": (False, "tinygpt's MLP has no biases")},
            rope_pairs=True,
        ),
        # Qwen3: Llama's layers plus an RMSNorm on each head's
        # queries and keys; full attention, no sliding window.
        Family(
            "qwen3",
            "Qwen3",
            True,
            {"use_sliding_window": (False, "tinygpt's attention is full")},
            rope_pairs=False,
        ),
    )
}
