"""LoRA / QLoRA finetuning of a tinygpt run and of a tiny Hugging Face model, on real code data.

Everything is real: the base is pretrained here with tinygpt's Trainer, adapters come from `peft`,
4-bit weights from `bitsandbytes` (which runs NF4 on the CPU), and the saved adapter is reloaded
through plain `peft.PeftModel.from_pretrained`, the way any user of the ecosystem would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tinygpt.colab.runs import run_status  # noqa: E402
from tinygpt.colab.tables import finetune_recipe_rows  # noqa: E402
from tinygpt.core.callback import Callback  # noqa: E402
from tinygpt.core.config import ConfigError, DataConfig, TrainConfig  # noqa: E402
from tinygpt.core.recipes import Recipe, model_config  # noqa: E402
from tinygpt.data.sampler import WindowSampler, fixed_batches  # noqa: E402
from tinygpt.finetune.lora import (  # noqa: E402
    attach_lora,
    export_adapter,
    export_tinygpt_base,
    linear_layer_names,
    load_base,
    load_finetuned,
    merge_adapter,
)
from tinygpt.finetune.loss import causal_lm_loss  # noqa: E402
from tinygpt.finetune.memory_plan import (  # noqa: E402
    base_config_dict,
    default_finetune_recipe,
    memory_table,
)
from tinygpt.finetune.presets import (  # noqa: E402
    FINETUNE_RECIPES,
    FinetuneError,
    LoraSettings,
    check_qlora,
    get_finetune_recipe,
)
from tinygpt.finetune.run_finetune import finetune  # noqa: E402
from tinygpt.model.generate import compare_generations, generate_response  # noqa: E402
from tinygpt.model.gpt import GPT  # noqa: E402
from tinygpt.model.tokenizer import train_bpe  # noqa: E402
from tinygpt.train.trainer import TrainData, Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Small enough for seconds on a laptop CPU, large enough that the loss visibly falls.
FAST = dict(
    seq_len=128,
    micro_batch_size=4,
    grad_accum_steps=1,
    max_steps=24,
    warmup_steps=2,
    lr=5e-3,
    min_lr=5e-4,
    eval_every=8,
    save_every=8,
    eval_batches=2,
    log_every=4,
)


def texts(records: list[dict]) -> list[str]:
    return [r["instruction"] + "\n" + r["input"] + "\n" + r["output"] for r in records]


def make_run(folder: Path, docs: list[str], tok, seed: int, steps: int) -> Path:
    """A real tinygpt run folder: a tiny GPT pretrained by the Trainer on `docs`."""
    recipe = Recipe(
        "test-tiny",
        "tiny base for finetuning tests",
        "cpu",
        model_config("tiny", vocab_size=512),
        TrainConfig(
            micro_batch_size=8,
            seq_len=64,
            max_steps=steps,
            lr=3e-3,
            min_lr=3e-4,
            warmup_steps=5,
            eval_every=0,
            save_every=0,
            log_every=steps,
            precision="fp32",
            compile="off",
            seed=seed,
        ),
        DataConfig(vocab_size=512),
    )
    ids = np.array([t for text in docs for t in tok.encode(text) + [tok.eot_id]], dtype=np.int64)
    torch.manual_seed(seed)
    model = GPT(recipe.model)
    Trainer(
        model,
        dataclasses.replace(recipe.train, device="cpu"),
        TrainData(WindowSampler(ids, 64, seed), fixed_batches(ids[-2000:], 64, 8, 1)),
        folder,
    ).fit("never")
    (folder / "run.json").write_text(json.dumps({"recipe": recipe.to_dict()}))
    tok.save(folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def alpaca(shared_data) -> list[dict]:
    return json.loads((shared_data / "code_alpaca_2k.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def prose(shakespeare) -> list[str]:
    text = shakespeare[:300_000]
    return [text[i : i + 2000] for i in range(0, len(text), 2000)]


@pytest.fixture(scope="module")
def tok(alpaca, prose):
    return train_bpe(texts(alpaca) + prose, vocab_size=512)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, prose, tok) -> Path:
    """A base that knows English prose (Shakespeare) and has never seen code: finetuning has work to do."""
    return make_run(tmp_path_factory.mktemp("tiny") / "run", prose, tok, seed=0, steps=60)


@pytest.fixture(scope="module")
def lora(tmp_path_factory, tiny_run, shared_data):
    return finetune(
        "lora-r8",
        str(tiny_run),
        str(shared_data / "code_alpaca_2k.json"),
        tmp_path_factory.mktemp("lora") / "ft",
        hardware="cpu",
        train=FAST,
        progress=False,
    )


@pytest.fixture(scope="module")
def qlora(tmp_path_factory, tiny_run, shared_data):
    return finetune(
        "qlora-r16",
        str(tiny_run),
        str(shared_data / "code_alpaca_2k.json"),
        tmp_path_factory.mktemp("qlora") / "ft",
        hardware="cpu",
        train={**FAST, "max_steps": 16},
        progress=False,
    )


def val_loss(model, batches) -> float:
    with torch.no_grad():
        total = sum(float(causal_lm_loss(model, x, y)) for x, y in batches)
    return total / sum(int((y != -100).sum()) for _, y in batches)


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


@pytest.fixture(scope="module")
def val_batches(lora):
    """The run's own validation batches (same data, tokenizer and seed as in training)."""
    from tinygpt.finetune.instruct import build_instruct_data

    cfg = get_finetune_recipe("lora-r8").train_config("cpu", **FAST)
    data = json.loads((lora.run_dir / "finetune.json").read_text())["data"]
    return build_instruct_data(
        data,
        lora.tokenizer,
        cfg.seq_len,
        seed=cfg.seed,
        val_batch_size=cfg.micro_batch_size,
        eval_batches=cfg.eval_batches,
    ).val_batches


