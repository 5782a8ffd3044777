"""Nothing read from a run folder or a mirror (a shared Drive folder anyone with access may write)
writes outside its folder or runs code (issue 21, items 2-5). Each test is an attack as it was made
against 0f7fccf, through the real paths (`tinygpt pretrain` in a subprocess, `colab.zip_run`): it
asserts that no file appears outside the folder and that the user sees the one line saying what
was refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import types
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tinygpt.core.checkpoint import MANIFEST, list_checkpoints

REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 4, 2


def env(cache: Path, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "TINYGPT_COMPILE_KEY"}
    return {
        **e,
        "TINYGPT_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        **extra,
    }


def pretrain_cli(
    run_dir: Path,
    data: Path,
    cache: Path,
    mirror: Path | None = None,
    steps: int = STEPS,
    extra: tuple[str, ...] = (),
    **env_extra: str,
) -> subprocess.CompletedProcess:
    """`tinygpt pretrain` as a user types it; stdout and stderr together in .stdout."""
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
        str(steps),
        "--save-every",
        str(SAVE_EVERY),
        "--quiet",
        "--device",
        "cpu",
        "--probe",
        "off",
        *extra,
    ] + (["--mirror", str(mirror)] if mirror else [])
    return subprocess.run(
        cmd,
        env=env(cache, **env_extra),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def data(shared_data, tmp_path_factory) -> Path:
    """A small text (fast runs): the first 100k characters of Tiny Shakespeare."""
    p = tmp_path_factory.mktemp("trust-data") / "shakespeare-100k.txt"
    p.write_text(
        (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:100_000],
        encoding="utf-8",
    )
    return p


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory, data) -> Path:
    """A finished run mirrored to root/drive/runs/r (checkpoints, run files, token shards beside it).
    Tests copy it before changing anything."""
    root = tmp_path_factory.mktemp("trust-mirrored")
    out = pretrain_cli(root / "vm" / "r", data, root / "tg", root / "drive" / "runs" / "r")
    assert out.returncode == 0, out.stdout
    return root


def copy_of(mirrored: Path, tmp_path: Path, drive_at: str = "drive") -> tuple[Path, Path]:
    """(the VM's run folder, the mirror) copied from the fixture; drive_at: where the Drive copy lies."""
    shutil.copytree(mirrored / "vm", tmp_path / "vm", symlinks=True)
    shutil.copytree(mirrored / "drive", tmp_path / drive_at, symlinks=True)
    return tmp_path / "vm" / "r", tmp_path / drive_at / "runs" / "r"


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


# ---- 2. the compile cache ------------------------------------------------------------------------


@pytest.mark.slow  # a mirrored CLI run (the `mirrored` fixture) and more CLI runs
def test_a_mirrored_run_leaves_no_signing_key_on_the_mirror(mirrored):
    """The key that signs compile caches never lives on the shared folder (whoever writes it would
    sign caches that run on the next VM)."""
    assert not [p for p in (mirrored / "drive").rglob("*") if "key" in p.name]
    assert (mirrored / "tg" / "compile-signing.key").stat().st_mode & 0o077 == 0


def _forged_cache(
    run_dir: Path, key: bytes, what: dict, artifacts: list[tuple[str, str, bytes]]
) -> None:
    """compile_cache.bin holding `artifacts` (kind, key, content), signed with `key` as the attacker did."""
    from torch.compiler._cache import (
        CacheArtifactFactory,
        CacheArtifactManager,
        _serialize_single_cache,
    )
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    from tinygpt.train.compile_cache import CompileCache

    CacheArtifactManager._ensure_cache_artifacts_registered()
    ser = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    kinds: dict[str, list] = {}
    for kind, k, content in artifacts:
        kinds.setdefault(kind, []).append(CacheArtifactFactory.create(kind, k, content))
    for item in kinds.items():
        ser.append(item)
    payload = ser.to_bytes()
    run_dir.mkdir(parents=True, exist_ok=True)
    header = json.dumps(
        {"what": what, "hmac": CompileCache(run_dir, key, what)._sign(payload)}
    ).encode()
    (run_dir / "compile_cache.bin").write_bytes(header + b"\n" + payload)


def _what_of_cpu_smoke() -> dict:
    """What a `tinygpt pretrain --recipe cpu-smoke --set train.compile=on` run's compile cache is for."""
    from tinygpt.core.precision import choose_precision
    from tinygpt.core.recipes import get_recipe
    from tinygpt.model.gpt import GPT
    from tinygpt.train.compile_cache import describe

    recipe = get_recipe("cpu-smoke").replace(train={"compile": "on"})
    t, dev = recipe.train, torch.device("cpu")
    torch.manual_seed(t.seed)
    return describe(
        GPT(recipe.model),
        dev,
        choose_precision(dev, t.precision).name,
        t.micro_batch_size,
        t.seq_len,
        t.compile,
    )


@pytest.mark.slow  # a mirrored CLI run (the `mirrored` fixture) and more CLI runs
def test_a_compile_cache_signed_with_a_key_planted_on_the_mirror_writes_nothing(
    mirrored, tmp_path, data
):
    """The attack: a new VM (no local key), the attacker's key beside the mirror where 0f7fccf adopted
    it, and a cache signed with it whose autotune artifact is named by an absolute path (a `.pth` file
    runs at the next Python start). The run compiles afresh and says why in one line."""
    local, mirror = copy_of(mirrored, tmp_path)
    shutil.rmtree(local.parent)  # a new VM: its disk is empty
    attacker_key = b"A" * 32
    (mirror.parent / ".tinygpt-compile-signing.key").write_bytes(attacker_key)
    proof = tmp_path / "outside" / "written_by_compile_cache.pth"
    _forged_cache(
        mirror, attacker_key, _what_of_cpu_smoke(), [("autotune", str(proof), b"import os\n")]
    )
    out = pretrain_cli(
        local,
        data,
        tmp_path / "tg",
        mirror,
        steps=STEPS + 1,
        extra=("--set", "train.compile=on"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    assert out.returncode == 0, out.stdout
    assert not proof.exists() and not (tmp_path / "outside").exists()
    notes = [
        n
        for m in map(json.loads, (local / "metrics.jsonl").read_text().splitlines())
        if "startup" in m
        for n in m["startup"].get("notes", [])
    ]
    assert any(
        "not signed with this user's key" in n and "TINYGPT_COMPILE_KEY" in n for n in notes
    ), notes
    assert not any("compile cache loaded" in n for n in notes)


@pytest.mark.parametrize(
    "kind,key",
    [
        ("autotune", "{outside}/x.pth"),  # the attack: an absolute path
        (
            "autotune",
            "../../../outside/x.pth",
        ),  # the same climbing out with .. (the cache folder is a/b/inductor)
        ("inductor", "{outside}/fx"),  # the other artifact kinds pick their paths the same way
        ("aot_autograd", "../../../../outside/aot"),
        ("precompile", "{outside}/pkg"),
    ],
)
def test_even_a_cache_signed_with_the_users_own_key_writes_only_inside_torchs_cache(
    tmp_path, monkeypatch, kind, key
):
    """A key given as TINYGPT_COMPILE_KEY (the same on every VM): a cache signed with it whose artifact
    would be written outside torch's cache folder is refused whole, before anything is written."""
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager

    from tinygpt.train.compile_cache import CompileCache

    CacheArtifactManager._ensure_cache_artifacts_registered()
    if (
        kind not in CacheArtifactFactory._artifact_types
    ):  # e.g. precompile: not in torch 2.9's caches
        pytest.skip(f"this torch ({torch.__version__}) has no {kind} artifacts to forge")
    outside = tmp_path / "outside"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a" / "b" / "inductor"))
    user_key = hashlib.sha256(b"as if from TINYGPT_COMPILE_KEY").digest()
    what = {"torch": torch.__version__, "mode": "on"}
    good = ("autotune", "ab/good.best_config", b'{"x": 1}')
    _forged_cache(
        tmp_path / "run", user_key, what, [good, (kind, key.format(outside=outside), b"\x80\x04N.")]
    )
    note = CompileCache(tmp_path / "run", user_key, what).load()
    assert {f for f in files_under(tmp_path) if not f.startswith("a/b/inductor/")} == {
        "run",
        "run/compile_cache.bin",
        "a",
        "a/b",
        "a/b/inductor",
    }  # nothing written outside torch's cache
    assert not (
        tmp_path / "a" / "b" / "inductor" / "ab" / "good.best_config"
    ).exists()  # nor inside: refused whole
    assert (
        "refused, nothing of it was written" in note and "outside torch's cache folder" in note
    ), note


def test_a_local_key_file_others_could_write_or_from_a_colab_secret(tmp_path, monkeypatch):
    """A key file another user may write (or owns, or a link) signs nothing: refused in one line, the
    cache neither loaded nor saved. Colab's secret gives the same key on every VM."""
    from tinygpt.train.compile_cache import KEY_FILE, CompileCache, signing_key

    monkeypatch.delenv("TINYGPT_COMPILE_KEY", raising=False)
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "tg"))
    key, note = signing_key()  # made on first use, this user's alone
    path = tmp_path / "tg" / KEY_FILE
    assert len(key) == 32 and note is None and path.stat().st_mode & 0o777 == 0o600
    assert signing_key() == (key, None)
    os.chmod(path, 0o666)
    key2, note = signing_key()
    assert key2 is None and "may be written by others" in note and "refused" in note
    cache = CompileCache(tmp_path / "run", key2, {"mode": "on"}, note)
    assert cache.load() == note and cache.save() == 0 and not (tmp_path / "run").exists()
    os.chmod(path, 0o600)
    if os.getuid() == 0:  # as root (Colab): a file of another user's
        os.chown(path, 12345, -1)
        assert "belongs to another user" in signing_key()[1]
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.key")
    (tmp_path / "elsewhere.key").write_bytes(b"E" * 32)
    assert "is not a plain file" in signing_key()[1]

    monkeypatch.setenv(
        "TINYGPT_COMPILE_KEY", "a long secret of this user's"
    )  # given by the user: no file made
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "env-vm"))
    k_env, note = signing_key()
    assert len(k_env) == 32 and note is None and not (tmp_path / "env-vm").exists()
    monkeypatch.delenv("TINYGPT_COMPILE_KEY")
    colab = types.ModuleType("google.colab")
    colab.userdata = types.SimpleNamespace(
        get=lambda name: "my colab secret" if name == "TINYGPT_COMPILE_KEY" else None
    )
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    k_a, _ = signing_key()
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "another-vm"))
    assert (
        signing_key() == (k_a, None) and k_a is not None and not (tmp_path / "another-vm").exists()
    )


