"""Batch-size warm-up (`train.batch_warmup`, issue 50): the tokens each step trains on, counted as the
trainer takes them from the sampler on real text; the token total a run reports; exact resume after
kill -9 in the middle of the warm-up; and the settings it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import wait_for_step

from tinygpt.core import checkpoint as ckpt
from tinygpt.core.batch_schedule import batch_rows, tokens_through
from tinygpt.core.config import ConfigError, TrainConfig
from tinygpt.core.recipes import model_config
from tinygpt.data.sampler import WindowSampler, fixed_batches
from tinygpt.model.gpt import GPT
from tinygpt.train.distributed import Ranks
from tinygpt.train.step import TrainStep
from tinygpt.train.trainer import TrainData, Trainer

REPO = Path(__file__).resolve().parents[1]


class CountingSampler(WindowSampler):
    """The trainer's sampler, recording the rows of every batch it hands out."""

    taken: list[int]

    def next_batch(self, batch_size, rank=0, world_size=1):
        self.taken.append(batch_size)
        return super().next_batch(batch_size, rank, world_size)


def train(tokens, run_dir, **kw):
    """A tiny model trained on Tiny Shakespeare; (result, rows the sampler gave per call, config)."""
    cfg = TrainConfig(
        **{
            **dict(micro_batch_size=8, seq_len=64, max_steps=12, warmup_steps=2, eval_every=6),
            **dict(eval_batches=2, log_every=1, save_every=0, precision="fp32", device="cpu"),
            **kw,
        }
    )
    torch.manual_seed(0)
    sampler = CountingSampler(tokens.train, cfg.seq_len, cfg.seed)
    sampler.taken = []
    val = fixed_batches(tokens.val, cfg.seq_len, cfg.micro_batch_size, cfg.eval_batches)
    model = GPT(model_config("tiny", vocab_size=512))
    result = Trainer(model, cfg, TrainData(sampler, val), run_dir).fit()
    return result, sampler.taken, cfg


def test_the_rows_of_a_step_grow_to_the_full_batch_and_the_tokens_are_counted(tokens, tmp_path):
    """Half of 12 steps of warm-up from a quarter of 8 rows: 2, 3, 4, 5, 6, 7 rows, then 8; the
    logged token count is what the sampler gave, fewer than 12 full steps."""
    result, taken, cfg = train(tokens, tmp_path, batch_warmup=0.5, batch_start=0.25)
    assert taken == [2, 3, 4, 5, 6, 7] + [8] * 6
    seen = sum(taken) * cfg.seq_len
    logged = [m["tokens"] for m in result.metrics if "tokens" in m]
    assert logged[-1] == seen == tokens_through(cfg, 12) < 12 * cfg.tokens_per_step
    assert logged[:3] == [2 * 64, 5 * 64, 9 * 64]  # step by step, not steps x the full batch
    vals = [m["val_loss"] for m in result.metrics if m.get("val_loss") is not None]
    assert vals[-1] < vals[0]  # it still learns


def test_with_accumulation_the_warm_up_takes_fewer_micro_batches_of_the_same_shape(
    tokens, tmp_path
):
    _, taken, cfg = train(
        tokens, tmp_path, micro_batch_size=2, grad_accum_steps=4, max_steps=8, batch_warmup=0.5
    )
    per_step = [len(batch_rows(cfg, s)) for s in range(8)]
    assert per_step == [1, 2, 2, 3, 4, 4, 4, 4] and taken == [2] * sum(per_step)


def test_off_by_default_the_steps_are_the_full_batch(tokens, tmp_path):
    _, taken, cfg = train(tokens, tmp_path, max_steps=4)
    assert taken == [8] * 4 and tokens_through(cfg, 4) == 4 * cfg.tokens_per_step


@pytest.mark.parametrize(
    "change, words",
    [
        ({"batch_start": 0.5}, "set train.batch_warmup"),
        ({"batch_warmup": 1.0}, "batch_warmup"),
        ({"batch_warmup": 0.2, "batch_start": 0.0}, "batch_start"),
        ({"normuon": True}, "apply to optimizer='muon'"),
    ],
)
def test_a_setting_that_cannot_apply_is_refused_in_one_line(change, words):
    with pytest.raises(ConfigError, match=words) as e:
        TrainConfig(**change)
    assert "\n" not in str(e.value)


def test_under_torchrun_the_warm_up_is_refused_before_any_work(tokens):
    cfg = TrainConfig(micro_batch_size=8, seq_len=64, batch_warmup=0.2, device="cpu")
    model = GPT(model_config("tiny", vocab_size=512))
    sampler = WindowSampler(tokens.train, cfg.seq_len, cfg.seed)
    with pytest.raises(ConfigError, match="set it to 0 to train under torchrun") as e:
        TrainStep(model, cfg, sampler, ranks=Ranks(rank=0, world_size=2))
    assert "\n" not in str(e.value)


# --- exact resume in the middle of the warm-up, across processes ---------------------------------


def _cli(run_dir, shared_data, cache):
    env = {**os.environ, "TINYGPT_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tinygpt", "pretrain", "--recipe", "cpu-smoke"]
    cmd += ["--run-dir", str(run_dir), "--data", str(shared_data / "tinyshakespeare.txt")]
    cmd += ["--max-steps", "60", "--save-every", "4", "--quiet", "--device", "cpu"]
    cmd += ["--set", "train.batch_warmup=0.6", "train.log_every=1"]  # 36 steps of warm-up
    return subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        (m["step"], m.get("loss"), m.get("tokens"), m.get("val_loss"))
        for m in map(json.loads, lines)
        if "startup" not in m
    ]


@pytest.mark.slow  # three real runs, one killed
def test_a_run_killed_in_the_warm_up_resumes_bit_for_bit(shared_data, tmp_path):
    cache = tmp_path / "cache"
    ref = tmp_path / "ref"
    p = _cli(ref, shared_data, cache)
    assert p.wait(300) == 0, p.stdout.read().decode()
    run = tmp_path / "run"
    p = _cli(run, shared_data, cache)
    wait_for_step(run, 22, p)
    p.kill()  # SIGKILL: no handler runs, a checkpoint may be half written
    p.wait(60)
    steps = [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")]
    assert steps and 20 <= max(steps) < 36  # stopped inside the warm-up
    p = _cli(run, shared_data, cache)
    out = p.communicate(timeout=300)[0].decode()
    assert p.returncode == 0, out
    assert _records(run) == _records(ref)  # the same losses and token counts, step for step
    a = ckpt.load_checkpoint(ref / "checkpoints" / "step_000060")[0]
    b = ckpt.load_checkpoint(run / "checkpoints" / "step_000060")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