# ----- a tinygpt base ------------------------------------------------------------------------------
def test_tinygpt_base_exports_to_llama_with_identical_logits(tiny_run, tmp_path):
    from tinygpt.model.loading import load_run

    gpt, tok, _, _ = load_run(tiny_run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        export_tinygpt_base(tiny_run, tmp_path / "base")
    )
    x = torch.tensor([tok.encode("def add(a, b):\n    return a + b")])
    assert type(hf).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(logits(hf, x), gpt(x), rtol=0, atol=1e-5)
    assert linear_layer_names(hf) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]


def test_lora_loss_falls_on_code_data(lora, val_batches):
    assert lora.train.step == 24 and lora.data.format == "alpaca" and lora.data.truncated > 0
    assert lora.trainable_params == 2 * 8 * (
        4 * (64 + 64) + 3 * (64 + 192)
    )  # r (in + out) per layer, 2 blocks
    base = load_base(
        json.loads((lora.adapter_dir / "tinygpt_finetune.json").read_text())["base_path"]
    )
    before, after = val_loss(base, val_batches), val_loss(lora.model, val_batches)
    assert after < before - 0.2, (before, after)
    assert lora.train.val_loss == pytest.approx(
        after, rel=1e-5
    )  # the trainer measured the same thing


def test_only_adapters_train_and_checkpoints_hold_only_them(lora):
    names = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert lora.trainable_params == sum(
        p.numel() for p in lora.model.parameters() if p.requires_grad
    )
    from safetensors.torch import load_file

    sd = load_file(str(lora.run_dir / "checkpoints" / "step_000024" / "model.safetensors"))
    assert (
        sd and all("lora_" in k for k in sd) and len(sd) == 2 * 7 * 2
    )  # A and B, 7 layers each, 2 blocks


def test_best_checkpoint_exports_as_an_adapter(lora, val_batches, tmp_path):
    best, _ = load_finetuned(export_adapter(lora.run_dir, "best", tmp_path / "best"))
    assert val_loss(best, val_batches) == pytest.approx(lora.train.best_val_loss, rel=1e-6)
    with pytest.raises(FinetuneError, match="not a finetuning run folder"):
        export_adapter(tmp_path)


