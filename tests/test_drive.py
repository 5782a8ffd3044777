"""Drive sync: mirroring run folders, retries on Drive errors, restore after a lost VM, token cache,
and the fake google.colab. Real checkpoints on real folders; the only fake is google.colab."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from tinygpt.colab import mount
from tinygpt.core.checkpoint import (
    MANIFEST,
    list_checkpoints,
    read_manifest,
    save_checkpoint,
    step_name,
    verify_checkpoint,
)
from tinygpt.sync.copy import Backoff, prune_mirror
from tinygpt.sync.mirror import Mirror
from tinygpt.sync.restore import restore_latest
from tinygpt.sync.token_cache import restore_shards, sync_shards

REPO = Path(__file__).resolve().parents[1]
FAKE_COLAB = Path(__file__).parent / "fake_colab"
RUN_FILES = {
    "run.json": '{"recipe": "tiny"}',
    "tokenizer.json": '{"model": "bpe"}',
    "metrics.jsonl": '{"step": 100, "loss": 3.0}\n',
}


def no_wait(**kw) -> Backoff:
    return Backoff(wait=lambda stop, s: None, **kw)


def make_run(root: Path, files: bool = True) -> Path:
    run = root / "runs" / "r"
    run.mkdir(parents=True)
    for name, text in RUN_FILES.items() if files else ():
        (run / name).write_text(text)
    return run


def make_ckpt(run: Path, step: int, where: str = "checkpoints") -> Path:
    torch.manual_seed(step)
    path = run / "checkpoints" / step_name(step) if where == "checkpoints" else run / where
    return save_checkpoint(path, {"w": torch.randn(64, 64)}, {"step": step})


def steps(ckpt_root: Path) -> list[int]:
    return [s for s, _ in list_checkpoints(ckpt_root)]


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith((".tmp-", ".old-"))]


def enotconn(*_):
    raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")


# ---- mirroring -----------------------------------------------------------------------------------


def test_mirror_copies_verified_checkpoints_keeps_last_k_and_run_files(tmp_path):
    run, mirror = make_run(tmp_path / "vm"), tmp_path / "drive" / "r"
    m = Mirror(run, mirror, keep_last=2, backoff=no_wait())
    for step in (100, 200, 300, 400, 500):
        m.on_checkpoint(make_ckpt(run, step), step)
        if step == 300:
            m.on_checkpoint(make_ckpt(run, 300, "best"), 300)
        m.on_log({"step": step, "loss": 1.0})
        assert m.flush(timeout=30)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(
            '{"step": 500, "loss": 2.0}\n{"step": 6'
        )  # a line being appended is not copied half
    assert m.close(timeout=30)

    assert steps(mirror / "checkpoints") == [400, 500]
    for p in [mirror / "checkpoints" / step_name(s) for s in (400, 500)] + [mirror / "best"]:
        assert verify_checkpoint(p) == (True, "ok")
    assert read_manifest(mirror / "best")["step"] == 300
    assert (mirror / "checkpoints" / step_name(500) / "model.safetensors").read_bytes() == (
        run / "checkpoints" / step_name(500) / "model.safetensors"
    ).read_bytes()
    assert (mirror / "run.json").read_text() == RUN_FILES["run.json"]
    assert (mirror / "metrics.jsonl").read_text().endswith('"loss": 2.0}\n')
    assert leftovers(mirror) == []
    st = m.status
    assert (st.last_synced_step, st.best_step, st.pending, st.errors) == (500, 300, 0, 0)
    assert "step 500 synced" in str(st)


def test_never_deletes_the_only_valid_checkpoint(tmp_path):
    run, mirror = make_run(tmp_path / "vm"), tmp_path / "drive" / "r"
    ckpts = mirror / "checkpoints"
    # a valid one, then newer junk: a truncated file and a folder with no manifest
    shutil.copytree(make_ckpt(run, 100), ckpts / step_name(100))
    shutil.copytree(make_ckpt(run, 200), ckpts / step_name(200))
    with open(ckpts / step_name(200) / "model.safetensors", "r+b") as f:
        f.truncate(100)
    shutil.copytree(make_ckpt(run, 300), ckpts / step_name(300))
    (ckpts / step_name(300) / MANIFEST).unlink()
    assert prune_mirror(ckpts, keep_last=1) == []
    assert verify_checkpoint(ckpts / step_name(100))[0]

    def truncating_copy(src: Path, dst: Path) -> None:  # Drive keeps losing the end of step 400
        shutil.copyfile(src, dst)
        if step_name(400) in str(src):
            with open(dst, "r+b") as f:
                f.truncate(10)

    m = Mirror(
        run,
        mirror,
        keep_last=1,
        backoff=no_wait(max_attempts=3),
        copy_file=truncating_copy,
        catch_up=False,
    )  # about pruning: the local step 300 is not to be copied first
    with pytest.warns(UserWarning, match="Drive mirror"):
        m.on_checkpoint(make_ckpt(run, 400), 400)
        assert m.close(timeout=30)
    assert steps(ckpts) == [100, 200, 300]
    assert verify_checkpoint(ckpts / step_name(100))[0]
    assert m.status.errors == 3 and "bytes" in m.status.last_error
    assert leftovers(mirror) == []


def test_drive_errors_are_retried_with_backoff_and_never_reach_training(tmp_path):
    run, mirror = make_run(tmp_path / "vm"), tmp_path / "drive" / "r"
    calls, sleeps = [], []

    def flaky_copy(src: Path, dst: Path) -> None:
        calls.append(src)
        if len(calls) <= 5:
            enotconn()
        shutil.copyfile(src, dst)

    # catch_up=False: the checkpoint made below is handed over once, never also found by the catch-up
    m = Mirror(
        run,
        mirror,
        backoff=Backoff(wait=lambda stop, s: sleeps.append(s)),
        copy_file=flaky_copy,
        catch_up=False,
    )
    m.on_checkpoint(
        make_ckpt(run, 100), 100
    )  # the training thread: returns at once, raises nothing
    m.on_checkpoint(run / "nonexistent", "not a step")  # a bad call is only an error in the status
    m.on_log({"loss": 1.0})
    assert m.close(timeout=30)
    assert verify_checkpoint(mirror / "checkpoints" / step_name(100)) == (True, "ok")
    assert sleeps == [2.0, 4.0, 8.0, 16.0, 32.0]
    st = m.status
    assert st.last_synced_step == 100 and st.errors == 6
    m.on_checkpoint(make_ckpt(run, 200), 200)  # after close: ignored, no exception


def test_drive_down_for_good_gives_up_quietly_and_the_next_checkpoint_catches_up(tmp_path):
    run, mirror = make_run(tmp_path / "vm"), tmp_path / "drive" / "r"
    down = threading.Event()
    down.set()

    def copy(src: Path, dst: Path) -> None:
        if down.is_set():
            enotconn()
        shutil.copyfile(src, dst)

    m = Mirror(run, mirror, backoff=no_wait(max_attempts=4), copy_file=copy)
    with pytest.warns(UserWarning, match="not connected"):
        m.on_checkpoint(make_ckpt(run, 100), 100)
        assert m.flush(timeout=30)
    assert m.status.last_synced_step is None and "Transport endpoint" in m.status.last_error
    down.clear()
    m.on_checkpoint(make_ckpt(run, 200), 200)
    assert m.close(timeout=30)
    assert steps(mirror / "checkpoints") == [200] and m.status.last_synced_step == 200


def test_newer_checkpoints_supersede_pending_ones_and_locally_pruned_ones_are_skipped(tmp_path):
    run, mirror = make_run(tmp_path / "vm"), tmp_path / "drive" / "r"
    started, release, copied = threading.Event(), threading.Event(), []

    def blocking_copy(src: Path, dst: Path) -> None:
        copied.append(src.parent.name)
        if not started.is_set():
            started.set()
            release.wait(30)  # Drive is slow: step 100 takes a while
        shutil.copyfile(src, dst)

    m = Mirror(run, mirror, keep_last=5, backoff=no_wait(), copy_file=blocking_copy, catch_up=False)
    m.on_checkpoint(make_ckpt(run, 100), 100)
    assert started.wait(30)
    for step in (200, 300, 400):
        m.on_checkpoint(make_ckpt(run, step), step)
    shutil.rmtree(run / "checkpoints" / step_name(400))  # the trainer pruned it meanwhile
    assert m.status.pending == 2  # step 100 in flight, step 400 queued
    release.set()
    assert m.close(timeout=30)
    assert steps(mirror / "checkpoints") == [100]
    assert set(copied) == {step_name(100)}
    assert m.status.superseded == 2 and m.status.errors == 0


def test_a_checkpoint_pruned_locally_during_its_copy_is_dropped_without_an_error(tmp_path):
    run, mirror = make_run(tmp_path / "vm"), tmp_path / "drive" / "r"
    started, release = threading.Event(), threading.Event()

    def slow_copy(src: Path, dst: Path) -> None:
        started.set()
        release.wait(30)
        shutil.copyfile(src, dst)

    sleeps = []
    m = Mirror(
        run, mirror, backoff=Backoff(wait=lambda stop, s: sleeps.append(s)), copy_file=slow_copy
    )
    m.on_checkpoint(make_ckpt(run, 100), 100)
    assert started.wait(30)
    shutil.rmtree(run / "checkpoints" / step_name(100))
    release.set()
    assert m.close(timeout=30)
    assert steps(mirror / "checkpoints") == [] and leftovers(mirror) == []
    assert m.status.errors == 0 and sleeps == []


def test_a_new_session_clears_leftovers_and_puts_back_a_moved_aside_best(tmp_path):
    run, mirror = make_run(tmp_path / "vm"), make_run(tmp_path / "drive")
    make_ckpt(mirror, 300, "best").rename(
        mirror / ".old-best-4242-deadbeef"
    )  # killed between renames
    (mirror / ".tmp-metrics.jsonl-4242-deadbeef").write_text("half")
    Mirror(run, mirror).close(timeout=30)
    assert verify_checkpoint(mirror / "best")[0] and leftovers(mirror) == []


def test_mirror_refuses_the_run_folder_itself(tmp_path):
    with pytest.raises(ValueError, match="run folder itself"):
        Mirror(tmp_path, tmp_path)


# ---- restore -------------------------------------------------------------------------------------


def test_restore_takes_the_newer_mirror_checkpoint_and_the_run_files(tmp_path):
    old_vm, mirror = make_run(tmp_path / "old"), tmp_path / "drive" / "r"
    with Mirror(old_vm, mirror, keep_last=3, backoff=no_wait()) as m:
        for step in (100, 200):
            m.on_checkpoint(make_ckpt(old_vm, step), step)
        m.on_checkpoint(make_ckpt(old_vm, 200, "best"), 200)
    new_vm = make_run(tmp_path / "new", files=False)
    make_ckpt(new_vm, 100)

    got = restore_latest(new_vm, mirror, backoff=no_wait())
    assert got == new_vm / "checkpoints" / step_name(200)
    assert verify_checkpoint(got) == (True, "ok")
    assert read_manifest(new_vm / "best")["step"] == 200
    for name, text in RUN_FILES.items():
        assert (new_vm / name).read_text() == text
    assert leftovers(new_vm) == []


def test_restore_prefers_local_when_newer_or_equal_and_handles_nothing(tmp_path):
    local, mirror = make_run(tmp_path / "vm"), make_run(tmp_path / "drive")
    make_ckpt(mirror, 200)
    make_ckpt(local, 300)
    make_ckpt(local, 200)
    copies = []
    record = lambda s, d: copies.append(s) or shutil.copyfile(s, d)  # noqa: E731
    assert restore_latest(
        local, mirror, backoff=no_wait(), copy_file=record
    ) == local / "checkpoints" / step_name(300)
    shutil.rmtree(local / "checkpoints" / step_name(300))
    assert restore_latest(
        local, mirror, backoff=no_wait(), copy_file=record
    ) == local / "checkpoints" / step_name(200)
    assert copies == []  # a tie goes to the local disk
    assert restore_latest(tmp_path / "empty", tmp_path / "no-drive") is None
    assert restore_latest(tmp_path / "empty", None) is None


def test_restore_skips_killed_truncated_and_corrupt_mirror_checkpoints(tmp_path):
    local, mirror = make_run(tmp_path / "vm", files=False), make_run(tmp_path / "drive")
    make_ckpt(local, 100)
    make_ckpt(mirror, 200)
    ckpts = mirror / "checkpoints"
    partial = ckpts / f".tmp-{step_name(600)}-4242-deadbeef"  # a copy killed half way
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 1000)
    make_ckpt(mirror, 300)
    (ckpts / step_name(300) / MANIFEST).unlink()  # data there, manifest never written
    make_ckpt(mirror, 400)
    with open(ckpts / step_name(400) / "model.safetensors", "r+b") as f:
        f.truncate(500)
    make_ckpt(mirror, 500)
    with open(ckpts / step_name(500) / "model.safetensors", "r+b") as f:  # same size, flipped bytes
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))

    with pytest.warns(UserWarning) as record:
        got = restore_latest(local, mirror, backoff=no_wait())
    assert got == local / "checkpoints" / step_name(200)
    assert verify_checkpoint(got) == (True, "ok")
    text = "\n".join(str(w.message) for w in record)
    assert "sha256" in text and "bytes" in text and "no manifest" in text
    assert steps(local / "checkpoints") == [100, 200] and leftovers(local) == []


def test_kill_9_during_a_copy_leaves_the_mirror_usable(tmp_path):
    old_vm, mirror = make_run(tmp_path / "old"), tmp_path / "drive" / "r"
    make_ckpt(old_vm, 100)
    make_ckpt(old_vm, 200)
    script = textwrap.dedent(f"""
        import os, signal, shutil
        from pathlib import Path
        from tinygpt.sync.copy import Backoff
        from tinygpt.sync.mirror import Mirror
        def dying_copy(src, dst):
            if "step_000200" in str(src):  # half the file reaches Drive, then the VM is gone
                dst.write_bytes(Path(src).read_bytes()[:1000])
                os.kill(os.getpid(), signal.SIGKILL)
            shutil.copyfile(src, dst)
        run = Path({str(old_vm)!r})
        m = Mirror(run, {str(mirror)!r}, backoff=Backoff(wait=lambda stop, s: None), copy_file=dying_copy,
                   catch_up=False)  # step 100 first, as handed over (the catch-up could take 200 first)
        for step in (100, 200):
            m.on_checkpoint(run / "checkpoints" / f"step_{{step:06d}}", step)
            m.flush()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, timeout=120, capture_output=True
    )
    assert proc.returncode == -9, proc.stderr.decode()
    assert [p.name.startswith(f".tmp-{step_name(200)}") for p in leftovers(mirror)] == [True]

    new_vm = tmp_path / "new" / "r"
    assert restore_latest(new_vm, mirror, backoff=no_wait()) == new_vm / "checkpoints" / step_name(
        100
    )
    assert (new_vm / "tokenizer.json").read_text() == RUN_FILES["tokenizer.json"]
    Mirror(new_vm, mirror).close(timeout=30)  # a new session clears what the killed one left
    assert leftovers(mirror) == [] and steps(mirror / "checkpoints") == [100]


