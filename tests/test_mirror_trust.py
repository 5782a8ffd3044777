"""A shared mirror decides nothing (issue 32, items 1-4 and 10): its run.json never chooses the base, the data or
the tokenizer; its budget.json never sets an endless run; a mirror that vanishes mid-run is never recreated on the
VM's own disk, and the run says so. Each test is the attack as it was made against ee92b4d, through the real
`tinygpt pretrain` in a subprocess, on text every machine has (the standard library's sources)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinygpt.core.callback import Callback
from tinygpt.core.recipes import get_recipe

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(os.__file__).parent


def env(cache: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "TINYGPT_COMPILE_KEY"}
    return {
        **e,
        "TINYGPT_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "TINYGPT_MIRROR_WAIT_S": "20",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
    }


def pretrain(
    run_dir: Path, cache: Path, *extra: str, data: Path | None = None
) -> subprocess.CompletedProcess:
    """`tinygpt pretrain --recipe cpu-smoke` as a user types it; stdout and stderr together in .stdout."""
    cmd = [
        sys.executable,
        "-m",
        "tinygpt",
        "pretrain",
        "--recipe",
        "cpu-smoke",
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--device",
        "cpu",
        "--probe",
        "off",
        *(("--data", str(data)) if data else ()),
        *extra,
    ]
    return subprocess.run(
        cmd,
        env=env(cache),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )


def text_folder(folder: Path, n: int = 3) -> Path:
    """A folder of real text: a few modules of the standard library."""
    folder.mkdir(parents=True)
    for name in ("argparse.py", "textwrap.py", "shlex.py")[:n]:
        (folder / name).write_text((STDLIB / name).read_text(encoding="utf-8"), encoding="utf-8")
    return folder


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def forged_mirror(mirror: Path, private_text: Path, private_base: Path) -> None:
    """What an attacker with write access to a shared Drive folder writes: a run.json whose recipe (cpu-smoke, the
    victim's usual) trains on a private text folder of the victim's from a private run folder of the victim's, and
    an identity.json that matches it (so the old mirror check passed)."""
    r = get_recipe("cpu-smoke")
    forged = r.replace(data={"source": str(private_text)}).to_dict()
    forged["model"]["init"] = str(private_base)
    mirror.mkdir(parents=True)
    (mirror / "run.json").write_text(json.dumps({"recipe": forged}))
    config = {
        "recipe": r.name,
        "model": {
            k: v
            for k, v in forged["model"].items()
            if k not in ("activation_checkpointing", "fused_proj", "bf16_residual", "attn_impl")
        },
        "data": forged["data"],
    }
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]
    (mirror / "identity.json").write_text(json.dumps({"run_id": "attacker0001", "config": digest}))


def test_a_mirrors_run_json_never_chooses_the_base_or_the_data(tmp_path):
    """Item 1: `tinygpt pretrain --recipe cpu-smoke --run-dir victim --mirror drive/run` on a new VM, with a mirror
    whose run.json names a private base and private data of the victim's: refused in one line naming the fields,
    before anything is read, trained or uploaded. The same command with the victim's own mirror then trains."""
    private_text = text_folder(tmp_path / "private" / "notes")
    private_base = tmp_path / "private" / "base_run"
    private_base.mkdir()
    drive = tmp_path / "drive"
    forged_mirror(drive / "run", private_text, private_base)
    before = listing(drive)
    out = pretrain(
        tmp_path / "victim", tmp_path / "cache", "--max-steps", "2", "--mirror", str(drive / "run")
    )
    assert out.returncode != 0, out.stdout
    assert "holds another run than this command's" in out.stdout, out.stdout
    assert "model.init" in out.stdout and "data.source" in out.stdout, out.stdout
    # the fields, never the other run's values (its private paths), nor advice to type them
    assert str(private_text) not in out.stdout and "use another --mirror folder" in out.stdout, (
        out.stdout
    )
    assert "Give the command" not in out.stdout, out.stdout
    assert (
        "base " not in out.stdout
    )  # the old "base .../private_run: its weights and tokenizer" line
    assert (
        listing(drive) == before
    )  # no token cache, no checkpoint, no identity written to the shared folder
    assert not (tmp_path / "victim" / "run.json").exists()
    assert not listing(tmp_path / "cache")  # nothing of the private text was tokenized

    # a symbolic link as the mirror's run.json is not followed either
    (drive / "run" / "run.json").unlink()
    (drive / "run" / "run.json").symlink_to(tmp_path / "private" / "notes" / "argparse.py")
    out = pretrain(
        tmp_path / "victim", tmp_path / "cache", "--max-steps", "2", "--mirror", str(drive / "run")
    )
    assert out.returncode != 0 and "symbolic link" in out.stdout, out.stdout
    assert out.stdout.strip().count("\n") == 0, out.stdout  # one line

    # the victim's own, empty mirror: the run trains on the command's data and mirrors it
    data = text_folder(tmp_path / "data")
    out = pretrain(
        tmp_path / "victim",
        tmp_path / "cache",
        "--max-steps",
        "2",
        "--save-every",
        "2",
        "--mirror",
        str(drive / "mine"),
        data=data,
    )
    assert out.returncode == 0, out.stdout
    assert (drive / "mine" / "checkpoints" / "step_000002").is_dir()
    assert json.loads((tmp_path / "victim" / "run.json").read_text())["recipe"]["data"][
        "source"
    ] == str(data)


def test_the_notebook_base_picker_takes_no_local_path_from_a_mirror(tmp_path):
    """Item 1 in 01_pretrain: the base dropdown's default (what Run all trains) comes from the local run folder;
    a mirror's base only when it is one of the listed Hub models, never a folder of this VM it names."""
    from tinygpt.colab.pickers import HUB_BASES, BasePicker
    from tinygpt.colab.runs import RunFolders

    private_text = text_folder(tmp_path / "private" / "notes", 1)
    forged_mirror(tmp_path / "drive" / "run", private_text, tmp_path / "private" / "base_run")
    run = RunFolders("run", tmp_path / "local", tmp_path / "drive" / "run")
    assert BasePicker(run).value is None  # from scratch: the forged folder is not picked
    hub = HUB_BASES[1][1]
    info = json.loads((run.mirror / "run.json").read_text())
    info["recipe"]["model"]["init"] = hub
    (run.mirror / "run.json").write_text(json.dumps(info))
    assert BasePicker(run).value == hub


class UnmountAt(Callback):
    """A trainer callback that, at checkpoint `step`, waits (bounded) until the mirror holds the checkpoint before
    it, then does what a dropped Drive mount does to the path: the mount's contents vanish and an empty mount point
    stays on the VM's own disk."""

    def __init__(self, mount: Path, mirror: Path, step: int, before: int) -> None:
        self.mount, self.mirror, self.step, self.before = mount, mirror, step, before
        self.done = False

    def on_checkpoint(self, path, step: int) -> None:
        import shutil
        import time

        if step != self.step or self.done:
            return
        deadline = (
            time.monotonic() + 300
        )  # generous: a loaded machine copies slowly; counted, never timed
        while not (
            self.mirror / "checkpoints" / f"step_{self.before:06d}" / "manifest.json"
        ).is_file():
            assert time.monotonic() < deadline, "the mirror never received the first checkpoint"
            time.sleep(0.1)
        shutil.rmtree(self.mount)
        self.mount.mkdir()  # the mount point, now a plain empty folder of the VM's disk
        self.done = True


def test_a_mirror_that_vanishes_mid_run_is_never_recreated_on_the_vms_disk(
    tmp_path, monkeypatch, capsys
):
    """Item 3: the mirror's mount dropped after step 2 (as Drive's FUSE mount drops): the run goes on locally, makes
    nothing under the empty mount point, warns once that the mirror is gone and where the checkpoints are, and its
    last line says what the mirror lacks. Before, steps 4/6, best/ and metrics were written under the mount point
    and the run exited 0 with no word."""
    import warnings

    from tinygpt.cli_report import report_pretrain
    from tinygpt.pretrain.run_pretrain import pretrain as run_pretrain

    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TINYGPT_MIRROR_WAIT_S", "30")
    mount = tmp_path / "drive"
    mount.mkdir()
    mirror = mount / "MyDrive" / "run"
    data = text_folder(tmp_path / "data", 1)
    cb = UnmountAt(mount, mirror, step=4, before=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = run_pretrain(
            "cpu-smoke",
            tmp_path / "vm",
            data=str(data),
            max_steps=6,
            save_every=2,
            mirror=mirror,
            device="cpu",
            probe="off",
            progress=False,
            callbacks=[cb],
        )
    assert cb.done and res.step == 6
    assert listing(mount) == []  # nothing recreated under the mount point
    gone = [str(w.message) for w in seen if "is gone" in str(w.message)]
    assert gone and f"local checkpoints are safe in {tmp_path / 'vm'}" in gone[0], [
        str(w.message) for w in seen
    ]
    capsys.readouterr()
    assert report_pretrain(res, tmp_path / "vm", str(mirror)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert (
        last.startswith(f"the mirror {mirror} is behind: the folder is gone") and "remount" in last
    ), last
    assert "same command again" not in last


def test_a_mirror_folder_replaced_mid_run_gets_nothing_more(tmp_path):
    """Item 3, another way a mount goes: the folder replaced by another one of the same name (a remount, a restore
    from the bin). The background mirror notices before the next copy and stops; the new folder stays empty."""
    import shutil

    from tinygpt.core.checkpoint import write_manifest
    from tinygpt.sync.mirror import Mirror

    local, mirror = tmp_path / "vm", tmp_path / "drive" / "run"

    def checkpoint(step: int) -> Path:
        p = local / "checkpoints" / f"step_{step:06d}"
        p.mkdir(parents=True)
        (p / "model.bin").write_bytes(os.urandom(1000))
        write_manifest(p, {"step": step})
        return p

    (local).mkdir()
    (local / "run.json").write_text("{}")
    m = Mirror(local, mirror, identity={"run_id": "r1", "config": "c1"})
    m.on_checkpoint(checkpoint(2), 2)
    assert m.flush(timeout=300)
    assert (mirror / "checkpoints" / "step_000002").is_dir()
    shutil.rmtree(mirror)
    mirror.mkdir()  # same name, another folder
    m.on_checkpoint(checkpoint(4), 4)
    assert not m.flush(timeout=300)  # given up, not synced
    assert listing(mirror) == []
    assert "is gone" in (m.status.last_error or "") and "replaced" in m.status.last_error


@pytest.mark.slow  # fills a mirror through CLI runs in subprocesses (five); the local file's check stays fast below
def test_a_mirrors_run_files_that_tinygpt_never_wrote_are_refused_before_any_copy(tmp_path):
    """Items 4 and 5: a budget.json with max_steps 10^30 (a run that never ends) or a metrics.jsonl row with a step
    "x" placed on a real run's mirror: a new VM's start is refused in one line naming the mirror's file, and the
    file is not copied into the local folder (where it stopped every later start too)."""
    data = text_folder(tmp_path / "data", 1)
    drive = tmp_path / "drive" / "run"
    out = pretrain(
        tmp_path / "vm1",
        tmp_path / "cache",
        "--max-steps",
        "2",
        "--save-every",
        "2",
        "--mirror",
        str(drive),
        data=data,
    )
    assert out.returncode == 0, out.stdout
    honest = (drive / "metrics.jsonl").read_text()

    for name, forged in (
        ("budget.json", json.dumps({"hours": 1, "max_steps": 10**30})),
        ("budget.json", json.dumps({"hours": 1e9, "max_steps": 5})),
        ("metrics.jsonl", honest + json.dumps({"step": "x", "loss": 1.0}) + "\n" + honest),
        ("tokenizer.json", None),
    ):
        keep = (drive / name).read_bytes() if (drive / name).exists() else None
        if (
            forged is None
        ):  # 100 MB of nothing, as sparse as the 4 GB one that was read whole before
            with open(drive / name, "r+b") as f:
                f.truncate(100 << 20)
        else:
            (drive / name).write_text(forged)
        out = pretrain(
            tmp_path / "vm2",
            tmp_path / "cache",
            "--max-steps",
            "4",
            "--mirror",
            str(drive),
            data=data,
        )
        assert out.returncode != 0, out.stdout
        assert str(drive / name) in out.stdout, out.stdout
        assert "did not write" in out.stdout or "not written by tinygpt" in out.stdout, out.stdout
        assert "restore it from the mirror" not in out.stdout, out.stdout
        assert out.stdout.strip().count("\n") == 0, out.stdout  # one line
        assert (
            not (tmp_path / "vm2" / name).exists()
            and not (tmp_path / "vm2" / "checkpoints").exists()
        )
        (drive / name).unlink()
        if keep is not None:
            (drive / name).write_bytes(keep)
    (drive / "metrics.jsonl").write_text(honest)


def test_a_budget_json_tinygpt_never_wrote_is_refused_and_an_honest_one_read(tmp_path):
    """The same budget.json read from a local folder: 10^30 steps, or more steps than its hours buy at its
    step time, is refused naming the file; an honest one is read."""
    from tinygpt.core.rundir import RunDirError
    from tinygpt.train.budget import Budget

    (tmp_path / "budget.json").write_text(json.dumps({"hours": 1, "max_steps": 10**30}))
    with pytest.raises(RunDirError) as e:
        Budget.load(tmp_path)
    assert "budget.json" in str(e.value) and "max_steps" in str(e.value)
    (tmp_path / "budget.json").write_text(
        json.dumps(
            {"hours": 1, "max_steps": 3000, "decided_at_step": 10, "step_s": 1.0, "decided_at": 1.0}
        )
    )
    assert Budget.load(tmp_path).max_steps == 3000
    (tmp_path / "budget.json").write_text(
        json.dumps(
            {"hours": 1, "max_steps": 3000, "decided_at_step": 10, "step_s": 2.0, "decided_at": 1.0}
        )
    )
    with pytest.raises(RunDirError, match="buy"):
        Budget.load(tmp_path)  # 1 h at 2 s a step buys 1800 steps, not 3000


def test_evals_jsonl_is_never_written_or_read_through_a_link(tmp_path, capsys):
    """Item 2: a run folder (restored from a shared mirror, or handed over) whose evals.jsonl is a symbolic or a hard
    link to a file of the user's: `tinygpt eval` appends nothing to that file, `tinygpt export` copies nothing of it
    into the model card; each says which file it refused. A plain evals.jsonl is appended and carried as before."""
    from tinygpt.cli import main
    from tinygpt.pretrain.run_pretrain import pretrain as run_pretrain

    data = text_folder(tmp_path / "data", 1)
    run = tmp_path / "run"
    run_pretrain(
        "cpu-smoke",
        run,
        data=str(data),
        max_steps=4,
        save_every=4,
        progress=False,
        cache_dir=tmp_path / "cache",
        device="cpu",
        probe="off",
    )
    secret = tmp_path / "home" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text('{"task": "private", "data": "the password is swordfish", "scores": {}}\n')
    before = secret.read_text()
    evals = run / "evals.jsonl"
    for link in (lambda: evals.symlink_to(secret), lambda: os.link(secret, evals)):
        link()
        code = main(
            [
                "eval",
                str(run),
                "--task",
                "perplexity",
                "--data",
                str(data / "argparse.py"),
                "--max-chars",
                "2000",
            ]
        )
        out = capsys.readouterr()
        assert secret.read_text() == before  # nothing appended to the user's file
        assert code != 0 and "evals.jsonl" in out.err and "link" in out.err, out
        code = main(["export", str(run), str(tmp_path / "export")])
        out = capsys.readouterr()
        assert code != 0 and "evals.jsonl" in out.err, out
        assert not (tmp_path / "export").exists()
        evals.unlink()
    assert (
        main(
            [
                "eval",
                str(run),
                "--task",
                "perplexity",
                "--data",
                str(data / "argparse.py"),
                "--max-chars",
                "2000",
            ]
        )
        == 0
    )
    assert json.loads(evals.read_text().splitlines()[-1])["task"] == "perplexity"
    assert main(["export", str(run), str(tmp_path / "export")]) == 0
    capsys.readouterr()
    assert "swordfish" not in "".join(
        p.read_text(errors="replace") for p in (tmp_path / "export").glob("*.md")
    )


def test_a_diverged_first_try_says_what_is_true_and_leaves_the_folder_as_found(tmp_path):
    """Item 10: `--set train.lr=1e9` diverges before any checkpoint. Before: "The last good checkpoint is None ...
    run again to resume from it", and a folder that existed kept a .lock. Now the message says nothing was saved
    and the run starts again from step 0, and the folder holds what it held before; the advice then works."""
    data = text_folder(tmp_path / "data", 1)
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine\n")
    out = pretrain(run, tmp_path / "cache", "--max-steps", "20", "--set", "train.lr=1e9", data=data)
    assert out.returncode != 0, out.stdout
    assert "None" not in out.stdout and "before any checkpoint was saved" in out.stdout, out.stdout
    assert "starts from step 0" in out.stdout, out.stdout
    assert listing(run) == ["notes.txt"]  # no run.json, tokenizer, metrics or .lock left behind
    out = pretrain(run, tmp_path / "cache", "--max-steps", "2", data=data)  # as the message says
    assert out.returncode == 0, out.stdout


def test_the_loser_of_two_runs_on_one_mirror_is_told_to_use_another(tmp_path):
    """Item 10: two runs started at once on one new mirror: the first claims it, the second's copies stop; its last
    line used to say "the same command again copies the rest", which the mirror then refused. It now names the run
    that holds the mirror and says to use another --mirror folder."""
    from tinygpt.cli_report import mirror_line
    from tinygpt.core.checkpoint import write_manifest
    from tinygpt.sync.catchup import mirror_lag
    from tinygpt.sync.identity import write_identity
    from tinygpt.sync.mirror import Mirror

    mirror = tmp_path / "drive" / "run"
    locals_ = []
    for run_id in ("winner00001", "loser000002"):
        local = tmp_path / run_id
        ckpt = local / "checkpoints" / "step_000002"
        ckpt.mkdir(parents=True)
        (ckpt / "model.bin").write_bytes(os.urandom(100))
        write_manifest(ckpt, {"step": 2})
        identity = {"run_id": run_id, "config": "same"}
        write_identity(local, identity)
        m = Mirror(local, mirror, identity=identity)
        m.on_checkpoint(ckpt, 2)
        m.flush(timeout=300)
        m.close(timeout=60)
        locals_.append(local)
    assert json.loads((mirror / "identity.json").read_text())["run_id"] == "winner00001"
    assert mirror_lag(locals_[0], mirror) == []
    line = mirror_line(mirror, mirror_lag(locals_[1], mirror))
    assert "belongs to run winner00001" in line and "use another --mirror folder" in line, line
    assert "same command again" not in line


def test_an_export_killed_with_9_leaves_no_temporary_for_ever(tmp_path):
    """Item 10: `kill -9` during `tinygpt export` left `.tmp-<name>-<pid>` beside the target for ever. The next
    write of that target removes the temporaries of processes that no longer run, and leaves a running one's."""
    import signal

    from tinygpt.core.files import atomic_output

    dead = subprocess.Popen(["sleep", "60"])
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        target = tmp_path / "export"
        for pid in (dead.pid, alive.pid):
            (tmp_path / f".tmp-export-{pid}").mkdir()
            (tmp_path / f".tmp-export-{pid}" / "model.safetensors").write_bytes(b"half")
        with atomic_output(target, folder=True) as tmp:
            (tmp / "README.md").write_text("card\n")
        assert listing(tmp_path) == sorted(
            [
                "export",
                "export/README.md",
                f".tmp-export-{alive.pid}",
                f".tmp-export-{alive.pid}/model.safetensors",
            ]
        )
    finally:
        alive.kill()
        alive.wait()


def test_a_mirrors_plan_sizes_nothing_here(tmp_path, monkeypatch):
    """Issue 48: a `--size auto` run's mirror whose run.json says d12 (plan and ladder fields), its checkpoints
    deleted: a new VM (another cache, so another key) plans here and trains what its own plan chose, not an
    85M-parameter d12. With the checkpoints kept, the size is the checkpoint's: a plan that says otherwise is
    refused in one line naming the file and the mirror."""
    import shutil

    from tinygpt.core.config import ConfigError
    from tinygpt.fit.ladder import rung
    from tinygpt.pretrain.run_pretrain import pretrain as run_pretrain

    data = text_folder(tmp_path / "data", 1)
    drive = tmp_path / "drive" / "run"
    kw = dict(
        data=str(data),
        size="auto",
        hours=0.002,
        device="cpu",
        progress=False,
        tensorboard=False,
        mirror=drive,
    )
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "vm1cache"))
    run_pretrain("cpu-smoke", tmp_path / "vm1", **kw)
    planned = json.loads((tmp_path / "vm1" / "run.json").read_text())["plan"]["size"]
    assert planned != "d12"
    info = json.loads((drive / "run.json").read_text())
    big = rung(get_recipe("cpu-smoke"), 12)
    info["recipe"]["model"].update(
        {k: getattr(big.model, k) for k in ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff")}
    )
    info["plan"]["size"] = "d12"
    for row in info["plan"]["candidates"]:
        row["chosen"] = row["size"] == "d12"
    (drive / "run.json").write_text(json.dumps(info))

    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "vm2cache"))
    with pytest.raises(
        ConfigError, match=r"holds a d\d+ model, but the plan in .*run\.json \(from the mirror "
    ):
        run_pretrain("cpu-smoke", tmp_path / "vm2", **kw)
    shutil.rmtree(drive / "checkpoints")
    shutil.rmtree(drive / "best", ignore_errors=True)
    run_pretrain("cpu-smoke", tmp_path / "vm3", **kw)
    now = json.loads((tmp_path / "vm3" / "run.json").read_text())
    assert now["plan"]["size"] != "d12" and now["recipe"]["model"]["n_layer"] < 12
    assert now["recipe"]["model"]["n_layer"] == int(now["plan"]["size"][1:])