def test_saved_adapter_reloads_through_peft_with_the_same_outputs(lora):
    from peft import PeftModel

    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in lora.adapter_dir.iterdir()
    }
    config = json.loads((lora.adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["task_type"] == "CAUSAL_LM"
    base = transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    reloaded = PeftModel.from_pretrained(base, str(lora.adapter_dir)).eval()
    x = torch.tensor([lora.tokenizer("def fib(n):")["input_ids"]])
    assert torch.equal(logits(reloaded, x), logits(lora.model, x))


def test_merged_model_matches_the_adapter_model(lora):
    out = merge_adapter(lora.run_dir)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([lora.tokenizer("Write a function that sorts a list.")["input_ids"]])
    # W + BA folded into one matrix changes only the fp32 summation order
    torch.testing.assert_close(logits(merged, x), logits(lora.model, x), rtol=0, atol=1e-4)
    text = generate_response(
        merged, lora.tokenizer, "Write a function that adds two numbers.", max_new_tokens=12
    )
    assert text == generate_response(
        lora.model, lora.tokenizer, "Write a function that adds two numbers.", max_new_tokens=12
    )


def test_before_and_after_generations_are_the_base_and_the_finetuned_model(lora):
    prompts = ["Write a function that adds two numbers.", "Reverse a string in Python."]
    gens = compare_generations(lora.model, lora.tokenizer, prompts, max_new_tokens=10)
    base = load_base(
        json.loads((lora.adapter_dir / "tinygpt_finetune.json").read_text())["base_path"]
    ).eval()
    for (prompt, before, after), expected in zip(gens.rows, prompts):
        assert prompt == expected
        assert before == generate_response(base, lora.tokenizer, prompt, max_new_tokens=10)
        assert after == generate_response(lora.model, lora.tokenizer, prompt, max_new_tokens=10)
    assert "--- before (the base) ---" in str(gens) and prompts[1] in str(gens)
    assert any(p.requires_grad for p in lora.model.parameters())  # the adapter is switched back on


def test_adapter_on_a_different_base_is_refused(lora, tmp_path, prose, tok):
    other = make_run(tmp_path / "other", prose[:20], tok, seed=1, steps=2)
    other_base = export_tinygpt_base(other, tmp_path / "other_base")
    with pytest.raises(FinetuneError, match="different base: same shapes, different weights"):
        load_finetuned(lora.run_dir, base=str(other_base))
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "narrow")
    with pytest.raises(FinetuneError, match=r"different base .*hidden_size: 64 vs 32"):
        load_finetuned(lora.run_dir, base=str(tmp_path / "narrow"))
    # a bare PEFT adapter: neither tinygpt's info file nor its manifest
    (lora.adapter_dir / "tinygpt_finetune.json").rename(tmp_path / "info.json")
    (lora.adapter_dir / "manifest.json").rename(tmp_path / "manifest.json")
    try:
        with pytest.raises(FinetuneError, match="does not fit base"):
            load_finetuned(lora.run_dir, base=str(tmp_path / "narrow"))
    finally:
        (tmp_path / "info.json").rename(lora.adapter_dir / "tinygpt_finetune.json")
        (tmp_path / "manifest.json").rename(lora.adapter_dir / "manifest.json")


def test_fp16_base_keeps_fp32_adapters_so_the_grad_scaler_works(lora):
    """As on a T4: base weights in fp16, autocast fp16, a GradScaler; fp16 adapters would make unscale_
    fail with "Attempting to unscale FP16 gradients"."""
    from tinygpt.core.precision import Precision

    base_path = json.loads((lora.adapter_dir / "tinygpt_finetune.json").read_text())["base_path"]
    pm = attach_lora(load_base(base_path, dtype=torch.float16), LoraSettings(r=4, alpha=8))
    trainable = [p for p in pm.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}
    assert {p.dtype for p in pm.parameters() if not p.requires_grad} == {torch.float16}
    fp16 = Precision("fp16", "cpu", "a T4's precision, on the CPU")
    opt, scaler = torch.optim.AdamW(trainable, lr=1e-3), fp16.grad_scaler()
    x = torch.tensor([lora.tokenizer("def f(x):\n    return x * 2")["input_ids"]])
    with fp16.autocast():
        loss = causal_lm_loss(pm, x[:, :-1], x[:, 1:])
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # fp16 adapters would raise here
    scaler.step(opt)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable)


def test_activation_checkpointing_gives_the_adapters_the_same_gradients(lora, val_batches):
    base_path = json.loads((lora.adapter_dir / "tinygpt_finetune.json").read_text())["base_path"]
    x, y = val_batches[0]
    grads = []
    for ckpt in (False, True):
        pm = attach_lora(
            load_base(base_path),
            LoraSettings(r=4, alpha=8, dropout=0.0),
            activation_checkpointing=ckpt,
            seed=1,
        )
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)  # B starts at 0: make A's gradient non-zero too
        pm.train()
        causal_lm_loss(pm, x, y).backward()
        grads.append({n: p.grad for n, p in pm.named_parameters() if p.requires_grad})
    # each decoder layer's own flag: transformers 5.0 (Colab's) has no `is_activation_checkpointing` yet
    assert all(layer.gradient_checkpointing for layer in pm.get_base_model().model.layers)
    assert all(g is not None and g.abs().sum() > 0 for g in grads[1].values())
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7)


# ----- a Hugging Face base -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, tok) -> Path:
    d = tmp_path_factory.mktemp("qwen2") / "base"
    cfg = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(d)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.tok, eos_token="<|endoftext|>"
    ).save_pretrained(d)
    return d


