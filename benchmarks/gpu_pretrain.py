"""Pretraining speed of a tinygpt model: tokens/s, MFU, peak memory and the largest micro-batch,
optionally next to Hugging Face `LlamaForCausalLM` of the identical configuration.

    python benchmarks/gpu_pretrain.py --size 124m --seq-len 1024 --micro-batch 16 --reference hf
    python benchmarks/gpu_pretrain.py --size 124m --compile off --chunked-ce off   # one speed step off
    python benchmarks/gpu_pretrain.py --size 124m --micro-batch 16 --fused-proj on --reference hf
    python benchmarks/gpu_pretrain.py --size tiny --seq-len 64 --micro-batch 4 --steps 5 --device cpu --reference hf

A step is what the trainer does: forward under autocast, backward through the GradScaler,
unscale, clip to norm 1, optimizer step, zero_grad. Steps are timed after warm-up (CUDA events on
a GPU, perf_counter on the CPU) and the median is reported. MFU = flops_per_token * tokens/s /
the GPU's peak dense rate for the precision; flops_per_token counts 6 FLOPs per matmul weight plus
attention at full (not causal-halved) length, as PaLM and nanoGPT do. The reference gets its best
settings whatever the flags say: SDPA attention, the same autocast precision, fused AdamW and
torch.compile on CUDA (and wherever tinygpt gets them). Both models start from the same weights
(their parameter names match), and their losses on one batch are compared to show that the
configurations are the same. The largest micro-batch (on CUDA; --find-max-batch) is searched by
doubling until out of memory, then bisecting, with eager steps so that no size waits for a
compilation (a compiled step needs no more memory). The table goes to a dated file in benchmarks/results/
(`--results`).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import results_file
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinygpt.core.config import GPT2_VOCAB_PADDED, TrainConfig  # noqa: E402
from tinygpt.core.precision import Precision, choose_precision, enable_tf32, resolve_device  # noqa: E402
from tinygpt.core.recipes import MODEL_SIZES, model_config  # noqa: E402
from tinygpt.fit.hardware import peak_tflops as probe_peak_tflops  # noqa: E402
from tinygpt.model import losses  # noqa: E402
from tinygpt.model.gpt import GPT  # noqa: E402
from tinygpt.train.optim import build_optimizer, param_groups  # noqa: E402


def peak_tflops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak dense TFLOP/s of this GPU at this precision, where the number came from); the same
    denominator as the trainer's MFU."""
    if device.type != "cuda":
        return None, "none (not a GPU)"
    name = torch.cuda.get_device_name(device)
    peak = probe_peak_tflops(name, precision)
    if peak is None:
        return None, f"none (tinygpt.fit.hardware has no {precision} peak for {name!r})"
    return peak, "tinygpt.fit.hardware.GPU_TABLE"


class TinyGPTLoss(torch.nn.Module):
    """tinygpt's loss with the chunked cross-entropy on, off or automatic."""

    def __init__(self, model: GPT, chunked: str):
        super().__init__()
        self.model, self.chunked = model, chunked

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.model.hidden_states(idx)
        if self.chunked == "auto":
            rows = None
        elif self.chunked == "off":
            rows = 0
        elif idx.is_cuda:  # sized by the free memory, as the trainer's chunked loss is
            rows = -1
        else:  # the automatic chunk size, and one chunk where the automatic choice is the plain loss
            rows = (
                losses.default_chunk_rows(idx.numel(), self.model.config.vocab_size) or idx.numel()
            )
        return losses.linear_cross_entropy(h, self.model.lm_head.weight, targets, chunk_rows=rows)


class HFLoss(torch.nn.Module):
    """LlamaForCausalLM's own loss (fp32 logits, F.cross_entropy); targets are already shifted."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, labels=targets, shift_labels=targets).loss


def hf_llama(model: GPT) -> torch.nn.Module:
    """LlamaForCausalLM of the same configuration, with SDPA attention and the same weights."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit("--reference hf needs transformers: pip install transformers") from e
    hf = LlamaForCausalLM(LlamaConfig(**model.config.to_hf_llama(), attn_implementation="sdpa"))
    hf.config.use_cache = False  # training: no KV cache (HF keeps one by default)
    if model.config.activation_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise SystemExit(f"the HF model differs: missing {missing}, unexpected {unexpected}")
    return hf


