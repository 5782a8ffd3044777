"""`ModelConfig.fused_proj`: one q/k/v matmul and one gate/up matmul give the unfused model's weights at init,
its logits and gradients, its training losses, and files under the Hugging Face names (loadable either way,
exported through transformers with the same logits)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import export_run

from tinygpt.core import checkpoint as ckpt
from tinygpt.core.config import ConfigError, ModelConfig, TrainConfig
from tinygpt.core.recipes import get_recipe, model_config
from tinygpt.data.sampler import WindowSampler, fixed_batches
from tinygpt.model import hf_import
from tinygpt.model.gpt import GPT, KVCache
from tinygpt.model.tokenizer import train_bpe
from tinygpt.train.optim import build_optimizer
from tinygpt.train.trainer import TrainData, Trainer

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
VARIANTS = [
    dict(),
    dict(n_kv_head=1),
    dict(qk_norm=True),
    dict(n_kv_head=1, qk_norm=True, tie_embeddings=True),
    dict(n_kv_head=1, attention_bias=True),
]


def _config(fused: bool, **kw) -> ModelConfig:
    return dataclasses.replace(
        model_config("tiny", vocab_size=512, n_head=4), fused_proj=fused, **kw
    )


def _pair(seed: int = 0, perturb: bool = True, **kw) -> tuple[GPT, GPT]:
    """(unfused, fused) models with the same weights, each initialised from `seed` on its own."""
    models = []
    for fused in (False, True):
        torch.manual_seed(seed)
        models.append(GPT(_config(fused, **kw)))
    if perturb:  # far from init (norm weights too), so that a wrong mapping of any weight shows
        with torch.no_grad():
            for p in models[0].parameters():
                p.add_(torch.randn_like(p) * 0.1)
        models[1].load_state_dict(models[0].state_dict())
    return models[0], models[1]


def _unfused_grads(model: GPT) -> dict[str, torch.Tensor]:
    """Each parameter's gradient under the unfused (Hugging Face) name; a fused one split into its parts."""
    out = {}
    for name, p in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        module, _, proj = prefix.rpartition(".")
        if proj in FUSED:
            sizes = [rows for _, rows in model.get_submodule(module).fused_parts[proj]]
            for part, g in zip(FUSED[proj], p.grad.split(sizes)):
                out[f"{module}.{part}.{leaf}"] = g
        else:
            out[name] = p.grad
    return out


def _batch(seed: int = 1, B: int = 3, T: int = 40) -> torch.Tensor:
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kw", VARIANTS)
def test_same_seed_gives_bit_identical_weights_under_the_hf_names(kw):
    for zero_init in (False, True):
        plain, fused = _pair(perturb=False, zero_init_proj=zero_init, **kw)
        assert hasattr(fused.model.layers[0].self_attn, "qkv_proj") and hasattr(
            fused.model.layers[0].mlp, "gate_up_proj"
        )
        assert not hasattr(fused.model.layers[0].self_attn, "q_proj")
        a, b = plain.state_dict(), fused.state_dict()
        assert list(a) == list(b)  # the same names in the same order
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert fused.num_params() == plain.num_params()
        assert fused.flops_per_token(128) == plain.flops_per_token(128)
        n_q, n_kv = 4 * fused.config.head_dim, fused.config.n_kv_head * fused.config.head_dim
        assert fused.model.layers[0].self_attn.qkv_proj.weight.shape == (
            n_q + 2 * n_kv,
            fused.config.d_model,
        )
        assert fused.model.layers[0].mlp.gate_up_proj.weight.shape == (
            2 * fused.config.d_ff,
            fused.config.d_model,
        )