def _key_after(barrier, out) -> None:
    from tinygpt.train.compile_cache import signing_key

    barrier.wait()
    key, note = signing_key()
    out.put((key.hex() if key else None, note))


def test_runs_starting_at_once_on_a_fresh_machine_share_one_whole_key(tmp_path, monkeypatch):
    """Eight processes ask for the key at the same moment, none made yet: one key file is made, whole,
    and every process signs with it (before: the others were refused, or read a key file half written)."""
    import multiprocessing

    monkeypatch.delenv("TINYGPT_COMPILE_KEY", raising=False)
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "tg"))
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(8), ctx.Queue()
    procs = [ctx.Process(target=_key_after, args=(barrier, out)) for _ in range(8)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    from tinygpt.train.compile_cache import KEY_FILE

    assert {note for _, note in got} == {None}, got
    assert {key for key, _ in got} == {(tmp_path / "tg" / KEY_FILE).read_bytes().hex()}
    assert sorted(p.name for p in (tmp_path / "tg").iterdir()) == [KEY_FILE]  # no temporary left


_FULL_DISK = """
import resource, signal
from tinygpt.train.compile_cache import signing_key
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))  # room for half a key: the disk fills mid-write
print(signing_key()[1])
"""


def test_a_key_file_the_disk_cannot_hold_leaves_nothing_that_refuses_the_next_run(
    tmp_path, monkeypatch
):
    """The first key is written on a disk that fills after 16 bytes (a real write, cut by the kernel's file
    size limit): the cache is off for that run in one line, and no file is left, so the next run makes a whole
    key (before: a 16-byte key file was left, refused by every later run until the user deleted it)."""
    from tinygpt.train.compile_cache import KEY_FILE, signing_key

    monkeypatch.delenv("TINYGPT_COMPILE_KEY", raising=False)
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "tg"))
    run = subprocess.run(
        [sys.executable, "-c", _FULL_DISK],
        env=dict(os.environ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "the compile cache is off: no key file could be made" in run.stdout, run.stdout
    assert list((tmp_path / "tg").iterdir()) == []
    key, note = signing_key()
    assert note is None and key == (tmp_path / "tg" / KEY_FILE).read_bytes() and len(key) == 32


# ---- 3. names from a mirror's manifests ----------------------------------------------------------


@pytest.mark.slow  # a mirrored CLI run (the `mirrored` fixture) and more CLI runs
def test_a_mirror_manifest_that_climbs_out_or_lies_about_its_step_is_skipped(
    mirrored, tmp_path, data
):
    """The mirror lies deeper than the local folder, so `../` * 5 resolves inside the mirror on the
    way in but outside the run folder on the way out: 0f7fccf wrote the file there. A manifest whose
    step is not its folder's (30 in step_000050) is skipped too; the run resumes from a good one.
    Also: a run file on the mirror that is a link to a file of this VM is not copied in (the next sync
    would carry it to the shared folder)."""
    local, mirror = copy_of(mirrored, tmp_path / "L", drive_at="m1/m2/m3/m4/drive")
    shutil.rmtree(local)  # a new VM
    (tmp_path / "outside").mkdir()
    steps = list_checkpoints(mirror / "checkpoints")
    newest = steps[-1][1]
    # folder step_000050 claiming step 50, listing a name that climbs out
    climb = mirror / "checkpoints" / "step_000050"
    shutil.copytree(newest, climb)
    payload = b"written outside the run folder\n"
    depth_of_src = len(
        climb.relative_to(tmp_path / "L").parts
    )  # m1/m2/m3/m4/drive/runs/r/checkpoints/step_000050
    # from the mirror's step folder it reaches L/m1/../m4/outside; from the local copy's temporary folder
    # (L/vm/r/checkpoints/.tmp-step_000050-*) it reaches tmp_path/outside, outside the run folder
    name = "../" * (depth_of_src - 4) + "outside/traversal.txt"
    (climb / name).parent.mkdir(parents=True, exist_ok=True)
    (climb / name).write_bytes(payload)
    m = json.loads((climb / MANIFEST).read_text())
    m["step"] = 50
    m["files"] = {
        name: {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()},
        **m["files"],
    }
    (climb / MANIFEST).write_text(json.dumps(m))
    # folder step_000030 whose manifest says another step
    liar = mirror / "checkpoints" / "step_000030"
    shutil.copytree(newest, liar)
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's private file\n")
    (mirror / "samples.txt").unlink()
    (mirror / "samples.txt").symlink_to(secret)

    out = pretrain_cli(local, data, tmp_path / "tg", mirror, steps=STEPS + 2)
    assert out.returncode == 0, out.stdout
    assert not (tmp_path / "outside" / "traversal.txt").exists()
    assert "climbs out of its folder with '..'" in out.stdout
    assert f"its manifest says step {steps[-1][0]}, the folder is step_000030" in out.stdout
    assert (
        f"{mirror / 'samples.txt'} is a symbolic link" in out.stdout
        and "not followed" in out.stdout
    )
    assert "private file" not in (local / "samples.txt").read_text()
    assert (
        not (local / "checkpoints" / "step_000050").exists()
        and not (local / "checkpoints" / "step_000030").exists()
    )
    assert (
        local / "checkpoints" / f"step_{STEPS + 2:06d}"
    ).is_dir()  # resumed from the good one, trained on


def test_a_shard_list_on_the_mirror_naming_a_path_outside_is_refused(tmp_path):
    from tinygpt.sync.token_cache import restore_shards

    mirror, local = tmp_path / "a" / "b" / "mirror", tmp_path / "local"
    mirror.mkdir(parents=True)
    data = np.arange(100, dtype=np.uint16).tobytes()
    (tmp_path / "a" / "b" / "evil.bin").write_bytes(data)  # what the name reaches on the mirror
    info = {"name": "../evil.bin", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (mirror / MANIFEST).write_text(
        json.dumps({"shards": [{"train": info, "val": info}], "dtype": "uint16"})
    )
    with pytest.warns(UserWarning, match=r"names '../evil.bin', which climbs out of its folder"):
        assert restore_shards(mirror, local) == 0
    assert files_under(tmp_path) == {
        "a",
        "a/b",
        "a/b/evil.bin",
        "a/b/mirror",
        "a/b/mirror/manifest.json",
        "local",
    }


# ---- 4. links in a run folder --------------------------------------------------------------------


@pytest.mark.slow  # a mirrored CLI run (the `mirrored` fixture) and more CLI runs
@pytest.mark.parametrize(
    "name,how",
    [
        (".lock", "symlink"),
        ("metrics.jsonl", "symlink"),
        ("samples.txt", "symlink"),
        ("metrics.jsonl", "hardlink"),
        ("checkpoints", "symlink"),
    ],
)
def test_a_link_in_the_run_folder_is_refused_before_anything_is_written(
    mirrored, tmp_path, data, name, how
):
    """0f7fccf wrote the lock text into the linked file, cut its lines (metrics), appended to it
    (samples), or wrote checkpoints into the linked folder and pruned there."""
    local, _ = copy_of(mirrored, tmp_path)
    target = tmp_path / "users" / name
    target.parent.mkdir()
    if name == "checkpoints":
        shutil.move(str(local / name), str(target))
    else:
        target.write_text('{"step": 1000000, "the user": "file"}\n')
        (local / name).unlink(missing_ok=True)
    before = files_under(target) if target.is_dir() else target.read_bytes()
    if how == "symlink":
        (local / name).symlink_to(target, target_is_directory=target.is_dir())
    else:
        os.link(target, local / name)
    out = pretrain_cli(local, data, tmp_path / "tg", steps=STEPS + 2)
    assert (files_under(target) if target.is_dir() else target.read_bytes()) == before, out.stdout
    assert out.returncode == 2, out.stdout
    kind = "is a symbolic link" if how == "symlink" else "other hard link"
    assert f"{local / name} " in out.stdout and kind in out.stdout and "never follows" in out.stdout
    assert len([ln for ln in out.stdout.splitlines() if "error:" in ln]) == 1


@pytest.mark.slow  # a mirrored CLI run (the `mirrored` fixture) and more CLI runs
def test_the_download_zip_leaves_links_out_and_says_so(mirrored, tmp_path, capsys):
    from tinygpt import colab

    local, _ = copy_of(mirrored, tmp_path)
    shadow, passwd = tmp_path / "shadow", tmp_path / "passwd"
    shadow.write_text("root:$6$secret-hash\n")
    passwd.write_text("root:x:0:0\n")
    (local / "plots").mkdir(exist_ok=True)
    (local / "plots" / "loss.png").symlink_to(shadow)
    (local / "samples.txt").unlink()
    (local / "samples.txt").symlink_to(passwd)
    os.link(shadow, local / "plots" / "hard.png")
    z = colab.zip_run(local, tmp_path / "r.zip")
    with zipfile.ZipFile(z) as f:
        names = f.namelist()
        blob = b"".join(f.read(n) for n in names)
    assert (
        "r/plots/loss.png" not in names
        and "r/samples.txt" not in names
        and "r/plots/hard.png" not in names
    )
    assert b"secret-hash" not in blob and b"root:x" not in blob
    assert "r/tokenizer.json" in names and any(n.endswith("model.safetensors") for n in names)
    line = capsys.readouterr().out
    assert "left out of the zip, never followed" in line and "loss.png is a symbolic link" in line
    assert "samples.txt is a symbolic link" in line and "hard.png has 1 other hard link" in line


# ---- 5. a poisoned token shard -------------------------------------------------------------------


@pytest.mark.slow  # a mirrored CLI run (the `mirrored` fixture) and more CLI runs
def test_a_poisoned_token_shard_from_the_mirror_is_named_removed_and_tokenized_again(
    mirrored, tmp_path, data
):
    """Ids of 65535 with a matching sha256 in the mirror's shard: 0f7fccf restored it and failed with
    `index out of range in self`, naming neither shard nor mirror, and kept it in the local cache."""
    local, mirror = copy_of(mirrored, tmp_path)
    shutil.rmtree(local.parent)  # a new VM: no run folder, no token cache
    shard_dir = next((mirror.parent / "_token_cache").iterdir())
    manifest = json.loads((shard_dir / MANIFEST).read_text())
    entry = manifest["shards"][0]["train"]
    poisoned = np.full(entry["bytes"] // 2, 65535, dtype=np.uint16).tobytes()
    (shard_dir / entry["name"]).write_bytes(poisoned)
    entry["sha256"] = hashlib.sha256(poisoned).hexdigest()
    (shard_dir / MANIFEST).write_text(json.dumps(manifest))
    out = pretrain_cli(local, data, tmp_path / "tg", mirror, steps=STEPS + 2)
    assert out.returncode == 0, out.stdout
    local_shard = tmp_path / "tg" / "tokens" / shard_dir.name / entry["name"]
    assert (
        f"token shard {local_shard} (from the mirror {shard_dir}) holds token id 65535"
        in out.stdout
    )
    assert "removed from the local cache" in out.stdout and "tokenized again" in out.stdout
    vocab = json.loads((local / "run.json").read_text())["recipe"]["model"]["vocab_size"]
    assert int(np.fromfile(local_shard, dtype=np.uint16).max()) < vocab  # tokenized again, here
    again = pretrain_cli(
        local, data, tmp_path / "tg", mirror, steps=STEPS + 4
    )  # the next start: nothing to say
    assert again.returncode == 0 and "token shard" not in again.stdout, again.stdout


def test_a_linked_token_folder_on_the_mirror_is_never_written_through(tmp_path):
    """The shard copy to the mirror (and back) does not follow a link planted where the shard
    folder belongs: it would write manifest.json and shards into any folder of this VM."""
    from tinygpt.sync.token_cache import sync_shards

    local, users = tmp_path / "local", tmp_path / "users-folder"
    local.mkdir()
    users.mkdir()
    data = np.arange(100, dtype=np.uint16).tobytes()
    (local / "train_000000.bin").write_bytes(data)
    (local / "val_000000.bin").write_bytes(data)
    info = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (local / MANIFEST).write_text(
        json.dumps(
            {
                "shards": [
                    {
                        "train": {"name": "train_000000.bin", **info},
                        "val": {"name": "val_000000.bin", **info},
                    }
                ]
            }
        )
    )
    mirror = tmp_path / "drive" / "_token_cache" / "key"
    mirror.parent.mkdir(parents=True)
    mirror.symlink_to(users, target_is_directory=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        copied = sync_shards(local, mirror)
    assert list(users.iterdir()) == [] and copied == 0
    assert any(f"{mirror} is a symbolic link" in str(w.message) for w in said), [
        str(w.message) for w in said
    ]
