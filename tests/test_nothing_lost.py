"""Nothing is lost and nothing is half-done (issue 22, docs/RELIABILITY.md): each fault built for real,
through the real `tinygpt` command in a subprocess where the fault is about processes (a second writer,
SIGTERM, a full disk): the mirror catches up on the next command, the lock follows the folder, one run per
mirror, a failed first try leaves no trace, values are checked before work, no leftovers."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tinygpt.cli import main
from tinygpt.core import checkpoint as ckpt
from tinygpt.core.callback import Callback
from tinygpt.core.files import TMP_PREFIX, atomic_output
from tinygpt.core.recipes import get_recipe
from tinygpt.core.rundir import LOCK, RunDir, RunDirError, RunDirReplaced
from tinygpt.core.runlock import lock
from tinygpt.data.shard_writer import SHARD_TOKENS
from tinygpt.model.tokenizer import Tokenizer
from tinygpt.pretrain.run_pretrain import pretrain
from tinygpt.sync.copy import copy_checkpoint
from tinygpt.train.stopping import closing

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(max_steps=4, save_every=2, eval_every=2, progress=False, device="cpu")
SMOKE = ["--recipe", "cpu-smoke", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def env(cache: Path, **extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TINYGPT_CACHE": str(cache), **extra}


def _limit_memory() -> None:
    # a model too big for the machine fails in this child at 6 GB, never by swapping a shared machine
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


def tinygpt(
    *args: str, cache: Path, timeout: float = 300, **extra: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tinygpt", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env(cache, **extra),
        timeout=timeout,
        preexec_fn=_limit_memory,
    )


def spawn(*args: str, cache: Path, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tinygpt", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env(cache, **extra),
        preexec_fn=_limit_memory,
    )


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def one_error_line(p: subprocess.CompletedProcess) -> str:
    """The one line a refused command prints (warnings aside), with exit status 2."""
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("tinygpt ")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (
        p.returncode,
        p.stderr[-2000:],
    )
    return lines[0]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, cache) -> Path:
    run = tmp_path_factory.mktemp("runs") / "r"
    pretrain("cpu-smoke", run, cache_dir=cache / "tokens", **FAST)
    return run


def mount_tmpfs(where: Path, size: str = "5m") -> Iterator[Path]:
    """A small file system at `where` for the test (a fixture's body): full disks made on purpose."""
    where.mkdir(parents=True, exist_ok=True)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    yield from mount_tmpfs(tmp_path / "disk")


def fill(disk: Path, leave: int) -> Path:
    filler = disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
    return filler


# ---- 1. the mirror is a promise ------------------------------------------------------------------


@pytest.mark.slow  # CLI runs onto a full mirror
def test_a_full_mirror_is_said_in_the_last_line_and_the_next_command_catches_up(
    tmp_path, small_disk, cache
):
    """A 5 MB mirror file system with room for the run files only: training finishes, its last line says
    the mirror is behind; with space freed, the same command on the finished run copies the final
    checkpoint and best/ there (before: "complete" and the mirror stuck at what it had)."""
    run, mirror = tmp_path / "r", small_disk / "r"
    filler = fill(small_disk, leave=200 * 1024)
    cmd = [
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(run),
        "--mirror",
        str(mirror),
        "--max-steps",
        "4",
        "--save-every",
        "2",
    ]
    p = tinygpt(*cmd, cache=cache, TINYGPT_MIRROR_WAIT_S="3")
    assert p.returncode == 0, p.stderr[-2000:]
    assert last_line(p.stdout).startswith(
        f"the mirror {mirror} is behind: it lacks checkpoint step 4"
    ), p.stdout
    assert not ckpt.list_checkpoints(mirror / "checkpoints")
    filler.unlink()
    p = tinygpt(*cmd, cache=cache)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout.strip().splitlines()
    assert (
        out[-2].startswith(f"run {run} is complete: step 4 of 4")
        and out[-1] == f"the mirror {mirror} has all of it"
    )
    assert [s for s, _ in ckpt.list_checkpoints(mirror / "checkpoints")] == [4]
    assert ckpt.verify_checkpoint(mirror / "checkpoints" / ckpt.step_name(4), deep=True)[0]
    assert ckpt.verify_checkpoint(mirror / "best", deep=True)[0]
    assert (mirror / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()


@pytest.mark.slow  # a CLI run with a mirror
def test_a_mirror_under_a_file_gives_up_at_once_after_training(tmp_path, cache):
    """A permanent error (the mirror's parent is a file): no 120 s wait after training; the last line
    says what the mirror lacks. (Before: "gave up after the wait", two minutes later.)"""
    (tmp_path / "drive").write_text("a file where the Drive folder was")
    run, mirror = tmp_path / "r", tmp_path / "drive" / "r"
    p = tinygpt(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(run),
        "--mirror",
        str(mirror),
        "--max-steps",
        "2",
        cache=cache,
        timeout=100,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "waiting would not help" in p.stderr and "gave up at once" in p.stderr, p.stderr[-2000:]
    # a mirror that cannot even be listed lacks all of the run, and the line says why
    assert "is behind: it lacks everything (the mirror cannot be read" in last_line(p.stdout)


# ---- 2. the lock follows the folder, not the path -----------------------------------------------


def test_a_callback_failing_to_close_does_not_hide_the_error_that_ended_the_run(tmp_path):
    """A callback whose folder was deleted fails as it closes (a TensorBoard writer did in CI); the run's
    own one-line reason (here: its folder was replaced) is what reaches the user, the close failure a
    warning. With no error in flight the close failure itself is raised, after every callback closed."""
    closed = []

    class Notes(Callback):  # a user's callback that writes its notes into a folder as it closes
        def __init__(self, folder: Path):
            self.folder = folder
            folder.mkdir()

        def close(self):
            (self.folder / "notes.txt").write_text("closed\n")
            closed.append(self.folder.name)

    def deleted(name):
        cb = Notes(tmp_path / name)
        shutil.rmtree(tmp_path / name)
        return cb

    with (
        pytest.warns(UserWarning, match="Notes could not close: FileNotFoundError"),
        pytest.raises(RunDirReplaced),
    ):
        with closing([deleted("a"), Notes(tmp_path / "b")]):
            raise RunDirReplaced("run folder was deleted and made again")
    assert closed == ["b"]  # the one after the failing one still closed
    with pytest.raises(FileNotFoundError):
        with closing([deleted("c"), Notes(tmp_path / "d")]):
            pass
    assert closed == ["b", "d"]


@pytest.mark.slow  # CLI runs, one replaced mid-run
def test_a_writer_whose_folder_was_replaced_stops_and_the_new_run_is_left_alone(tmp_path, cache):
    """`rm -rf run; mkdir run` in another tab while a run trains: a second run gets the new folder's lock
    and trains; the first stops in one line naming what happened and writes nothing into the new folder
    (before: it went on, metrics of both mixed, and it died with "free some disk space")."""
    run = tmp_path / "r"
    first = spawn(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(run),
        "--max-steps",
        "6000",
        "--save-every",
        "5000",
        "--set",
        "train.eval_every=5000",
        "train.log_every=1",
        cache=cache,
    )
    try:
        deadline = time.monotonic() + 240
        while (
            not (run / "metrics.jsonl").is_file()
            or len((run / "metrics.jsonl").read_text().splitlines()) < 3
        ):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        while (
            run.exists()
        ):  # the writer may add a file while rm -rf runs: remove again, as a user would
            shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        second = tinygpt("pretrain", *SMOKE, "--run-dir", str(run), "--max-steps", "4", cache=cache)
        assert second.returncode == 0, second.stderr[-2000:]
        _, err = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
    lines = [ln for ln in err.splitlines() if ln.startswith("tinygpt ")]
    assert first.returncode == 2 and len(lines) == 1, err[-2000:]
    # "deleted" when the writer looked between the rm -rf and the mkdir, else "deleted and made again"
    assert "was deleted" in lines[0] and "stopped without writing into it" in lines[0], lines
    steps = [m["step"] for m in RunDir(run).metrics() if "loss" in m]
    assert steps == sorted(set(steps)) and max(steps) == 4, steps  # only the second run's records
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")][-1] == 4


def test_the_lock_is_never_followed_through_a_symlink(tmp_path):
    run, target = tmp_path / "r", tmp_path / "precious.txt"
    run.mkdir()
    target.write_text("keep me")
    (run / LOCK).symlink_to(target)
    with pytest.raises(RunDirError, match="cannot open the lock .* symlink"):
        with lock(RunDir(run)):
            pass
    assert target.read_text() == "keep me"


def test_a_ctrl_c_while_the_lock_is_taken_leaves_no_folder_and_no_handler_behind(
    tmp_path, monkeypatch
):
    """The signal comes while .lock exists but before the lock is recorded as held (here: while the
    holder's name is looked up). It reaches the program once the lock is held, so the release runs and
    the folder the lock made is gone; the program's own SIGINT handler is back in place."""
    import socket

    run = tmp_path / "r"
    real_hostname = socket.gethostname

    def hostname_then_ctrl_c():
        assert (run / LOCK).exists()
        signal.raise_signal(signal.SIGINT)
        return real_hostname()

    monkeypatch.setattr(socket, "gethostname", hostname_then_ctrl_c)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with lock(RunDir(run)):
            pytest.fail("the Ctrl-C must stop the run before its body starts")
    assert not run.exists()
    assert signal.getsignal(signal.SIGINT) is handler
    monkeypatch.undo()
    with lock(RunDir(run)):  # the folder is free again
        assert (run / LOCK).exists()


# ---- 3. one run per mirror -----------------------------------------------------------------------


@pytest.mark.slow  # CLI runs sharing a mirror
def test_a_second_run_on_the_same_mirror_is_refused_before_it_writes(tmp_path, cache):
    mirror = tmp_path / "drive" / "r"
    a = tinygpt(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(tmp_path / "a"),
        "--mirror",
        str(mirror),
        "--max-steps",
        "2",
        cache=cache,
    )
    assert a.returncode == 0, a.stderr[-2000:]
    before = {p: p.stat().st_mtime_ns for p in mirror.rglob("*")}
    text = tmp_path / "other.txt"
    text.write_text(Path(json.__file__).read_text() * 20)
    b = tinygpt(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(tmp_path / "b"),
        "--mirror",
        str(mirror),
        "--max-steps",
        "2",
        "--data",
        str(text),
        cache=cache,
    )
    # the mirror's run.json is compared with the command first, naming what differs (issue 32)
    assert "holds another run than this command's" in one_error_line(
        b
    ) and "data.source" in one_error_line(b)
    assert {p: p.stat().st_mtime_ns for p in mirror.rglob("*")} == before  # nothing written there
    assert not (tmp_path / "b").exists()  # nor here
    # the same settings in another run folder that is a run of its own (its identity) is refused too
    c = tinygpt(
        "pretrain", *SMOKE, "--run-dir", str(tmp_path / "c"), "--max-steps", "2", cache=cache
    )
    assert c.returncode == 0
    c = tinygpt(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(tmp_path / "c"),
        "--mirror",
        str(mirror),
        "--max-steps",
        "4",
        cache=cache,
    )
    assert "two runs would mix their checkpoints" in one_error_line(c)
    assert {p: p.stat().st_mtime_ns for p in mirror.rglob("*")} == before
    # a new VM (an empty run folder) with the same settings resumes the mirror's run
    d = tinygpt(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(tmp_path / "d"),
        "--mirror",
        str(mirror),
        "--max-steps",
        "4",
        cache=cache,
    )
    assert d.returncode == 0 and "resumed from step 2" in d.stdout, d.stderr[-2000:]


@pytest.mark.slow  # CLI runs with a mirror
def test_a_different_tokenizer_on_the_mirror_is_named_and_never_overwrites(
    small_run, tmp_path, cache
):
    """A mirror from before identities (no identity.json) holding another run's newer tokenizer.json."""
    run, mirror = tmp_path / "r", tmp_path / "drive" / "r"
    shutil.copytree(small_run, run)
    shutil.copytree(small_run, mirror)
    (mirror / "identity.json").unlink(missing_ok=True)
    (run / "identity.json").unlink(missing_ok=True)
    other = json.loads((mirror / "tokenizer.json").read_text())
    other["normalizer"] = {"type": "Lowercase"}  # another run's tokenizer, newer than the local one
    (mirror / "tokenizer.json").write_text(json.dumps(other))
    mine = (run / "tokenizer.json").read_bytes()
    p = tinygpt(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(run),
        "--mirror",
        str(mirror),
        "--max-steps",
        "6",
        cache=cache,
    )
    line = one_error_line(p)
    assert "tokenizer.json on the mirror" in line and "differs" in line, line
    assert (run / "tokenizer.json").read_bytes() == mine


# ---- 4. a failed first try leaves no trace -------------------------------------------------------


@pytest.mark.slow  # CLI runs
def test_a_failed_first_try_leaves_nothing_and_the_fixed_one_trains_its_own_tokenizer(
    tmp_path, cache
):
    run, corpus = tmp_path / "r", tmp_path / "corpus.txt"
    corpus.write_text("x")
    p = tinygpt(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(run),
        "--data",
        str(corpus),
        "--max-steps",
        "2",
        cache=cache,
    )
    assert "training split" in one_error_line(p)
    assert not run.exists()
    p = tinygpt(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(run),
        "--device",
        "mps",
        "--max-steps",
        "2",
        cache=cache,
    )
    assert "mps" in one_error_line(p)
    assert not run.exists()
    corpus.write_text(Path(json.__file__).read_text() * 30)
    p = tinygpt(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(run),
        "--data",
        str(corpus),
        "--max-steps",
        "2",
        cache=cache,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert (
        Tokenizer.load(run / "tokenizer.json").vocab_size == 512
    )  # not the 257 of the 1-character corpus


def test_a_failed_write_of_run_json_stops_the_tokenizing_process(tmp_path, monkeypatch):
    """run.json is written once the tokens are open, and on rank 0 the background process is tokenizing by
    then: a write that fails there (a full disk, a replaced folder, a Ctrl-C) stops it too, instead of
    leaving it tokenizing on in the notebook's kernel after the run has failed."""
    import errno

    import tinygpt.data.tokens as tokens_module

    real, streams = tokens_module.stream_token_cache, []

    def recording(*args, **kw):  # the real stream, kept to look at its process afterwards
        streams.append(real(*args, **kw))
        return streams[-1]

    monkeypatch.setattr(tokens_module, "stream_token_cache", recording)

    def full_disk(self, info):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path / "run.json"))

    monkeypatch.setattr(RunDir, "write_info", full_disk)
    # thousands of steps: the process has shards to write for several seconds (it was found still running)
    with pytest.raises(OSError, match="No space left"):
        pretrain(
            "cpu-smoke",
            tmp_path / "r",
            cache_dir=tmp_path / "tokens",
            max_steps=6000,
            progress=False,
            device="cpu",
        )
    assert len(streams) == 1 and streams[0].writer.process.poll() is not None
    assert not (tmp_path / "r").exists()  # a failed first try leaves nothing


def test_a_failed_first_finetuning_try_leaves_no_base_and_the_fixed_one_runs(
    small_run, tmp_path, shared_data
):
    from tinygpt.finetune.run_finetune import finetune

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"no": "fields a record has"}] * 20))
    ft = tmp_path / "ft"
    with pytest.raises(Exception):
        finetune(
            "lora-r8",
            str(small_run),
            str(bad),
            ft,
            hardware="cpu",
            train={"max_steps": 2},
            progress=False,
            device="cpu",
        )
    assert not ft.exists()  # no base/, no finetune.json
    res = finetune(
        "lora-r8",
        str(small_run),
        str(shared_data / "code_alpaca_2k.json"),
        ft,
        hardware="cpu",
        train={"max_steps": 2, "eval_every": 2, "save_every": 2},
        progress=False,
        device="cpu",
    )
    assert res.train.step == 2 and (ft / "adapter").is_dir()


