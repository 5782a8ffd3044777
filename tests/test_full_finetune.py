"""Full finetuning (`--recipe full`) of a tiny Hugging Face Llama on real instruction data, set against a plain
transformers + torch.optim.AdamW loop on the same records in the same order with the same settings; its result is a
whole model folder that transformers loads, and a kill -9 resumes it bit for bit."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tinygpt.colab.runs import run_status  # noqa: E402
from tinygpt.colab.tables import finetune_recipe_rows  # noqa: E402
from tinygpt.finetune.instruct import build_instruct_data  # noqa: E402
from tinygpt.finetune.lora import load_base, load_finetuned  # noqa: E402
from tinygpt.finetune.memory_plan import memory_table  # noqa: E402
from tinygpt.finetune.presets import get_finetune_recipe  # noqa: E402
from tinygpt.finetune.run_finetune import finetune  # noqa: E402
from tinygpt.model import hf  # noqa: E402
from tinygpt.model.generate import compare_generations, generate_response  # noqa: E402
from tinygpt.model.tokenizer import train_bpe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAIN = dict(
    seq_len=128,
    micro_batch_size=2,
    grad_accum_steps=2,
    max_steps=5,
    warmup_steps=2,
    lr=1e-3,
    min_lr=1e-4,
    eval_every=0,
    save_every=0,
    eval_batches=1,
    log_every=1,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory, shared_data) -> Path:
    records = json.loads((shared_data / "code_alpaca_2k.json").read_text(encoding="utf-8"))
    tok = train_bpe([r["instruction"] + "\n" + r["output"] for r in records], 512)
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tok.eot_id,
        eos_token_id=tok.eot_id,
    )
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("base") / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    hf.hf_tokenizer(tok).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def full(tmp_path_factory, base, shared_data):
    return finetune(
        "full",
        str(base),
        str(shared_data / "code_alpaca_2k.json"),
        tmp_path_factory.mktemp("full") / "ft",
        hardware="cpu",
        train=TRAIN,
        progress=False,
    )


def _lr(step: int) -> float:
    """Linear warmup, then cosine to min_lr at the last step: the trainer's schedule, written out."""
    lr, min_lr, warmup, steps = (
        TRAIN["lr"],
        TRAIN["min_lr"],
        TRAIN["warmup_steps"],
        TRAIN["max_steps"],
    )
    if step < warmup:
        return lr * (step + 1) / warmup
    return min_lr + 0.5 * (lr - min_lr) * (
        1 + math.cos(math.pi * (step - warmup) / (steps - 1 - warmup))
    )


def test_full_finetuning_equals_a_plain_transformers_loop(full, base, shared_data):
    assert (
        full.plan.pack and full.trainable_params == full.total_params
    )  # every weight trains, records packed
    cfg = get_finetune_recipe("full").train_config("cpu", **TRAIN)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    data = build_instruct_data(
        str(shared_data / "code_alpaca_2k.json"),
        tok,
        cfg.seq_len,
        pack=True,
        seed=cfg.seed,
        val_batch_size=cfg.micro_batch_size,
        eval_batches=cfg.eval_batches,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=1e-8,
        weight_decay=cfg.weight_decay,
    )
    assert cfg.weight_decay == 0.0 and cfg.grad_clip == 1.0
    losses = []
    for step in range(cfg.max_steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step)
        batches = [data.train.next_batch(cfg.micro_batch_size) for _ in range(cfg.grad_accum_steps)]
        n = sum(
            int((y != -100).sum()) for _, y, _ in batches
        )  # the step's loss is per target token of the step
        total = 0.0
        for x, y, pos in batches:
            logits = model(input_ids=x, position_ids=pos).logits
            loss = (
                F.cross_entropy(
                    logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"
                )
                / n
            )
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    logged = [m["loss"] for m in full.train.metrics if "loss" in m]
    assert len(logged) == 5 and losses[-1] < losses[0]
    assert logged == pytest.approx(losses, abs=1e-4)
    # the result is a whole model folder holding the same weights as the plain loop's
    finetuned = transformers.AutoModelForCausalLM.from_pretrained(full.model_dir).eval()
    ours, theirs = finetuned.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 1e-4
    assert full.adapter_dir is None and not (full.run_dir / "adapter_config.json").exists()


