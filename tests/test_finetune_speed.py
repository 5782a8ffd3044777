"""The finetuning speed steps leave the numbers alone: packed rows, the full-logits loss, the compiled
loss module and the memory plan each give the loss and gradients of the plain path.

Real tiny models (Llama, Qwen2 and Gemma-2 from their configs, LoRA from `peft`, 4-bit layers from
`bitsandbytes`) on real text: the built-in instruction set made from the Python standard library.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tinygpt.core.recipes import model_config  # noqa: E402
from tinygpt.finetune.instruct import build_instruct_data  # noqa: E402
from tinygpt.finetune.lora import attach_lora, load_base  # noqa: E402
from tinygpt.finetune.loss import FinetuneLoss, causal_lm_loss, module_loss  # noqa: E402
from tinygpt.finetune.memory_plan import device_need_gb, memory_table, plan_finetune  # noqa: E402
from tinygpt.finetune.presets import LoraSettings, get_finetune_recipe  # noqa: E402
from tinygpt.finetune.run_finetune import finetune  # noqa: E402
from tinygpt.finetune.stdlib_instructions import stdlib_instructions  # noqa: E402
from tinygpt.model.losses import IGNORE_INDEX  # noqa: E402
from tinygpt.model.tokenizer import train_bpe  # noqa: E402
from tinygpt.train.step import ModelIO  # noqa: E402
from tinygpt.train.trainer import TrainData, Trainer  # noqa: E402

SEQ = 256
TRAIN = dict(
    seq_len=SEQ,
    micro_batch_size=2,
    grad_accum_steps=2,
    max_steps=2,
    warmup_steps=1,
    lr=3e-3,
    eval_every=2,
    save_every=2,
    eval_batches=1,
    log_every=1,
)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return stdlib_instructions(300)


@pytest.fixture(scope="module")
def tok(records):
    return train_bpe([r["instruction"] + "\n" + r["output"] for r in records], vocab_size=512)


def small_config(family: str):
    shape = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if family == "llama":
        return transformers.LlamaConfig(**shape)
    if family == "qwen2":
        return transformers.Qwen2Config(**shape, tie_word_embeddings=True)
    return transformers.Gemma2Config(**shape, head_dim=16, final_logit_softcapping=5.0)


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory, tok) -> dict[str, Path]:
    """Model folders as from the Hub (weights + tokenizer), made here: nothing is downloaded. Queries and
    keys are scaled up so that attention picks tokens, as a trained model's does (a fresh one's is nearly
    uniform, and what a record would see of its neighbours would hardly show)."""
    out = {}
    for family in ("llama", "qwen2", "gemma2"):
        d = tmp_path_factory.mktemp(family) / "base"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(small_config(family))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(6)
        model.save_pretrained(d)
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok.tok, eos_token="<|endoftext|>"
        ).save_pretrained(d)
        out[family] = d
    return out


def lora_model(base: Path, quantize: str = "none"):
    """A PEFT model whose B matrices are not zero (as after some training), so that every adapter weight
    gets a gradient and the adapters change the outputs."""
    pm = attach_lora(
        load_base(str(base), quantize=quantize), LoraSettings(r=4, alpha=8, dropout=0.0), seed=1
    )
    torch.manual_seed(2)
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return pm


def loss_and_grads(pm, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    pm.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(
            ga[n], gb[n], rtol=rtol * 10, atol=atol, msg=lambda m: f"{n}: {m}"
        )


def packed_data(records, tokenizer):
    return build_instruct_data(
        records, tokenizer, SEQ, pack=True, val_fraction=0.0, template="short"
    )


def records_of(pos: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each record in a packed row: where its position ids start again at 0."""
    starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
    return list(zip(starts[:-1], starts[1:]))