def test_hf_base_with_dora_and_rslora_on_mbpp(qwen2_dir, shared_data, tmp_path):
    from peft import PeftModel

    recipe = get_finetune_recipe("lora-r16")
    recipe.lora = LoraSettings(
        r=16,
        alpha=32,
        use_rslora=True,
        use_dora=True,
        target_modules=("q_proj", "v_proj", "down_proj"),
    )
    recipe.template = (
        "short"  # MBPP prompts carry their tests: the long Alpaca preamble would not fit 256 tokens
    )
    res = finetune(
        recipe,
        str(qwen2_dir),
        str(shared_data / "mbpp.jsonl"),
        tmp_path / "ft",
        hardware="cpu",
        train={**FAST, "seq_len": 256, "max_steps": 8, "eval_every": 4},
        progress=False,
    )
    ids = [
        json.loads(x)["task_id"]
        for x in (shared_data / "mbpp.jsonl").read_text().splitlines()
        if x.strip()
    ]
    assert res.data.format == "mbpp" and res.data.excluded == sum(11 <= i <= 510 for i in ids)
    losses = [m["val_loss"] for m in res.train.metrics if "val_loss" in m]
    assert losses[-1] < losses[0]
    config = json.loads((res.adapter_dir / "adapter_config.json").read_text())
    assert config["use_dora"] and config["use_rslora"]
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    reloaded = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(qwen2_dir), str(res.adapter_dir)
    ).eval()
    x = torch.tensor([res.tokenizer("assert add(1, 2) == 3")["input_ids"]])
    torch.testing.assert_close(logits(reloaded, x), logits(res.model, x), rtol=0, atol=1e-6)


def test_gemma2_base_uses_eager_attention_and_its_soft_capped_logits(tmp_path):
    """Gemma-2 (the seed scenario, here at toy size): soft-capped logits, so the loss takes the full logits."""
    cfg = transformers.Gemma2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    transformers.Gemma2ForCausalLM(cfg).save_pretrained(tmp_path / "gemma2")
    model = load_base(str(tmp_path / "gemma2"))
    assert model.config._attn_implementation == "eager" and model.config.final_logit_softcapping
    pm = attach_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0), activation_checkpointing=True)
    assert len([n for n, p in pm.named_parameters() if p.requires_grad]) == 2 * 7 * 2
    x = torch.randint(0, 300, (2, 12))
    loss = causal_lm_loss(pm, x[:, :-1], x[:, 1:])
    ref = torch.nn.functional.cross_entropy(
        pm(input_ids=x[:, :-1]).logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum"
    )
    torch.testing.assert_close(loss, ref)
    loss.backward()


def test_gemma2_soft_capped_loss_goes_chunk_by_chunk_with_the_reference_gradients(tmp_path):
    """Gemma-2's soft-capped logits, 5 rows at a time (each chunk recomputed in backward), against the
    model's own full logits; logits large enough for the cap to bend them show it is really applied."""
    cfg = transformers.Gemma2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=1.0,
    )
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(cfg).save_pretrained(tmp_path / "gemma2")
    base = load_base(str(tmp_path / "gemma2"))
    with torch.no_grad():
        base.lm_head.weight.mul_(30)  # logits up to ~10: well into tanh's bend at a cap of 1
    pm = attach_lora(base, LoraSettings(r=4, alpha=8, dropout=0.0))
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)  # B starts at 0: make A's gradient non-zero too
    x = torch.randint(0, 300, (2, 13))
    y = x[:, 1:].clone()
    y[0, :4] = -100  # prompt tokens carry no loss
    results = []
    for loss_fn in (
        lambda: torch.nn.functional.cross_entropy(
            pm(input_ids=x[:, :-1]).logits.flatten(0, 1).float(), y.flatten(), reduction="sum"
        ),
        lambda: causal_lm_loss(pm, x[:, :-1], y, chunk_rows=5),
    ):  # 24 rows: 5 chunks, the last of 4
        pm.zero_grad()
        loss = loss_fn()
        loss.backward()
        results.append(
            (
                loss.detach(),
                {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad},
            )
        )
    (ref, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-7)
    from tinygpt.model.losses import linear_cross_entropy

    hf = pm.get_base_model()
    with torch.no_grad():
        uncapped = linear_cross_entropy(
            hf.model(input_ids=x[:, :-1]).last_hidden_state, hf.lm_head.weight, y, reduction="sum"
        )
    assert (
        abs(float(uncapped) - float(ref)) > 10
    )  # the cap changes the loss: it is not silently skipped


def test_gpt2_family_linear_layers_are_found():
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2)
    )
    assert linear_layer_names(model) == [
        "c_attn",
        "c_fc",
        "c_proj",
    ]  # Conv1D layers count; lm_head does not
    pm = attach_lora(model, LoraSettings(r=4, alpha=8))
    assert {n.split(".")[-4] for n, p in pm.named_parameters() if p.requires_grad} == {
        "c_attn",
        "c_fc",
        "c_proj",
    }