def make_step(
    loss_fn: Callable,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    prec: Precision,
    accum: int = 1,
) -> Callable:
    """One training step as the trainer does it: `accum` micro-batches (the same one, here: a
    step's speed does not depend on the tokens), then the optimizer once."""
    scaler = prec.grad_scaler()
    params = [p for p in model.parameters() if p.requires_grad]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        for _ in range(accum):
            with prec.autocast():
                loss = loss_fn(x, y)
            scaler.scale(loss / accum).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    step: Callable, batches: list, warmup: int, steps: int, device: torch.device
) -> list[float]:
    """Seconds per step for `steps` steps after `warmup` untimed ones."""
    for i in range(warmup):
        step(*batches[i % len(batches)])
    sync(device)
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(steps)
        ]
        for i, (start, end) in enumerate(events):
            start.record()
            step(*batches[i % len(batches)])
            end.record()
        sync(device)
        return [s.elapsed_time(e) / 1e3 for s, e in events]
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(*batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    return times


def random_batches(n: int, batch: int, seq_len: int, vocab: int, device: torch.device) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        w = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
        out.append((w[:, :-1].contiguous().to(device), w[:, 1:].contiguous().to(device)))
    return out


def fits(step: Callable, batch: int, seq_len: int, vocab: int, device: torch.device) -> bool:
    """Whether two full steps at this micro-batch run without running out of memory."""
    try:
        for x, y in random_batches(2, batch, seq_len, vocab, device):
            step(x, y)
        sync(device)
        return True
    except torch.OutOfMemoryError:
        gc.collect()  # the exception's frames hold the failed step's tensors
        return False
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def max_micro_batch(
    step: Callable,
    opt: torch.optim.Optimizer,
    start: int,
    limit: int,
    bisect: int,
    seq_len: int,
    vocab: int,
    device: torch.device,
) -> int:
    """The largest micro-batch that fits: double from `start` until out of memory (or `limit`),
    then `bisect` halvings of the gap. 0 when even `start` does not fit."""
    ok, bad, b = 0, None, start
    while b <= limit:
        if not fits(step, b, seq_len, vocab, device):
            bad = b
            break
        ok, b = b, b * 2
        opt.zero_grad(set_to_none=True)
    for _ in range(bisect if bad is not None and ok else 0):
        mid = (ok + bad) // 2
        if mid in (ok, bad):
            break
        opt.zero_grad(set_to_none=True)
        if fits(step, mid, seq_len, vocab, device):
            ok = mid
        else:
            bad = mid
    opt.zero_grad(set_to_none=True)
    return ok


def measure(
    name: str,
    model: torch.nn.Module,
    loss_mod: torch.nn.Module,
    opt: torch.optim.Optimizer,
    args,
    prec: Precision,
    device: torch.device,
    use_compile: bool,
    flops_per_token: float,
    peak: float | None,
) -> dict:
    """Time the steps, then search the largest micro-batch (eager); one row of the table."""
    loss_fn = torch.compile(loss_mod) if use_compile else loss_mod
    step = make_step(loss_fn, model, opt, prec)
    batches = random_batches(4, args.micro_batch, args.seq_len, model.config.vocab_size, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = time_steps(step, batches, args.warmup, args.steps, device)
    median_s = statistics.median(times)
    tok_s = args.micro_batch * args.seq_len / median_s
    # GB here is GiB (2**30 bytes), as tinygpt.fit.probe, Colab and nvidia-smi count GPU memory.
    row = {
        "impl": name,
        "params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "step_ms": median_s * 1e3,
        "step_ms_min": min(times) * 1e3,
        "tokens_per_s": tok_s,
        "mfu": tok_s * flops_per_token / (peak * 1e12) if peak else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
        "max_micro_batch": None,
    }
    if args.find_max_batch == "on" or (args.find_max_batch == "auto" and device.type == "cuda"):
        # Eager, so that each size costs no compilation; compiled steps need no more memory than eager.
        eager_step = make_step(loss_mod, model, opt, prec)
        row["max_micro_batch"] = max_micro_batch(
            eager_step,
            opt,
            args.micro_batch,
            args.max_batch_limit,
            args.bisect,
            args.seq_len,
            model.config.vocab_size,
            device,
        )
    return row


def batch_loss(loss_mod: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return loss_mod(x, y).item()


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'impl':<9} {'params':>12} {'micro-batch':>11} {'step ms':>9} {'tokens/s':>11} {'MFU':>6} "
        f"{'peak GB':>8} {'max micro-batch':>15}"
    )  # the largest is found in eager mode
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['impl']:<9} {r['params']:>12,} {r['micro_batch']:>11} {r['step_ms']:>9.1f} "
            f"{r['tokens_per_s']:>11,.0f} {fmt(r['mfu'], '6.1%'):>6} {fmt(r['peak_memory_gb'], '8.2f'):>8} "
            f"{fmt(r['max_micro_batch'], '15d'):>15}"
        )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="124m", choices=list(MODEL_SIZES))
    p.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_PADDED)
    p.add_argument(
        "--seq-len", type=int, default=None, help="default: the model size's max_seq_len"
    )
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, default=20, help="timed steps (the median is reported)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps first (default 5 with compile, else 2)",
    )
    p.add_argument(
        "--compile", default="auto", choices=["auto", "on", "off"], help="auto: on for CUDA"
    )
    p.add_argument(
        "--fused-adamw", default="auto", choices=["auto", "on", "off"], help="auto: on for CUDA"
    )
    p.add_argument(
        "--chunked-ce",
        default="auto",
        choices=["auto", "on", "off"],
        help="auto: chunked when the logits are large (tinygpt.model.losses), as in training",
    )
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument(
        "--fused-proj",
        default="off",
        choices=["on", "off"],
        help="one matmul for q/k/v and one for gate/up (ModelConfig.fused_proj); same weights at init",
    )
    p.add_argument(
        "--find-max-batch", default="auto", choices=["auto", "on", "off"], help="auto: on for CUDA"
    )
    p.add_argument("--max-batch-limit", type=int, default=1024)
    p.add_argument(
        "--bisect", type=int, default=2, help="halvings between the last fit and the first OOM"
    )
    p.add_argument("--reference", default="none", choices=["none", "hf"])
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--json", help="also write the results to this file")
    results_file.add_option(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = resolve_device(args.device)
    prec = choose_precision(device, args.precision)
    on_cuda = device.type == "cuda"
    if on_cuda:
        enable_tf32()
    use_compile = args.compile == "on" or (args.compile == "auto" and on_cuda)
    fused = args.fused_adamw == "on" or (args.fused_adamw == "auto" and on_cuda)
    args.warmup = args.warmup if args.warmup is not None else (5 if use_compile else 2)
    mcfg = model_config(
        args.size,
        vocab_size=args.vocab_size,
        activation_checkpointing=args.activation_checkpointing,
        fused_proj=args.fused_proj == "on",
    )
    args.seq_len = args.seq_len or mcfg.max_seq_len
    if args.seq_len > mcfg.max_seq_len:
        mcfg.max_seq_len = args.seq_len
    peak, peak_source = peak_tflops(device, prec.name)
    name = (
        torch.cuda.get_device_name(device)
        if on_cuda
        else f"CPU ({torch.get_num_threads()} threads)"
    )
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    torch.manual_seed(0)
    model = GPT(mcfg).to(device)
    model.train()
    flops = model.flops_per_token(args.seq_len)
    init_state = (
        {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if args.reference == "hf"
        else None
    )
    tcfg = TrainConfig(
        optimizer=args.optimizer, lr=6e-4, seq_len=args.seq_len, micro_batch_size=args.micro_batch
    )
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(
            param_groups(model, tcfg.weight_decay), lr=tcfg.lr, betas=(0.9, 0.95), fused=fused
        )
    else:
        opt = build_optimizer(model, tcfg, device.type)
    x0, y0 = random_batches(1, args.micro_batch, args.seq_len, args.vocab_size, device)[0]
    ours_loss = TinyGPTLoss(model, args.chunked_ce)
    first_loss = batch_loss(ours_loss, x0, y0)
    rows = [measure("tinygpt", model, ours_loss, opt, args, prec, device, use_compile, flops, peak)]
    result = {
        "device": name,
        "precision": prec.name,
        "precision_reason": prec.reason,
        "size": args.size,
        "vocab_size": args.vocab_size,
        "seq_len": args.seq_len,
        "compile": use_compile,
        "fused_adamw": fused,
        "chunked_ce": args.chunked_ce,
        "optimizer": args.optimizer,
        "fused_proj": mcfg.fused_proj,
        "steps": args.steps,
        "warmup": args.warmup,
        "flops_per_token": flops,
        "peak_tflops": peak,
        "peak_source": peak_source,
        "torch": torch.__version__,
        "rows": rows,
    }
    del opt, ours_loss, model
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()

    if args.reference == "hf":
        import transformers

        torch.manual_seed(0)
        ref = GPT(mcfg)
        ref.load_state_dict(init_state)
        hf = hf_llama(ref).to(device)
        hf.train()
        del ref
        hf_opt = torch.optim.AdamW(
            param_groups(hf, tcfg.weight_decay),
            lr=tcfg.lr,
            betas=(0.9, 0.95),
            fused=fused or on_cuda,
        )
        hf_loss = HFLoss(hf)
        result["hf_same_batch_loss_diff"] = abs(batch_loss(hf_loss, x0, y0) - first_loss)
        rows.append(
            measure(
                "hf-llama",
                hf,
                hf_loss,
                hf_opt,
                args,
                prec,
                device,
                use_compile or on_cuda,
                flops,
                peak,
            )
        )
        result["transformers"] = transformers.__version__
        ours, ref_row = rows
        result["ratio"] = {"tokens_per_s": ours["tokens_per_s"] / ref_row["tokens_per_s"]}
        if on_cuda:
            result["ratio"]["peak_memory"] = ours["peak_memory_gb"] / ref_row["peak_memory_gb"]

    say = results_file.Report()
    say(
        f"device {name}, precision {prec.name} ({prec.reason}); size {args.size}, vocab {args.vocab_size}, "
        f"context {args.seq_len}; compile {use_compile}, fused AdamW {fused}, chunked CE {args.chunked_ce}, "
        f"optimizer {args.optimizer}, fused projections {mcfg.fused_proj}; "
        f"median of {args.steps} steps after {args.warmup} warm-up"
    )
    say(
        f"FLOPs/token {flops:.3e} (6N + attention); peak {fmt(peak, '.0f')} TFLOPs from {peak_source}"
    )
    print_table(rows)
    reference = None
    if "ratio" in result:
        r = result["ratio"]
        mem = f", peak memory x{r['peak_memory']:.2f}" if "peak_memory" in r else ""
        reference = (
            f"tinygpt / hf-llama: tokens/s x{r['tokens_per_s']:.2f}{mem}; "
            f"same-batch loss difference at init {result['hf_same_batch_loss_diff']:.2e}"
        )
        print(reference)
    table = results_file.table(
        [{**r, "mfu": None if r["mfu"] is None else f"{r['mfu']:.1%}"} for r in rows],
        [k for k in rows[0] if k != "step_ms_min"],
    )
    results_file.write(
        args.results,
        __file__,
        "pretrain-speed",
        f"Pretraining speed of tinygpt {args.size}"
        + (" beside LlamaForCausalLM" if reference else ""),
        say.text() + "\n\n" + table,
        argv,
        reference
        and "transformers' LlamaForCausalLM of the same configuration and weights "
        f"(the hf-llama row, transformers {result['transformers']}): {reference}",
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