def test_result_loads_exports_and_answers_before_and_after(full, tmp_path):
    from tinygpt.cli import main

    model, tok = load_finetuned(full.run_dir)
    assert main(["export", str(full.run_dir), str(tmp_path / "out")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.tensor([tok("def add(a, b):")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=x).logits, model(input_ids=x).logits, atol=1e-5, rtol=0
        )
    assert f"model here: {full.model_dir}" in str(run_status(full.run_dir))
    rows = compare_generations(
        full.model, full.tokenizer, ["Reverse a list."], max_new_tokens=8, base=full.base_path
    ).rows
    # "before" is the base's own answer (loaded beside: a full finetune has no adapter to switch off), "after"
    # the finetuned model's; which greedy tokens a model this small prefers is chance, so the two models are
    # told apart by their logits on the prompt, not by their text
    base_model = load_base(full.base_path).eval()
    assert rows == [
        (
            "Reverse a list.",
            generate_response(base_model, full.tokenizer, "Reverse a list.", max_new_tokens=8),
            generate_response(full.model, full.tokenizer, "Reverse a list.", max_new_tokens=8),
        )
    ]
    with torch.no_grad():
        assert not torch.allclose(
            base_model(input_ids=x).logits, full.model(input_ids=x).logits, atol=1e-3
        )


def test_memory_table_counts_weights_gradients_and_adamw_for_every_weight(base):
    config = json.loads((base / "config.json").read_text())
    params = 512 * 64 + 2 * (
        64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 160
    )  # tied embedding + each layer's linears
    table = {r["part"]: r["gb"] for r in memory_table("full", "t4", config)}
    assert table["base weights"] == pytest.approx(params * 4 / 1e9, abs=1e-3)  # fp32 master weights
    assert (
        table["gradients + AdamW"] == pytest.approx(params * 12 / 1e9, abs=1e-3)
        and table["adapters"] == 0
    )
    smol = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }
    weights = {r["part"]: r["gb"] for r in memory_table("full", "t4", smol)}
    assert (
        0.5 < weights["base weights"] < 0.6 and 1.5 < weights["gradients + AdamW"] < 1.7
    )  # SmolLM2-135M: 16 B/param
    rows = {r[0]: r for r in finetune_recipe_rows(smol, "t4", 15.0)}
    assert rows["full"][2] == "yes" and float(rows["full"][1].split()[0]) > float(
        rows["lora-r16"][1].split()[0]
    )


KILLER = textwrap.dedent(f"""
    import os, signal, sys
    from tinygpt.core.callback import Callback
    from tinygpt.finetune.run_finetune import finetune
    class Killer(Callback):
        def on_log(self, m):
            if m.get("step") == 5:
                os.kill(os.getpid(), signal.SIGKILL)  # after step 5, before its checkpoint
    finetune("full", sys.argv[1], sys.argv[2], sys.argv[3], hardware="cpu", progress=False, callbacks=[Killer()],
             train={{**{TRAIN!r}, "max_steps": 8, "save_every": 2, "eval_every": 4}})
""")


@pytest.mark.slow  # a real process killed
def test_kill_9_and_resume_gives_the_same_model_bit_for_bit(base, shared_data, tmp_path):
    from safetensors.torch import load_file

    data = str(shared_data / "code_alpaca_2k.json")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(base), data, str(tmp_path / "broken")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    train = {**TRAIN, "max_steps": 8, "save_every": 2, "eval_every": 4}
    resumed = finetune(
        "full", str(base), data, tmp_path / "broken", hardware="cpu", train=train, progress=False
    )
    assert resumed.train.resumed_from == 4 and resumed.train.step == 8
    finetune(
        "full", str(base), data, tmp_path / "whole", hardware="cpu", train=train, progress=False
    )
    a = load_file(str(tmp_path / "broken" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "whole" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def log(d):
        return [
            {k: v for k, v in json.loads(line).items() if k != "tokens_per_s"}
            for line in (d / "metrics.jsonl").read_text().splitlines()
        ]

    assert log(tmp_path / "broken") == log(tmp_path / "whole")


def test_a_full_finetunes_closing_lines_export_a_finetuned_model_not_a_merge(
    base, shared_data, tmp_path, capsys
):
    from tinygpt.cli import main

    run = tmp_path / "ft"
    assert (
        main(
            [
                "finetune",
                str(run),
                "--recipe",
                "full",
                "--base",
                str(base),
                "--data",
                str(shared_data / "code_alpaca_2k.json"),
                "--max-steps",
                "1",
                "--hardware",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"model (transformers format): {run / 'model'}" in out
    assert (
        f"tinygpt export {run} hf-model/" in out
        and "# the finetuned model, as a Hugging Face folder" in out
    )
    assert "adapter" not in out  # a full finetune has none to merge