@pytest.mark.parametrize("kw", VARIANTS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_same_logits_loss_and_gradients(kw, checkpointing):
    plain, fused = _pair(activation_checkpointing=checkpointing, **kw)
    x, y = _batch(1), _batch(2)
    for m in (plain, fused):
        m.train()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x), atol=1e-5, rtol=1e-5)
    losses = []
    for m in (plain, fused):
        loss = m(x, y)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    a, b = _unfused_grads(plain), _unfused_grads(fused)
    assert a.keys() == b.keys() == {n for n, _ in plain.named_parameters()}
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_head=1, qk_norm=True)])
def test_kv_cache_generation_equals_full_recompute(kw):
    plain, fused = _pair(**kw)
    fused.eval(), plain.eval()
    x = _batch(3, B=2, T=30)
    with torch.no_grad():
        full = fused(x)
        torch.testing.assert_close(full, plain(x), atol=1e-5, rtol=1e-5)
        cache = KVCache.empty(fused.config, 2, 64, "cpu", torch.float32)
        steps = [fused(x[:, :12], cache=cache)]  # a prompt
        steps += [fused(x[:, t : t + 1], cache=cache) for t in range(12, 20)]  # one token at a time
        steps.append(fused(x[:, 20:], cache=cache))  # a chunk appended to a filled cache
    assert cache.pos == 30
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_checkpoints_keep_the_hf_names_and_load_fused_or_unfused(tmp_path):
    plain, fused = _pair(n_kv_head=1, qk_norm=True, tie_embeddings=True)
    x = _batch(4)
    sd = ckpt.model_state(fused)
    assert not any(name in k for k in sd for name in FUSED)
    assert {k for k in sd if ".layers.0." in k} == {
        f"model.layers.0.{k}.weight"
        for k in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert sd.keys() == ckpt.model_state(plain).keys()
    ckpt.save_checkpoint(tmp_path / "fused", sd, {"step": 1})
    ckpt.save_checkpoint(tmp_path / "plain", ckpt.model_state(plain), {"step": 1})
    with torch.no_grad():
        want = plain.eval()(x)
        for folder, fused_proj in [("fused", False), ("fused", True), ("plain", True)]:
            torch.manual_seed(9)  # other weights, all replaced by the load
            model = GPT(_config(fused_proj, n_kv_head=1, qk_norm=True, tie_embeddings=True))
            ckpt.load_model_state(model, ckpt.load_checkpoint(tmp_path / folder)[0])
            torch.testing.assert_close(model.eval()(x), want, atol=1e-5, rtol=1e-5)
    # a file missing one part of a fused matrix is refused, as for the unfused model
    del sd["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ckpt.CheckpointError, match="missing"):
        ckpt.load_model_state(
            GPT(_config(True, n_kv_head=1, qk_norm=True, tie_embeddings=True)), sd
        )


@pytest.mark.parametrize("qk_norm,arch", [(False, "LlamaForCausalLM"), (True, "Qwen3ForCausalLM")])
def test_export_and_import_through_transformers(tmp_path, shakespeare, qk_norm, arch):
    transformers = pytest.importorskip("transformers")
    tok = train_bpe([shakespeare[:100_000]], 512)
    _, model = _pair(n_kv_head=2, qk_norm=qk_norm)
    model.eval()
    recipe = get_recipe("cpu-smoke").replace(
        model=dataclasses.asdict(model.config), data={"vocab_size": 512}
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"recipe": recipe.to_dict()}))
    tok.save(run / "tokenizer.json")
    ckpt.save_checkpoint(
        run / "checkpoints" / ckpt.step_name(10), ckpt.model_state(model), {"step": 10}
    )
    out = export_run(run, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["architectures"] == [arch]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    imported, _ = hf_import.import_hf(out)
    x = torch.tensor([tok.encode(shakespeare[:300])[:128]])
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(hf_model(x).logits, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(imported(x), want, atol=1e-5, rtol=1e-5)


def test_muon_with_fused_projections_is_refused_with_what_to_do():
    with pytest.raises(ConfigError, match="fused_proj=False, or use optimizer='adamw'"):
        get_recipe("cpu-fast").replace(model={"fused_proj": True})
    with pytest.raises(ConfigError, match="fused_proj=False"):
        build_optimizer(GPT(_config(True)), TrainConfig(optimizer="muon"), "cpu")
    build_optimizer(
        GPT(_config(True)), TrainConfig(optimizer="adamw"), "cpu"
    )  # AdamW is elementwise: fine
    with pytest.raises(ConfigError, match="fused_proj must be True or False"):
        _config("on")


def _train(tokens, run_dir: Path, fused: bool):
    cfg = TrainConfig(
        micro_batch_size=8,
        seq_len=64,
        max_steps=12,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=3,
        eval_every=6,
        eval_batches=2,
        log_every=1,
        save_every=6,
        keep_last=2,
        precision="fp32",
        device="cpu",
        optimizer="adamw",
    )
    torch.manual_seed(0)  # the same draws: fused_proj must not change the initial weights
    model = GPT(_config(fused, n_kv_head=2, qk_norm=True))
    sampler = WindowSampler(tokens.train, cfg.seq_len, cfg.seed)
    val = fixed_batches(tokens.val, cfg.seq_len, cfg.micro_batch_size, cfg.eval_batches)
    return Trainer(model, cfg, TrainData(sampler, val), run_dir).fit()


def test_adamw_training_gives_the_same_losses_fused_or_not(tokens, tmp_path):
    plain, fused = (
        _train(tokens, tmp_path / "plain", False),
        _train(tokens, tmp_path / "fused", True),
    )
    a = [m["loss"] for m in plain.metrics if "loss" in m]
    b = [m["loss"] for m in fused.metrics if "loss" in m]
    assert len(a) == 12 and a[-1] < a[0] - 0.5  # it learns
    assert b == pytest.approx(a, abs=2e-5)
    assert fused.val_loss == pytest.approx(plain.val_loss, abs=2e-5)
    sa = ckpt.load_checkpoint(tmp_path / "plain" / "checkpoints" / "step_000012")[0]
    sb = ckpt.load_checkpoint(tmp_path / "fused" / "checkpoints" / "step_000012")[0]
    assert sa.keys() == sb.keys()  # the fused run saved the Hugging Face names
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], atol=1e-4, rtol=0, msg=k)
