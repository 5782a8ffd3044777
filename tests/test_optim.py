"""The optimizers: Muon for hidden matrices + AdamW for the rest, as one optimizer for the trainer."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from tinygpt.core.config import ModelConfig, TrainConfig, model_config
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import train_bpe
from tinygpt.train.optim import MuonAdamW, build_optimizer, split_muon_params

VOCAB = 512
SEQ, BATCH = 64, 8


@pytest.fixture(scope="module")
def shakespeare_ids(shakespeare) -> np.ndarray:
    text = shakespeare[:200_000]  # enough for 30 steps of 8 x 64 tokens without repeats
    tok = train_bpe([text], VOCAB)
    return np.asarray(tok.encode(text), dtype=np.int64)


def batches(ids: np.ndarray, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        starts = rng.integers(0, len(ids) - SEQ - 1, BATCH)
        w = torch.from_numpy(np.stack([ids[s:s + SEQ + 1] for s in starts]))
        out.append((w[:, :-1], w[:, 1:]))
    return out


def train_steps(model: GPT, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, data, lr: float) -> list[float]:
    """The trainer's step: lr times lr_scale, scaled backward, unscale, clip, scaler step, zero_grad."""
    out = []
    for x, y in data:
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_muon_gets_the_hidden_matrices_only(tie):
    cfg = ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=32,
                      tie_embeddings=tie)
    model = GPT(cfg)
    muon, decay, no_decay = split_muon_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)].split(".")[-2] for p in muon) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] * cfg.n_layer)
    assert {names[id(p)] for p in decay} == ({"model.embed_tokens.weight"} if tie else
                                            {"model.embed_tokens.weight", "lm_head.weight"})
    assert all(p.dim() == 1 for p in no_decay)
    everything = muon + decay + no_decay
    assert len({id(p) for p in everything}) == len(everything) == len(list(model.parameters()))

    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=1e-3), "cpu")
    assert isinstance(opt, torch.optim.Optimizer)
    kinds = {g["kind"]: g["lr_scale"] for g in opt.param_groups}
    assert set(kinds) == {"muon", "adamw"} and kinds["adamw"] == 1.0
    muon_group = next(g for g in opt.param_groups if g["kind"] == "muon")
    # Muon's decay per step is lr * lr_scale * weight_decay: the same as AdamW's lr * weight_decay.
    assert muon_group["lr_scale"] * muon_group["weight_decay"] == pytest.approx(0.1)


def test_muon_lowers_the_loss_on_shakespeare(shakespeare_ids):
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=VOCAB, max_seq_len=SEQ))
    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=3e-3), "cpu")
    losses = train_steps(model, opt, torch.amp.GradScaler("cpu", enabled=False), batches(shakespeare_ids, 30), 3e-3)
    assert losses[0] == pytest.approx(np.log(VOCAB), abs=0.3)  # a fresh model is near uniform
    assert np.mean(losses[-5:]) < losses[0] - 0.8, losses


def test_state_dict_round_trip_resumes_bit_for_bit(shakespeare_ids):
    """Stop after 4 steps, save model + optimizer + scaler, load into fresh objects: the next 4 steps
    give the same losses and weights as never stopping (GradScaler enabled, as with fp16)."""
    data = batches(shakespeare_ids, 8, seed=1)
    cfg = TrainConfig(optimizer="muon", lr=3e-3)

    def fresh():
        torch.manual_seed(0)
        model = GPT(model_config("tiny", vocab_size=VOCAB, max_seq_len=SEQ))
        return model, build_optimizer(model, cfg, "cpu"), torch.amp.GradScaler("cpu", init_scale=1024.0)

    model, opt, scaler = fresh()
    train_steps(model, opt, scaler, data[:4], 3e-3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, buf)
    straight = train_steps(model, opt, scaler, data[4:], 3e-3)

    model2, opt2, scaler2 = fresh()
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    scaler2.load_state_dict(state["scaler"])
    assert isinstance(opt2, MuonAdamW) and len(opt2.state) == len(list(model2.parameters()))
    resumed = train_steps(model2, opt2, scaler2, data[4:], 3e-3)
    assert resumed == straight
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)


def test_grad_scaler_skips_the_step_on_inf():
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=64, max_seq_len=16))
    opt = build_optimizer(model, TrainConfig(optimizer="muon"), "cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, 64, (2, 16))
    scaler.scale(model(x, x)).backward()
    model.model.layers[0].mlp.up_proj.weight.grad[0, 0] = float("inf")  # a Muon parameter
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0  # inf found: the scale halves and nothing moves
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def test_adamw_is_unchanged():
    model = GPT(model_config("tiny", vocab_size=64, max_seq_len=16))
    opt = build_optimizer(model, TrainConfig(optimizer="adamw"), "cpu")
    assert type(opt) is torch.optim.AdamW
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