@pytest.mark.slow  # times real steps: two budgeted runs (short form: test_budget's refix tests on given times)
def test_a_resumed_budget_measures_its_own_steps(tmp_path):
    """Issue 48: budget.json says 0.002 h buy 72,000 steps (0.1 ms each, within its own bounds) for a run that
    resumes from its checkpoint: the resumed process measures its steps and fixes the count from them, so the
    hours asked are the hours its steps take (their count times the step time it measured), and it ends."""
    from tinygpt.pretrain.run_pretrain import pretrain as run_pretrain

    data = text_folder(tmp_path / "data", 1)
    run = tmp_path / "run"
    kw = dict(
        data=str(data),
        device="cpu",
        progress=False,
        tensorboard=False,
        cache_dir=tmp_path / "cache",
    )
    first = run_pretrain("cpu-smoke", run, hours=0.001, **kw)
    forged = {
        "hours": 0.002,
        "max_steps": 72_000,
        "step_s": 1e-4,
        "decided_at_step": 1,
        "decided_at": 1.0,
    }
    (run / "budget.json").write_text(json.dumps(forged))
    again = run_pretrain("cpu-smoke", run, hours=0.002, **kw)
    kept = json.loads((run / "budget.json").read_text())
    assert again.resumed_from == first.step and again.step == kept["max_steps"] < 72_000
    assert kept["step_s"] != 1e-4 and kept["decided_at_step"] > first.step
    assert abs(kept["max_steps"] * kept["step_s"] - 0.002 * 3600) <= 0.1 * 0.002 * 3600, kept