# ----- QLoRA ---------------------------------------------------------------------------------------
def test_qlora_trains_a_4bit_base_on_the_cpu(qlora, val_batches):
    import bitsandbytes as bnb

    layer = qlora.model.get_base_model().model.layers[0].self_attn.q_proj
    assert (
        isinstance(layer.base_layer, bnb.nn.Linear4bit)
        and layer.base_layer.weight.quant_type == "nf4"
    )
    assert layer.base_layer.weight.quant_state.nested  # double quantization
    assert all(p.dtype == torch.float32 for p in qlora.model.parameters() if p.requires_grad)
    base = load_base(
        json.loads((qlora.adapter_dir / "tinygpt_finetune.json").read_text())["base_path"],
        quantize="nf4",
    )
    before, after = val_loss(base, val_batches), val_loss(qlora.model, val_batches)
    assert after < before - 0.15, (before, after)


def test_qlora_adapter_reloads_and_merges_into_the_dequantized_base(qlora):
    x = torch.tensor([qlora.tokenizer("def is_even(n):")["input_ids"]])
    reloaded, _ = load_finetuned(qlora.run_dir)
    assert torch.equal(logits(reloaded, x), logits(qlora.model, x))
    merged = transformers.AutoModelForCausalLM.from_pretrained(merge_adapter(qlora.run_dir)).eval()
    assert not any("4bit" in type(m).__name__ for m in merged.modules())
    torch.testing.assert_close(logits(merged, x), logits(qlora.model, x), rtol=0, atol=1e-4)


def test_qlora_gradients_match_a_dequantized_fp32_reference(qlora, val_batches):
    """bitsandbytes' CPU path is checked against plain fp32 matmuls with the dequantized weights."""
    base = load_base(
        json.loads((qlora.adapter_dir / "tinygpt_finetune.json").read_text())["base_path"],
        quantize="nf4",
    )
    from peft import PeftModel

    ref = PeftModel.from_pretrained(base.dequantize(), str(qlora.adapter_dir), is_trainable=True)
    quant = PeftModel.from_pretrained(
        load_base(str(base.name_or_path), quantize="nf4"), str(qlora.adapter_dir), is_trainable=True
    )
    x, y = val_batches[0]
    grads = []
    for m in (quant, ref):
        m.eval()  # no dropout: the two passes must see the same function
        causal_lm_loss(m, x, y).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 28
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6)


