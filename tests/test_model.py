"""The model against Hugging Face Llama (the reference), the KV cache, activation checkpointing."""

import dataclasses

import pytest
import torch

from tinygpt.core.config import ConfigError, ModelConfig
from tinygpt.core.recipes import MODEL_SIZES, get_recipe, model_config
from tinygpt.model.gpt import GPT, KVCache

transformers = pytest.importorskip("transformers")


def _pair(**kw):
    cfg = ModelConfig(
        **{**dict(vocab_size=320, n_layer=2, n_head=4, d_model=64, d_ff=176, max_seq_len=64), **kw}
    )
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf_llama())).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    return cfg, ours, ref


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(n_kv_head=2),
        dict(n_kv_head=1, tie_embeddings=True),
        dict(rope_theta=500000.0, norm_eps=1e-6),
    ],
)
def test_logits_match_transformers_llama(kw):
    cfg, ours, ref = _pair(**kw)
    assert set(ours.state_dict()) == set(
        ref.state_dict()
    )  # same names: weights move with no renaming
    x = torch.randint(0, cfg.vocab_size, (3, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(x), ref(x).logits
    assert a.shape == (3, 50, cfg.vocab_size)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert ours.num_params() == sum(p.numel() for p in ref.parameters())


def test_loss_matches_transformers_and_ignores_masked_targets():
    cfg, ours, ref = _pair()
    x = torch.randint(0, cfg.vocab_size, (2, 40))
    y = torch.roll(x, -1, 1)
    y[:, :10] = -100
    with torch.no_grad():
        ours_loss = ours(x, y)
        ref_loss = torch.nn.functional.cross_entropy(
            ref(x).logits.view(-1, cfg.vocab_size), y.view(-1)
        )
        ours_sum = ours(x, y, reduction="sum")
    torch.testing.assert_close(ours_loss, ref_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_sum, ref_loss * (y != -100).sum(), rtol=1e-5, atol=1e-4)


def test_kv_cache_decoding_equals_full_forward():
    cfg, ours, _ = _pair(n_kv_head=2)
    x = torch.randint(0, cfg.vocab_size, (2, 30))
    with torch.no_grad():
        full = ours(x)
        cache = KVCache.empty(cfg, 2, 30, "cpu", torch.float32)
        parts = [ours(x[:, :12], cache=cache)]  # prefill
        parts.append(ours(x[:, 12:20], cache=cache))  # a chunk onto a filled cache
        parts += [ours(x[:, t : t + 1], cache=cache) for t in range(20, 30)]  # one token at a time
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0)


def test_activation_checkpointing_gives_the_same_gradients():
    cfg, ours, _ = _pair()
    ckpt = GPT(ModelConfig(**{**cfg.to_dict(), "activation_checkpointing": True}))
    ckpt.load_state_dict(ours.state_dict())
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    for m in (ours, ckpt):
        m.train()
        m(x, torch.roll(x, -1, 1)).backward()
    for (n, a), (_, b) in zip(ours.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_tied_embeddings_share_one_matrix():
    m = GPT(ModelConfig(vocab_size=100, n_layer=1, n_head=2, d_model=32, tie_embeddings=True))
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert m.num_params() == sum(p.numel() for p in m.parameters())  # parameters() lists it once


def test_scaled_init_shrinks_residual_projections():
    m = GPT(model_config("cpu", vocab_size=512, n_layer=8))
    std_q = m.model.layers[0].self_attn.q_proj.weight.std().item()
    std_o = m.model.layers[0].self_attn.o_proj.weight.std().item()
    assert abs(std_q - 0.02) < 0.002 and abs(std_o - 0.02 / 4) < 0.001


def test_named_sizes_have_the_advertised_parameter_counts():
    from tinygpt.model.gpt import meta_model

    expected_m = {"16m": 16, "50m": 50, "124m": 124, "350m": 350, "760m": 760}
    for name, millions in expected_m.items():
        n = meta_model(model_config(name, vocab_size=50304)).num_params()
        assert abs(n / 1e6 - millions) / millions < 0.12, (name, n)
    small = GPT(model_config("16m", vocab_size=50304))
    assert small.num_params() == meta_model(small.config).num_params()
    assert set(MODEL_SIZES) >= set(expected_m)


def test_too_long_input_and_bad_configs_are_refused():
    m = GPT(ModelConfig(vocab_size=50, n_layer=1, n_head=2, d_model=16, max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ConfigError, match="multiple of n_head"):
        ModelConfig(d_model=100, n_head=3)
    with pytest.raises(ConfigError, match="n_kv_head"):
        ModelConfig(n_head=4, n_kv_head=3)


def test_zero_init_projections_make_every_block_the_identity_at_start():
    """zero_init_proj: o_proj and down_proj start at zero, so the logits are those of the embedding
    through the final norm and the head alone; training moves them off zero."""
    cfg = dataclasses.replace(get_recipe("cpu-smoke").model, zero_init_proj=True, qk_norm=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    zeros = [n for n, p in model.named_parameters() if p.dim() == 2 and not p.any()]
    assert len(zeros) == 2 * cfg.n_layer and all(
        n.endswith(("o_proj.weight", "down_proj.weight")) for n in zeros
    )
    x = torch.randint(cfg.vocab_size, (2, 16))
    with torch.no_grad():
        direct = model.lm_head(model.model.norm(model.model.embed_tokens(x)))
        torch.testing.assert_close(model(x), direct)
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    assert model.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0  # they do learn


def test_a_runs_identity_leaves_out_what_a_probe_may_choose_otherwise():
    """`ModelConfig.identity` is what the mirror's identity.json hashes: every field but the speed and memory
    choices, so that a run resumed on another GPU (another probe) is still the same run."""
    cfg = get_recipe("cpu-smoke").model
    # what identity.json hashed before `identity` existed: a run mirrored then resumes as itself
    assert sorted(cfg.identity()) == [
        "d_ff",
        "d_model",
        "init",
        "init_std",
        "max_seq_len",
        "n_head",
        "n_kv_head",
        "n_layer",
        "norm_eps",
        "qk_norm",
        "rope_theta",
        "tie_embeddings",
        "vocab_size",
        "zero_init_proj",
    ]
    assert cfg.identity() == {k: getattr(cfg, k) for k in cfg.identity()}
    assert (
        dataclasses.replace(cfg, activation_checkpointing=True, fused_proj=True).identity()
        == cfg.identity()
    )
    assert dataclasses.replace(cfg, qk_norm=True).identity() != cfg.identity()
