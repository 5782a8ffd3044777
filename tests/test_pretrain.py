"""pretrain(): the probe's decisions on a GPU, kept when resuming; TensorBoard logging."""

import json
import re

import pytest
import torch

from tinygpt.core.config import ConfigError
from tinygpt.core.recipes import get_recipe
from tinygpt.fit.probe import fit_to_device
from tinygpt.pretrain.run_pretrain import pretrain
from tinygpt.train.decisions import sign


def test_probe_decides_on_a_gpu_and_the_run_keeps_its_decisions(tmp_path, monkeypatch):
    import tinygpt.fit.probe as probe_mod

    calls = []

    class FakeResult:  # the probe itself is tested in test_probe.py; here only how pretrain uses it
        micro_batch_size, grad_accum_steps, seq_len, precision, activation_checkpointing = (
            8,
            64,
            1024,
            "bf16",
            True,
        )
        loss = "full"

        def to_dict(self):
            return {"micro_batch_size": 8}

    monkeypatch.setattr(
        probe_mod,
        "probe",  # the result is kept in the run folder (probe.json)
        lambda recipe, device=None, run_dir=None: (
            calls.append(recipe.name) or FakeResult() if run_dir == tmp_path else None
        ),
    )
    recipe = get_recipe("a100-124m")
    fitted, info = fit_to_device(recipe, tmp_path, torch.device("cuda"))
    assert calls == ["a100-124m"] and info == {"micro_batch_size": 8}
    assert (fitted.train.micro_batch_size, fitted.train.grad_accum_steps) == (8, 64)
    assert (
        fitted.train.tokens_per_step == recipe.train.tokens_per_step
        and fitted.model.activation_checkpointing
    )
    assert fitted.train.loss == "full"
    # the CPU keeps the recipe as written
    assert fit_to_device(recipe, tmp_path, torch.device("cpu")) == (recipe, None)
    # a resumed run keeps the decisions recorded in its own (signed) run.json, whatever GPU it lands on now
    (tmp_path / "run.json").write_text(
        json.dumps(sign({"recipe": fitted.to_dict(), "probe": info}))
    )
    again, info2 = fit_to_device(recipe, tmp_path, torch.device("cuda"))
    assert calls == ["a100-124m"] and again.to_dict() == fitted.to_dict() and info2 == info
    # a run.json this user did not sign (a shared mirror's) decides nothing: this machine probes, and on a
    # CPU the recipe stands as written, whatever its "probe" says
    forged = fitted.replace(
        train={"micro_batch_size": 1, "grad_accum_steps": 64 * 8, "seq_len": 8}
    ).to_dict()
    (tmp_path / "run.json").write_text(
        json.dumps({"recipe": forged, "probe": {"device_name": "NVIDIA H100"}})
    )
    again, _ = fit_to_device(recipe, tmp_path, torch.device("cuda"))
    assert calls == ["a100-124m"] * 2 and again.to_dict() == fitted.to_dict()
    assert fit_to_device(recipe, tmp_path, torch.device("cpu")) == (recipe, None)


def test_a_probed_run_resumes_on_a_new_vm_from_the_mirror_with_its_own_choices(
    tmp_path, shared_data, monkeypatch
):
    """On a new VM the run folder is empty until the mirror is restored: the restore must come before the
    probe, or the run is probed again (a minute on a GPU), may choose otherwise, and is refused as another
    configuration. The first VM's probe is played by its recorded result: micro-batch 4 with 2 accumulation
    steps where the recipe says 8 and 1, as a probe on a smaller GPU would."""
    import tinygpt.fit.probe as probe_mod
    import tinygpt.pretrain.run_pretrain as pretrain_mod

    real_fit = pretrain_mod.fit_to_device
    probed = {"micro_batch_size": 4, "grad_accum_steps": 2, "device_name": "NVIDIA T4"}
    monkeypatch.setattr(
        pretrain_mod,
        "fit_to_device",
        lambda recipe, *a: (
            recipe.replace(train={"micro_batch_size": 4, "grad_accum_steps": 2}),
            probed,
        ),
    )
    kw = dict(
        data=str(shared_data / "tinyshakespeare.txt"),
        save_every=2,
        eval_every=2,
        progress=False,
        device="cpu",
        mirror=tmp_path / "drive" / "run",
        cache_dir=tmp_path / "cache",
    )
    first = pretrain("cpu-smoke", tmp_path / "vm1" / "run", max_steps=4, **kw)
    assert first.step == 4
    monkeypatch.setattr(
        pretrain_mod, "fit_to_device", real_fit
    )  # the new VM reads what the first one chose
    calls = []
    monkeypatch.setattr(probe_mod, "probe", lambda *a, **k: calls.append(a))
    again = pretrain("cpu-smoke", tmp_path / "vm2" / "run", max_steps=6, **kw)
    assert (again.resumed_from, again.step, calls) == (4, 6, [])
    info = json.loads((tmp_path / "vm2" / "run" / "run.json").read_text())
    assert info["probe"] == probed and (
        info["recipe"]["train"]["micro_batch_size"],
        info["recipe"]["train"]["grad_accum_steps"],
    ) == (4, 2)


