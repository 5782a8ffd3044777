"""The training loop on real text: accumulation, schedule, checkpoints, exact resume after kill -9."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch
from conftest import wait_for_step

from tinygpt.core import checkpoint as ckpt
from tinygpt.core.config import Schedule, TrainConfig
from tinygpt.core.recipes import model_config
from tinygpt.data.sampler import WindowSampler, fixed_batches
from tinygpt.model.gpt import GPT
from tinygpt.train.step import lr_at
from tinygpt.train.trainer import TrainData, Trainer, TrainingError

REPO = Path(__file__).resolve().parents[1]


def make_trainer(tokens, run_dir, **train_kw):
    cfg = TrainConfig(
        **{
            **dict(
                micro_batch_size=8,
                seq_len=64,
                max_steps=20,
                lr=3e-3,
                min_lr=3e-4,
                warmup_steps=4,
                eval_every=10,
                eval_batches=2,
                log_every=1,
                save_every=5,
                keep_last=2,
                precision="fp32",
                device="cpu",
            ),
            **train_kw,
        }
    )
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=512))
    sampler = WindowSampler(tokens.train, cfg.seq_len, cfg.seed)
    val = fixed_batches(tokens.val, cfg.seq_len, cfg.micro_batch_size, cfg.eval_batches)
    return Trainer(model, cfg, TrainData(sampler, val), run_dir)


def test_loss_falls_and_run_folder_is_complete(tokens, tmp_path):
    res = make_trainer(tokens, tmp_path, max_steps=40).fit()
    losses = [m["loss"] for m in res.metrics if "loss" in m]
    assert losses[-1] < losses[0] - 0.8  # from ~6.2 (ln 512) well down on real text
    assert res.val_loss < 5.6 and res.step == 40
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [
        35,
        40,
    ]  # keep_last=2
    assert ckpt.verify_checkpoint(tmp_path / "best")[0]
    best = ckpt.read_manifest(tmp_path / "best")
    assert best["val_loss"] == min(m["val_loss"] for m in res.metrics if "val_loss" in m)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 41))
    assert {"step", "loss", "lr", "tokens_per_s", "grad_norm"} <= set(lines[0])
    sd, state, _ = ckpt.load_checkpoint(tmp_path / "checkpoints" / "step_000040")
    assert not any("_orig_mod" in k for k in sd) and state["step"] == 40 and "sampler" in state


def test_gradient_accumulation_equals_one_big_batch(tokens, tmp_path):
    big = make_trainer(
        tokens, tmp_path / "a", micro_batch_size=8, grad_accum_steps=1, max_steps=6
    ).fit()
    acc = make_trainer(
        tokens, tmp_path / "b", micro_batch_size=4, grad_accum_steps=2, max_steps=6
    ).fit()
    a = [m["loss"] for m in big.metrics if "loss" in m]
    b = [m["loss"] for m in acc.metrics if "loss" in m]
    assert a == pytest.approx(b, abs=2e-5)


@pytest.mark.parametrize("schedule", get_args(Schedule))
@pytest.mark.parametrize("steps", [110, 12, 3])
def test_every_schedule_warms_up_then_trains_its_last_step_at_min_lr(schedule, steps):
    """One convention for where a schedule ends: the last step run (max_steps - 1) trains at min_lr, the
    step before it above; warmup first, and never a rise after it."""
    cfg = TrainConfig(
        schedule=schedule,
        lr=1e-3,
        min_lr=1e-4,
        warmup_steps=min(10, steps - 1),
        max_steps=steps,
        decay_fraction=0.2,
    )
    lrs = [lr_at(s, cfg) for s in range(steps)]
    assert lrs[0] == pytest.approx(1e-3 / cfg.warmup_steps) and lrs[
        cfg.warmup_steps - 1
    ] == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4) and lrs[-2] > 1e-4 + 1e-9
    assert all(a >= b for a, b in zip(lrs[cfg.warmup_steps - 1 :], lrs[cfg.warmup_steps :]))
    assert lr_at(steps, cfg) == pytest.approx(
        1e-4
    )  # past the end (a resume of a finished run) stays there


def test_cosine_is_halfway_down_halfway_from_warmup_to_the_last_step():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=111)
    assert lr_at(60, cfg) == pytest.approx(5.5e-4) and lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(109, cfg) > lr_at(110, cfg)


def test_corrupt_and_incomplete_checkpoints_fall_back_to_the_previous(tokens, tmp_path):
    make_trainer(tokens, tmp_path, max_steps=15, keep_last=3).fit()
    root = tmp_path / "checkpoints"
    assert ckpt.latest_valid(root).name == "step_000015"
    data = bytearray((root / "step_000015" / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    (root / "step_000015" / "model.safetensors").write_bytes(bytes(data))
    (
        root / "step_000010" / "manifest.json"
    ).unlink()  # as if killed before the manifest was written
    with pytest.warns(UserWarning, match="sha256"):
        assert ckpt.latest_valid(root).name == "step_000005"
    with pytest.raises(ckpt.CheckpointError, match="sha256"):
        ckpt.load_checkpoint(root / "step_000015")
    # resuming picks step 5 and finishes the run again
    with pytest.warns(UserWarning):
        res = make_trainer(tokens, tmp_path, max_steps=15, keep_last=3).fit()
    assert res.resumed_from == 5 and res.step == 15


def test_resume_with_another_configuration_is_refused(tokens, tmp_path):
    make_trainer(tokens, tmp_path, max_steps=5).fit()
    with pytest.raises(TrainingError, match="lr: 0.003 in the run, 0.01 now"):
        make_trainer(tokens, tmp_path, max_steps=10, lr=1e-2).fit()
    res = make_trainer(tokens, tmp_path, max_steps=10).fit()  # a longer run is allowed
    assert res.resumed_from == 5 and res.step == 10


def test_nan_stops_training_and_keeps_the_last_good_checkpoint(tokens, tmp_path):
    t = make_trainer(tokens, tmp_path, max_steps=20, log_every=3, save_every=5)

    def poisoned(model, x, y):
        loss = model(x, y, reduction="sum")
        return loss * float("nan") if t.step >= 7 else loss

    t.loss_fn = poisoned
    with pytest.raises(TrainingError, match="step_000005"):
        t.fit()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [5]
    sd, _, _ = ckpt.load_checkpoint(tmp_path / "checkpoints" / "step_000005")
    assert all(torch.isfinite(v).all() for v in sd.values())


def test_fp16_with_grad_scaler_trains_on_cpu(tokens, tmp_path):
    t = make_trainer(tokens, tmp_path, max_steps=12, precision="fp16")
    assert t.precision.use_scaler and t.scaler.is_enabled()
    res = t.fit()
    losses = [m["loss"] for m in res.metrics if "loss" in m]
    assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0]
    _, state, _ = ckpt.load_checkpoint(res.checkpoint)
    assert state["scaler"]["scale"] > 0  # the scaler's state travels with the checkpoint
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # fp32 master weights


# --- exact resume across processes --------------------------------------------------------------


def _cli(run_dir, shared_data, cache, steps=60, **popen_kw):
    env = {**os.environ, "TINYGPT_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "tinygpt",
        "pretrain",
        "--recipe",
        "cpu-smoke",
        "--run-dir",
        str(run_dir),
        "--data",
        str(shared_data / "tinyshakespeare.txt"),
        "--max-steps",
        str(steps),
        "--save-every",
        "4",
        "--quiet",
        "--device",
        "cpu",
    ]
    return subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen_kw
    )


def _losses(run_dir):
    return [
        (m["step"], m.get("loss"), m.get("val_loss"))
        for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "startup" not in m
    ]  # each start records its own start-up times


@pytest.mark.slow  # real processes killed (short form: test_fast_recipe.py's resume)
@pytest.mark.parametrize("how", ["kill9", "sigterm"])
def test_interrupted_run_resumes_bit_identical(how, shared_data, tmp_path):
    cache = tmp_path / "cache"
    ref = tmp_path / "ref"
    p = _cli(ref, shared_data, cache)
    assert p.wait(300) == 0, p.stdout.read().decode()
    run = tmp_path / "run"
    p = _cli(run, shared_data, cache)
    wait_for_step(run, 22 if how == "kill9" else 13, p)
    if how == "kill9":
        p.kill()  # SIGKILL: no handler runs, a checkpoint may be half written
    else:
        p.send_signal(signal.SIGTERM)  # saves at the end of the current step and exits
    p.wait(60)
    steps = [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")]
    assert steps and max(steps) < 60
    if how == "sigterm":
        assert p.returncode == 0 and max(steps) % 4 != 0 or max(steps) >= 13  # saved at the stop
    p = _cli(run, shared_data, cache)
    out = p.communicate(timeout=300)[0].decode()
    assert p.returncode == 0, out
    assert _losses(run) == _losses(ref)  # the same loss curve, step for step
    a = ckpt.load_checkpoint(ref / "checkpoints" / "step_000060")[0]
    b = ckpt.load_checkpoint(run / "checkpoints" / "step_000060")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical weights


def test_a_full_disk_stops_training_with_the_last_checkpoint_intact(tokens, tmp_path, monkeypatch):
    import errno

    t = make_trainer(tokens, tmp_path, max_steps=20, save_every=5)
    real_save = ckpt.save_checkpoint

    def fill_disk(path, model_sd, state, meta=None):
        if state["step"] >= 10:  # the disk fills up while the second checkpoint is written
            tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
            tmp.mkdir(parents=True)
            (tmp / "model.safetensors").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(path, model_sd, state, meta)

    monkeypatch.setattr(ckpt, "save_checkpoint", fill_disk)
    with pytest.raises(
        TrainingError, match="No space left on device.*step_000005.*free some disk space"
    ):
        t.fit()
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step_000005"]  # no half-written folder left behind
    assert ckpt.verify_checkpoint(root / "step_000005")[0]


def test_checkpoint_carries_the_recipe_and_tokenizer(shared_data, tmp_path):
    from tinygpt.model.tokenizer import Tokenizer
    from tinygpt.pretrain.run_pretrain import pretrain

    res = pretrain(
        "cpu-smoke",
        tmp_path / "run",
        data=str(shared_data / "tinyshakespeare.txt"),
        max_steps=5,
        progress=False,
        cache_dir=tmp_path / "cache",
        device="cpu",
        tensorboard=False,
    )
    _, state, _ = ckpt.load_checkpoint(res.checkpoint)
    assert state["run_info"]["recipe"]["name"] == "cpu-smoke"
    saved = Tokenizer.load(tmp_path / "run" / "tokenizer.json")
    assert (
        state["run_info"]["tokenizer"] == saved.to_json()
    )  # a checkpoint folder alone is enough to decode


@pytest.mark.slow  # torch.compile against eager
def test_torch_compile_trains_like_eager_and_saves_clean_keys(tokens, tmp_path):
    eager = make_trainer(tokens, tmp_path / "eager", max_steps=4, log_every=1).fit()
    t = make_trainer(tokens, tmp_path / "compiled", max_steps=4, log_every=1, compile="on")
    assert t.forward_model is not t.model  # the compiled wrapper runs the steps
    compiled = t.fit()
    a = [m["loss"] for m in eager.metrics if "loss" in m]
    b = [m["loss"] for m in compiled.metrics if "loss" in m]
    assert b == pytest.approx(a, abs=1e-4)  # inductor fuses differently: equal to float tolerance
    sd, _, _ = ckpt.load_checkpoint(compiled.checkpoint)
    assert sd.keys() == ckpt.load_checkpoint(eager.checkpoint)[0].keys()
    assert not any("_orig_mod" in k for k in sd)
