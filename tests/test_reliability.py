"""Nothing a run folder, a mirror or a full disk holds can hurt the user (docs/RELIABILITY.md).

Each test builds the fault for real: a poisoned state.pt with a manifest rewritten to match, corrupt
mirror checkpoints, a mirror under a regular file, two processes on one run folder, a disk that
fills up, latin-1 files, a flipped adapter byte.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinygpt.cli import main
from tinygpt.core import checkpoint as ckpt
from tinygpt.core.checkpoint import CheckpointError
from tinygpt.pretrain.run_pretrain import pretrain

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(max_steps=4, save_every=2, eval_every=2, progress=False, device="cpu")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """A real cpu-smoke run on the built-in corpus (the stdlib sources): 4 steps, 2 checkpoints."""
    run = tmp_path_factory.mktemp("runs") / "r"
    pretrain("cpu-smoke", run, cache_dir=run.parent / "cache", **FAST)
    return run


class _RunsCode:
    """Unpickling this calls os.system: what an attacker would put into a shared state.pt."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _poison(ckpt_dir: Path, marker: Path) -> None:
    state = torch.load(ckpt_dir / ckpt.STATE_FILE, weights_only=True)
    state["payload"] = _RunsCode(marker)
    torch.save(state, ckpt_dir / ckpt.STATE_FILE)
    manifest = ckpt.read_manifest(ckpt_dir)
    ckpt.write_manifest(
        ckpt_dir, {k: v for k, v in manifest.items() if k not in ("files", "format", "created_at")}
    )
    assert ckpt.verify_checkpoint(ckpt_dir)[0]  # whoever writes the file can write the manifest too


def test_a_poisoned_state_never_runs(small_run, tmp_path, capsys):
    run = tmp_path / "shared"
    shutil.copytree(small_run, run)
    marker = tmp_path / "pwned"
    newest = ckpt.latest_valid(run / "checkpoints")
    _poison(newest, marker)
    with pytest.raises(CheckpointError, match="could run code"):
        ckpt.load_checkpoint(newest)
    # generate reads the weights only (safetensors); resuming reads state.pt, weights-only
    assert main(["generate", str(run), "--prompt", "def", "--max-new-tokens", "2"]) == 0
    with pytest.raises(CheckpointError, match="could run code"):
        pretrain("cpu-smoke", run, cache_dir=small_run.parent / "cache", **{**FAST, "max_steps": 6})
    assert not marker.exists(), "a pickled call in state.pt was executed"


def test_training_state_is_weights_only(small_run):
    state = torch.load(
        ckpt.latest_valid(small_run / "checkpoints") / ckpt.STATE_FILE, weights_only=True
    )
    assert state["step"] == 4 and isinstance(state["rng"]["numpy"]["keys"], torch.Tensor)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a full (sha256) check notices
    path.write_bytes(bytes(data))


def _corrupt_copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / ckpt.MANIFEST).read_text())
    (dst / ckpt.MANIFEST).write_text(
        json.dumps({**manifest, "step": int(dst.name[5:])})
    )  # its folder's step
    _flip_a_byte(dst / ckpt.MODEL_FILE)
    assert ckpt.verify_checkpoint(dst, deep=False)[0] and not ckpt.verify_checkpoint(dst)[0]


def test_mirror_pruning_keeps_the_good_checkpoints_under_corrupt_newer_ones(small_run, tmp_path):

    from tinygpt.sync.copy import prune_mirror
    from tinygpt.sync.restore import restore_latest

    mirror = tmp_path / "drive" / "r"
    shutil.copytree(small_run, mirror)
    good = ckpt.list_checkpoints(mirror / "checkpoints")
    assert [s for s, _ in good] == [2, 4]
    for step in (8, 10):
        _corrupt_copy(good[-1][1], mirror / "checkpoints" / ckpt.step_name(step))
    prune_mirror(mirror / "checkpoints", keep_last=1)
    left = {p.name for _, p in ckpt.list_checkpoints(mirror / "checkpoints")}
    assert ckpt.step_name(4) in left, "pruning deleted the newest good checkpoint"
    # a new VM (empty local folder) resumes from it, not from step 0
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        restored = restore_latest(tmp_path / "vm" / "r", mirror)
    assert (
        restored is not None
        and restored.name == ckpt.step_name(4)
        and ckpt.verify_checkpoint(restored)[0]
    )


