"""Continued pretraining (`tinygpt pretrain --init`) from a Hugging Face model made here with `transformers`:
a tiny SmolLM2-shaped `LlamaForCausalLM` (grouped-query attention, tied embeddings, RoPE theta 100000) saved with
`save_pretrained` beside its tokenizer.json, as a Hub model is. The Hub path runs through `huggingface_hub`
itself, offline, on the same files laid out as its cache holds a download."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import export_run

from tinygpt.core import checkpoint as ckpt
from tinygpt.core.config import ConfigError
from tinygpt.data.sampler import WindowSampler
from tinygpt.data.shards import StreamedShards
from tinygpt.model import hf, hf_import
from tinygpt.model.loading import load_run
from tinygpt.model.tokenizer import Tokenizer, train_bpe
from tinygpt.pretrain.init import (
    CONTINUE_MAX_LR,
    continued_recipe,
    initial_model,
    read_base,
    starting_base,
)
from tinygpt.pretrain.run_pretrain import pretrain

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]
TRAIN = dict(
    max_steps=8,
    micro_batch_size=4,
    seq_len=64,
    log_every=1,
    save_every=4,
    eval_every=4,
    eval_batches=2,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory, shakespeare) -> Path:
    """A SmolLM2-shaped base: 4 query heads sharing 2 key/value heads, tied embeddings, end-of-text id 0."""
    tok = train_bpe([shakespeare[:200_000]], 512)
    assert tok.eot_id == 0  # as in SmolLM2
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # far from init, so that a wrong mapping of any weight shows in the loss
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path_factory.mktemp("base") / "smollm2-tiny"
    model.save_pretrained(out)
    hf.hf_tokenizer(tok).save_pretrained(out)
    return out


def _hf_loss(model, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return float(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()))


def _first_batches(
    run: Path, cache: Path, recipe, n: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first n training micro-batches of a run: its token cache read by a sampler with the run's seed."""
    key = json.loads((run / "run.json").read_text())["data"]["cache"]
    t = recipe.train
    sampler = WindowSampler(StreamedShards(cache / key), t.seq_len, t.seed)
    return [sampler.next_batch(t.micro_batch_size) for _ in range(n)]


@pytest.fixture(scope="module")
def continued(tmp_path_factory, base, shared_data):
    tmp = tmp_path_factory.mktemp("continued")
    recipe = continued_recipe("cpu-smoke", str(base)).replace(
        train=TRAIN, data={"source": str(shared_data / "tinyshakespeare.txt")}
    )
    res = pretrain(
        recipe, tmp / "run", cache_dir=tmp / "cache", progress=False, probe="off", device="cpu"
    )
    return recipe, res, tmp


def test_recipe_is_sized_for_the_base(base):
    recipe = continued_recipe("cpu-smoke", str(base))
    m = recipe.model
    assert (m.n_layer, m.n_head, m.n_kv_head, m.d_model, m.d_ff) == (2, 4, 2, 64, 160)
    assert (
        m.tie_embeddings
        and m.rope_theta == 100000.0
        and m.max_seq_len == 256
        and m.init == str(base.resolve())
    )
    assert recipe.data.tokenizer == "init" and recipe.data.vocab_size == 512
    t = recipe.train
    assert (
        t.lr == CONTINUE_MAX_LR < 3e-3
        and t.min_lr == pytest.approx(t.lr / 10)
        and t.warmup_steps >= 5
    )
    assert (
        t.seq_len == 64 and t.tokens_per_step == 512
    )  # cpu-smoke's context (the base's is longer) and batch
    assert (
        continued_recipe("a100-124m", str(base)).train.seq_len == 256
    )  # a GPU recipe: the base's own context


def test_first_loss_equals_transformers_and_training_lowers_it(continued, base):
    recipe, res, tmp = continued
    run = tmp / "run"
    log = [
        m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m
    ]
    assert [m["step"] for m in log] == list(range(1, 9))
    batches = _first_batches(
        run, tmp / "cache", recipe, 8 * recipe.train.grad_accum_steps
    )  # all it trained on
    x, y = batches[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    assert log[0]["loss"] == pytest.approx(
        _hf_loss(reference, x, y), abs=1e-4
    )  # step 1: the base's own loss
    assert res.step == 8
    # the run's tokenizer is the base's, and the export loads back into transformers with the run's logits
    assert Tokenizer.load(run).to_json() == Tokenizer.load(base).to_json()
    out = export_run(run, tmp / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.num_key_value_heads == 2 and exported.config.tie_word_embeddings
    model = load_run(run)[0]
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=x).logits, model(x), atol=1e-4, rtol=0)
    # training lowered the loss: on the batches it trained on, the trained model against the base, batch by batch
    # (eight steps' logged losses are each on another batch: their noise is larger than eight steps' gain)
    before, after = ([_hf_loss(m, bx, by) for bx, by in batches] for m in (reference, exported))
    assert sum(after) / len(after) < sum(before) / len(before) - 0.02


