"""docs/TRUST.md's table of every file read from a run folder or a mirror, walked (issue 48). A file name tinygpt
defines, or a field a run writes into run.json or budget.json, with no row fails here; each decision row is
attacked with a hostile value on a mirror whose checkpoints were deleted, as a second VM (another
$TINYGPT_CACHE, so another signing key) meets it: the value changes nothing the command did not ask for, or the
start is refused in one line (exit 2) naming the mirror and the file."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tinygpt.cli import main

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(os.__file__).parent
SECTION = "## Every file read from a run folder or a mirror"
ROW = re.compile(r"^\| `([^`]+)` \| `([^`]+)` \| (decision|state|record) \|")


def table() -> dict[tuple[str, str], str]:
    """(file, field) -> kind, from the table's rows."""
    text = (REPO / "docs" / "TRUST.md").read_text(encoding="utf-8")
    assert SECTION in text
    rows = {}
    for line in text.split(SECTION, 1)[1].splitlines():
        if m := ROW.match(line):
            rows[(m[1], m[2])] = m[3]
    return rows


def defined_file_names() -> set[str]:
    """Every module-level string constant of the package that names a file or folder of a run: an upper-case
    name bound to "name.ext", ".name" or "_name" (tuple assignments included)."""
    looks = re.compile(
        r"^(\.?[\w-]+\.(json|jsonl|txt|bin|pt|safetensors|key|md|lock)|\.[a-z][\w.-]*|_[a-z][a-z_]*)$"
    )
    out = set()
    for path in (REPO / "tinygpt").rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            pairs = []
            for t in targets:
                if isinstance(t, ast.Name):
                    pairs.append((t, node.value))
                elif isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(t.elts, node.value.elts))
            for name, value in pairs:
                if (
                    isinstance(name, ast.Name)
                    and name.id.isupper()
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                    and looks.match(value.value)
                ):
                    out.add(value.value)
    return out


def not_run_files() -> set[str]:
    text = (REPO / "docs" / "TRUST.md").read_text(encoding="utf-8").split(SECTION, 1)[1]
    line = next(
        p for p in text.split("\n\n") if p.startswith("Names tinygpt defines that are not files")
    )
    return set(re.findall(r"`([^`]+)`", line))


def env_for(monkeypatch, cache: Path) -> None:
    """A machine: its own cache, so its own signing key; no key given by the environment."""
    monkeypatch.setenv("TINYGPT_CACHE", str(cache))
    monkeypatch.delenv("TINYGPT_COMPILE_KEY", raising=False)
    monkeypatch.setenv("TINYGPT_MIRROR_WAIT_S", "20")


def text_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "shlex.py").write_text(
        (STDLIB / "shlex.py").read_text(encoding="utf-8"), encoding="utf-8"
    )
    return folder


def pretrain(run: Path, mirror: Path, data: Path, *extra: str) -> int:
    return main(
        [
            "pretrain",
            "--recipe",
            "cpu-smoke",
            "--run-dir",
            str(run),
            "--data",
            str(data),
            "--quiet",
            "--device",
            "cpu",
            "--mirror",
            str(mirror),
            *extra,
        ]
    )


@pytest.fixture
def honest(tmp_path, monkeypatch):
    """A run the first VM trained to step 2 on its mirror, the mirror's checkpoints then deleted (the attacker
    keeps only the small files); the second VM's environment is set. Returns (mirror, data, vm1 run.json)."""
    data = text_folder(tmp_path / "data")
    env_for(monkeypatch, tmp_path / "vm1cache")
    mirror = tmp_path / "drive" / "run"
    assert pretrain(tmp_path / "vm1", mirror, data, "--max-steps", "2", "--save-every", "2") == 0
    for folder in ("checkpoints", "best"):
        shutil.rmtree(mirror / folder, ignore_errors=True)
    first = json.loads((tmp_path / "vm1" / "run.json").read_text())
    env_for(monkeypatch, tmp_path / "vm2cache")
    return mirror, data, first


def edit(path: Path, change) -> None:
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))