# ----- packing ---------------------------------------------------------------------------------------
def test_packed_rows_restart_positions_at_every_record_and_keep_every_target(records, tok):
    padded = build_instruct_data(records, tok, SEQ, template="short", seed=5)
    packed = build_instruct_data(records, tok, SEQ, template="short", seed=5, pack=True)
    assert packed.train.packed and not padded.train.packed
    assert (
        packed.report.sequences < padded.report.sequences / 1.5
    )  # fewer rows: less padding per step
    flat = lambda rows: [t for _, y in rows for t in y.tolist() if t != IGNORE_INDEX]  # noqa: E731
    assert flat(packed.train.rows) == flat(padded.train.rows)  # the same targets, in the same order
    x, y, pos = packed.train.next_batch(4)
    assert (
        x.shape == y.shape == pos.shape == (4, SEQ)
    )  # one shape for every batch: one compiled graph
    example_lengths = {int(n) for lengths in packed.train.lengths for n in lengths}
    for b in range(4):
        spans = records_of(pos[b])
        assert spans[-1][1] == SEQ and len(spans) >= 2
        for s, e in spans:
            assert torch.equal(pos[b, s:e], torch.arange(e - s))
            # a record starts with bos (end-of-text here) and its prompt carries no loss; so does the padding
            assert int(x[b, s]) == tok.eot_id and int(y[b, s]) == IGNORE_INDEX
        # every span but the last is one whole example (x drops the last token of the row only)
        assert all(e - s in example_lengths for s, e in spans[:-1])
    # validation is never packed: the same batches whichever way the training rows are built
    for (xa, ya), (xb, yb) in zip(padded.val_batches, packed.val_batches, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_packed_batch_gives_the_loss_and_gradients_of_its_records_one_by_one(
    family, base_dirs, records
):
    base = base_dirs[family]
    hf_tok = transformers.AutoTokenizer.from_pretrained(base)
    x, y, pos = packed_data(records, hf_tok).train.next_batch(2)
    pm = lora_model(base)
    packed = loss_and_grads(pm, lambda: causal_lm_loss(pm, x, y, pos))
    spans = [(b, s, e) for b in range(2) for s, e in records_of(pos[b])]
    assert len(spans) >= 5
    one_by_one = loss_and_grads(
        pm,
        lambda: sum(causal_lm_loss(pm, x[b : b + 1, s:e], y[b : b + 1, s:e]) for b, s, e in spans),
    )
    assert_same(packed, one_by_one, rtol=1e-5, atol=1e-5)
    # Without the position ids the records would see each other: the gradients move far beyond that
    # tolerance (by a third or more of their norm here; the packed ones are within 1e-6 of one by one).
    _, leaky = loss_and_grads(pm, lambda: causal_lm_loss(pm, x, y))
    assert max(float((leaky[n] - packed[1][n]).norm() / packed[1][n].norm()) for n in leaky) > 0.1


# ----- the loss --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_full_logits_and_chunked_losses_equal_the_models_own_logits(family, base_dirs, records):
    base = base_dirs[family]
    x, y, pos = packed_data(
        records, transformers.AutoTokenizer.from_pretrained(base)
    ).train.next_batch(2)
    pm = lora_model(base)

    def plain():  # the model's own logits, as any transformers user computes the loss
        logits = pm(input_ids=x, position_ids=pos, use_cache=False).logits.float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")

    reference = loss_and_grads(pm, plain)
    full = FinetuneLoss(pm, full_logits=True)
    assert full.chunk_rows == 0 and FinetuneLoss(pm, full_logits=False).chunk_rows is None
    assert_same(loss_and_grads(pm, lambda: full(x, y, pos)), reference)
    # chunks of 37 rows: 512 rows in 14 chunks, the last one short
    assert_same(loss_and_grads(pm, lambda: causal_lm_loss(pm, x, y, pos, chunk_rows=37)), reference)


# ----- compiled ----------------------------------------------------------------------------------------
@pytest.mark.slow  # torch.compile against eager
@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_loss_module_compiles_as_one_graph_with_the_eager_loss_and_gradients(
    quantize, base_dirs, records
):
    """Forward pass and loss are one graph (no break back to Python between them) for LoRA and QLoRA;
    compiled (aot_eager: dynamo's graph and autograd's joint graph, without a C++ compiler) they give
    the eager loss and gradients."""
    base = base_dirs["llama"]
    x, y, pos = packed_data(
        records, transformers.AutoTokenizer.from_pretrained(base)
    ).train.next_batch(2)
    pm = lora_model(base, quantize)
    module = FinetuneLoss(pm)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(module)(x, y, pos)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    eager = loss_and_grads(pm, lambda: module(x, y, pos))
    compiled = torch.compile(module, backend="aot_eager")
    assert_same(
        loss_and_grads(pm, lambda: module_loss(compiled, x, y, pos)), eager, rtol=1e-5, atol=1e-5
    )
    torch._dynamo.reset()


@pytest.mark.slow  # torch.compile
def test_a_compiled_lora_step_on_an_unpadded_batch_reaches_sdpa_causal_without_a_mask(
    base_dirs, monkeypatch
):
    """Compiled, an unpadded batch calls SDPA with no mask and is_causal=True, as eager does: the kernels that
    take no mask (FlashAttention) stay open. transformers built a (B, 1, T, T) mask while compiling. The loss
    and gradients are the eager ones; a packed batch (position ids) still gets its document mask."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    pm = lora_model(base_dirs["llama"])
    module = FinetuneLoss(pm)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(512, (2, 64), generator=g), torch.randint(512, (2, 64), generator=g)
    eager = loss_and_grads(pm, lambda: module(x, y))
    assert calls and set(calls) == {(True, True)}
    calls.clear()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    assert_same(
        loss_and_grads(pm, lambda: module_loss(compiled, x, y)), eager, rtol=1e-5, atol=1e-5
    )
    assert len(calls) == 2 and set(calls) == {(True, True)}  # both layers, traced once
    calls.clear()
    pos = torch.cat([torch.arange(40), torch.arange(24)]).expand(2, 64)
    module_loss(compiled, x, y, pos)
    assert calls and set(calls) == {(False, False)}  # two records in a row: kept apart by a mask
    torch._dynamo.reset()


@pytest.mark.slow  # torch.compile
def test_on_a_gpu_packed_records_take_a_flex_block_mask_with_the_sdpa_masks_loss(
    base_dirs, monkeypatch
):
    """Where a base trains on a GPU (`hf_attention(config, packed_flex=True)`), packed records are kept
    apart by a FlexAttention block mask, built outside the decoder layers that "auto" compiles regionally:
    no (B, 1, T, T) mask reaches SDPA, and the loss is that of SDPA with transformers' mask. Whole rows still
    reach SDPA with no mask and is_causal=True. (The same code on the CPU here, forward only: FlexAttention
    has no backward on a CPU; the kit's finetune step trains it on a GPU.)"""
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention.flex_attention import BlockMask

    from tinygpt.model.attention import EXPANDING_SDPA, PACKED_FLEX, hf_attention
    from tinygpt.train.step import compiled, regional

    seen = []
    flex_forward, sdpa = (
        hf_flex.flex_attention_forward,
        torch.nn.functional.scaled_dot_product_attention,
    )

    def flex(module, q, k, v, mask, **kw):
        seen.append(("flex", isinstance(mask, BlockMask)))
        return flex_forward(module, q, k, v, mask, **kw)

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append(("sdpa", attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(hf_flex, "flex_attention_forward", flex)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    pm = lora_model(base_dirs["llama"])
    module = FinetuneLoss(pm)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(512, (2, 64), generator=g), torch.randint(512, (2, 64), generator=g)
    pos = torch.cat([torch.arange(40), torch.arange(24)]).expand(2, 64)
    with torch.no_grad():  # FlexAttention's backward needs a GPU
        with_sdpa_mask = module_loss(module, x, y, pos)
        # the reference: transformers' (B, 1, T, T) mask
        assert set(seen) == {("sdpa", False, False)}
        hf = pm.get_base_model()
        assert hf.config._attn_implementation == EXPANDING_SDPA == hf_attention(hf.config)
        hf.config._attn_implementation = hf_attention(hf.config, packed_flex=True)
        assert hf.config._attn_implementation == PACKED_FLEX and regional(module, "auto")
        torch._dynamo.reset()
        seen.clear()
        step = compiled(module, "auto")
        torch.testing.assert_close(
            module_loss(step, x, y, pos), with_sdpa_mask, rtol=1e-4, atol=1e-5
        )
        assert seen and set(seen) == {("flex", True)}  # every layer: a block mask, no SDPA
        seen.clear()
        module_loss(step, x, y)  # whole rows: no mask at all
        assert seen and set(seen) == {("sdpa", True, True)}
    torch._dynamo.reset()


class Source:
    """A fixed list of batches, in order (the Trainer's BatchSource)."""

    def __init__(self, batches):
        self.batches, self.i = batches, 0

    def next_batch(self, batch_size, rank=0, world_size=1):
        self.i += 1
        return self.batches[(self.i - 1) % len(self.batches)]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, s):
        self.i = s["i"]


@pytest.mark.slow  # torch.compile against eager
def test_trainer_compiles_forward_and_loss_together_and_trains_as_eager(
    base_dirs, records, tmp_path
):
    """compile="on" (what "auto" means on CUDA): the Trainer's step runs the compiled FinetuneLoss
    (inductor), and two optimizer steps leave the adapters where eager steps leave them."""
    base = base_dirs["llama"]
    data = packed_data(records, transformers.AutoTokenizer.from_pretrained(base))
    batches = [data.train.next_batch(2) for _ in range(4)]
    cfg = get_finetune_recipe("lora-r8").train_config(
        "cpu", **{**TRAIN, "eval_every": 0, "save_every": 0, "compile": "on", "precision": "fp32"}
    )
    adapters = []
    for mode in ("on", "off"):
        pm = lora_model(base)
        trainer = Trainer(
            FinetuneLoss(pm),
            dataclasses.replace(cfg, compile=mode, device="cpu"),
            TrainData(Source(batches)),
            tmp_path / mode,
            io=ModelIO(loss_fn=module_loss),
        )
        if mode == "on":
            assert trainer.forward_model._orig_mod is trainer.model and isinstance(
                trainer.model, FinetuneLoss
            )
        res = trainer.fit("never")
        assert res.step == 2 and res.loss is not None
        adapters.append(
            {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
        )
    torch._dynamo.reset()
    for n in adapters[0]:
        torch.testing.assert_close(adapters[0][n], adapters[1][n], rtol=1e-4, atol=1e-5)


# ----- the plan --------------------------------------------------------------------------------------
def test_plan_recomputes_only_when_the_estimate_does_not_fit():
    small = {"model_type": "llama", **model_config("124m", vocab_size=50304).to_hf_llama()}
    recipe = get_finetune_recipe("lora-r16")
    assert recipe.train_config("a100").compile == recipe.train_config("t4").compile == "auto"
    h100 = plan_finetune(recipe, "a100", small, 85.0)
    assert (h100.activation_checkpointing, h100.full_logits, h100.pack) == (False, True, True)
    table = memory_table(recipe, "a100", small, activation_checkpointing=False, full_logits=True)
    assert h100.need_gb == pytest.approx(device_need_gb(table, "a100"), abs=1e-3)
    assert h100.need_gb < 0.9 * 85 and h100.memory_gb == 85.0
    lean = device_need_gb(memory_table(recipe, "a100", small), "a100")
    assert (
        lean < h100.need_gb
    )  # checkpointing and chunking save memory, which this GPU does not need
    # a GPU a little larger than the leanest plan: the run recomputes, and says why
    tight = plan_finetune(recipe, "a100", small, lean / 0.85)
    assert tight.activation_checkpointing and "activation checkpointing on" in tight.why
    # between the two: full logits dropped first (cheap), recomputation kept off
    no_logits = device_need_gb(
        memory_table(recipe, "a100", small, activation_checkpointing=False, full_logits=False),
        "a100",
    )
    middle = plan_finetune(recipe, "a100", small, no_logits / 0.89)
    assert (middle.activation_checkpointing, middle.full_logits) == (False, False)
    gemma2_2b = dict(
        model_type="gemma2",
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
    )
    t4 = plan_finetune(
        recipe, "t4", gemma2_2b, 15.8
    )  # a T4: 16-bit Gemma-2 2B recomputes, its logits fit
    assert t4.activation_checkpointing and t4.full_logits
    smaller = plan_finetune(
        recipe, "t4", gemma2_2b, 11.0
    )  # 2048 x 256k logits (6 GB) no longer fit beside it
    assert smaller.activation_checkpointing and not smaller.full_logits
    forced = dataclasses.replace(recipe, activation_checkpointing="on")
    assert plan_finetune(forced, "a100", small, 85.0).activation_checkpointing
    assert not plan_finetune(dataclasses.replace(recipe, pack=False), "a100", small, 85.0).pack
    assert not plan_finetune(
        recipe, "a100", {**small, "model_type": "gpt2"}, 85.0
    ).pack  # unknown masks


def test_plan_is_recorded_and_a_resumed_run_keeps_it(base_dirs, records, tmp_path):
    (tmp_path / "data.json").write_text(json.dumps(records[:200]))
    data, run = str(tmp_path / "data.json"), tmp_path / "ft"
    first = finetune(
        "lora-r8", str(base_dirs["qwen2"]), data, run, hardware="cpu", train=TRAIN, progress=False
    )
    assert first.plan.pack and not first.plan.activation_checkpointing and first.plan.full_logits
    info = json.loads((run / "finetune.json").read_text())
    assert info["plan"] == first.plan.to_dict()
    assert first.data.sequences < first.data.train_examples  # packed
    # As if the run had started on a GPU that needed recomputation: the resumed run keeps that choice.
    info["plan"]["activation_checkpointing"] = True
    (run / "finetune.json").write_text(json.dumps(info))
    resumed = finetune(
        "lora-r8",
        str(base_dirs["qwen2"]),
        data,
        run,
        hardware="cpu",
        train={**TRAIN, "max_steps": 4},
        progress=False,
    )
    assert resumed.train.resumed_from == 2 and resumed.train.step == 4
    assert (
        resumed.plan.activation_checkpointing
    )  # and each decoder layer checkpoints (any transformers 5.x):
    assert all(
        layer.gradient_checkpointing for layer in resumed.model.get_base_model().model.layers
    )
    assert json.loads((run / "finetune.json").read_text())["plan"]["activation_checkpointing"]


def test_a_run_from_before_plans_resumes_with_padded_rows(base_dirs, records, tmp_path):
    """finetune.json of an older tinygpt: no plan, the recipe said pack=False and listed the classes that
    recompute. The run resumes on its own rows (the data position checks them) under today's recipe."""
    (tmp_path / "data.json").write_text(json.dumps(records[:200]))
    data, run = str(tmp_path / "data.json"), tmp_path / "ft"
    old_recipe = dataclasses.replace(
        get_finetune_recipe("lora-r8"), pack=False, activation_checkpointing=("t4", "a100")
    )
    first = finetune(
        old_recipe, str(base_dirs["llama"]), data, run, hardware="cpu", train=TRAIN, progress=False
    )
    assert not first.plan.pack and first.data.sequences == first.data.train_examples
    info = json.loads((run / "finetune.json").read_text())
    del info["plan"]
    (run / "finetune.json").write_text(json.dumps(info))
    resumed = finetune(
        "lora-r8",
        str(base_dirs["llama"]),
        data,
        run,
        hardware="cpu",
        train={**TRAIN, "max_steps": 4},
        progress=False,
    )
    assert resumed.train.resumed_from == 2 and resumed.train.step == 4
    assert not resumed.plan.pack and not resumed.plan.activation_checkpointing
    assert np.isfinite(resumed.train.loss)