def test_another_run_as_the_base_starts_from_its_last_checkpoint(continued, tmp_path):
    _, res, tmp = continued
    recipe = continued_recipe("cpu-smoke", str(tmp / "run"))
    assert recipe.model.init == str((tmp / "run").resolve()) and recipe.model.n_kv_head == 2
    model = initial_model(recipe.model, starting_base(recipe, tmp_path / "new"))
    a, b = ckpt.model_state(model), ckpt.load_checkpoint(res.checkpoint)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _refused(tmp_path, config: dict) -> str:
    folder = tmp_path / "other"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        read_base(str(folder))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bases_the_gpt_cannot_represent_are_refused_naming_what_differs(base, tmp_path):
    llama = json.loads((base / "config.json").read_text())
    assert "model_type 'qwen2' (biases on q/k/v)" in _refused(
        tmp_path, {**llama, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    )
    assert "mlp_bias=true" in _refused(tmp_path, {**llama, "mlp_bias": True})
    assert (
        hf_import.representation_gaps({**llama, "attention_bias": True}) == []
    )  # ModelConfig.attention_bias
    assert "RoPE scaling 'llama3'" in _refused(
        tmp_path, {**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    )
    assert "hidden_act 'gelu'" in _refused(tmp_path, {**llama, "hidden_act": "gelu"})
    # Qwen3-0.6B's shape: 16 heads of 128 on a hidden size of 1024
    gap = _refused(
        tmp_path,
        {
            **llama,
            "model_type": "qwen3",
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "head_dim": 128,
        },
    )
    assert "head_dim 128 x 16 heads = 2048, not hidden_size 1024" in gap
    assert "no tokenizer.json" in _refused(tmp_path, llama)


# ----- the Hub path, the command line, kill -9 and resume ------------------------------------------
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(base: Path, root: Path) -> Path:
    """`base` laid out as huggingface_hub's cache holds a download of the Hub model test-org/smollm2-tiny."""
    repo = root / "models--test-org--smollm2-tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(base, repo / "snapshots" / COMMIT)
    return root


def _cli(run: Path, data: Path, tmp: Path, *extra: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TINYGPT_CACHE": str(tmp / "cache"),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_CACHE": str(tmp / "hub"),
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "tinygpt",
        "pretrain",
        "--recipe",
        "cpu-smoke",
        "--run-dir",
        str(run),
        "--data",
        str(data),
        "--max-steps",
        "12",
        "--save-every",
        "4",
        "--device",
        "cpu",
        "--quiet",
        "--probe",
        "off",
        "--set",
        "train.micro_batch_size=4",
        "train.log_every=1",
        *extra,
    ]
    return subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _log(run: Path) -> list[tuple]:
    return [
        (m["step"], m.get("loss"), m.get("val_loss"))
        for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "startup" not in m
    ]


def _last_logged_step(run: Path) -> int:
    """The step of the last whole line of metrics.jsonl while the run writes it (a line may be half
    written when it is read, or the file not made yet): 0 before the first."""
    path = run / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    whole = text[: text.rfind("\n") + 1].splitlines()
    return max((m["step"] for m in map(json.loads, whole) if "startup" not in m), default=0)


@pytest.mark.slow  # a real process killed
def test_hub_base_resumes_bit_exact_after_kill_9_without_reading_the_base_again(
    base, shared_data, tmp_path
):
    _hub_cache(base, tmp_path / "hub")
    data = shared_data / "tinyshakespeare.txt"
    ref = _cli(tmp_path / "ref", data, tmp_path, "--init", "hf:test-org/smollm2-tiny")
    out = ref.communicate(timeout=300)[0].decode()
    assert ref.returncode == 0, out
    assert "base hf:test-org/smollm2-tiny: its weights and tokenizer" in out
    assert (
        json.loads((tmp_path / "ref" / "run.json").read_text())["recipe"]["model"]["init"]
        == "hf:test-org/smollm2-tiny"
    )

    run = tmp_path / "run"
    p = _cli(run, data, tmp_path, "--init", "hf:test-org/smollm2-tiny")
    t0 = time.time()
    while (
        not any(s >= 8 for s, _ in ckpt.list_checkpoints(run / "checkpoints"))
        or _last_logged_step(run) < 9
    ):
        assert p.poll() is None and time.time() - t0 < 300, p.stdout.read().decode()
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait(60)
    assert max(s for s, _ in ckpt.list_checkpoints(run / "checkpoints")) < 12
    shutil.rmtree(tmp_path / "hub")  # the base is gone: a resume must not need it
    p = _cli(run, data, tmp_path)  # the plain command: the run folder knows its base
    out = p.communicate(timeout=300)[0].decode()
    assert p.returncode == 0, out
    assert "resumed from step" in out
    assert _log(run) == _log(tmp_path / "ref")
    a = ckpt.load_checkpoint(tmp_path / "ref" / "checkpoints" / "step_000012")[0]
    b = ckpt.load_checkpoint(run / "checkpoints" / "step_000012")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_refuses_a_base_it_cannot_represent_before_any_work(
    base, shared_data, tmp_path, monkeypatch, capsys
):
    import huggingface_hub

    from tinygpt.cli import main

    monkeypatch.setattr(
        huggingface_hub.constants, "HF_HUB_OFFLINE", True
    )  # the Hub path, with no network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path / "cache"))
    qwen2 = tmp_path / "qwen2"
    shutil.copytree(base, qwen2)
    cfg = json.loads((qwen2 / "config.json").read_text())
    (qwen2 / "config.json").write_text(
        json.dumps({**cfg, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    )
    args = [
        "pretrain",
        "--recipe",
        "cpu-smoke",
        "--run-dir",
        str(tmp_path / "run"),
        "--data",
        str(shared_data / "tinyshakespeare.txt"),
        "--device",
        "cpu",
        "--quiet",
        "--init",
    ]
    for init, says in [
        (str(qwen2), "cannot represent this model: model_type 'qwen2' (biases on q/k/v)"),
        (
            "hf:test-org/not-there",
            "could not get model 'test-org/not-there' from the Hugging Face Hub",
        ),
    ]:
        assert main(args + [init]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_notebook_base_picker_defaults_to_the_runs_own_base(continued, tmp_path):
    from tinygpt import colab

    _, _, tmp = continued
    fresh = colab.base_picker(resume_from=tmp_path / "new")
    assert fresh.value is None and "hf:HuggingFaceTB/SmolLM2-135M" in [
        v for _, v in fresh.dropdown.options
    ]
    resumed = colab.base_picker(resume_from=tmp / "run")
    init = json.loads((tmp / "run" / "run.json").read_text())["recipe"]["model"]["init"]
    assert resumed.value == init and (init, init) in resumed.dropdown.options
    # what the training cell trains: the run's own recipe, read from run.json (the base is not read again)
    assert (
        colab.pretrain_recipe("cpu-smoke", resumed.value, tmp / "run").to_dict()
        == json.loads((tmp / "run" / "run.json").read_text())["recipe"]
    )


def test_a_qwen3_base_continues_with_its_qk_norm(base, shared_data, tmp_path):
    """The Qwen family's member the GPT represents: Llama's layers plus an RMSNorm on each head's queries and keys."""
    cfg = transformers.Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(1)
    qwen3 = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in qwen3.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    qwen3.save_pretrained(tmp_path / "qwen3")
    shutil.copy(base / "tokenizer.json", tmp_path / "qwen3")
    recipe = continued_recipe("cpu-smoke", str(tmp_path / "qwen3")).replace(
        train={**TRAIN, "max_steps": 2, "eval_every": 0, "save_every": 0},
        data={"source": str(shared_data / "tinyshakespeare.txt")},
    )
    assert recipe.model.qk_norm and recipe.model.family.model_type == "qwen3"
    res = pretrain(
        recipe,
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
        probe="off",
        device="cpu",
    )
    x, y = _first_batches(tmp_path / "run", tmp_path / "cache", recipe)[0]
    assert res.metrics[0]["step"] == 1
    assert res.metrics[0]["loss"] == pytest.approx(_hf_loss(qwen3.eval(), x, y), abs=1e-4)


def test_a_base_that_does_not_match_the_recipe_is_refused_before_any_work(
    base, shared_data, tmp_path
):
    """The base is read once, in the plan (before the tokenizer, the token cache and run.json): a recipe whose
    network is not the base's, or that takes the base's tokenizer without naming a base, fails there in one
    line and leaves no run folder behind."""
    recipe = continued_recipe("cpu-smoke", str(base)).replace(
        data={"source": str(shared_data / "tinyshakespeare.txt")}
    )
    kw = dict(cache_dir=tmp_path / "cache", progress=False, device="cpu", max_steps=2)
    with pytest.raises(
        ConfigError, match=r"another network than the recipe's model .*n_layer"
    ) as e:
        pretrain(recipe.replace(model={"n_layer": 3}), tmp_path / "run", **kw)
    assert "\n" not in str(e.value)
    with pytest.raises(
        ConfigError, match="data.tokenizer=init takes the tokenizer of the base, but model.init"
    ):
        pretrain(recipe.replace(model={"init": None}), tmp_path / "run", **kw)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    assert starting_base(recipe, tmp_path / "run").tokenizer.vocab_size == recipe.data.vocab_size
