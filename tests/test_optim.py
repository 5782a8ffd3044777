"""The optimizers: Muon for hidden matrices + AdamW for the rest, as one optimizer for the trainer."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch

from tinygpt.core.config import ModelConfig, TrainConfig
from tinygpt.core.recipes import model_config
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
        w = torch.from_numpy(np.stack([ids[s : s + SEQ + 1] for s in starts]))
        out.append((w[:, :-1], w[:, 1:]))
    return out


def train_steps(
    model: GPT, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, data, lr: float
) -> list[float]:
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
    cfg = ModelConfig(
        vocab_size=300,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=64,
        max_seq_len=32,
        tie_embeddings=tie,
    )
    model = GPT(cfg)
    muon, decay, no_decay = split_muon_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)].split(".")[-2] for p in muon) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] * cfg.n_layer
    )
    assert {names[id(p)] for p in decay} == (
        {"model.embed_tokens.weight"} if tie else {"model.embed_tokens.weight", "lm_head.weight"}
    )
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
    losses = train_steps(
        model, opt, torch.amp.GradScaler("cpu", enabled=False), batches(shakespeare_ids, 30), 3e-3
    )
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
        return (
            model,
            build_optimizer(model, cfg, "cpu"),
            torch.amp.GradScaler("cpu", init_scale=1024.0),
        )

    model, opt, scaler = fresh()
    train_steps(model, opt, scaler, data[:4], 3e-3)
    buf = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, buf
    )
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


def _muon_with_scaler(fused: bool, scaler_on: bool):
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=64, max_seq_len=16))
    muon, decay, no_decay = split_muon_params(model)
    # fused: what build_optimizer gives on CUDA, where the AdamW half unscales and skips inside its kernel
    opt = MuonAdamW(
        [{"params": muon, "lr_scale": 4.0, "weight_decay": 0.025}],
        [
            {"params": decay, "lr_scale": 1.0, "weight_decay": 0.1},
            {"params": no_decay, "lr_scale": 1.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
        fused=fused,
    )
    return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**12, enabled=scaler_on)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("explicit_unscale", [True, False])
def test_scaled_fp16_steps_equal_unscaled_ones_without_reading_back(
    fused, explicit_unscale, shakespeare_ids, monkeypatch
):
    """The GradScaler hands MuonAdamW grad_scale and found_inf (it supports amp scaling) instead of reading
    found_inf back to decide; the steps equal those without a scaler. With fused AdamW (CUDA's) nothing at all is
    read back to the host in the step (Tensor.item is what would sync)."""
    data = [(x[:, :16], y[:, :16]) for x, y in batches(np.asarray(shakespeare_ids) % 64, 3)]
    weights = []
    for scaler_on in (False, True):
        model, opt, scaler = _muon_with_scaler(fused, scaler_on)
        assert opt._step_supports_amp_scaling
        for g in opt.param_groups:
            g["lr"] = 3e-3 * g.get("lr_scale", 1.0)
        for x, y in data:
            scaler.scale(model(x, y)).backward()
            if explicit_unscale:  # the trainer's order: unscale, clip, step
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if scaler_on and fused:
                with monkeypatch.context() as m:
                    m.setattr(
                        torch.Tensor,
                        "item",
                        lambda t: pytest.fail("the step read a value back to the host"),
                    )
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        assert not hasattr(opt, "found_inf") and not hasattr(
            opt._adamw, "found_inf"
        )  # handed back to the scaler
        weights.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*weights):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_a_scaled_step_with_an_inf_gradient_changes_nothing(fused):
    model, opt, scaler = _muon_with_scaler(fused, True)
    x = torch.randint(0, 64, (2, 16))
    scaler.scale(model(x, x)).backward()  # a first step: momentum buffers and AdamW moments exist
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in model.parameters()]
    state = {
        id(p): {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
        for p in model.parameters()
    }
    scaler.scale(model(x, x)).backward()
    model.model.layers[0].mlp.up_proj.weight.grad[0, 0] = float("inf")  # a Muon parameter
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**11  # inf found: the scale halves
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for p in model.parameters():  # nor did the momentum buffers or the AdamW moments move
        for k, v in state[id(p)].items():
            if k != "step":
                assert torch.equal(opt.state[p][k], v), k


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_eager_optimizers_step_as_torchs_and_import_no_compiler(optimizer, shakespeare_ids):
    """Where nothing compiles, `build_optimizer(compiled=False)` gives EagerAdamW / EagerMuonAdamW:
    the same losses, weights and state as torch's classes (a checkpoint of one loads into the other),
    and, in a fresh process, no import of torch._dynamo (counted in sys.modules, not timed)."""
    data = batches(shakespeare_ids, 6, seed=2)
    cfg = TrainConfig(optimizer=optimizer, lr=3e-3)
    runs = []
    for compiled in (True, False):
        torch.manual_seed(0)
        model = GPT(model_config("tiny", vocab_size=VOCAB, max_seq_len=SEQ))
        opt = build_optimizer(model, cfg, "cpu", compiled=compiled)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        runs.append((model, opt, train_steps(model, opt, scaler, data, 3e-3)))
    (m1, o1, losses1), (m2, o2, losses2) = runs
    assert type(o2).__name__.startswith("Eager") and not type(o1).__name__.startswith("Eager")
    assert losses1 == losses2
    assert all(
        torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values())
    )
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"] and s1["state"].keys() == s2["state"].keys()
    for k, state in s1["state"].items():
        assert all(torch.equal(v, s2["state"][k][name]) for name, v in state.items())
    o1.load_state_dict(s2)
    o2.load_state_dict(s1)
    code = (
        "import sys, torch\n"
        "from tinygpt.core.config import TrainConfig\n"
        "from tinygpt.core.recipes import model_config\n"
        "from tinygpt.model.gpt import GPT\n"
        "from tinygpt.train.optim import build_optimizer\n"
        "model = GPT(model_config('tiny', vocab_size=64, max_seq_len=16))\n"
        f"opt = build_optimizer(model, TrainConfig(optimizer='{optimizer}'), 'cpu', compiled=False)\n"
        "x = torch.randint(0, 64, (2, 16))\n"
        "model(x, x).backward()\n"
        "opt.step()\n"
        "opt.zero_grad(set_to_none=True)\n"
        "opt.load_state_dict(opt.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_normuon_gives_each_neuron_an_update_of_the_same_size(shakespeare_ids):
    """One step on real text with train.normuon (no weight decay): each row of a tall hidden
    matrix's change, one output neuron's, has the same norm (Muon's rows differ), and the change
    is as large in all as Muon's, so that Muon's learning rate keeps its meaning."""
    x, y = batches(shakespeare_ids, 1, seed=3)[0]
    changes = {}
    for normuon in (False, True):
        torch.manual_seed(0)
        model = GPT(model_config("tiny", vocab_size=VOCAB, max_seq_len=SEQ))
        cfg = TrainConfig(optimizer="muon", lr=3e-3, weight_decay=0.0, normuon=normuon)
        opt = build_optimizer(model, cfg, "cpu", compiled=False)
        w = model.blocks()[0].mlp.up_proj.weight
        assert w.shape[0] > w.shape[1]  # tall: Muon's rows are not orthonormal
        before = w.detach().clone()
        model(x, y).backward()
        opt.step()
        changes[normuon] = w.detach() - before
        assert ("row_sq" in opt.state[w]) is normuon
    muon, nor = (changes[k].norm(dim=1) for k in (False, True))
    assert muon.max() / muon.min() > 1.2 and nor.max() / nor.min() < 1.01
    assert float(changes[True].norm()) == pytest.approx(float(changes[False].norm()), rel=0.02)


def test_normuon_lowers_the_loss_on_shakespeare_and_resumes_bit_for_bit(shakespeare_ids):
    data = batches(shakespeare_ids, 30)
    cfg = TrainConfig(optimizer="muon", lr=3e-3, normuon=True)
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=VOCAB, max_seq_len=SEQ))
    opt = build_optimizer(model, cfg, "cpu", compiled=False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    losses = train_steps(model, opt, scaler, data[:26], 3e-3)
    assert np.mean(losses[-5:]) < losses[0] - 0.8, losses
    state = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, state)
    straight = train_steps(model, opt, scaler, data[26:], 3e-3)
    state.seek(0)
    saved = torch.load(state, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])  # the neurons' running mean squares with it
    assert train_steps(model, opt, scaler, data[26:], 3e-3) == straight