def test_metrics_reach_tensorboard(tmp_path, shared_data):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pretrain(
        "cpu-smoke",
        tmp_path / "run",
        data=str(shared_data / "tinyshakespeare.txt"),
        max_steps=10,
        progress=False,
        cache_dir=tmp_path / "cache",
        device="cpu",
    )
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train/loss")]
    logged = [
        m["loss"]
        for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "loss" in m
    ]
    assert losses == pytest.approx(logged, rel=1e-6) and "val/loss" in acc.Tags()["scalars"]


def test_samples_come_every_sample_every_steps_and_once_at_the_end(tmp_path, shared_data):
    """train.sample_every=4 over 10 steps: steps 4 and 8 on the way, 10 at the end (nothing twice); a resume
    to 12 adds only its own end; under FSDP, where rank 0 holds a shard, the option is refused before any work."""
    from tinygpt.pretrain.pretrain_options import PretrainOptions
    from tinygpt.pretrain.run_pretrain import check_recipe
    from tinygpt.train.distributed import Ranks

    recipe = get_recipe("cpu-smoke").replace(train={"sample_every": 4})
    kw = dict(
        data=str(shared_data / "tinyshakespeare.txt"),
        save_every=5,
        eval_every=5,
        progress=False,
        device="cpu",
        cache_dir=tmp_path / "cache",
    )
    pretrain(recipe, tmp_path / "run", max_steps=10, **kw)
    samples = tmp_path / "run" / "samples.txt"
    assert re.findall(r"=== step (\d+) ===", samples.read_text()) == ["4", "8", "10"]
    pretrain(recipe, tmp_path / "run", max_steps=12, **kw)
    assert re.findall(r"=== step (\d+) ===", samples.read_text()) == ["4", "8", "10", "12"]
    with pytest.raises(ConfigError, match="train.sample_every=0"):
        check_recipe(
            recipe,
            PretrainOptions(run_dir=tmp_path / "fsdp", parallel="fsdp"),
            torch.device("cpu"),
            Ranks(0, 2, "fsdp"),
        )
    assert not (tmp_path / "fsdp").exists()


def test_samples_txt_is_cut_back_to_the_checkpoint_a_run_resumes_from(tmp_path, shared_data):
    """As metrics.jsonl: a run killed after its step-6 sample but before its step-8 checkpoint resumes from
    step 4, and writes the samples of steps 6 and 8 again, once each, the same text as the unbroken run's."""
    import shutil

    recipe = get_recipe("cpu-smoke").replace(train={"sample_every": 3})
    kw = dict(
        data=str(shared_data / "tinyshakespeare.txt"),
        save_every=4,
        eval_every=4,
        progress=False,
        device="cpu",
        cache_dir=tmp_path / "cache",
        max_steps=8,
    )
    pretrain(recipe, tmp_path / "run", **kw)
    samples = tmp_path / "run" / "samples.txt"
    unbroken = samples.read_text()
    assert re.findall(r"=== step (\d+) ===", unbroken) == ["3", "6", "8"]
    shutil.rmtree(
        tmp_path / "run" / "checkpoints" / "step_000008"
    )  # the kill came before this checkpoint
    assert pretrain(recipe, tmp_path / "run", **kw).resumed_from == 4
    assert samples.read_text() == unbroken


def test_a_run_resumes_with_its_data_file_spelled_otherwise_and_another_file_is_refused(
    tmp_path, monkeypatch
):
    """`--data /abs/text.txt` at the start, `--data text.txt` (the same file, relative) at the resume: the same
    run, which keeps its own spelling in run.json; the same name in another folder is another file, refused."""
    import inspect as some_module
    import shutil

    text = tmp_path / "data" / "text.txt"
    text.parent.mkdir()
    shutil.copy(
        some_module.__file__, text
    )  # real text every machine has: a standard library module
    kw = dict(
        save_every=3, eval_every=3, progress=False, device="cpu", cache_dir=tmp_path / "cache"
    )
    run = tmp_path / "run"
    pretrain("cpu-smoke", run, data=str(text), max_steps=3, **kw)
    monkeypatch.chdir(text.parent)
    resumed = pretrain("cpu-smoke", run, data="text.txt", max_steps=6, **kw)
    assert resumed.resumed_from == 3 and resumed.step == 6
    assert json.loads((run / "run.json").read_text())["recipe"]["data"]["source"] == str(text)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(text, other / "text.txt")
    monkeypatch.chdir(other)
    with pytest.raises(ConfigError, match=r"data.source: .* in the run, 'text.txt' now"):
        pretrain("cpu-smoke", run, data="text.txt", max_steps=9, **kw)