def test_nothing_verifies_is_said_before_step_0(small_run, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(small_run, run)
    for _, p in ckpt.list_checkpoints(run / "checkpoints"):
        _flip_a_byte(p / ckpt.MODEL_FILE)
    with pytest.warns(
        UserWarning, match="no checkpoint .* passes verification: training starts from step 0"
    ):
        res = pretrain(
            "cpu-smoke", run, cache_dir=small_run.parent / "cache", **{**FAST, "max_steps": 2}
        )
    assert res.resumed_from is None and res.step == 2


def test_a_dead_mirror_warns_at_once_and_close_says_what_is_missing(small_run, tmp_path):
    """The mirror's parent is a regular file (a Drive folder replaced by a file): a permanent error.
    Training never waits for it; the mirror tries once (no retries, no wait after training) and
    close() names what is not on Drive."""
    from tinygpt.sync.copy import Backoff
    from tinygpt.sync.mirror import Mirror

    blocker = tmp_path / "drive"
    blocker.write_text("not a folder")
    newest = ckpt.latest_valid(small_run / "checkpoints")
    with pytest.warns(UserWarning) as seen:
        m = Mirror(
            small_run,
            blocker / "r",
            backoff=Backoff(max_attempts=1000, base_delay_s=0.05, max_delay_s=0.05),
            close_timeout_s=1000.0,
        )
        m.on_checkpoint(newest, 4)
        assert m.close() is False  # at once: the thread ended at the first permanent error
    messages = [str(w.message) for w in seen]
    assert any("waiting would not help" in t for t in messages), messages
    assert m.status.errors == 1, m.status  # one attempt, not 1000 retries
    assert any(ckpt.step_name(4) in x for x in m.not_synced), m.not_synced
    assert any("gave up at once" in t and "not on it" in t for t in messages)


def test_one_writer_per_run_folder_and_a_killed_one_leaves_no_lock(small_run, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(small_run, run)
    # a second process holds the run folder (as a training run does), then is killed with SIGKILL
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\nfrom tinygpt.core.rundir import RunDir\n"
                "from tinygpt.core.runlock import lock\n"
                "with lock(RunDir(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(600)\n"
            ),
            str(run),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(Exception, match=rf"in use by process {holder.pid} on "):
            pretrain(
                "cpu-smoke", run, cache_dir=small_run.parent / "cache", **{**FAST, "max_steps": 6}
            )
        assert ckpt.latest_valid(run / "checkpoints").name == ckpt.step_name(
            4
        )  # nothing was touched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    res = pretrain(
        "cpu-smoke", run, cache_dir=small_run.parent / "cache", **{**FAST, "max_steps": 6}
    )
    assert res.resumed_from == 4 and res.step == 6