# ---- token cache ---------------------------------------------------------------------------------


def make_shards(folder: Path, n: int, done: bool) -> Path:
    """A shard folder as tinygpt.data.shards writes it: files, then the manifest listing them."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for i in range(n):
        entry = {"documents_end": 10 * (i + 1)}
        for split, size in (("train", 20_000), ("val", 1_000)):
            data = os.urandom(size)
            (folder / f"{split}_{i:06d}.bin").write_bytes(data)
            entry[split] = {
                "name": f"{split}_{i:06d}.bin",
                "bytes": size,
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        shards.append(entry)
    (folder / MANIFEST).write_text(json.dumps({"dtype": "uint16", "shards": shards, "done": done}))
    return folder


def test_token_shards_go_to_the_mirror_as_they_are_written_and_come_back(tmp_path):
    local, mirror = (
        make_shards(tmp_path / "vm" / "cache", 2, done=False),
        tmp_path / "drive" / "cache",
    )
    calls = []

    def flaky_copy(src: Path, dst: Path) -> None:
        calls.append(src)
        if len(calls) <= 2:
            enotconn()
        shutil.copyfile(src, dst)

    assert sync_shards(local, mirror, backoff=no_wait(), copy_file=flaky_copy) == 2
    assert sync_shards(local, mirror, backoff=no_wait()) == 0  # nothing new
    make_shards(
        local, 3, done=True
    )  # the writer went on (same names: rewritten, like a new VM would)
    shutil.rmtree(mirror)
    assert sync_shards(local, mirror, backoff=no_wait()) == 3
    assert json.loads((mirror / MANIFEST).read_text())["done"] is True

    new = tmp_path / "new" / "cache"
    assert restore_shards(mirror, new, backoff=no_wait()) == 3
    for p in local.glob("*.bin"):
        assert (new / p.name).read_bytes() == p.read_bytes()
    assert json.loads((new / MANIFEST).read_text()) == json.loads((local / MANIFEST).read_text())
    assert restore_shards(mirror, new) == 0  # all here: nothing to do
    assert restore_shards(tmp_path / "nothing", tmp_path / "x") == 0


def test_a_corrupt_shard_on_the_mirror_ends_the_restore_before_it(tmp_path):
    local, mirror = (
        make_shards(tmp_path / "vm" / "cache", 3, done=True),
        tmp_path / "drive" / "cache",
    )
    assert sync_shards(local, mirror, backoff=no_wait()) == 3
    with open(mirror / "train_000001.bin", "r+b") as f:
        f.write(b"\xff\xfe\xfd")
    with pytest.warns(UserWarning, match="sha256"):
        restore_shards(mirror, tmp_path / "a", backoff=no_wait())
    kept = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert [s["train"]["name"] for s in kept["shards"]] == ["train_000000.bin"] and kept[
        "done"
    ] is False
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".tmp")]
    assert not (tmp_path / "a" / "train_000001.bin").exists()


# ---- Colab ---------------------------------------------------------------------------------------


def _forget_colab() -> None:
    for name in [n for n in sys.modules if n == "google.colab" or n.startswith("google.colab.")]:
        del sys.modules[name]


@pytest.fixture
def fake_colab(tmp_path, monkeypatch):
    _forget_colab()
    monkeypatch.syspath_prepend(str(FAKE_COLAB))
    monkeypatch.setenv("TINYGPT_FAKE_DRIVE_ROOT", str(tmp_path / "drive-backing"))
    monkeypatch.setenv("TINYGPT_FAKE_DOWNLOADS", str(tmp_path / "downloads"))
    yield tmp_path
    _forget_colab()


def test_outside_colab(tmp_path):
    _forget_colab()
    assert mount.in_colab() is False
    with pytest.raises(RuntimeError, match="--mirror"):
        mount.mount_drive(tmp_path / "drive")


def test_fake_colab_mount_makes_mydrive_appear_and_mirror_writes_there(fake_colab):
    tmp = fake_colab
    assert mount.in_colab() is True
    mountpoint = tmp / "content" / "drive"
    mydrive = mount.mount_drive(mountpoint)
    assert mydrive == mountpoint / "MyDrive" and mydrive.is_dir()
    assert mount.mount_drive(mountpoint) == mydrive  # mounted already: fine
    target = mount.drive_run_dir("r", mydrive)
    assert target == mydrive / "tinygpt" / "runs" / "r"

    run = make_run(tmp / "vm")
    with Mirror(run, target, backoff=no_wait()) as m:
        m.on_checkpoint(make_ckpt(run, 100), 100)
    backing = tmp / "drive-backing" / "MyDrive" / "tinygpt" / "runs" / "r"
    assert verify_checkpoint(backing / "checkpoints" / step_name(100))[0]

    from google.colab import files

    files.download(str(run / "run.json"))
    assert (tmp / "downloads" / "run.json").read_text() == RUN_FILES["run.json"]
    assert files.downloaded == [str(run / "run.json")]
