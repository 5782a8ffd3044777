"""The speed-run recipe's training-time changes (issue 50): document masking and a growing attention
window (what the model attends to while it trains, never the saved network), Polar Express for Muon,
separate embedding and head rates; a real run of `a100-124m-speedrun` at a tiny shape on real text, and
its export through transformers with the same logits. How many tokens it saves is a benchmark
(benchmarks/time_to_loss.py --tokens), not a test."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from conftest import export_run

from tinygpt.core.config import ConfigError, TrainConfig
from tinygpt.core.recipes import get_recipe
from tinygpt.data.sampler import WindowSampler
from tinygpt.model.loading import load_run
from tinygpt.model.masks import document_ids, mask_rule, masked_attention, training_mask
from tinygpt.pretrain.run_pretrain import pretrain
from tinygpt.train.optim import build_optimizer, polar_express
from tinygpt.train.step import window_at

transformers = pytest.importorskip("transformers")

TINY = {
    "n_layer": 2,
    "n_head": 2,
    "n_kv_head": 2,
    "d_model": 64,
    "d_ff": 192,
    "max_seq_len": 128,
    "vocab_size": 512,
}


@pytest.fixture(scope="module")
def speedrun(tmp_path_factory, shared_data):
    """a100-124m-speedrun at a tiny shape, both masks on, 12 steps on Tiny Shakespeare."""
    root = tmp_path_factory.mktemp("speedrun")
    recipe = get_recipe("a100-124m-speedrun").replace(
        model=TINY,
        train={
            "micro_batch_size": 8,
            "seq_len": 64,
            "grad_accum_steps": 1,
            "max_steps": 12,
            "warmup_steps": 2,
            "eval_every": 6,
            "save_every": 6,
            "log_every": 2,
            "eval_batches": 2,
            "precision": "fp32",
            "compile": "off",
            "doc_mask": True,
            "window_start": 16,
        },
        data={
            "source": str(shared_data / "tinyshakespeare.txt"),
            "tokenizer": "train",
            "vocab_size": 512,
            "max_chars": 300_000,
        },
    )
    result = pretrain(recipe, root / "run", progress=False, device="cpu", cache_dir=root / "cache")
    return recipe, result, root


def two_documents(tok, first: str, second: str, length: int = 24) -> tuple[torch.Tensor, int]:
    """(1, T) ids: `first`'s first `length` tokens, end-of-text, then `second`'s; and where the second
    document begins."""
    a, b = tok.encode(first)[:length], tok.encode(second)[:length]
    assert len(a) == len(b) == length
    return torch.tensor([a + [tok.eot_id] + b]), length + 1


def test_the_document_mask_keeps_a_document_from_seeing_the_one_before(speedrun, shakespeare):
    """The trained model under the document mask: the second document's logits are the same whatever
    the first document says, and the same as the second document's alone; without the mask they
    change."""
    _, _, root = speedrun
    model, tok, _, _ = load_run(root / "run")
    model.eval()
    speeches = [s for s in shakespeare.split("\n\n") if len(s) > 300]
    x, start = two_documents(tok, speeches[0], speeches[2])
    y, _ = two_documents(tok, speeches[1], speeches[2])

    def logits(ids: torch.Tensor, masked: bool) -> torch.Tensor:
        mask = (
            training_mask(document_ids(ids, tok.eot_id), None, *ids.shape, ids.device)
            if masked
            else None
        )
        with torch.no_grad():
            return model(ids, mask=mask)[0, start:]

    torch.testing.assert_close(logits(x, True), logits(y, True), atol=1e-5, rtol=0)
    alone = torch.tensor([tok.encode(speeches[2])[:24]])
    torch.testing.assert_close(logits(x, True), model(alone)[0].detach(), atol=1e-5, rtol=0)
    assert (logits(x, False) - logits(y, False)).abs().max() > 1e-2


def test_a_window_hides_what_lies_further_back_than_the_layers_can_reach(speedrun, shakespeare):
    """With a window of w tokens an L-layer model's position t depends on tokens back to t - L(w - 1):
    changing the first token leaves every later position's logits as they were."""
    _, _, root = speedrun
    model, tok, _, _ = load_run(root / "run")
    model.eval()
    x = torch.tensor([tok.encode(shakespeare[:400])[:48]])
    y = x.clone()
    y[0, 0] = (y[0, 0] + 1) % 512
    w, reach = 6, model.config.n_layer * 5
    mask = training_mask(None, w, *x.shape, x.device)
    with torch.no_grad():
        a, b = model(x, mask=mask)[0], model(y, mask=mask)[0]
    torch.testing.assert_close(a[reach + 1 :], b[reach + 1 :], atol=1e-5, rtol=0)
    assert (a[1 : reach + 1] - b[1 : reach + 1]).abs().max() > 1e-3