def test_the_cli_refuses_a_busy_run_folder_in_one_line(small_run, tmp_path, capsys):
    from tinygpt.core.rundir import RunDir
    from tinygpt.core.runlock import lock

    with lock(RunDir(tmp_path / "busy")):
        code = main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--run-dir",
                str(tmp_path / "busy"),
                "--max-steps",
                "1",
                "--quiet",
            ]
        )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and f"in use by process {os.getpid()}" in err


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 16 MB filesystem (tmpfs), where the machine lets us mount one (root); skipped elsewhere."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip(
            "cannot mount a small tmpfs here (needs root); the ENOSPC path is also covered in test_trainer.py"
        )
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(disk: Path, leave: int) -> None:
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def test_a_full_disk_names_the_last_good_checkpoint_in_one_line(small_run, tiny_disk, capsys):
    run = tiny_disk / "r"
    shutil.copytree(small_run, run)  # steps 2 and 4 on the small disk
    _fill(tiny_disk, leave=64 * 1024)  # room for the log, not for another checkpoint
    code = main(
        [
            "pretrain",
            "--recipe",
            "cpu-smoke",
            "--run-dir",
            str(run),
            "--max-steps",
            "8",
            "--quiet",
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "disk is full" in err and ckpt.step_name(4) in err and "free some disk space" in err
    assert not [
        p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")
    ]  # nothing half-written
    assert ckpt.verify_checkpoint(run / "checkpoints" / ckpt.step_name(4))[0]
    # the same command on the still-full disk: one line again, nothing lost
    (tiny_disk / "filler").unlink()
    _fill(tiny_disk, leave=0)
    code = main(
        [
            "pretrain",
            "--recipe",
            "cpu-smoke",
            "--run-dir",
            str(run),
            "--max-steps",
            "8",
            "--quiet",
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert ckpt.verify_checkpoint(run / "checkpoints" / ckpt.step_name(4))[0]


def test_cli_errors_are_one_line_and_set_twice_keeps_both(tmp_path, capsys):
    assert (
        main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--run-dir",
                str(tmp_path / "a"),
                "--set",
                "train.lr=abc",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.lr" in err
    assert (
        main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--run-dir",
                str(tmp_path / "b"),
                "--quiet",
                "--data",
                "hf:does/not-exist",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("Hub" in err or "does/not-exist" in err), err
    bad = tmp_path / "c"
    bad.mkdir()
    (bad / "run.json").write_text("{not json")
    assert main(["generate", str(bad), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.json" in err
    (bad / "run.json").write_text("[1, 2]")
    assert main(["generate", str(bad), "--prompt", "x"]) == 2
    assert "run.json" in capsys.readouterr().err
    # --set given twice keeps both
    run = tmp_path / "d"
    assert (
        main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--run-dir",
                str(run),
                "--quiet",
                "--max-steps",
                "2",
                "--set",
                "train.eval_every=2",
                "--set",
                "train.save_every=1",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    import json

    train = json.loads((run / "run.json").read_text())["recipe"]["train"]
    assert (train["eval_every"], train["save_every"]) == (2, 1)


def test_quiet_says_resumed_at_the_start_and_a_leftover_best_is_cleaned(
    small_run, tmp_path, capsys
):
    run = tmp_path / "r"
    shutil.copytree(small_run, run)
    (run / ".tmp-best-99999").mkdir()  # what a kill during a best/ write leaves
    (run / ".tmp-best-99999" / "model.safetensors").write_bytes(b"half")
    assert (
        main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--run-dir",
                str(run),
                "--quiet",
                "--max-steps",
                "6",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "resumed from step 4"
    assert not (run / ".tmp-best-99999").exists()


def _stdlib_text(chars: int) -> str:
    import sysconfig

    out, n = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        t = f.read_text(encoding="utf-8", errors="ignore")
        out.append(t)
        n += len(t)
        if n >= chars:
            break
    return "".join(out)[:chars]


def test_latin1_files_are_read_and_counted_not_dropped(tmp_path):
    from tinygpt.core.config import DataConfig
    from tinygpt.data.sources import iter_documents

    folder = tmp_path / "texts"
    folder.mkdir()
    text = _stdlib_text(200_000).replace(
        "e", "é"
    )  # real prose and code, in an old Western encoding
    (folder / "old.txt").write_bytes(text.encode("latin-1", errors="replace"))
    (folder / "new.txt").write_text("Grüße aus UTF-8.\n" * 500, encoding="utf-8")
    (folder / "blob.txt").write_bytes(b"\x00\x01BLOBMARK" * 100)
    with pytest.warns(UserWarning, match=r"1 file binary .*1 file not UTF-8, read as latin-1"):
        docs = list(iter_documents(DataConfig(source=str(folder))))
    joined = "".join(docs)
    assert (
        len(joined) >= 200_000 and "é" in joined and "Grüße" in joined and "BLOBMARK" not in joined
    )


def test_a_single_huge_line_still_splits_into_train_and_validation(tmp_path):
    from tinygpt.core.config import DataConfig
    from tinygpt.data.shards import build_token_cache
    from tinygpt.model.tokenizer import train_bpe

    one_line = tmp_path / "dump.txt"
    one_line.write_text(_stdlib_text(400_000).replace("\n", " "), encoding="utf-8")
    assert one_line.read_text().count("\n") == 0
    cfg = DataConfig(source=str(one_line), vocab_size=400)
    tok = train_bpe([one_line.read_text()[:100_000]], 400)
    data = build_token_cache(cfg, tok, tmp_path / "cache")
    assert (
        data.meta["documents"] > 20
        and data.meta["val_tokens"] > 0
        and data.meta["train_tokens"] > 0
    )


def test_a_garbled_hf_config_is_named_in_one_line(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{garbage")
    text = tmp_path / "t.txt"
    text.write_text(_stdlib_text(5_000))
    assert main(["eval", str(folder), "--task", "perplexity", "--data", str(text)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json is not valid JSON" in err, err
