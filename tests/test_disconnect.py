"""The Colab disconnect contract, with real processes: a run mirrored to a "Drive" folder is killed
(kill -9) in the middle, the VM's disk is lost, and a new process resumes from the mirror at the
last verified checkpoint and ends bit-identical (CPU) to a run that was never stopped. Also: a
copy cut short by the kill, a corrupt or truncated checkpoint on the mirror, and Drive failing
for a while during training."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock  # a dependency of torch
from safetensors.torch import load_file

from tinygpt.core.checkpoint import MODEL_FILE, list_checkpoints, step_name, verify_checkpoint
from tinygpt.pretrain.run_pretrain import pretrain
from tinygpt.sync.copy import Backoff
from tinygpt.sync.mirror import Mirror

pytestmark = (
    pytest.mark.slow
)  # real runs killed, mirrors filled (short form: test_fast_recipe.py's resume)
REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 40, 4

RESUME = """
import json, sys
from tinygpt.pretrain.run_pretrain import pretrain
run_dir, data, mirror = sys.argv[1:4]
r = pretrain("cpu-smoke", run_dir, data=data, mirror=mirror, max_steps=%d, save_every=%d, device="cpu",
             progress=False)
print(json.dumps({"resumed_from": r.resumed_from, "step": r.step}))
""" % (STEPS, SAVE_EVERY)


def env(cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "TINYGPT_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
    }


def cli(run_dir: Path, data: Path, cache: Path, mirror: Path | None = None) -> subprocess.Popen:
    """`tinygpt pretrain` as a user types it (the notebook calls the same `pretrain`)."""
    cmd = [
        sys.executable,
        "-m",
        "tinygpt",
        "pretrain",
        "--recipe",
        "cpu-smoke",
        "--data",
        str(data),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
        "--quiet",
        "--device",
        "cpu",
    ] + (["--mirror", str(mirror)] if mirror else [])
    return subprocess.Popen(
        cmd, env=env(cache), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def resume_on_new_vm(run_dir: Path, data: Path, cache: Path, mirror: Path) -> tuple[dict, str]:
    """A fresh process training the same run; what pretrain returned (resumed_from, step) and its stderr.
    (`tinygpt pretrain` does not print the step it resumed from, so this calls pretrain itself.)"""
    p = subprocess.run(
        [sys.executable, "-c", RESUME, str(run_dir), str(data), str(mirror)],
        env=env(cache),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def valid_steps(ckpt_root: Path) -> list[int]:
    return [s for s, p in list_checkpoints(ckpt_root) if verify_checkpoint(p)[0]]


def losses(run_dir: Path) -> list[tuple]:
    return [
        (m["step"], m.get("loss"), m.get("val_loss"))
        for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "startup" not in m
    ]  # each start records its own start-up times


def assert_same_weights(a: Path, b: Path) -> None:
    x, y = load_file(str(a / MODEL_FILE)), load_file(str(b / MODEL_FILE))
    assert x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x), f"{a} and {b} differ"


def assert_like_reference(run_dir: Path, reference: Path) -> None:
    assert losses(run_dir) == losses(reference)  # the same curve, step for step
    final = step_name(STEPS)
    assert_same_weights(
        run_dir / "checkpoints" / final, reference / "checkpoints" / final
    )  # bit for bit


@pytest.fixture(scope="module")
def data(shared_data) -> Path:
    return shared_data / "tinyshakespeare.txt"


def shared_once(tmp_path_factory, name: str, make) -> Path:
    """make(folder) once per test session, also under pytest-xdist: the workers share the folder
    (the tests only read it or copy it), so the slow runs are not repeated on each worker."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, above each worker's own
    folder, done = base / f"disconnect-{name}", base / f"disconnect-{name}.done"
    with FileLock(str(base / f"disconnect-{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            folder.mkdir(parents=True)
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    """The run never stopped."""

    def make(root: Path) -> None:
        p = cli(root / "run", data, root / "cache")
        out = p.communicate(timeout=300)[0].decode()
        assert p.returncode == 0, out

    return shared_once(tmp_path_factory, "reference", make) / "run"


@pytest.fixture(scope="module")
def killed_mirror(tmp_path_factory, data) -> Path:
    """What Drive holds after the VM died: a mirrored run killed with kill -9 after at least two
    checkpoints reached the mirror. Tests copy it before changing anything."""
    return (
        shared_once(tmp_path_factory, "killed", lambda root: kill_midway(root, data))
        / "drive"
        / "runs"
        / "r"
    )


def kill_midway(root: Path, data: Path) -> None:
    """Train with a mirror under root/drive, kill -9 once two checkpoints are on the mirror."""
    mirror = root / "drive" / "runs" / "r"
    p = cli(root / "vm" / "r", data, root / "cache", mirror)
    t0 = time.monotonic()
    while (
        len(valid_steps(mirror / "checkpoints")) < 2
        and p.poll() is None
        and time.monotonic() - t0 < 240
    ):
        time.sleep(0.01)
    p.kill()  # SIGKILL: no handler runs, the mirror thread dies mid-copy if it was copying
    out = p.communicate(timeout=60)[0].decode()
    assert p.returncode == -9, (
        f"the run ended before it could be killed (exit {p.returncode}):\n{out}"
    )
    steps = valid_steps(mirror / "checkpoints")
    assert len(steps) >= 2 and steps[-1] < STEPS


def new_vm(tmp_path: Path, killed_mirror: Path) -> tuple[Path, Path, Path]:
    """(local run folder, token cache, mirror) of a fresh VM: nothing local, Drive as it was left.
    The mirror's parent goes along: the token cache is mirrored beside the runs."""
    drive = tmp_path / "drive"
    shutil.copytree(killed_mirror.parents[1], drive, symlinks=True)
    return tmp_path / "vm" / "r", tmp_path / "cache", drive / "runs" / killed_mirror.name


def test_killed_run_resumes_from_the_mirror_on_a_new_vm_bit_identical(
    tmp_path, data, reference, killed_mirror
):
    local, cache, mirror = new_vm(tmp_path, killed_mirror)
    last = valid_steps(mirror / "checkpoints")[-1]
    result, _ = resume_on_new_vm(local, data, cache, mirror)
    assert result == {"resumed_from": last, "step": STEPS}
    assert_like_reference(local, reference)
    assert verify_checkpoint(mirror / "checkpoints" / step_name(STEPS))[0]  # the mirror caught up
    assert_same_weights(
        mirror / "checkpoints" / step_name(STEPS), local / "checkpoints" / step_name(STEPS)
    )
    assert losses(mirror) == losses(reference)


def test_half_copied_corrupt_and_truncated_checkpoints_on_the_mirror_are_skipped(
    tmp_path, data, reference, killed_mirror
):
    local, cache, mirror = new_vm(tmp_path, killed_mirror)
    ckpts = mirror / "checkpoints"
    *_, before, newest = valid_steps(ckpts)
    src = ckpts / step_name(newest)
    # The kill during a copy: a temp folder with half a model file (never a step_ folder by itself).
    half = ckpts / f".tmp-{step_name(newest + SAVE_EVERY)}-999-deadbeef"
    half.mkdir()
    (half / MODEL_FILE).write_bytes((src / MODEL_FILE).read_bytes()[:1000])
    # A checkpoint truncated on Drive (a newer step, so it is tried first) ...
    truncated = ckpts / step_name(newest + 2 * SAVE_EVERY)
    shutil.copytree(src, truncated)
    (truncated / "manifest.json").write_text(
        (src / "manifest.json")
        .read_text()
        .replace(f'"step": {newest}', f'"step": {newest + 2 * SAVE_EVERY}')
    )
    with open(truncated / MODEL_FILE, "r+b") as f:
        f.truncate(5000)
    # ... and the newest real one corrupted in place: right size, wrong bytes (only the sha256 tells).
    with open(src / MODEL_FILE, "r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(bytes(64))
    assert valid_steps(ckpts) == [before]

    result, stderr = resume_on_new_vm(local, data, cache, mirror)
    assert result == {"resumed_from": before, "step": STEPS}
    assert "skipping checkpoint" in stderr
    assert_like_reference(local, reference)
    assert not [
        p for p in ckpts.iterdir() if p.name.startswith(".tmp-")
    ]  # the new session cleaned up


@pytest.mark.filterwarnings("ignore:Drive mirror")
def test_drive_failing_for_a_while_never_stops_training_and_the_mirror_catches_up(
    tmp_path, data, reference
):
    calls = {"n": 0, "failed": 0}

    def flaky_copy(src: Path, dst: Path) -> None:
        calls["n"] += 1
        if calls["n"] <= 10:  # Drive drops out for the first checkpoints, then comes back
            calls["failed"] += 1
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        shutil.copyfile(src, dst)

    local, mirror_dir = tmp_path / "vm" / "r", tmp_path / "drive" / "r"
    mirror = Mirror(
        local,
        mirror_dir,
        keep_last=2,
        copy_file=flaky_copy,
        backoff=Backoff(max_attempts=3, base_delay_s=0.001, max_delay_s=0.01),
    )
    result = pretrain(
        "cpu-smoke",
        local,
        data=str(data),
        max_steps=STEPS,
        save_every=SAVE_EVERY,
        device="cpu",
        progress=False,
        callbacks=[mirror],
        cache_dir=tmp_path / "cache",
    )  # closes the mirror
    assert result.step == STEPS and not result.interrupted
    assert_like_reference(local, reference)  # Drive's trouble changed nothing in training
    status = mirror.status
    assert calls["failed"] == 10 and status.errors >= 3 and "not connected" in status.last_error
    assert status.last_synced_step == STEPS and status.pending == 0
    assert valid_steps(mirror_dir / "checkpoints")[-1] == STEPS
    assert_same_weights(
        mirror_dir / "checkpoints" / step_name(STEPS), local / "checkpoints" / step_name(STEPS)
    )
    assert losses(mirror_dir) == losses(reference)
