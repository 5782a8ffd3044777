"""Finetuning speed: tinygpt's LoRA / QLoRA step next to a plain Hugging Face + PEFT loop, in one process,
on the same base, data shape and device.

    python benchmarks/gpu_finetune.py --size 124m --micro-batch 8 --seq-len 768 --grad-accum 2 --reference peft
    python benchmarks/gpu_finetune.py --size 124m --micro-batch 8 --seq-len 768 --grad-accum 2 --quantize nf4 \\
        --reference peft
    python benchmarks/gpu_finetune.py --device cpu --size tiny --micro-batch 4 --seq-len 128 --grad-accum 2 \\
        --steps 3 --reference peft     # the CPU mode (tests/test_gpu_finetune_bench.py runs it)

The base is made here, nothing is downloaded: a tinygpt model of --size with random weights, exported as
a `LlamaForCausalLM` folder (what `finetune` does with a tinygpt run); the GPT-2 tokenizer, or for
--size tiny a 512-token BPE trained on the data. The data is the built-in instruction set (the Python
standard library's functions; `tinygpt.finetune.stdlib_instructions`), or --data random: full rows of
random tokens, every position a target (pretraining's shape, no padding anywhere).

tinygpt's step is the Trainer's own optimizer step, set up as `finetune` sets it up: the recipe
(lora-r16 or qlora-r16) with this shape, its plan from the memory estimate against this device
(activation checkpointing, full or chunked logits, packed rows), `FinetuneLoss` compiled as a whole
(compile auto: on CUDA). The reference is the loop a careful user writes: the base in bf16 (fp32 on the
CPU) with SDPA attention, or in 4-bit NF4 with double quantization through bitsandbytes (--quantize nf4,
CUDA), the same LoRA settings through `get_peft_model`, autocast, the model's own loss from labels
normalised over the step's targets (num_items_in_batch), clipping to 1, fused AdamW on CUDA; no
activation checkpointing, eager unless --reference-compile on; padded batches (dynamic padding to the
longest record) unless --reference-data packed gives it tinygpt's packed rows and position ids.

Tokens/s counts real tokens on both sides: the tokens of the records, never padding. Steps are timed
after warm-up (CUDA events on a GPU, perf_counter on the CPU); the median is reported. Peak memory is
torch.cuda.max_memory_allocated in GiB (none on the CPU). The base loss of one batch is computed both
ways before training to show the two sides run the same model on the same tokens. The table goes to a dated
file in benchmarks/results/ (`--results`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable

import results_file
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_pretrain import fmt, sync, time_steps  # noqa: E402  (this folder: the same timing as pretraining's)

from tinygpt.core.config import GPT2_VOCAB_PADDED  # noqa: E402
from tinygpt.core.precision import (  # noqa: E402
    choose_precision,
    compiles,
    enable_tf32,
    resolve_device,
)
from tinygpt.core.recipes import MODEL_SIZES, model_config  # noqa: E402
from tinygpt.finetune.instruct import build_instruct_data  # noqa: E402
from tinygpt.finetune.lora import attach_lora, load_base, load_tokenizer  # noqa: E402
from tinygpt.finetune.loss import FinetuneLoss, module_loss  # noqa: E402
from tinygpt.finetune.memory_plan import base_config, memory_gb_of, plan_finetune  # noqa: E402
from tinygpt.finetune.presets import check_qlora, detect_hardware, get_finetune_recipe  # noqa: E402
from tinygpt.finetune.stdlib_instructions import stdlib_instructions  # noqa: E402
from tinygpt.fit.step_speed import RandomBatches  # noqa: E402
from tinygpt.model.gpt import GPT  # noqa: E402
from tinygpt.model.hf import export_model  # noqa: E402
from tinygpt.model.losses import IGNORE_INDEX  # noqa: E402
from tinygpt.model.tokenizer import load_gpt2, train_bpe  # noqa: E402
from tinygpt.train.step import ModelIO, TrainStep  # noqa: E402


def make_base(args, folder: Path, records: list[dict]) -> Path:
    """A tinygpt model of --size with random weights, exported as a Llama folder with its tokenizer."""
    if args.size == "tiny":
        tok = train_bpe([r["instruction"] + "\n" + r["output"] for r in records], vocab_size=512)
        vocab = 512
    else:
        tok, vocab = load_gpt2(), GPT2_VOCAB_PADDED
    mcfg = model_config(args.size, vocab_size=vocab)
    mcfg.max_seq_len = max(mcfg.max_seq_len, args.seq_len)
    torch.manual_seed(0)
    return export_model(GPT(mcfg), tok, folder / "base")


def sources(args, base: Path, records: list[dict], pack: bool):
    """(tinygpt's batch source, the reference's): the same records, tokenized once each way."""
    tok = load_tokenizer(str(base))
    if args.data == "random":
        vocab = base_config(str(base)).vocab_size
        return RandomBatches(vocab, args.seq_len), RandomBatches(vocab, args.seq_len)

    def build(p):
        return build_instruct_data(
            records,
            tok,
            args.seq_len,
            pack=p,
            val_fraction=0.0,
            seed=0,
        ).train

    return build(pack), build(args.reference_data == "packed")


def measure(
    name: str, step: Callable[[], None], source, args, device: torch.device, params: int
) -> dict:
    """Time the steps: one row of the table. Real tokens are those the timed steps were served."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    sync(device)
    before = source.served_tokens
    times = time_steps(step, [()], 0, args.steps, device)
    real_per_step = (source.served_tokens - before) / args.steps
    median = statistics.median(times)
    return {
        "impl": name,
        "trainable_params": params,
        "step_ms": median * 1e3,
        "step_ms_min": min(times) * 1e3,
        "real_tokens_per_step": real_per_step,
        "tokens_per_s": real_per_step / median,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
    }