def refused(capsys, code: int, mirror: Path, name: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0, err  # one line
    assert str(mirror) in err and name in err, err
    assert "Error:" not in err.replace("error:", ""), err  # no class name
    return err


def trained_as_asked(run: Path, first: dict) -> dict:
    """The run's run.json: the model and the train settings the command asks for (the first VM's, which the
    same command made), whatever the mirror said."""
    from tinygpt.train.exact_resume import RESUMABLE_CHANGES

    info = json.loads((run / "run.json").read_text())
    for part in ("model", "train"):
        ours = {k: v for k, v in info["recipe"][part].items() if k not in RESUMABLE_CHANGES}
        assert ours == {
            k: v for k, v in first["recipe"][part].items() if k not in RESUMABLE_CHANGES
        }, part
    assert "plan" not in info
    return info


def attack_recipe(tmp_path, honest, capsys):
    mirror, data, _ = honest
    edit(
        mirror / "run.json",
        lambda d: d["recipe"]["data"].update(source="/home/victim/private_notes"),
    )
    err = refused(
        capsys, pretrain(tmp_path / "vm2", mirror, data, "--max-steps", "2"), mirror, "run.json"
    )
    assert (
        "private_notes" not in err
        and "use another --mirror folder" in err
        and "Give the command" not in err
    )
    assert not (tmp_path / "vm2" / "run.json").exists()


def attack_plan(tmp_path, honest, capsys):
    """A `plan` the user never asked for (no --size): the run trains the recipe as written."""
    mirror, data, first = honest
    row = {
        "size": "d12",
        "chosen": True,
        "params": 8.5e7,
        "tokens": 1e6,
        "tokens_per_s": 1.0,
        "predicted_loss": 3.0,
        "epochs": None,
    }
    edit(
        mirror / "run.json",
        lambda d: d.update(plan={"size": "d12", "hours": 0.01, "candidates": [row]}),
    )
    assert pretrain(tmp_path / "vm2", mirror, data, "--max-steps", "2") == 0, (
        capsys.readouterr().err
    )
    trained_as_asked(tmp_path / "vm2", first)
    # under --size auto, a size off the ladder: refused in one line, nothing left behind
    edit(
        mirror / "run.json",
        lambda d: (
            d["recipe"]["train"].update(schedule="wsd"),
            d.update(plan={"size": "d7", "hours": 0.01, "candidates": [row]}),
        ),
    )
    code = pretrain(tmp_path / "vm3", mirror, data, "--hours", "0.001", "--size", "auto")
    assert "not on the ladder" in refused(capsys, code, mirror, "run.json")
    assert not (tmp_path / "vm3").exists()


def hostile_probe(d: dict) -> None:
    d["probe"] = {"device_name": "NVIDIA H100"}
    d["recipe"]["train"].update(
        micro_batch_size=1, grad_accum_steps=64, seq_len=8, precision="fp32"
    )


def attack_probe(tmp_path, honest, capsys):
    """The probed fields with a "probe" that never ran on this CPU: the recipe as written."""
    mirror, data, first = honest
    edit(mirror / "run.json", hostile_probe)
    assert pretrain(tmp_path / "vm2", mirror, data, "--max-steps", "2") == 0, (
        capsys.readouterr().err
    )
    assert trained_as_asked(tmp_path / "vm2", first)["probe"] is None


def attack_signature(tmp_path, honest, capsys, monkeypatch):
    """The first VM's own signed run.json, its probe edited: on the first VM itself (its key) it is not its
    own any more, so it decides nothing there either."""
    mirror, data, first = honest
    edit(mirror / "run.json", hostile_probe)
    env_for(monkeypatch, tmp_path / "vm1cache")
    assert pretrain(tmp_path / "vm3", mirror, data, "--max-steps", "2") == 0, (
        capsys.readouterr().err
    )
    trained_as_asked(tmp_path / "vm3", first)


def budget_attack(tmp_path, honest, capsys, forged: dict):
    """budget.json whose step time buys far more steps than the hours: the steps come from a step time this
    process measured, and it ends."""
    mirror, data, _ = honest
    edit(
        mirror / "run.json", lambda d: d["recipe"]["train"].update(schedule="wsd")
    )  # a budgeted run's
    (mirror / "budget.json").write_text(json.dumps(forged))
    assert pretrain(tmp_path / "vm2", mirror, data, "--hours", "0.0005") == 0, (
        capsys.readouterr().err
    )
    kept = json.loads((tmp_path / "vm2" / "budget.json").read_text())
    assert kept["step_s"] != forged["step_s"] and kept["max_steps"] < 2000
    last = max(int(p.name[5:]) for p in (tmp_path / "vm2" / "checkpoints").iterdir())
    assert last == kept["max_steps"]


def attack_max_steps(tmp_path, honest, capsys):
    budget_attack(
        tmp_path,
        honest,
        capsys,
        {
            "hours": 0.005,
            "max_steps": 180000,
            "step_s": 0.0001,
            "decided_at_step": 10,
            "decided_at": 1.0,
        },
    )


def attack_step_s(tmp_path, honest, capsys):
    budget_attack(
        tmp_path,
        honest,
        capsys,
        {
            "hours": 720,
            "max_steps": 10**8,
            "step_s": 0.0001,
            "decided_at_step": 1,
            "decided_at": 1.0,
        },
    )


def attack_probe_json(tmp_path, honest, capsys):
    """A probe.json with this machine's key but another's values: never read, never enters the machine-wide
    cache; one that is no probe result is refused in one line naming the file."""
    from tinygpt.core.config import DataConfig, ModelConfig, TrainConfig
    from tinygpt.core.recipes import Recipe
    from tinygpt.fit.probe import probe
    from tinygpt.fit.probe_cache import ProbeResult

    model = ModelConfig(vocab_size=260, n_layer=1, n_head=2, d_model=32, d_ff=64, max_seq_len=64)
    recipe = Recipe(
        "tiny-test",
        "",
        "cpu",
        model,
        TrainConfig(micro_batch_size=8, seq_len=32, grad_accum_steps=8, precision="fp32"),
        DataConfig(vocab_size=257),
    )
    calls = []

    def measure(b, t, c):
        calls.append(b)
        return 0.05 * b

    kw = dict(
        measure=measure, memory_limit_gb=1.0, margin=0.0, speed=None, run_dir=tmp_path / "shared"
    )
    genuine = probe(recipe, "cpu", cache_dir=tmp_path / "first", **kw)
    forged = tmp_path / "shared" / "probe.json"
    edit(forged, lambda d: d.update(micro_batch_size=1, seq_len=8, grad_accum_steps=4096))
    n = len(calls)
    mine = probe(recipe, "cpu", cache_dir=tmp_path / "machine", **kw)
    assert (
        len(calls) > n and not mine.from_cache and mine.micro_batch_size == genuine.micro_batch_size
    )
    cached = [json.loads(p.read_text()) for p in (tmp_path / "machine").glob("*.json")]
    assert [c["micro_batch_size"] for c in cached] == [genuine.micro_batch_size]
    bad = {**genuine.to_dict(), "precision": "fp8"}
    with pytest.raises(
        ValueError, match=f"^{re.escape(str(forged))} is not a probe result tinygpt wrote"
    ):
        ProbeResult.from_dict(bad, str(forged))


def attack_finetune_json(tmp_path, honest, capsys):
    """finetune.json that no checkpoint was trained with and this user did not sign: its hardware class and
    plan decide nothing (decided here); the same file signed here does."""
    from tinygpt.finetune.run_finetune import kept_decisions
    from tinygpt.train.decisions import FINETUNE_DOMAIN, sign

    run = tmp_path / "ft"
    run.mkdir()
    forged = {
        "recipe": {"name": "lora-r16"},
        "base": "b",
        "data": "d",
        "hardware": "h100",
        "plan": {"pack": True},
    }
    assert kept_decisions(run, forged) is None
    assert kept_decisions(run, sign(forged, FINETUNE_DOMAIN))["hardware"] == "h100"


def attack_identity(tmp_path, honest, capsys):
    mirror, data, _ = honest
    (mirror / "identity.json").write_text(json.dumps({"run_id": "attacker01", "config": "0" * 16}))
    err = refused(
        capsys,
        pretrain(tmp_path / "vm2", mirror, data, "--max-steps", "2"),
        mirror,
        "identity.json",
    )
    assert "use another --mirror folder" in err.lower()


ATTACKS = {
    ("run.json", "recipe"): attack_recipe,
    ("run.json", "plan"): attack_plan,
    ("run.json", "probe"): attack_probe,
    ("run.json", "signature"): attack_signature,
    ("budget.json", "max_steps"): attack_max_steps,
    ("budget.json", "step_s"): attack_step_s,
    ("probe.json", "*"): attack_probe_json,
    ("finetune.json", "*"): attack_finetune_json,
    ("identity.json", "*"): attack_identity,
}


def test_every_decision_row_is_attacked():
    decisions = {k for k, kind in table().items() if kind == "decision"}
    assert decisions == set(ATTACKS)


def test_every_file_name_tinygpt_defines_has_a_row():
    files = {f for f, _ in table()}
    missing = defined_file_names() - files - not_run_files()
    assert not missing, f"files with no row in docs/TRUST.md: {sorted(missing)}"
    assert {"run.json", "budget.json", "probe.json", "identity.json"} <= defined_file_names()


def test_every_field_a_run_writes_has_a_row(honest):
    from tinygpt.train.budget import Budget

    mirror, _, first = honest
    rows = table()
    written = set(first) | {"plan"}  # plan: written under --size auto
    assert {f for f, _ in rows if f == "run.json"} and written == {
        k for f, k in rows if f == "run.json"
    }
    assert {f.name for f in dataclasses.fields(Budget)} == {
        k for f, k in rows if f == "budget.json"
    }


@pytest.mark.parametrize("row", list(ATTACKS), ids=[f"{f}:{k}" for f, k in ATTACKS])
def test_a_hostile_decision_changes_nothing_or_is_refused(
    row, tmp_path, honest, capsys, monkeypatch
):
    attack = ATTACKS[row]
    if "monkeypatch" in attack.__code__.co_varnames[: attack.__code__.co_argcount]:
        attack(tmp_path, honest, capsys, monkeypatch)
    else:
        attack(tmp_path, honest, capsys)
