"""The fast recipes (issue 14): the speed-run choices they make, a real run of `cpu-fast` on real text that
resumes exactly, and its export through `transformers` (Qwen3, because of QK-norm) with the same logits.
How much faster they reach a loss is a benchmark (benchmarks/time_to_loss.py), not a test."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import export_run

from tinygpt.core import checkpoint as ckpt
from tinygpt.core.recipes import get_recipe
from tinygpt.model.loading import load_run
from tinygpt.pretrain.run_pretrain import pretrain

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("fast, baseline", [("cpu-fast", "cpu"), ("a100-124m-fast", "a100-124m")])
def test_fast_recipes_keep_the_baselines_data_and_size_with_the_speedrun_choices(fast, baseline):
    f, b = get_recipe(fast), get_recipe(baseline)
    assert f.model.qk_norm and f.model.zero_init_proj and not f.model.tie_embeddings
    assert (f.train.optimizer, f.train.schedule, f.train.min_lr) == ("muon", "wsd", 0.0)
    assert (f.model.d_model, f.model.vocab_size) == (b.model.d_model, b.model.vocab_size)
    assert f.model.n_layer <= b.model.n_layer
    assert (
        f.data.tokenizer == b.data.tokenizer and f.data.vocab_size == b.data.vocab_size
    )  # losses compare
    assert f.token_budget <= b.token_budget / 2 and f.train.seq_len == b.train.seq_len


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    recipe = get_recipe("cpu-fast").replace(
        train={
            "max_steps": 24,
            "eval_every": 12,
            "save_every": 12,
            "log_every": 4,
            "warmup_steps": 4,
        },
        data={"max_chars": 300_000},
    )
    result = pretrain(recipe, root / "run", progress=False, device="cpu", cache_dir=root / "cache")
    return recipe, result, root


def test_cpu_fast_learns_and_ends_its_schedule_at_zero(fast_run):
    recipe, result, root = fast_run
    losses = [m["loss"] for m in result.metrics if "loss" in m]
    vals = [m["val_loss"] for m in result.metrics if m.get("val_loss") is not None]
    assert len(vals) == 2 and vals[-1] < vals[0] and losses[-1] < losses[0] - 1.0
    lrs = [m["lr"] for m in result.metrics if "lr" in m]
    assert (
        max(lrs) == pytest.approx(recipe.train.lr) and lrs[-1] < 0.25 * recipe.train.lr
    )  # in its decay


def test_cpu_fast_resumes_bit_for_bit(fast_run, tmp_path):
    """The finished run with its step-24 checkpoint taken away resumes from step 12 (Muon's momentum,
    the schedule's place) and writes the same losses and weights."""
    recipe, result, root = fast_run
    shutil.copytree(root / "run", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000024")
    rest = pretrain(
        recipe, tmp_path / "run", progress=False, device="cpu", cache_dir=root / "cache"
    )
    assert (rest.resumed_from, rest.step) == (12, 24)
    whole = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    key = [(m["step"], m["loss"]) for m in whole if "loss" in m]
    assert len(key) == 6 and [(m["step"], m["loss"]) for m in again if "loss" in m] == key
    a, _, _, _ = load_run(root / "run")
    b, _, _, _ = load_run(tmp_path / "run")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.slow  # a second resume (test_cpu_fast_resumes_bit_for_bit is the fast one)
def test_a_run_begun_before_a_setting_existed_resumes(fast_run, tmp_path):
    """run.json and the checkpoint's training state written without `train.loss` and `model.fused_proj`
    (as by a version before them): the run resumes, those fields taking their defaults."""
    recipe, _, root = fast_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    shutil.rmtree(run / "checkpoints" / "step_000024")
    info = json.loads((run / "run.json").read_text())
    del info["recipe"]["train"]["loss"], info["recipe"]["model"]["fused_proj"]
    (run / "run.json").write_text(json.dumps(info))
    step = run / "checkpoints" / "step_000012"
    state = torch.load(step / ckpt.STATE_FILE, weights_only=True)
    del state["train_config"]["loss"]
    torch.save(state, step / ckpt.STATE_FILE)
    manifest = ckpt.read_manifest(step)
    ckpt.write_manifest(
        step, {k: v for k, v in manifest.items() if k not in ("files", "format", "created_at")}
    )
    rest = pretrain(recipe, run, progress=False, device="cpu", cache_dir=root / "cache")
    assert (rest.resumed_from, rest.step) == (12, 24)


def test_cpu_fast_exports_as_qwen3_with_the_same_logits(fast_run, tmp_path):
    _, _, root = fast_run
    out = export_run(root / "run", tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours, tok, _, _ = load_run(root / "run")
    x = torch.tensor([tok.encode("def parse(self, text):\n    return self.scanner.scan(text)")])
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours.eval()(x), atol=1e-4, rtol=0)
