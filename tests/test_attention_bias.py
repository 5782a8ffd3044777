"""`ModelConfig.attention_bias`: a bias on each attention projection (q, k, v, o), as the `attention_bias` of
transformers' Llama and Qwen3 configs. A run with it trains on real text and exports with the same logits through
transformers; the memory estimate counts its parameters and their autocast copies."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import export_run

from tinygpt.core.config import ModelConfig
from tinygpt.core.recipes import get_recipe
from tinygpt.fit.memory import GB, estimate_memory
from tinygpt.model import hf_import
from tinygpt.model.gpt import GPT
from tinygpt.model.loading import load_run
from tinygpt.pretrain.run_pretrain import pretrain

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("qk_norm,arch", [(False, "LlamaForCausalLM"), (True, "Qwen3ForCausalLM")])
def test_a_run_with_attention_biases_trains_on_text_and_exports_with_the_same_logits(
    tmp_path, shared_data, qk_norm, arch
):
    text = shared_data / "tinyshakespeare.txt"
    recipe = get_recipe("cpu-smoke").replace(model={"attention_bias": True, "qk_norm": qk_norm})
    result = pretrain(
        recipe,
        tmp_path / "run",
        data=str(text),
        max_steps=20,
        progress=False,
        cache_dir=tmp_path / "cache",
        device="cpu",
    )
    losses = [m["loss"] for m in result.metrics if "loss" in m]
    assert result.step == 20 and losses[-1] < losses[0] - 0.5, losses
    model, tok, _, _ = load_run(tmp_path / "run")
    biases = {n: p for n, p in model.named_parameters() if n.endswith(".bias")}
    assert {n.split(".")[-2] for n in biases} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert len(biases) == 4 * model.config.n_layer and all(
        p.abs().max() > 0 for p in biases.values()
    )  # trained

    out = export_run(tmp_path / "run", tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["attention_bias"] is True
    assert (
        ModelConfig.from_hf_llama(cfg).attention_bias and hf_import.representation_gaps(cfg) == []
    )
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor(
        [tok.encode(text.read_text(encoding="utf-8")[5000:7000])[: model.config.max_seq_len]]
    )
    with torch.no_grad():
        torch.testing.assert_close(ref(x).logits, model(x), atol=1e-4, rtol=0)
    back, _ = hf_import.import_hf(out)
    assert all(torch.equal(back.state_dict()[n], p) for n, p in biases.items())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_memory_estimate_counts_the_biases_and_their_autocast_copies(precision):
    plain = ModelConfig(vocab_size=300, n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=160)
    biased = ModelConfig(**{**plain.to_dict(), "attention_bias": True})
    a, b = estimate_memory(plain, 4, 64, precision), estimate_memory(biased, 4, 64, precision)
    per_layer = (plain.n_head + 2 * plain.n_kv_head) * plain.head_dim + plain.d_model  # q, k, v, o
    assert (
        b.n_params - a.n_params
        == plain.n_layer * per_layer
        == GPT(biased).num_params() - GPT(plain).num_params()
    )
    copy_bytes = (
        0 if precision == "fp32" else 2 * plain.n_layer * per_layer
    )  # autocast casts each bias too
    assert round((b.weight_copies_gb - a.weight_copies_gb) * GB) == copy_bytes
    assert (
        b.activations_gb == a.activations_gb
    )  # a bias keeps no input of its own for the backward pass


def test_a_run_begun_before_the_option_keeps_its_identity():
    """The mirror's identity.json hashes `ModelConfig.identity`: the option is in it only where it is set, so a
    run mirrored before attention_bias existed resumes as itself."""
    cfg = get_recipe("cpu-smoke").model
    assert "attention_bias" not in cfg.identity()
    assert ModelConfig(**{**cfg.to_dict(), "attention_bias": True}).identity() == {
        **cfg.identity(),
        "attention_bias": True,
    }