def test_a_deleted_mirror_is_not_said_to_hold_a_step(tmp_path):
    """Issue 48: after `rm -rf` of the mirror, the give-up warning said "on the mirror: step 2"; it now says what
    is there now, and names no class."""
    import shutil
    import warnings

    from tinygpt.core.checkpoint import write_manifest
    from tinygpt.sync.mirror import Mirror

    local, mirror = tmp_path / "vm", tmp_path / "drive" / "run"

    def checkpoint(step: int) -> Path:
        p = local / "checkpoints" / f"step_{step:06d}"
        p.mkdir(parents=True)
        (p / "model.bin").write_bytes(os.urandom(1000))
        write_manifest(p, {"step": step})
        return p

    local.mkdir()
    (local / "run.json").write_text("{}")
    m = Mirror(local, mirror, identity={"run_id": "r1", "config": "c1"})
    m.on_checkpoint(checkpoint(2), 2)
    assert m.flush(timeout=300)
    shutil.rmtree(mirror)
    m.on_checkpoint(checkpoint(4), 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not m.close(timeout=60)
    said = " ".join(str(w.message) for w in seen)
    assert "on the mirror: nothing (the folder is gone)" in said and "step 2" not in said, said
    assert "Error:" not in said and "MirrorGone" not in said, said
