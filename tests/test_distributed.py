"""Several processes under torchrun on the CPU (gloo): the same loss curve as one process at the same
global batch, checkpoints that move between world sizes (DDP and FSDP2), and kill -9 of one rank."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import wait_for_step

from tinygpt.core import checkpoint as ckpt
from tinygpt.core.config import ConfigError
from tinygpt.data.sampler import WindowSampler
from tinygpt.train.distributed import check_parallel, split_global_batch, torchrun_env

REPO = Path(__file__).resolve().parents[1]
STEPS = 24  # steps are cheap (process start-up is not): room to stop a run half way
# The recipe's global batch is 4 sequences x 2 accumulation steps; with 2 processes each runs one
# micro-step of 4 (the accumulation is divided). Logged every step, evaluated and saved every 4.
COMMON = [
    "--recipe",
    "cpu-smoke",
    "--max-steps",
    str(STEPS),
    "--save-every",
    "4",
    "--eval-every",
    "4",
    "--device",
    "cpu",
    "--quiet",
    "--set",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
    "train.log_every=1",
    "train.keep_last=10",
]
FSDP_SCRIPT = (
    """
import sys
from tinygpt.core.recipes import get_recipe
from tinygpt.pretrain.run_pretrain import pretrain

recipe = get_recipe("cpu-smoke").replace(train=dict(micro_batch_size=4, grad_accum_steps=2, log_every=1, keep_last=10))
pretrain(recipe, sys.argv[1], data=sys.argv[2], max_steps=%d, save_every=4, eval_every=4, device="cpu",
         progress=False, parallel="fsdp")