def test_the_cuda_block_mask_and_the_cpu_mask_are_one_rule():
    """FlexAttention's dense view of `mask_rule` (what create_block_mask builds blocks from) is the SDPA
    mask `training_mask` gives on the CPU, for documents and a window together."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    x = torch.tensor([[5, 0, 7, 8, 9, 0, 1, 2, 3, 4, 0, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 0, 2]])
    docs = document_ids(x, eot_id=0)
    assert docs.tolist()[0] == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3]
    dense = training_mask(docs, 3, 2, 12, torch.device("cpu"))
    ref = flex.create_mask(mask_rule(docs, torch.tensor(3)), 2, 1, 12, 12, device="cpu")
    assert torch.equal(dense, ref.expand_as(dense))
    assert training_mask(None, 12, 2, 12, torch.device("cpu")) is None  # nothing beyond causal


def test_flex_attention_under_the_block_mask_gives_what_sdpa_gives_under_the_dense_one():
    """The CUDA path's attention (FlexAttention on a block mask, run eagerly here) against the CPU
    path's (SDPA on the boolean mask): two documents' boundaries and a window of 40."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, 50, (2, 256), generator=g)
    x[0, 30] = x[0, 200] = x[1, 100] = 0
    docs = document_ids(x, 0)
    block = flex.create_block_mask(
        mask_rule(docs, torch.tensor(40)), 2, None, 256, 256, device="cpu"
    )
    dense = training_mask(docs, 40, 2, 256, torch.device("cpu"))
    q, k, v = (torch.randn(2, 4, 256, 32, generator=g) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention says it is slow: it is the reference
        torch.testing.assert_close(
            masked_attention(q, k, v, block, False),
            masked_attention(q, k, v, dense, False),
            atol=1e-5,
            rtol=0,
        )


def test_the_window_grows_to_the_whole_context_by_the_cool_down_and_keeps_it():
    cfg = TrainConfig(
        seq_len=256, max_steps=100, window_start=32, schedule="wsd", decay_fraction=0.4
    )
    windows = [window_at(s, cfg) for s in range(100)]
    assert windows[0] == 32 and windows == sorted(windows)
    assert windows[59] < 256 and windows[60:] == [256] * 40 and windows[-1] == 256
    cosine = TrainConfig(seq_len=256, max_steps=100, window_start=32)
    assert window_at(98, cosine) < 256 == window_at(99, cosine)
    assert window_at(0, TrainConfig(seq_len=256)) is None


def test_the_sampler_carries_document_ids_only_when_asked(tokens):
    plain = WindowSampler(tokens, 64, seed=1).next_batch(4)
    x, y, docs = WindowSampler(tokens, 64, seed=1, eot_id=0).next_batch(4)
    assert len(plain) == 2 and torch.equal(plain[0], x)
    assert torch.equal(docs, document_ids(x, 0)) and docs.shape == x.shape


def test_polar_express_orthogonalises():
    g = torch.randn(96, 48, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(polar_express(g).float())
    assert s.shape == (48,) and 0.6 < s.min() and s.max() < 1.3


def test_a_polar_express_step_moves_a_hidden_matrix_by_an_orthogonal_update(speedrun, tokens):
    """One Muon step with muon_coeffs=polar-express (no weight decay) on real tokens: the change of a
    hidden matrix has near-equal singular values, as an orthogonalised update has; the other matrices
    move by AdamW's rule."""
    recipe, _, root = speedrun
    model, _, _, _ = load_run(root / "run")
    cfg = dataclasses.replace(
        recipe.train, muon_coeffs="polar-express", weight_decay=0.0, normuon=False
    )
    opt = build_optimizer(model, cfg, "cpu", compiled=False)
    x, y = WindowSampler(tokens, 64, seed=3).next_batch(8)
    w = model.model.layers[0].mlp.up_proj.weight
    before, embed = w.detach().clone(), model.model.embed_tokens.weight.detach().clone()
    model(x, y).backward()
    opt.step()
    s = torch.linalg.svdvals(w.detach() - before)
    assert s.max() / s.min() < 2.0 and not torch.equal(model.model.embed_tokens.weight, embed)


def test_embedding_and_head_rates_are_their_own_groups_only_when_set(speedrun):
    recipe, _, root = speedrun
    model, _, _, _ = load_run(root / "run")
    base = get_recipe("a100-124m-fast").train
    plain = build_optimizer(model, base, "cpu", compiled=False)
    split = build_optimizer(model, recipe.train, "cpu", compiled=False)
    assert (
        len(split.param_groups) == len(plain.param_groups) + 1
    )  # the head and the embedding apart (Muon takes every other matrix here)
    embed = next(
        g
        for g in split.param_groups
        if any(p is model.model.embed_tokens.weight for p in g["params"])
    )
    head = next(
        g for g in split.param_groups if any(p is model.lm_head.weight for p in g["params"])
    )
    assert embed["lr_scale"] == recipe.train.embed_lr_scale != 1.0
    assert head["lr_scale"] == recipe.train.head_lr_scale not in (1.0, embed["lr_scale"])
    # the decay per step (lr * weight_decay) stays what one AdamW group at lr would give
    ours = recipe.train
    for group in (embed, head):
        assert group["lr"] * group["weight_decay"] == pytest.approx(ours.lr * ours.weight_decay)
    adamw = [g for g in split.param_groups if g["kind"] == "adamw"]
    assert adamw and all(g["betas"][0] == recipe.train.beta1 != base.beta1 for g in adamw)


def test_the_speedrun_learns_and_exports_as_qwen3_with_the_same_logits(speedrun, tmp_path):
    recipe, result, root = speedrun
    vals = [m["val_loss"] for m in result.metrics if m.get("val_loss") is not None]
    assert result.step == 12 and len(vals) == 2 and vals[-1] < vals[0]
    saved = json.loads((root / "run" / "run.json").read_text())["recipe"]["train"]
    assert saved["doc_mask"] is True and saved["window_start"] == 16 and saved["normuon"] is True
    out = export_run(root / "run", tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours, tok, _, _ = load_run(root / "run")
    x = torch.tensor([tok.encode("ROMEO:\nBut soft, what light through yonder window breaks?")])
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours.eval()(x), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"optimizer": "adamw", "embed_lr_scale": 10.0}, "apply to optimizer='muon'"),
        ({"seq_len": 64, "window_start": 128}, "window_start must be at most seq_len"),
    ],
)
def test_a_setting_that_cannot_apply_is_refused_in_one_line(change, words):
    with pytest.raises(ConfigError, match=words) as e:
        TrainConfig(**change)
    assert "\n" not in str(e.value)
