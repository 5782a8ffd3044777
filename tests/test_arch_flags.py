"""modded-nanogpt's architecture changes, each one `ModelConfig` field, off by default:
`logit_softcap`, `mlp_act`, `value_embeds`, `unet_skips`. Each trains a tiny model on real text; with
every flag off nothing changes (the transformers-parity tests of test_hf.py check the logits); an export
a format cannot hold is refused in one line before anything is written, and ReLU² exports to transformers
with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tinygpt.cli import main
from tinygpt.core.config import ConfigError, ModelConfig
from tinygpt.core.recipes import get_recipe
from tinygpt.fit.memory import GB, estimate_memory
from tinygpt.model import hf_import
from tinygpt.model.generate import generate
from tinygpt.model.gpt import GPT
from tinygpt.model.loading import load_run
from tinygpt.model.losses import cross_entropy
from tinygpt.pretrain.run_pretrain import pretrain
from tinygpt.train.optim import split_muon_params
from tinygpt.train.step import regional_loss

FLAGS = {
    "softcap": {"logit_softcap": 3.0},  # low enough that a tiny model's logits reach it
    "relu2": {"mlp_act": "relu2"},
    "value_embeds": {"value_embeds": 1},
    "unet": {"unet_skips": True},
}
TINY = dict(vocab_size=300, n_layer=4, n_head=4, n_kv_head=2, d_model=64, d_ff=160, max_seq_len=64)


@pytest.fixture(scope="module", params=list(FLAGS))
def flagged_run(request, tmp_path_factory, shared_data):
    """A cpu-smoke run (2 layers) with one flag on, 20 steps on Tiny Shakespeare."""
    tmp = tmp_path_factory.mktemp(request.param)
    recipe = get_recipe("cpu-smoke").replace(model=FLAGS[request.param])
    result = pretrain(
        recipe,
        tmp / "run",
        data=str(shared_data / "tinyshakespeare.txt"),
        max_steps=20,
        progress=False,
        cache_dir=tmp / "cache",
        device="cpu",
    )
    return request.param, tmp / "run", result


def test_each_flag_trains_on_text_and_its_own_weights_learn(flagged_run):
    name, run, result = flagged_run
    losses = [m["loss"] for m in result.metrics if "loss" in m]
    assert result.step == 20 and losses[-1] < losses[0] - 0.5, losses
    model, tok, _, _ = load_run(run)
    assert getattr(model.config, next(iter(FLAGS[name]))) == next(iter(FLAGS[name].values()))
    own = {n: p for n, p in model.named_parameters() if "value_" in n or "skip_weights" in n}
    if name == "value_embeds":  # one table, mixed into both blocks (the first and the last)
        assert sorted(own) == [
            "model.layers.0.self_attn.value_lambdas",
            "model.layers.1.self_attn.value_lambdas",
            "model.value_embeds.0.weight",
        ]
        assert all(not torch.equal(own[n], torch.full((2,), 0.5)) for n in sorted(own)[:2])
    elif name == "unet":
        assert list(own) == ["model.skip_weights"] and own["model.skip_weights"].shape == (1,)
        assert own["model.skip_weights"].item() != 1.0  # trained
    else:
        assert own == {}
    # generation through the KV cache picks what the whole sequence's logits pick
    prompt = torch.tensor([tok.encode("ROMEO:")])
    with torch.no_grad():
        out = generate(model, prompt, max_new_tokens=8, temperature=0.0)
        again = model(out[:, :-1])[0, prompt.shape[1] - 1 :].argmax(-1)
    assert out.shape[1] == prompt.shape[1] + 8 and torch.equal(again, out[0, prompt.shape[1] :])
    if name == "softcap":  # generation and evaluation see the capped logits
        x = torch.tensor([tok.encode("First Citizen: we are accounted poor citizens")])
        with torch.no_grad():
            assert model(x).abs().max() < 3.0


def test_each_flag_exports_or_is_refused_in_one_line_before_writing(flagged_run, tmp_path, capsys):
    name, run, _ = flagged_run
    setting = "{}={!r}".format(*next(iter(FLAGS[name].items())))
    for fmt in ("hf", "gguf"):
        out = tmp_path / fmt
        code = main(["export", str(run), str(out), "--format", fmt])
        err = capsys.readouterr().err.strip()
        if name == "relu2" and fmt == "hf":
            assert code == 0, err
            continue
        assert code == 2 and len(err.splitlines()) == 1 and setting in err, err
        assert not out.exists()
        if fmt == "gguf" and name == "relu2":  # transformers holds it, llama.cpp does not
            assert "llama.cpp's llama architecture" in err and "Hugging Face format" in err
        else:
            assert "transformers' Llama" in err and "every named recipe exports" in err
    if name == "relu2":  # the Hugging Face folder: LlamaForCausalLM with hidden_act relu2
        transformers = pytest.importorskip("transformers")
        cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
        assert cfg["hidden_act"] == "relu2" and "auto_map" not in cfg
        assert hf_import.representation_gaps(cfg) == []
        assert ModelConfig.from_hf_llama(cfg).mlp_act == "relu2"
        model, tok, _, _ = load_run(run)
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        x = torch.tensor([tok.encode("First Citizen: we are accounted poor citizens")])
        with torch.no_grad():
            torch.testing.assert_close(ref(x).logits, model(x), atol=1e-4, rtol=0)


def test_relu2_with_qk_norm_exports_as_qwen3_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tinygpt.model.hf import export_model

    torch.manual_seed(0)
    model = GPT(ModelConfig(**TINY, qk_norm=True, mlp_act="relu2")).eval()
    out = export_model(model, None, tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(ref).__name__ == "Qwen3ForCausalLM" and ref.config.hidden_act == "relu2"
    x = torch.randint(300, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ref(x).logits, model(x), atol=1e-5, rtol=0)
        plain = GPT(ModelConfig(**TINY, qk_norm=True))
        plain.load_state_dict(model.state_dict())
        assert not torch.allclose(plain(x), model(x))  # the activation is what differs


@pytest.mark.parametrize("chunk", [False, True])
def test_softcap_applies_in_the_full_and_the_chunked_loss_and_their_gradients(chunk, monkeypatch):
    from tinygpt.model import losses

    if chunk:
        monkeypatch.setattr(losses, "PLAIN_MAX_LOGITS", 2**10)
        monkeypatch.setattr(losses, "CHUNK_LOGITS", 2**13)
    torch.manual_seed(0)
    model = GPT(ModelConfig(**TINY, logit_softcap=2.0))
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # logits of a few units, where the cap bends them
    x, y = torch.randint(300, (2, 64)), torch.randint(300, (2, 64))
    y[0, :5] = -100  # no loss there
    assert (losses.default_chunk_rows(128, 300) > 0) == chunk
    got = model(x, y)
    (g_got,) = torch.autograd.grad(got, model.lm_head.weight)
    hidden = model.hidden_states(x)
    logits = 2.0 * torch.tanh(model.lm_head(hidden) / 2.0)
    ref = F.cross_entropy(logits.view(-1, 300), y.view(-1), ignore_index=-100)
    (g_ref,) = torch.autograd.grad(ref, model.lm_head.weight)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(g_got, g_ref)
    uncapped = cross_entropy(model.lm_head, hidden, y)
    assert abs(uncapped.item() - ref.item()) > 1e-3  # the cap changes the loss
    # the trainer's loss by regions (a GPU's default) caps too
    torch.testing.assert_close(regional_loss(model, x, y, reduction="sum"), ref * (y >= 0).sum())


def test_flags_off_is_the_model_it_was():
    """No new parameter, key or identity entry, and the same transformers config, with every flag off."""
    cfg = ModelConfig(**TINY)
    model = GPT(cfg)
    assert not any("value_" in k or "skip" in k for k in model.state_dict())
    for name in FLAGS.values():
        assert next(iter(name)) not in cfg.identity()
    assert cfg.to_hf_llama()["hidden_act"] == "silu" and cfg.export_gaps("gguf") == []
    for flags in FLAGS.values():
        on = ModelConfig(**TINY, **flags)
        assert on.identity() == {**cfg.identity(), **flags}
        assert set(ModelConfig.network_fields()) >= set(flags)


def test_flagged_init_is_deterministic_from_the_seed_and_counted():
    all_on = {k: v for flags in FLAGS.values() for k, v in flags.items()}
    cfg = ModelConfig(**TINY, **all_on)
    a, b = (torch.manual_seed(7), GPT(cfg))[1], (torch.manual_seed(7), GPT(cfg))[1]
    assert all(torch.equal(p, b.state_dict()[n]) for n, p in a.state_dict().items())
    plain = GPT(ModelConfig(**TINY))
    kv_dim = 2 * 16
    # one table (vocab x kv_dim), two weights in each of the 2 blocks it feeds, 2 skip weights
    extra = 300 * kv_dim + 2 * 2 + 2
    assert a.num_params() - plain.num_params() == extra
    assert a.model.skip_weights.tolist() == [1.0, 1.0]
    assert a.model.layers[0].self_attn.value_lambdas.tolist() == [0.5, 0.5]
    # lookups and elementwise weights are no matmul work
    assert a.flops_per_token(64) == plain.flops_per_token(64)
    est, est_plain = (
        estimate_memory(cfg, 4, 64, "fp32"),
        estimate_memory(ModelConfig(**TINY), 4, 64),
    )
    assert est.n_params - est_plain.n_params == extra and est.params_gb * GB == 4 * a.num_params()
    # Muon leaves the value tables to AdamW, as the input embedding, and the weights without decay
    muon, decay, no_decay = split_muon_params(a)
    ids = {name: {id(p) for p in group} for name, group in zip("mdn", (muon, decay, no_decay))}
    assert id(a.model.value_embeds[0].weight) in ids["d"] and id(a.model.skip_weights) in ids["n"]
    assert not any(p.dim() != 2 for p in muon)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"value_embeds": 3}, "model.value_embeds (3) must be at most n_layer / 2 (2)"),
        ({"value_embeds": -1}, "model.value_embeds"),
        ({"unet_skips": True, "n_layer": 1}, "model.unet_skips needs n_layer >= 2"),
        ({"logit_softcap": 0.0}, "model.logit_softcap"),
        ({"mlp_act": "gelu"}, "model.mlp_act"),
    ],
)
def test_bad_flags_are_refused_in_one_line(kw, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{**TINY, **kw})
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1
    assert "Error" not in str(e.value)


def test_value_embeddings_keep_the_values_in_autocasts_dtype(monkeypatch):
    """The table's lookup is fp32; mixed into bf16 values it must not make them fp32 beside bf16
    queries and keys (CUDA's attention kernels refuse mixed dtypes)."""
    from tinygpt.model import gpt

    seen, expand = [], gpt.expand_kv
    monkeypatch.setattr(gpt, "expand_kv", lambda q, k, v: seen.append(v.dtype) or expand(q, k, v))
    model = GPT(ModelConfig(**TINY, value_embeds=1))
    x = torch.randint(300, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, x).backward()
    assert seen == [torch.bfloat16] * 4