def test_4bit_layers_keep_their_layout_through_evaluation(qlora):
    """bitsandbytes 0.50 on CPUs with AVX512-BF16 repacks a 4-bit weight in place on its first eval-mode pass
    (bf16 scales, a kernel with no backward: later gradients through it are lost). The run evaluated twice;
    its layers must still be in the standard layout, and a raw layer shows what would happen otherwise."""
    import bitsandbytes as bnb

    layers = [m for m in qlora.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 14 and not any(
        getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers
    )
    raw = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    raw.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
    raw = raw.to("cpu").eval()
    if not getattr(
        raw, "support_avx512bf16_for_cpu", False
    ):  # the attribute exists from bitsandbytes 0.47
        pytest.skip(
            "this CPU has no AVX512-BF16, or this bitsandbytes has no repacking: it never repacks here"
        )
    with torch.no_grad():
        raw(torch.randn(2, 64))
    assert raw.weight.quant_state.packing_format_for_cpu  # the pitfall is real on this machine
    x = torch.randn(2, 64, requires_grad=True)
    raw.train()(x).sum().backward()
    assert x.grad is None  # no gradient flows through a repacked layer


def test_qlora_without_bitsandbytes_fails_before_training(
    monkeypatch, tmp_path, tiny_run, shared_data
):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    with pytest.raises(FinetuneError, match=r"QLoRA needs bitsandbytes.*pip install bitsandbytes"):
        finetune(
            "qlora-r16",
            str(tiny_run),
            str(shared_data / "mbpp.jsonl"),
            tmp_path / "ft",
            hardware="cpu",
        )
    assert not (tmp_path / "ft").exists()
    monkeypatch.delitem(sys.modules, "bitsandbytes")
    with pytest.raises(FinetuneError, match="no 4-bit kernels for mps"):
        check_qlora(torch.device("mps"))


# ----- bad input -----------------------------------------------------------------------------------
def test_bad_bases_and_settings_fail_clearly(tmp_path, tiny_run, shared_data, monkeypatch):
    data = str(shared_data / "code_alpaca_2k.json")
    with pytest.raises(FinetuneError, match="does not exist"):
        finetune("lora-r8", str(tmp_path / "nope"), data, tmp_path / "a", hardware="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FinetuneError, match="neither run.json .* nor config.json"):
        finetune("lora-r8", str(tmp_path / "empty"), data, tmp_path / "a", hardware="cpu")
    import huggingface_hub.constants

    monkeypatch.setattr(
        huggingface_hub.constants, "HF_HUB_OFFLINE", True
    )  # no waiting on a network
    with pytest.raises(
        FinetuneError, match="(?s)could not load base model 'no-such-org/no-such-model'.*hf.* login"
    ):
        finetune("lora-r8", "no-such-org/no-such-model", data, tmp_path / "a", hardware="cpu")
    with pytest.raises(
        FinetuneError, match="unknown finetune recipe 'lora-r7'; choose one of lora-r8"
    ):
        finetune("lora-r7", str(tiny_run), data, tmp_path / "a")
    with pytest.raises(FinetuneError, match="no setting for hardware 'v100'"):
        finetune("lora-r8", str(tiny_run), data, tmp_path / "a", hardware="v100")
    assert not (tmp_path / "a").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        export_tinygpt_base(tiny_run, tmp_path / "b")
    )
    with pytest.raises(
        FinetuneError, match=r"\['qkv_proj'\] match no linear layer.*down_proj, gate_proj, k_proj"
    ):
        attach_lora(model, LoraSettings(target_modules=("q_proj", "qkv_proj")))
    with pytest.raises(FinetuneError, match="r >= 1"):
        LoraSettings(r=0)


def test_bad_data_fails_before_training(tmp_path, tiny_run):
    records = [{"instruction": "a", "input": "", "output": "b"}, {"instruction": "c"}]
    (tmp_path / "d.json").write_text(json.dumps(records))
    from tinygpt.data.sources import DataError

    with pytest.raises(DataError, match="record 1 has no field 'output'"):
        finetune(
            "lora-r8", str(tiny_run), str(tmp_path / "d.json"), tmp_path / "ft", hardware="cpu"
        )
    assert not (tmp_path / "ft" / "checkpoints").exists()


def test_run_folder_of_another_finetune_is_refused(lora, shared_data):
    with pytest.raises(ConfigError, match="holds another finetuning run"):
        finetune(
            "lora-r16",
            json.loads((lora.run_dir / "finetune.json").read_text())["base"],
            str(shared_data / "code_alpaca_2k.json"),
            lora.run_dir,
            hardware="cpu",
            train=FAST,
        )


# ----- recipes --------------------------------------------------------------------------------------
def test_recipes_and_memory_table():
    assert set(FINETUNE_RECIPES) == {"lora-r8", "lora-r16", "lora-r32", "qlora-r16", "full"}
    for r in FINETUNE_RECIPES.values():
        t4, a100 = r.train_config("t4"), r.train_config("a100")
        shape = lambda c: (c.micro_batch_size, c.grad_accum_steps, c.seq_len, c.lr, c.warmup_steps)  # noqa: E731
        f = 1 if r.lora is not None else 0.1  # full finetuning: a tenth of LoRA's rate
        assert shape(t4) == (4, 4, 512, pytest.approx(2e-4 * f), 100)
        assert shape(a100) == (8, 2, 768, pytest.approx(2.5e-4 * f), 150)
        assert (
            t4.micro_batch_size * t4.grad_accum_steps
            == a100.micro_batch_size * a100.grad_accum_steps
            == 16
        )
    gemma2_2b = dict(
        model_type="gemma2",
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        tie_word_embeddings=True,
    )
    q = {r["part"]: r["gb"] for r in memory_table(FINETUNE_RECIPES["qlora-r16"], "t4", gemma2_2b)}
    lo = {r["part"]: r["gb"] for r in memory_table(FINETUNE_RECIPES["lora-r16"], "t4", gemma2_2b)}
    assert (
        1.5 < q["base weights"] < 2.5 < 4.5 < lo["base weights"] < 5.5
    )  # 2.6B weights: ~2 GB in NF4, 5.2 in fp16
    assert (
        0.08 < q["adapters"] < 0.1
    )  # rank 16 on all 7 projections of 26 layers: 20.8M fp32 weights
    assert q["total"] < 15  # fits a T4
    assert (
        q["logits + loss"] < 0.5
    )  # soft-capped logits go chunk by chunk too: not 2048 x 256k of them
    smol = dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )  # SmolLM2-135M
    assert default_finetune_recipe(smol, "cpu")[0] == "lora-r8"
    assert default_finetune_recipe(smol, "t4", 15.0)[0] == "lora-r16"
    assert default_finetune_recipe(gemma2_2b, "a100", 40.0)[0] == "lora-r16"
    name, why = default_finetune_recipe(gemma2_2b, "t4", 8.0)  # a GPU too small for the 16-bit base
    assert name == "qlora-r16" and "8 GB" in why
    rows = finetune_recipe_rows(
        gemma2_2b, "t4", 7.0
    )  # 16-bit Gemma-2 2B needs ~7 GB with the CUDA context; NF4 ~4 GB
    assert rows[0][:3] == ("recipe", "memory", "fits") and [r[0] for r in rows[1:]] == list(
        FINETUNE_RECIPES
    )
    assert {r[0]: r[2] for r in rows[1:]} == {
        "lora-r8": "no",
        "lora-r16": "no",
        "lora-r32": "no",
        "qlora-r16": "yes",
        "full": "no",
    }