# ---- 5. values checked before work ---------------------------------------------------------------


@pytest.mark.slow  # CLI runs
def test_sizes_memory_and_hours_are_checked_before_any_work(tmp_path, capsys, cache):
    def refused(*args: str) -> str:
        code = main(["pretrain", *SMOKE, "--run-dir", str(tmp_path / "r"), *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert not (tmp_path / "r").exists()
        return err

    assert "model.d_model must be a positive whole number, got -64" in refused(
        "--set", "model.d_model=-64"
    )
    assert "finite" in refused("--hours", "inf")
    assert "finite" in refused("--set", "train.lr=1e999")
    # 5B parameters: refused with what fits, before a byte is allocated (in a child: see _limit_memory)
    line = one_error_line(
        tinygpt(
            "pretrain",
            *SMOKE,
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            "model.n_layer=100000",
            cache=cache,
            timeout=120,
        )
    )
    assert "GB to train" in line and "at most about" in line and "layers fit" in line, line
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # CLI runs
def test_a_garbled_budget_or_run_json_is_one_line_before_work(small_run, tmp_path, cache):
    run = tmp_path / "r"
    shutil.copytree(small_run, run)
    for bad in ({"max_steps": -7}, [1, 2], {"hours": 1.0, "max_steps": -7}):
        (run / "budget.json").write_text(json.dumps(bad))
        p = tinygpt("pretrain", *SMOKE, "--run-dir", str(run), "--max-steps", "6", cache=cache)
        assert "budget.json" in one_error_line(p)
    (run / "budget.json").unlink()
    info = json.loads((run / "run.json").read_text())
    info["recipe"]["model"]["n_layer"] = 1_000_000
    (run / "run.json").write_text(json.dumps(info))
    p = tinygpt(
        "generate",
        "--run-dir",
        str(run),
        "--prompt",
        "def",
        "--max-new-tokens",
        "2",
        cache=cache,
        timeout=120,
    )
    assert "run.json says n_layer 1000000" in one_error_line(p)


# ---- 6. leftovers --------------------------------------------------------------------------------


def _sigterm_when(proc: subprocess.Popen, ready, timeout: float = 120) -> bool:
    """SIGTERM `proc` as soon as ready() holds; False if it ended first."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
            return True
        time.sleep(0.002)
    proc.communicate(timeout=60)
    return False


@pytest.mark.slow  # a real process stopped
def test_sigterm_during_export_leaves_no_temporary_folder(small_run, tmp_path, cache):
    for attempt in range(10):
        out = tmp_path / f"hf{attempt}"
        proc = spawn("export", str(small_run), str(out), cache=cache)
        signalled = _sigterm_when(
            proc, lambda: any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
        )
        # (a signal sent once the export was already renamed into place, on a loaded machine, comes too late to
        # interrupt anything: that try counts as finished first)
        if signalled and not (
            proc.returncode in (0, -signal.SIGTERM) and (out / "config.json").is_file()
        ):
            break
    else:
        pytest.skip("the export always finished before a SIGTERM could reach it")
    assert proc.returncode == 130, proc.returncode
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("write", ["export", "mirror copy"])
def test_a_ctrl_c_just_after_a_temporary_folder_is_made_leaves_no_temporary(
    small_run, tmp_path, monkeypatch, write
):
    """The signal lands right after the mkdir of `.tmp-<name>-<pid>/` (an export's, a checkpoint copy's):
    the temporary is removed all the same (before, it was made outside the block that removes it)."""
    real_mkdir = Path.mkdir

    def mkdir_then_ctrl_c(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if self.name.startswith(TMP_PREFIX):
            raise KeyboardInterrupt

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(Path, "mkdir", mkdir_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        if write == "export":
            with atomic_output(out / "hf", folder=True):
                pytest.fail("the Ctrl-C must come before the block")
        else:
            copy_checkpoint(ckpt.latest_valid(small_run / "checkpoints"), out / "step")
    assert list(out.iterdir()) == []


@pytest.mark.slow  # a real process stopped
def test_sigterm_while_the_tokenizer_trains_leaves_no_run_folder(tmp_path, cache):
    """SIGTERM before training starts (the tokenizer is being trained): the first try leaves nothing."""
    run = tmp_path / "r"
    text = tmp_path / "big.txt"
    text.write_text(Path(json.__file__).read_text() * 400)  # a few seconds of BPE training
    proc = spawn(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(run),
        "--data",
        str(text),
        "--max-steps",
        "2",
        cache=cache,
    )
    assert _sigterm_when(proc, lambda: (run / LOCK).exists()), "training ended before the signal"
    assert proc.returncode == 130 and not run.exists(), (
        proc.returncode,
        list(run.iterdir()) if run.exists() else [],
    )


@pytest.fixture
def small_cache(tmp_path):
    yield from mount_tmpfs(tmp_path / "cache")


@pytest.mark.slow  # a CLI run onto a full disk
def test_a_full_disk_while_tokenizing_stops_training_at_once(tmp_path, small_cache):
    """The token cache on a 5 MB file system: the first shard (4 MB) fits, the second does not. Training
    stops at the next batch with the disk-full line (before: ~4000 steps later, when shard 1 was needed,
    with "tokenization stopped before shard 1")."""
    run = tmp_path / "r"
    # one thread for training: the niced writer must tokenize shard 1 while training runs, on a loaded machine too
    p = tinygpt(
        "pretrain",
        *SMOKE,
        "--run-dir",
        str(run),
        "--max-steps",
        "6000",
        "--save-every",
        "5000",
        "--set",
        "train.eval_every=5000",
        "data.max_chars=12000000",
        cache=small_cache,
        timeout=600,
        OMP_NUM_THREADS="1",
    )
    line = one_error_line(p)
    assert "the disk is full" in line and "free some disk space" in line, line
    step = int(line.split(" at step ")[1].split(":")[0])
    t = get_recipe("cpu-smoke").train
    shard_0_steps = SHARD_TOKENS // (t.micro_batch_size * t.seq_len * t.grad_accum_steps)  # 4096
    assert step < shard_0_steps, line  # before shard 0 ran out, when the old code first noticed