def first_batch(source, batch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in source.next_batch(batch))


def tinygpt_side(base: Path, source, device, prec, plan, recipe, cfg):
    """(step, loss module, trainable params): the Trainer's step as `finetune` builds it."""
    dtype = prec.dtype if device.type == "cuda" else torch.float32
    model = load_base(str(base), quantize=recipe.quantize, dtype=dtype, device=device)
    pm = attach_lora(
        model, recipe.lora, activation_checkpointing=plan.activation_checkpointing, seed=cfg.seed
    )
    module = FinetuneLoss(pm, full_logits=plan.full_logits)
    step = TrainStep(
        module, dataclasses.replace(cfg, device=str(device)), source, ModelIO(loss_fn=module_loss)
    )
    step.model.train()
    params = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    return step.optimizer_step, module, params  # the very step `fit` runs, without a run folder


def reference_side(args, base: Path, source, device, prec, recipe):
    """(step, model, trainable params) of a plain transformers + PEFT loop."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    on_cuda = device.type == "cuda"
    dtype = prec.dtype if on_cuda else torch.float32
    kw: dict = {"dtype": dtype, "attn_implementation": "sdpa"}
    if recipe.quantize == "nf4":
        kw.update(
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=dtype,
            ),
            device_map={"": device.index or 0} if on_cuda else {"": "cpu"},
        )
    model = AutoModelForCausalLM.from_pretrained(str(base), **kw)
    if recipe.quantize != "nf4":
        model.to(device)
    model.config.use_cache = False
    lora = recipe.lora
    model = get_peft_model(
        model,
        LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules="all-linear",
            bias="none",
            task_type="CAUSAL_LM",
        ),
    )
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=2e-4, weight_decay=0.0, fused=on_cuda)
    forward = torch.compile(model) if args.reference_compile == "on" else model
    scaler = prec.grad_scaler()

    def step() -> None:
        micro = [source.next_batch(args.micro_batch) for _ in range(args.grad_accum)]
        n = sum(int((b[1] != IGNORE_INDEX).sum()) for b in micro)
        for batch in micro:
            x, y, *pos = (t.to(device, non_blocking=True) for t in batch)
            with prec.autocast():
                out = forward(
                    input_ids=x,
                    labels=y,
                    shift_labels=y,
                    num_items_in_batch=n,
                    **({"position_ids": pos[0]} if pos else {}),
                )
            scaler.scale(out.loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step, model, sum(p.numel() for p in trainable)


@torch.no_grad()
def base_loss_tinygpt(module: FinetuneLoss, batch, prec) -> float:
    x, y, *pos = batch
    with prec.autocast():
        return float(module(x, y, *pos)) / max(int((y != IGNORE_INDEX).sum()), 1)


@torch.no_grad()
def base_loss_reference(model, batch, prec) -> float:
    x, y, *pos = batch
    with prec.autocast():
        return float(
            model(
                input_ids=x, labels=y, shift_labels=y, **({"position_ids": pos[0]} if pos else {})
            ).loss
        )


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'impl':<9} {'trainable':>10} {'step ms':>9} {'real tokens/step':>16} {'tokens/s':>11} "
        f"{'peak GiB':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['impl']:<9} {r['trainable_params']:>10,} {r['step_ms']:>9.1f} {r['real_tokens_per_step']:>16,.0f} "
            f"{r['tokens_per_s']:>11,.0f} {fmt(r['peak_memory_gb'], '8.2f'):>8}"
        )


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="124m", choices=list(MODEL_SIZES))
    p.add_argument(
        "--quantize", default="none", choices=["none", "nf4"], help="nf4: QLoRA (qlora-r16)"
    )
    p.add_argument(
        "--r", type=int, default=16, choices=[8, 16, 32], help="LoRA rank (lora-rR); QLoRA is r16"
    )
    p.add_argument(
        "--lora-dropout",
        type=float,
        default=None,
        help="the adapters' dropout, tinygpt's and the reference's (default: the recipe's, 0.05); "
        "0 skips the dropout kernels",
    )
    p.add_argument("--seq-len", type=int, default=768)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--data", default="instructions", choices=["instructions", "random"])
    p.add_argument(
        "--records", type=int, default=2000, help="instruction records to draw batches from"
    )
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--steps", type=int, default=10, help="timed optimizer steps (the median is reported)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps first (default 3 with compile, else 1)",
    )
    p.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="tinygpt's; auto: on for CUDA",
    )
    p.add_argument(
        "--activation-checkpointing",
        default="auto",
        choices=["auto", "on", "off"],
        help="tinygpt's; auto: the plan's, from the memory estimate",
    )
    p.add_argument(
        "--full-logits",
        default="auto",
        choices=["auto", "on", "off"],
        help="tinygpt's; auto: the plan's",
    )
    p.add_argument(
        "--pack", default="auto", choices=["auto", "on", "off"], help="tinygpt's; auto: the plan's"
    )
    p.add_argument("--reference", default="none", choices=["none", "peft"])
    p.add_argument("--reference-compile", default="off", choices=["on", "off"])
    p.add_argument("--reference-data", default="padded", choices=["padded", "packed"])
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--json", help="also write the results to this file")
    results_file.add_option(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = resolve_device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda:
        enable_tf32()
    prec = choose_precision(device, args.precision)
    recipe = get_finetune_recipe("qlora-r16" if args.quantize == "nf4" else f"lora-r{args.r}")
    if args.lora_dropout is not None:
        recipe = dataclasses.replace(
            recipe, lora=dataclasses.replace(recipe.lora, dropout=args.lora_dropout)
        )
    if recipe.quantize == "nf4":
        check_qlora(device)
    hardware = detect_hardware(device)
    cfg = recipe.train_config(
        hardware,
        micro_batch_size=args.micro_batch,
        grad_accum_steps=args.grad_accum,
        seq_len=args.seq_len,
        precision=args.precision,
        compile=args.compile,
        max_steps=10**6,
        warmup_steps=0,
    )
    use_compile = compiles(args.compile, device.type)
    args.warmup = args.warmup if args.warmup is not None else (3 if use_compile else 1)
    records = stdlib_instructions(args.records)
    name = (
        torch.cuda.get_device_name(device)
        if on_cuda
        else f"CPU ({torch.get_num_threads()} threads)"
    )
    with tempfile.TemporaryDirectory(prefix="gpu_finetune_") as tmp:
        base = make_base(args, Path(tmp), records)
        config = base_config(str(base)).to_dict()
        plan = plan_finetune(
            dataclasses.replace(recipe, train={**recipe.train, hardware: cfg}),
            hardware,
            config,
            memory_gb_of(device),
        )
        for flag in (
            "activation_checkpointing",
            "full_logits",
            "pack",
        ):  # a flag other than auto overrides the plan
            if getattr(args, flag) != "auto":
                plan = dataclasses.replace(plan, **{flag: getattr(args, flag) == "on"})
        ours_source, ref_source = sources(args, base, records, plan.pack)
        probe = first_batch(
            copy.deepcopy(ours_source), args.micro_batch, device
        )  # the first batch, for both

        step, module, params = tinygpt_side(base, ours_source, device, prec, plan, recipe, cfg)
        ours_loss = base_loss_tinygpt(module, probe, prec)
        rows = [measure("tinygpt", step, ours_source, args, device, params)]
        del step, module
        free(device)
        result = {
            "device": name,
            "precision": prec.name,
            "size": args.size,
            "recipe": recipe.name,
            "lora_dropout": recipe.lora.dropout,
            "data": args.data,
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "grad_accum": args.grad_accum,
            "compile": use_compile,
            "plan": plan.to_dict(),
            "steps": args.steps,
            "warmup": args.warmup,
            "torch": torch.__version__,
            "rows": rows,
        }
        if args.reference == "peft":
            import peft
            import transformers

            step, model, params = reference_side(args, base, ref_source, device, prec, recipe)
            result["same_batch_base_loss_diff"] = abs(
                base_loss_reference(model, probe, prec) - ours_loss
            )
            rows.append(measure("hf+peft", step, ref_source, args, device, params))
            del step, model
            free(device)
            result.update(
                transformers=transformers.__version__,
                peft=peft.__version__,
                reference={"compile": args.reference_compile == "on", "data": args.reference_data},
            )
            ours, ref = rows
            result["ratio"] = {"tokens_per_s": ours["tokens_per_s"] / ref["tokens_per_s"]}
            if on_cuda:
                result["ratio"]["peak_memory"] = ours["peak_memory_gb"] / ref["peak_memory_gb"]

    say = results_file.Report()
    say(
        f"device {name}, precision {prec.name}; base {args.size} ({recipe.name}), data {args.data}, "
        f"micro-batch {args.micro_batch} x {args.seq_len} x {args.grad_accum} accumulation; median of "
        f"{args.steps} steps after {args.warmup} warm-up; torch {torch.__version__}"
    )
    say(
        f"tinygpt: compile {use_compile}, activation checkpointing {plan.activation_checkpointing}, "
        f"full logits {plan.full_logits}, packed {plan.pack} ({plan.why})"
    )
    if args.reference == "peft":
        say(
            f"hf+peft: transformers {result['transformers']}, peft {result['peft']}, compile "
            f"{args.reference_compile == 'on'}, {args.reference_data} rows, no activation checkpointing"
        )
    print_table(rows)
    reference = None
    if "ratio" in result:
        r = result["ratio"]
        mem = f", peak memory x{r['peak_memory']:.2f}" if "peak_memory" in r else ""
        reference = (
            f"tinygpt / hf+peft: tokens/s x{r['tokens_per_s']:.2f}{mem} (real tokens); same-batch base loss "
            f"difference {result['same_batch_base_loss_diff']:.2e}"
        )
        print(reference)
    results_file.write(
        args.results,
        __file__,
        "finetune-speed",
        f"Finetuning speed of {recipe.name} on a {args.size} base"
        + (" beside transformers + PEFT" if reference else ""),
        say.text() + "\n\n" + results_file.table(rows),
        argv,
        reference
        and f"a plain transformers + PEFT loop on the same base (the hf+peft row): {reference}",
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