def test_default_recipe_follows_the_run_being_resumed_and_tinygpt_bases_have_a_config(
    tmp_path, tiny_run
):
    (tmp_path / "finetune.json").write_text(json.dumps({"recipe": {"name": "lora-r32"}}))
    config = base_config_dict(str(tiny_run))
    assert (
        config["model_type"] == "llama"
        and config["hidden_size"] == 64
        and config["vocab_size"] == 512
    )
    assert (
        default_finetune_recipe(config, "t4", 15.0, resume_from=[tmp_path / "nope", tmp_path])[0]
        == "lora-r32"
    )


# ----- kill -9 and resume -------------------------------------------------------------------------
KILL_TRAIN = dict(
    seq_len=128,
    micro_batch_size=2,
    grad_accum_steps=2,
    max_steps=8,
    warmup_steps=2,
    lr=3e-3,
    eval_every=4,
    save_every=2,
    eval_batches=1,
    log_every=1,
)
KILLER = textwrap.dedent(f"""
    import os, signal, sys
    from tinygpt.finetune.run_finetune import finetune
    kill_at = int(sys.argv[4])
    from tinygpt.core.callback import Callback
    class Killer(Callback):
        def on_log(self, m):
            if m.get("step") == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # after step 5, before its checkpoint: step 5 is lost
    finetune("lora-r8", sys.argv[1], sys.argv[2], sys.argv[3], hardware="cpu", train={KILL_TRAIN!r},
             progress=False, callbacks=[Killer()])
""")


