"""Finetuning on unpacked records of mixed lengths compiles once per length bucket and never runs a
dynamic-shape graph: batches are padded to a few widths (powers of two up to seq_len) and reach the compiled
step with every dimension static. Counted on the CPU with the Trainer's own compile (its backend swapped for
aot_eager, which records each graph it is handed)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tinygpt.finetune.instruct import bucket_length, build_instruct_data
from tinygpt.finetune.stdlib_instructions import stdlib_instructions
from tinygpt.model.tokenizer import train_bpe

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from tinygpt.finetune.lora import attach_lora  # noqa: E402
from tinygpt.finetune.loss import FinetuneLoss, module_loss  # noqa: E402
from tinygpt.finetune.presets import LoraSettings, get_finetune_recipe  # noqa: E402
from tinygpt.train.step import ModelIO  # noqa: E402
from tinygpt.train.trainer import TrainData, Trainer  # noqa: E402


def length_buckets(seq_len: int) -> list[int]:
    """Every width `bucket_length` can give for this seq_len."""
    return sorted(
        {
            bucket_length(n, seq_len)
            for n in [1, seq_len] + [2**k for k in range(seq_len.bit_length())]
        }
    )


def test_bucket_lengths():
    assert length_buckets(512) == [64, 128, 256, 512]
    assert length_buckets(768) == [64, 128, 256, 512, 768]  # seq_len itself is the last bucket
    assert [bucket_length(n, 768) for n in (1, 64, 65, 300, 513, 768)] == [
        64,
        64,
        128,
        512,
        768,
        768,
    ]


class Graphs:
    """A compile backend that notes each graph (and whether any input size is symbolic), then runs aot_eager."""

    def __init__(self):
        self.dynamic: list[bool] = []

    def __call__(self, gm, example_inputs):
        def symbolic(v):
            return isinstance(v, torch.SymInt) or any(
                isinstance(s, torch.SymInt) for s in getattr(v, "shape", ())
            )

        self.dynamic.append(
            any(
                symbolic(n.meta.get("example_value"))
                for n in gm.graph.nodes
                if n.op == "placeholder"
            )
        )
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class Widths:
    """The batch source, noting the width of every batch it serves."""

    def __init__(self, source):
        self.source, self.seen = source, []

    def next_batch(self, *args):
        batch = self.source.next_batch(*args)
        self.seen.append(batch[0].shape[1])
        return batch

    def state_dict(self):
        return self.source.state_dict()

    def load_state_dict(self, s):
        self.source.load_state_dict(s)


@pytest.mark.slow  # torch.compile
def test_twenty_steps_of_mixed_lengths_compile_once_per_bucket(tmp_path, monkeypatch):
    records = stdlib_instructions(200)
    tok = train_bpe([r["instruction"] + "\n" + r["output"] for r in records], vocab_size=512)
    data = build_instruct_data(records, tok, 512, pack=False, val_fraction=0.0, seed=3)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        )
    )
    pm = attach_lora(base, LoraSettings(r=4, alpha=8, dropout=0.0), seed=1)
    cfg = get_finetune_recipe("lora-r8").train_config(
        "cpu",
        seq_len=512,
        micro_batch_size=2,
        grad_accum_steps=1,
        max_steps=20,
        warmup_steps=1,
        eval_every=0,
        save_every=0,
        log_every=20,
        compile="on",
        precision="fp32",
    )
    graphs = Graphs()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=graphs))
    torch._dynamo.reset()
    source = Widths(data.train)
    Trainer(
        FinetuneLoss(pm),
        dataclasses.replace(cfg, device="cpu"),
        TrainData(source),
        tmp_path,
        io=ModelIO(loss_fn=module_loss),
    ).fit("never")
    torch._dynamo.reset()
    buckets = set(source.seen)
    assert len(source.seen) == 20 and len(buckets) >= 2 and buckets <= set(length_buckets(512))
    assert len(graphs.dynamic) == len(buckets), (
        graphs.dynamic,
        source.seen,
    )  # one graph per bucket, no more
    assert not any(graphs.dynamic)  # and none with a symbolic size


def test_qlora_compiles_only_from_bitsandbytes_046_with_torch_28():
    from tinygpt.finetune.presets import qlora_compile

    assert qlora_compile("auto", "cuda", "0.46.0", "2.9.0+cu128") == (
        "auto",
        None,
    )  # Colab's pins: compiled
    mode, note = qlora_compile("auto", "cuda", "0.45.5", "2.9.0+cu128")
    assert mode == "off" and note == (
        "QLoRA runs eagerly: compiling its 4-bit layers needs bitsandbytes >= 0.46 "
        "(this runtime has bitsandbytes 0.45.5, torch 2.9.0)"
    )
    assert "torch >= 2.8" in qlora_compile("on", "cpu", "0.48.1", "2.7.1")[1]
    assert qlora_compile("auto", "cpu", "0.43.0", "2.4.1") == (
        "auto",
        None,
    )  # eager anyway: nothing to say


def test_an_old_bitsandbytes_trains_qlora_eagerly_and_says_so(tmp_path, monkeypatch):
    import json

    import bitsandbytes

    from tinygpt.finetune.run_finetune import finetune

    records = stdlib_instructions(60)
    (tmp_path / "data.json").write_text(json.dumps(records))
    tok = train_bpe([r["instruction"] + "\n" + r["output"] for r in records], vocab_size=512)
    base = tmp_path / "base"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        )
    ).save_pretrained(base)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.tok, eos_token="<|endoftext|>"
    ).save_pretrained(base)
    monkeypatch.setattr(bitsandbytes, "__version__", "0.45.5")
    compiled = []
    monkeypatch.setattr(
        torch, "compile", lambda *a, **k: compiled.append(a) or pytest.fail("QLoRA was compiled")
    )
    with pytest.warns(UserWarning, match=r"^QLoRA runs eagerly: .*bitsandbytes >= 0\.46"):
        res = finetune(
            "qlora-r16",
            str(base),
            str(tmp_path / "data.json"),
            tmp_path / "run",
            hardware="cpu",
            train=dict(max_steps=1, eval_every=0, save_every=1, seq_len=256, compile="on"),
            progress=False,
        )
    assert res.train.step == 1 and not compiled