"""
    % STEPS
)


# --- the pieces, in one process --------------------------------------------------------------------


def test_global_batch_is_split_over_ranks():
    assert split_global_batch(8, 16, 1) == (8, 16)
    assert split_global_batch(8, 16, 4) == (
        8,
        4,
    )  # accumulation divided first: the micro-batch stays
    assert split_global_batch(8, 1, 2) == (4, 1)  # else the micro-batch
    with pytest.raises(
        ConfigError, match="neither grad_accum_steps nor micro_batch_size is a multiple of 3"
    ):
        split_global_batch(8, 2, 3)


def test_ranks_read_disjoint_shares_of_the_single_process_order():
    tokens = np.arange(10_000, dtype=np.uint16)
    one = WindowSampler(tokens, 16, seed=3)
    ranks = [WindowSampler(tokens, 16, seed=3) for _ in range(2)]
    for _ in range(40):  # past an epoch boundary (624 windows)
        x = one.next_batch(8)[0]
        parts = [s.next_batch(4, r, 2)[0] for r, s in enumerate(ranks)]
        assert torch.equal(torch.cat(parts), x)
    assert all(s.state_dict() == one.state_dict() for s in ranks)  # the position is the global one


def test_torchrun_environment_and_parallel_modes():
    assert torchrun_env({}) is None
    env = torchrun_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    with pytest.raises(ConfigError, match="ddp, fsdp"):
        check_parallel("zero3", "adamw", 2)
    with pytest.raises(ConfigError, match="muon"):
        check_parallel("fsdp", "muon", 2)


# --- real torchrun jobs --------------------------------------------------------------------------


def _env(cache):
    return {
        **os.environ,
        "TINYGPT_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }


def _launch(run_dir, shared_data, cache, nproc=1, script=None, **popen_kw):
    data = str(shared_data / "tinyshakespeare.txt")
    if nproc == 1:
        cmd = [
            sys.executable,
            "-m",
            "tinygpt",
            "pretrain",
            "--run-dir",
            str(run_dir),
            "--data",
            data,
            *COMMON,
        ]
    else:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
        ]
        cmd = launcher + (
            [str(script), str(run_dir), data]
            if script
            else ["-m", "tinygpt", "pretrain", "--run-dir", str(run_dir), "--data", data, *COMMON]
        )
    return subprocess.Popen(
        cmd, env=_env(cache), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen_kw
    )


def _run(*args, **kw) -> str:
    p = _launch(*args, **kw)
    out = p.communicate(timeout=300)[0].decode()
    assert p.returncode == 0, out
    return out


def _curve(run_dir):
    return [
        (m["step"], m.get("loss"), m.get("val_loss"))
        for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "startup" not in m
    ]  # each start records its own start-up times


def _assert_same_run(run_dir, ref_dir, atol=1e-5):
    """The same loss curve and final weights as the reference, up to reduction order."""
    a, b = _curve(run_dir), _curve(ref_dir)
    assert [s for s, _, _ in a] == [s for s, _, _ in b] == list(range(1, STEPS + 1))
    for (s, loss, val), (_, ref_loss, ref_val) in zip(a, b):
        assert loss == pytest.approx(ref_loss, abs=atol), f"step {s}"
        assert (val is None) == (ref_val is None) and (
            val is None or val == pytest.approx(ref_val, abs=atol)
        )
    last = ckpt.step_name(STEPS)
    sd, state, _ = ckpt.load_checkpoint(run_dir / "checkpoints" / last)
    ref_sd, ref_state, _ = ckpt.load_checkpoint(ref_dir / "checkpoints" / last)
    assert sd.keys() == ref_sd.keys()
    assert all(torch.allclose(sd[k], ref_sd[k], atol=1e-4) for k in sd)
    assert state["sampler"] == ref_state["sampler"]  # the same place in the same global order
    opt, ref_opt = (
        state["optimizer"],
        ref_state["optimizer"],
    )  # the single-process format, whatever wrote it
    assert (
        opt["param_groups"] == ref_opt["param_groups"]
        and opt["state"].keys() == ref_opt["state"].keys()
    )
    for i, s in opt["state"].items():
        assert all(torch.allclose(v, ref_opt["state"][i][n], atol=1e-5) for n, v in s.items())


@pytest.fixture(scope="module")
def reference(shared_data, tmp_path_factory):
    """One process, the whole run: what every multi-process run below must reproduce."""
    root = tmp_path_factory.mktemp("dist")
    _run(root / "ref", shared_data, root / "cache")
    return root


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _rank_pid(torchrun_pid: int, rank: int, timeout: float = 60) -> int:
    t0 = time.time()
    while time.time() - t0 < timeout:
        for c in _children(torchrun_pid):
            try:
                env = (Path(f"/proc/{c}/environ").read_bytes()).split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return c
        time.sleep(0.05)
    raise TimeoutError(f"no rank {rank} under {torchrun_pid}")


@pytest.mark.slow  # torchrun processes killed
def test_kill9_of_one_rank_then_resume_in_one_process(reference, shared_data):
    """DDP on 2 processes; rank 1 is killed; the job ends with a clear error and an intact checkpoint,
    which one process resumes to the very loss curve of the unbroken single-process run."""
    run = reference / "ddp"
    p = _launch(run, shared_data, reference / "cache", nproc=2)
    wait_for_step(run, 6, p)
    os.kill(_rank_pid(p.pid, 1), 9)
    out = p.communicate(timeout=120)[0].decode()
    assert p.returncode != 0
    steps = [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")]
    assert steps and max(steps) < STEPS
    assert "lost its peers" in out and "run the same command again" in out, out
    assert (
        f"The last good checkpoint is {run / 'checkpoints' / ckpt.step_name(max(steps))}" in out
    ), out
    assert all(ckpt.verify_checkpoint(run / "checkpoints" / ckpt.step_name(s))[0] for s in steps)
    two, one = _curve(run)[:6], _curve(reference / "ref")[:6]  # 2 processes = 1, step for step
    assert [m[1] for m in two] == pytest.approx([m[1] for m in one], abs=1e-5) and two[3][
        2
    ] is not None
    _run(run, shared_data, reference / "cache", nproc=1)  # written by 2, resumed by 1
    _assert_same_run(run, reference / "ref")


@pytest.mark.slow  # torchrun processes stopped
def test_one_process_checkpoint_resumes_in_two_stops_on_sigterm_and_finishes_with_fsdp(
    reference, shared_data, tmp_path
):
    """The single-process run's step-4 checkpoint is resumed by 2 DDP processes; SIGTERM to torchrun
    stops both ranks at the same step with a checkpoint; 2 FSDP2 processes finish the run, which
    ends as the single-process run did, its checkpoints gathered into the single-process format."""
    run = reference / "resumed"
    shutil.copytree(reference / "ref", run)
    for step, folder in ckpt.list_checkpoints(run / "checkpoints"):
        if step > 4:
            shutil.rmtree(folder)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(x for x in lines if json.loads(x)["step"] <= 4))
    p = _launch(run, shared_data, reference / "cache", nproc=2)
    wait_for_step(run, 6, p)
    p.send_signal(signal.SIGTERM)  # torchrun passes it to every rank
    out = p.communicate(timeout=120)[0].decode()
    stopped = max(s for s, _ in ckpt.list_checkpoints(run / "checkpoints"))
    assert 6 <= stopped < STEPS and "stopped by a signal" in out, out
    assert ckpt.verify_checkpoint(run / "checkpoints" / ckpt.step_name(stopped))[0]
    script = tmp_path / "fsdp_pretrain.py"
    script.write_text(FSDP_SCRIPT)
    _run(run, shared_data, reference / "cache", nproc=2, script=script)
    _assert_same_run(run, reference / "ref")


@pytest.mark.slow  # torchrun processes
def test_two_ranks_fix_a_time_budget_again_together_and_end_at_the_same_step(tmp_path):
    """Under --hours rank 0's clock fixes the step count, at step 9 and again at each checkpoint of the
    stable phase; every rank takes it there (a rank that did not would wait for the others' next step
    forever). The built-in corpus: no shared data needed."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "tinygpt",
        "pretrain",
        "--run-dir",
        str(run),
        "--recipe",
        "cpu-smoke",
        "--hours",
        "0.003",
        "--save-every",
        "4",
        "--device",
        "cpu",
        "--quiet",
        "--set",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
    ]
    out = subprocess.run(
        cmd, env=_env(tmp_path / "cache"), cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    budget = json.loads((run / "budget.json").read_text())
    assert budget["decided_at_step"] > 9 and budget["decided_at_step"] % 4 == 0  # fixed again later
    steps = [
        m["step"]
        for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in m
    ]
    assert (
        steps[-1]
        == budget["max_steps"]
        == max(s for s, _ in ckpt.list_checkpoints(run / "checkpoints"))
    )