@pytest.mark.slow  # a real process killed
def test_kill_9_and_resume_gives_the_same_adapter_bit_for_bit(tmp_path, tiny_run, shared_data):
    from safetensors.torch import load_file

    data = str(shared_data / "code_alpaca_2k.json")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(tiny_run), data, str(tmp_path / "broken"), "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "broken" / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000004",
    ]
    # Resumed and unbroken runs go on here, in this process (one thread, like the subprocess).
    resumed = finetune(
        "lora-r8",
        str(tiny_run),
        data,
        tmp_path / "broken",
        hardware="cpu",
        train=KILL_TRAIN,
        progress=False,
    )
    assert resumed.train.resumed_from == 4 and resumed.train.step == 8
    finetune(
        "lora-r8",
        str(tiny_run),
        data,
        tmp_path / "whole",
        hardware="cpu",
        train=KILL_TRAIN,
        progress=False,
    )
    a = load_file(str(tmp_path / "broken" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "whole" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    strip = lambda ms: [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in ms]  # noqa: E731
    assert strip(log(tmp_path / "broken")) == strip(log(tmp_path / "whole"))


# ----- a mirror (Drive) and a new VM ----------------------------------------------------------------
MIRROR_TRAIN = dict(
    seq_len=128,
    micro_batch_size=2,
    grad_accum_steps=1,
    max_steps=6,
    warmup_steps=1,
    lr=3e-3,
    eval_every=3,
    save_every=2,
    eval_batches=1,
    log_every=1,
)


class Disconnect(Exception):
    """The VM goes away: training stops mid-run and its local disk is lost."""


class DisconnectAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_checkpoint(self, path, step):
        if step == self.step:  # written locally, never handed to the mirror (it comes after us)
            raise Disconnect


def test_mirror_gets_verified_checkpoints_and_the_adapter_and_a_new_vm_resumes_from_it(
    tmp_path, tiny_run, shared_data, monkeypatch
):
    from safetensors.torch import load_file

    from tinygpt.core.checkpoint import (
        list_checkpoints,
        read_manifest,
        sha256_file,
        verify_checkpoint,
    )

    data = str(shared_data / "code_alpaca_2k.json")
    vm, drive = tmp_path / "vm" / "ft", tmp_path / "drive" / "ft"
    with pytest.raises(Disconnect):
        finetune(
            "lora-r8",
            str(tiny_run),
            data,
            vm,
            hardware="cpu",
            train=MIRROR_TRAIN,
            progress=False,
            mirror=drive,
            callbacks=[DisconnectAt(4)],
        )
    assert [s for s, _ in list_checkpoints(vm / "checkpoints")] == [2, 4]
    assert [s for s, _ in list_checkpoints(drive / "checkpoints")] == [2]
    assert verify_checkpoint(drive / "checkpoints" / "step_000002")[0]
    assert {"finetune.json", "adapter_config.json", "tinygpt_finetune.json", "metrics.jsonl"} <= {
        p.name for p in drive.iterdir()
    }
    assert "on Drive: step 2 of recipe lora-r8" in str(run_status(vm, drive))

    shutil.rmtree(tmp_path / "vm")  # a new VM: nothing local, Drive is still there
    # It may be another GPU: the run keeps the hardware class it started with (finetune.json, from Drive).
    monkeypatch.setattr("tinygpt.finetune.run_finetune.detect_hardware", lambda device: "t4")
    resumed = finetune(
        "lora-r8", str(tiny_run), data, vm, train=MIRROR_TRAIN, progress=False, mirror=drive
    )
    assert resumed.train.resumed_from == 2 and resumed.train.step == 6 and resumed.hardware == "cpu"
    on_drive = [s for s, _ in list_checkpoints(drive / "checkpoints")]
    # the last step, and at most keep_last 2 as locally (step 4 may be superseded by 6 while step 3's best/ copies)
    assert on_drive[-1] == 6 and len(on_drive) <= 2 and set(on_drive) <= {2, 4, 6}, on_drive
    assert all(verify_checkpoint(p)[0] for _, p in list_checkpoints(drive / "checkpoints"))
    adapter = resumed.mirrored_adapter
    assert adapter == drive / "adapter"
    for name, info in read_manifest(adapter)[
        "files"
    ].items():  # every file checked against the local sha256
        assert sha256_file(adapter / name) == sha256_file(vm / "adapter" / name) == info["sha256"]
    assert "adapter on Drive" in str(run_status(vm, drive))

    whole = finetune(
        "lora-r8",
        str(tiny_run),
        data,
        tmp_path / "whole",
        hardware="cpu",
        train=MIRROR_TRAIN,
        progress=False,
    )
    a = load_file(str(adapter / "adapter_model.safetensors"))
    b = load_file(str(whole.adapter_dir / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) for k in a
    )  # as if never disconnected
    log = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    strip = lambda ms: [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in ms]  # noqa: E731
    assert strip(log(drive)) == strip(log(tmp_path / "whole"))

    shutil.rmtree(
        tmp_path / "vm"
    )  # later, on yet another VM: the adapter on Drive loads on its own
    model, tok = load_finetuned(drive)
    x = torch.tensor([tok("def fib(n):")["input_ids"]])
    torch.testing.assert_close(logits(model, x), logits(whole.model, x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_adapter_is_refused_in_one_line(lora, tmp_path, damage, capsys):
    """An adapter is checked like a checkpoint before use: flipped bytes (same size) and a truncated
    file both give one line and exit 2, never garbage output (docs/RELIABILITY.md)."""
    from tinygpt.cli import main

    adir = tmp_path / "adapter"
    shutil.copytree(lora.adapter_dir, adir)
    weights = adir / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[-9] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    weights.write_bytes(bytes(data))
    code = main(
        [
            "generate",
            "--adapter",
            str(adir),
            "--prompt",
            "Write a function",
            "--max-new-tokens",
            "4",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "is damaged" in err, err
    # without the manifest (a PEFT folder from elsewhere) a truncated file is still caught
    if damage == "truncate":
        (adir / "manifest.json").unlink()
        assert (
            main(["generate", "--adapter", str(adir), "--prompt", "x", "--max-new-tokens", "2"])
            == 2
        )
        assert "does not read back" in capsys.readouterr().err


def test_finetune_files_have_the_usual_mode_and_no_transformers_deprecation_warning(
    tiny_run, shared_data, tmp_path
):
    import os
    import stat
    import warnings as w

    with w.catch_warnings(record=True) as seen:
        w.simplefilter("always")
        res = finetune(
            "lora-r8",
            str(tiny_run),
            str(shared_data / "code_alpaca_2k.json"),
            tmp_path / "ft",
            hardware="cpu",
            train={**FAST, "max_steps": 2, "save_every": 2, "eval_every": 2},
            progress=False,
        )
    assert not [x for x in seen if "is_gradient_checkpointing" in str(x.message)]
    umask = os.umask(0)
    os.umask(umask)
    for p in [
        res.train.checkpoint / "model.safetensors",
        res.adapter_dir / "adapter_model.safetensors",
    ]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, (
            p
        )  # like every other file, not 0600
