"""Every GPU claim in one command: the measurements of issue 34, each beside its reference, each under its own
time cap, written to a folder and printed as one table.

    python benchmarks/gpu_kit.py --out $OUT                  # one GPU: ends inside 540 s (TOTAL_S)
    python benchmarks/gpu_kit.py --out $OUT --only pretrain,finetune --llama --artifacts prev/compile_artifacts
    python benchmarks/gpu_kit.py --smoke --out /tmp/kit      # every step's code path, tiny shapes, on the CPU

Steps, in order (each a row of results.md; docs/BENCHMARKS.md section 5 says what each compares):

  env          date, GPU, driver, torch / CUDA / transformers / peft / bitsandbytes versions
  startup      `tinygpt pretrain --data builtin` processes: seconds to the first step cold (fresh compiler and
               tinygpt caches) and warm (the run's compile cache in a fresh folder, as on a new VM), with
               dynamo's frames, graphs and recompiles counted after step 1
  probe        from the cold run: the probe's own time, its choice, its predicted tokens/s against the run's
               measured median (on the CPU, `tinygpt probe`'s timing of the recipe's step)
  pretrain     124M, context 1024, bf16: tinygpt as a user gets it (the probe's micro-batch, compile on, the
               loss the trainer takes, the recipe's accumulation: the optimizer once per step) beside
               transformers' GPT2LMHeadModel (and with --llama LlamaForCausalLM) of the same size (SDPA, fused
               AdamW, torch.compile): tokens/s, MFU and peak memory over one timed window after warm-up
               (benchmarks/gpu_pretrain.py's step and timing)
  speed_steps  tinygpt with each speed step changed in turn (unfused AdamW, the other loss, fused projections
               on, the measured options: bf16 residual stream, FP8 head (torchao, sm89+), FlashAttention-3
               (kernels hub, Hopper), each skipped with its reason where its package or GPU is missing; the
               whole model compiled as one graph instead of by regions, compile off: rows sharing the
               baseline's graphs first): what each is worth, and each row's loss curve (every row starts
               from the same weights on the same batches; loss_gap: its largest gap to the baseline's)
  finetune     LoRA r16 and QLoRA NF4 r16 on a locally made Llama-architecture 124M base, tinygpt's step beside a
               plain transformers + PEFT loop (benchmarks/gpu_finetune.py); then LoRA r16 with the adapters'
               dropout at 0 on both sides (what making 0 the default would buy)
  t4_fp16      fp16 with the GradScaler for 200 steps (no NaN, no inf) beside bf16 on the same batches
  t4_gqa       grouped-query attention with the fused-kernel decision forced to a T4's "sm75": the decision and
               which SDPA kernel ran (the math kernel must not)
  time_to_loss a100-124m against a100-124m-fast for the same wall time each on --data builtin: validation loss
               (not in the default set on a GPU: --only time_to_loss)

A step that fails records its one-line error and the kit goes on; so does a row that compiled a graph inside
its timed window (a recompile or a graph break: it would have timed a compile). On a GPU each step runs in its own process
(`--isolate auto`), killed at its cap, except pretrain and speed_steps, which share one (their rows reuse one
compiled graph); inside a step, rows that would not fit the step's budget are recorded as skipped. The default
steps' caps add up to 435 s and the kit's total is 480 s, so one command of at most 540 s returns the whole
table. Every step of a kit run shares one Inductor cache folder; each process's compile artifacts are saved
into --out/compile_artifacts (at most 64 MiB) for the next GPU run to load (--artifacts), and each step records
its compile-cache hits and misses. `--smoke` runs the same code with tiny shapes on the CPU (compiled
code run eagerly, QLoRA and the CUDA-only checks recorded as skipped with the reason) in under 2 minutes on
2 cores; tests/test_gpu_kit.py runs it. Writes results.json and results.md into --out after every step (a kit
cut off still returns what it finished), prints the table at the end and writes it, with the command and the
device, to the dated result file <date>-gpu-kit.md in --out (benchmarks/results_file.py), ready for
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib.metadata
import io
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]  # the sibling benchmarks, and tinygpt from this checkout

import results_file  # noqa: E402

# (name, cap on a GPU in seconds, cap in --smoke); the default steps' GPU caps add up to 435 s, under the kit's
# default total (TOTAL_S)
STEPS: list[tuple[str, float, float]] = [
    ("env", 10, 30),
    (
        "startup",
        150,
        60,
    ),  # two processes: cold (probe, compile, 8 steps) and warm (to its first step)
    ("probe", 5, 30),  # reads the cold run; on the CPU times the step itself
    ("pretrain", 75, 60),
    ("speed_steps", 120, 60),
    ("finetune", 45, 60),
    ("t4_fp16", 20, 30),
    ("t4_gqa", 10, 30),
    (
        "time_to_loss",
        80,
        60,
    ),  # 2 x --ttl-seconds of training, each run's start-up and evaluation beside them
]
KEY_STEP = {name: i for i, (name, _, _) in enumerate(STEPS)}
# on a GPU by default: time_to_loss only when asked (--only time_to_loss); --smoke runs every step
OPTIONAL_STEPS = ("time_to_loss",)
# steps that run in one process when isolated: their rows share compiled graphs (the same model and shapes)
GROUPS = (("pretrain", "speed_steps"),)
# the whole kit on a GPU: with the interpreter's start and the last step's grace it ends inside 540 s, what one
# command of a short GPU loan allows
TOTAL_S = 480.0
# the compile artifacts kept beside the results (torch.compiler.save_cache_artifacts), at most this many bytes
ARTIFACTS_LIMIT = 64 * 2**20
ARTIFACTS = "compile_artifacts"
GRACE_S = 10.0  # past its cap, an isolated step's process is killed
MIN_STEP_S = 5.0  # a step is not started with less than this left of the kit's total
GOALS = "issue 49's goals"


# ------------------------------------------------------------------------------------------------ the context


@dataclasses.dataclass
class Ctx:
    """What a step gets: the mode, where to write, the results of the steps before it, its deadline."""

    smoke: bool
    device: str
    work: Path  # scratch (run folders, caches); not --out, whose files come back from a lent GPU
    results: dict  # step name -> entry, the steps run so far
    deadline: float  # time.monotonic() by which the step should be done
    ttl_seconds: float
    llama: bool = True  # the transformers Llama row (optional on a GPU: --llama)

    def left(self) -> float:
        return self.deadline - time.monotonic()


def skip(reason: str) -> dict:
    """A figure that was not measured, and why."""
    return {"skipped": reason}


def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]


@contextlib.contextmanager
def quiet():
    """The reused benchmarks print their own tables; the kit prints one at the end."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield buf


def compiled_code(ctx: Ctx):
    """Compiled code as the GPU runs it; in --smoke the same wrappers run eagerly (a CPU compile takes minutes
    on 2 cores)."""
    if ctx.smoke:
        from tinygpt.train.step import eager

        return eager()
    return contextlib.nullcontext()


def free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ env


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def step_env(ctx: Ctx) -> dict:
    import torch

    out = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": version("transformers"),
        "peft": version("peft"),
        "bitsandbytes": version("bitsandbytes"),
        "liger_kernel": version("liger-kernel"),
        "triton": version("triton"),
    }
    try:
        out["commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        out["commit"] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            out["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                ).stdout.strip()
                or None
            )
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
    else:
        out["gpu"], out["driver"] = None, skip("no CUDA device")
    return out


# ------------------------------------------------------------------------------------------------ start-up, probe

_RUN = """
import json, sys
from torch._dynamo.utils import counters
from tinygpt.core.callback import Callback
from tinygpt.core.recipe_choice import apply_overrides
from tinygpt.core.recipes import get_recipe
from tinygpt.pretrain.run_pretrain import pretrain
recipe_name, run, steps, sets = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])

def count():
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values())}

class AfterStep1(Callback):
    at = None
    def on_startup(self, record):
        self.at = count()

cb = AfterStep1()
recipe = apply_overrides(get_recipe(recipe_name), sets)
res = pretrain(recipe, run, data="builtin", max_steps=steps, save_every=0, eval_every=0, progress=False,
               callbacks=[cb])
end, at = count(), cb.at or {"frames": 0, "graphs": 0, "recompiles": 0}
tps = [m["tokens_per_s"] for m in res.metrics if m.get("tokens_per_s") and m.get("step", 0) > 1]
print(json.dumps({"at_step1": at, "after_step1": {k: end[k] - at[k] for k in end}, "tokens_per_s": tps}))
"""


def launch_until_first_step(
    recipe: str,
    run_dir: Path,
    env: dict,
    steps: int,
    sets: list[str],
    timeout: float,
    finish: bool = True,
) -> dict:
    """Like benchmarks/startup.py's run_until_first_step (a fresh process, wall time from its launch to the
    start-up record in metrics.jsonl), through pretrain() so that dynamo's counters can be read at the end."""
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-c", _RUN, recipe, str(run_dir), str(steps), json.dumps(sets)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics, record, wall = run_dir / "metrics.jsonl", None, None
    try:
        while p.poll() is None or record is None:
            if record is None and metrics.exists():
                record = next(
                    (
                        m["startup"]
                        for m in map(json.loads, metrics.read_text().splitlines()[:3])
                        if "startup" in m
                    ),
                    None,
                )
                if record is not None:
                    wall = time.perf_counter() - t0
                    if not finish:  # the first step is what was asked for
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
                        return {"first_step_wall_s": round(wall, 2), "breakdown": record}
            if p.poll() is not None and record is None:
                break
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"tinygpt pretrain ran past {timeout:.0f} s")
            time.sleep(0.05)
        out, err = p.communicate(timeout=max(5.0, timeout - (time.perf_counter() - t0)))
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if p.returncode != 0 or record is None:
        lines = [ln for ln in (err or out or "").splitlines() if ln.strip()]
        raise RuntimeError(
            f"tinygpt pretrain failed: {lines[-1] if lines else f'exit {p.returncode}'}"
        )
    counts = json.loads(out.strip().splitlines()[-1])
    return {"first_step_wall_s": round(wall, 2), "breakdown": record, **counts}


def startup_settings(ctx: Ctx) -> tuple[str, int, list[str]]:
    if ctx.smoke:  # compile on a 2-core CPU takes minutes; the same two processes otherwise
        return "cpu-smoke", 4, ["train.compile=off", "train.log_every=1"]
    return "a100-124m", 8, ["train.log_every=1"]


def step_startup(ctx: Ctx) -> dict:
    from startup import (
        fresh_env,  # benchmarks/startup.py: empty tinygpt and inductor caches under a folder
    )

    recipe, steps, sets = startup_settings(ctx)
    root = ctx.work / "startup"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cold_env = fresh_env(root / "a")
    cold = launch_until_first_step(
        recipe,
        root / "cold",
        cold_env,
        steps,
        sets,
        timeout=ctx.left() * (0.6 if ctx.smoke else 0.75),
    )
    (root / "warm").mkdir()
    for f in ("compile_cache.bin", "run.json", "tokenizer.json"):
        if (root / "cold" / f).exists():
            shutil.copy(root / "cold" / f, root / "warm")
    warm_env = fresh_env(
        root / "b", TINYGPT_CACHE=cold_env["TINYGPT_CACHE"]
    )  # the same signing key, new compiler
    warm = launch_until_first_step(
        recipe, root / "warm", warm_env, steps, sets, timeout=max(ctx.left(), 1), finish=False
    )
    return {
        "recipe": recipe,
        "steps": steps,
        "settings": sets,
        "cold_s": cold["first_step_wall_s"],
        "warm_s": warm["first_step_wall_s"],
        "cold_compile_s": cold["breakdown"].get("compile_s"),
        "warm_compile_s": warm["breakdown"].get("compile_s"),
        "recompiles_after_step1": cold["after_step1"]["recompiles"],
        "graphs_after_step1": cold["after_step1"]["graphs"],
        "compile_cache_copied": (root / "warm" / "compile_cache.bin").exists(),
        "cold": cold,
        "warm": warm,
    }


def step_probe(ctx: Ctx) -> dict:
    """The probe of the cold start-up run (its probe.json and metrics), or on the CPU `tinygpt probe`'s timing
    of the recipe's step against the cold run's measured steps."""
    start = ctx.results.get("startup", {})
    if start.get("status") != "ok":
        raise RuntimeError("the startup step has no run to read (it did not finish)")
    cold = start["figures"]["cold"]
    measured = statistics.median(cold["tokens_per_s"]) if cold["tokens_per_s"] else None
    run = ctx.work / "startup" / "cold"
    probe_json = run / "probe.json"
    if probe_json.exists():
        r = json.loads(probe_json.read_text())
        out = {
            "source": "the cold run's probe.json",
            "search_s": r["search_s"],
            "micro_batch": r["micro_batch_size"],
            "grad_accum": r["grad_accum_steps"],
            "seq_len": r["seq_len"],
            "precision": r["precision"],
            "loss": r.get("loss"),
            "activation_checkpointing": r["activation_checkpointing"],
            "peak_gb": r["peak_gb"],
            "speeds": r.get("speeds"),
            "notes": r.get("notes"),
            "predicted_tokens_per_s": r["tokens_per_s"],
            "predicted_source": r.get("tokens_per_s_source"),
        }
    else:
        from tinygpt.fit.report import probe_report

        t0 = time.perf_counter()
        rep = json.loads(probe_report(start["figures"]["recipe"], as_json=True, cache_dir=None))
        exp = rep["expectations"]
        out = {
            "source": "tinygpt probe (no trial search off a GPU)",
            "search_s": round(time.perf_counter() - t0, 2),
            "micro_batch": json.loads((run / "run.json").read_text())["recipe"]["train"][
                "micro_batch_size"
            ]
            if (run / "run.json").exists()
            else None,
            "predicted_tokens_per_s": exp["tokens_per_s"],
            "predicted_source": exp["tokens_per_s_source"],
            "search": skip("the trial search runs on a CUDA GPU"),
        }
    out["measured_tokens_per_s"] = measured
    out["measured_source"] = (
        f"median of the cold run's logged steps after step 1 ({len(cold['tokens_per_s'])})"
    )
    pred = out["predicted_tokens_per_s"]
    out["predicted_over_measured"] = pred / measured if pred and measured else None
    return out


# ------------------------------------------------------------------------------------------------ pretraining


@dataclasses.dataclass
class Shape:
    size: str
    vocab: int
    seq_len: int
    micro_batch: int
    warmup: int  # optimizer steps
    steps: int
    accum: int = 1  # micro-batches per optimizer step: the recipe's


def pretrain_shape(ctx: Ctx) -> Shape:
    from tinygpt.core.config import GPT2_VOCAB_PADDED
    from tinygpt.core.recipes import get_recipe

    if ctx.smoke:
        return Shape("tiny", 512, 64, 4, 1, 3, accum=2)
    probe = ctx.results.get("probe", {})
    mb = (
        probe.get("figures", {}).get("micro_batch") if probe.get("status") == "ok" else None
    ) or 16
    # at the recipe's accumulation (a100-124m: 524,288 tokens a step), the optimizer once per step
    accum = max(1, get_recipe("a100-124m").train.tokens_per_step // (mb * 1024))
    return Shape("124m", GPT2_VOCAB_PADDED, 1024, mb, 1, 3, accum=accum)


def timed_row(
    name: str,
    model,
    loss_mod,
    opt,
    prec,
    device,
    compile_mode: str,
    shape: Shape,
    flops: float,
    peak: float | None,
    ctx: Ctx,
) -> dict:
    """One row: benchmarks/gpu_pretrain.py's step (autocast, GradScaler, clip, optimizer) and timing, with the
    peak memory taken over the timed window only (reset after the warm-up), and the loss of every step run
    (warm-up included; the mean over its micro-batches), read back after the timing: each row starts from the
    same seed's weights on the same batches, so rows that do the same math show the same loss curve."""
    import torch
    from gpu_pretrain import make_step, random_batches, time_steps

    from tinygpt.train.step import compiled, regional, regional_loss

    if compile_mode == "on":
        loss_fn = torch.compile(loss_mod)
    elif compile_mode == "auto" and regional(
        model, "auto"
    ):  # the trainer's default: blocks, then head and loss
        compiled(model, "auto")
        mode = {"off": "full", "on": "chunked"}.get(loss_mod.chunked, "auto")
        loss_fn = functools.partial(regional_loss, model, loss=mode, reduction="mean")
    elif compile_mode == "auto":
        loss_fn = torch.compile(loss_mod)
    else:
        loss_fn = loss_mod
    seen = []  # each micro-batch's loss, on the device until the timing is done

    def recorded(x, y):
        loss = loss_fn(x, y)
        seen.append(loss.detach())
        return loss

    step = make_step(recorded, model, opt, prec, accum=shape.accum)
    batches = random_batches(4, shape.micro_batch, shape.seq_len, shape.vocab, device)
    with compiled_code(ctx):
        t0 = time.perf_counter()
        time_steps(step, batches, shape.warmup, 0, device)
        warm_s = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        before = compiles()
        times = time_steps(step, batches, 0, shape.steps, device)
        in_window = compiles() - before
    med = statistics.median(times)
    if (
        in_window
    ):  # a recompile or a graph break's new frame: the timing holds a compile, not the step
        return {
            "impl": name,
            "error": f"{in_window} graph(s) compiled inside the timed window (a recompile or a graph "
            "break): its timing is not the step's",
            "compiles_in_timed_window": in_window,
            "step_ms_with_compile": med * 1e3,
        }
    losses = torch.stack(seen).float().view(-1, shape.accum).mean(1).tolist()
    tps = shape.accum * shape.micro_batch * shape.seq_len / med
    return {
        "impl": name,
        "params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        "compile": compile_mode,
        "micro_batch": shape.micro_batch,
        "grad_accum": shape.accum,
        "seq_len": shape.seq_len,
        "loss": getattr(loss_mod, "chunked", None),
        "step_ms": med * 1e3,
        "tokens_per_s": tps,
        "mfu": tps * flops / (peak * 1e12) if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
        "warmup_s": round(warm_s, 2),
        "compiles_in_timed_window": in_window,
        "precision": prec.name,
        "losses": [round(x, 4) for x in losses],
    }


def compiles() -> int:
    """Graphs dynamo compiled so far in this process, recompiles and graph breaks' new frames included: a row
    whose timed window adds one timed a compile, and says so (compiles_in_timed_window)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def kit_device(ctx: Ctx):
    import torch

    from tinygpt.core.precision import choose_precision, enable_tf32, resolve_device

    device = resolve_device("cpu" if ctx.smoke else ctx.device)
    if device.type == "cuda":
        enable_tf32()
    prec = choose_precision(device, "fp32" if ctx.smoke else "bf16")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return device, prec


def tinygpt_parts(
    shape: Shape, device, *, fused_proj=False, chunked="auto", fused_adamw=True, seed=0, **model_kw
):
    """(model, loss module, optimizer, FLOPs per token): what gpu_pretrain.py builds for tinygpt; `model_kw`:
    other ModelConfig fields (a speed option)."""
    import torch
    from gpu_pretrain import TinyGPTLoss

    from tinygpt.core.recipes import model_config
    from tinygpt.model.gpt import GPT
    from tinygpt.train.optim import param_groups

    cfg = model_config(shape.size, vocab_size=shape.vocab, fused_proj=fused_proj, **model_kw)
    cfg.max_seq_len = max(cfg.max_seq_len, shape.seq_len)
    torch.manual_seed(seed)
    model = GPT(cfg).to(device).train()
    opt = torch.optim.AdamW(
        param_groups(model, 0.1),
        lr=6e-4,
        betas=(0.9, 0.95),
        fused=fused_adamw and device.type == "cuda",
    )
    return (
        model,
        TinyGPTLoss(model, trainer_loss(shape, device) if chunked == "auto" else chunked),
        opt,
        model.flops_per_token(shape.seq_len),
    )


def trainer_loss(shape: Shape, device) -> str:
    """The loss the trainer takes for this micro-batch ("auto" resolved as `TrainStep` resolves it: on a GPU the
    full logits where they fit the free memory), as TinyGPTLoss names it: "off" (full logits), "on" (chunked), or
    "auto" (by size, per call: off a GPU)."""
    from tinygpt.model.losses import resolve_loss

    mode = resolve_loss("auto", shape.micro_batch * shape.seq_len, shape.vocab, device)
    return {"full": "off", "chunked": "on"}.get(mode, "auto")


def gpt2_parts(shape: Shape, device):
    """transformers' GPT2LMHeadModel of the same width, depth and context: SDPA, fused AdamW (CUDA); its own
    loss. FLOPs per token as nanoGPT counts them: 6 x the parameters (position embeddings left out) plus
    attention at full length."""
    import torch
    from gpu_pretrain import HFLoss
    from transformers import GPT2Config, GPT2LMHeadModel

    from tinygpt.core.recipes import model_config
    from tinygpt.train.optim import param_groups

    m = model_config(shape.size)
    cfg = GPT2Config(
        vocab_size=shape.vocab,
        n_positions=max(m.max_seq_len, shape.seq_len),
        n_embd=m.d_model,
        n_layer=m.n_layer,
        n_head=m.n_head,
        attn_implementation="sdpa",
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(device).train()
    opt = torch.optim.AdamW(
        param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), fused=device.type == "cuda"
    )
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    return model, HFLoss(model), opt, 6 * n + 12 * m.n_layer * m.d_model * shape.seq_len


def llama_parts(shape: Shape, device):
    """transformers' LlamaForCausalLM of tinygpt's configuration, with tinygpt's initial weights
    (gpu_pretrain.hf_llama)."""
    import torch
    from gpu_pretrain import HFLoss, hf_llama

    from tinygpt.train.optim import param_groups

    model, _, _, flops = tinygpt_parts(shape, torch.device("cpu"))
    hf = hf_llama(model).to(device).train()
    opt = torch.optim.AdamW(
        param_groups(hf, 0.1), lr=6e-4, betas=(0.9, 0.95), fused=device.type == "cuda"
    )
    return hf, HFLoss(hf), opt, flops


class Unavailable(Exception):
    """A row's option cannot run here (its package or GPU is missing): the row is skipped with this reason."""


def run_rows(ctx: Ctx, variants: list[tuple], shape: Shape, reserve_s: float) -> list[dict]:
    """Each variant (name, build() -> parts, compile mode[, precision]) timed in turn, at the kit's precision
    unless the variant names its own; a row that fails records its error, a row whose build raises
    `Unavailable` or that would not fit the step's budget (about `reserve_s` each) is skipped with the
    reason."""
    from gpu_pretrain import peak_tflops

    from tinygpt.core.precision import choose_precision

    device, kit_prec = kit_device(ctx)
    rows = []
    for name, build, mode, *own in variants:
        prec = choose_precision(device, own[0]) if own else kit_prec
        peak, _ = peak_tflops(device, prec.name)
        if ctx.left() < reserve_s:
            rows.append(
                {
                    "impl": name,
                    **skip(
                        f"the step's budget was spent ({ctx.left():.0f} s left, a row "
                        f"needs about {reserve_s:.0f})"
                    ),
                }
            )
            continue
        parts = None
        try:
            parts = build(shape, device)
            model, loss_mod, opt, flops = parts
            with quiet():
                rows.append(
                    timed_row(
                        name, model, loss_mod, opt, prec, device, mode, shape, flops, peak, ctx
                    )
                )
        except Unavailable as e:
            rows.append({"impl": name, **skip(str(e))})
        except (Exception, SystemExit) as e:  # noqa: BLE001 - one row's failure is that row's result
            rows.append({"impl": name, "error": one_line(e)})
        finally:  # the compiled graphs stay: a later row of the same model and shapes reuses them
            del parts
            free(device)
    return rows


def with_ratios(rows: list[dict], base: str) -> list[dict]:
    """Each row's tokens/s over the baseline row's, and the largest gap between their loss curves (the same
    seed's weights on the same batches: rows that do the same math stay within rounding)."""
    ref = next((r for r in rows if r["impl"] == base and "tokens_per_s" in r), None)
    for r in rows:
        if ref is not None and "tokens_per_s" in r and r is not ref:
            r["x_baseline"] = r["tokens_per_s"] / ref["tokens_per_s"]
            pairs = list(zip(r.get("losses") or [], ref.get("losses") or []))
            if pairs:
                r["loss_gap"] = max(abs(a - b) for a, b in pairs)
    return rows


def option_parts(option: str) -> Callable:
    """build(shape, device) for a speed option's row (`tinygpt.model.fast_options`: "bf16_residual",
    "fp8_head", "fa3"), raising `Unavailable` with the option's own one-line refusal where its package or GPU
    is missing here. The rows compile by regions, whose loss runs the FP8 head's own forward."""

    def build(shape: Shape, device):
        from tinygpt.core.config import ConfigError, TrainConfig
        from tinygpt.core.recipes import model_config
        from tinygpt.model.fast_options import check_fast_options, to_fp8_head

        kw = {"bf16_residual": {"bf16_residual": True}, "fa3": {"attn_impl": "fa3"}}.get(option, {})
        train = TrainConfig(fp8_head=option == "fp8_head")
        try:
            check_fast_options(
                model_config(shape.size, vocab_size=shape.vocab, **kw), train, device, "bf16"
            )
        except ConfigError as e:
            raise Unavailable(str(e)) from None
        parts = tinygpt_parts(shape, device, **kw)
        return (to_fp8_head(parts[0]), *parts[1:]) if option == "fp8_head" else parts

    return build


def compiled_trainer_speed(recipe, device, steps: int = 2, warmup: int = 1) -> float:
    """Tokens/s of the trainer's own step as the recipe compiles it, the median of `steps` after
    `warmup`: `tinygpt.fit.step_speed.trainer_speed`'s timing, which the probe runs eagerly."""
    import torch

    from tinygpt.fit.step_speed import RandomBatches
    from tinygpt.fit.trials import sync
    from tinygpt.model.gpt import GPT
    from tinygpt.train.step import TrainStep

    train = dataclasses.replace(recipe.train, device=str(device))
    times = []
    try:
        torch.manual_seed(0)
        batches = RandomBatches(recipe.model.vocab_size, train.seq_len)
        step = TrainStep(GPT(dataclasses.replace(recipe.model)), train, batches)
        for _ in range(warmup + steps):
            sync(step.device)
            t0 = time.perf_counter()
            step.optimizer_step()
            sync(step.device)
            times.append(time.perf_counter() - t0)
        del step
    finally:  # an out-of-memory error included: the memory goes
        free(torch.device(device))
    timed = sorted(times[warmup:])
    return train.tokens_per_step / timed[len(timed) // 2]


def step_pretrain(ctx: Ctx) -> dict:
    import torch
    from gpu_pretrain import peak_tflops

    shape = pretrain_shape(ctx)
    device, prec = kit_device(ctx)
    variants = [("tinygpt", tinygpt_parts, "auto"), ("hf-gpt2", gpt2_parts, "on")]
    if ctx.llama:
        variants.append(("hf-llama", llama_parts, "on"))
    rows = run_rows(ctx, variants, shape, reserve_s=0 if ctx.smoke else 20)
    tiny = next((r for r in rows if r["impl"] == "tinygpt" and "tokens_per_s" in r), None)
    for r in rows:
        if tiny is not None and r is not tiny and "tokens_per_s" in r:
            r["tinygpt_x"] = tiny["tokens_per_s"] / r["tokens_per_s"]
    # the trainer's own step (compiled_trainer_speed) as a user's run takes it: the recipe's loss,
    # accumulation and optimizer at the probe's micro-batch
    trainer = None
    if not ctx.smoke and ctx.left() > 25:
        from tinygpt.core.recipes import get_recipe
        from tinygpt.model.gpt import meta_model

        probe = ctx.results.get("probe", {}).get("figures") or {}
        recipe = get_recipe("a100-124m").replace(
            train={
                "micro_batch_size": shape.micro_batch,
                "grad_accum_steps": shape.accum,
                "precision": "bf16",
                "loss": probe.get("loss") or "auto",
            }
        )
        try:
            torch.cuda.reset_peak_memory_stats(device)
            tps = compiled_trainer_speed(recipe, device)
            peak, _ = peak_tflops(device, prec.name)
            flops = meta_model(recipe.model).flops_per_token(recipe.train.seq_len)
            trainer = {
                "impl": "tinygpt-trainer",
                "tokens_per_s": tps,
                "micro_batch": shape.micro_batch,
                "loss": recipe.train.loss,
                "peak_memory_gib_incl_warmup": torch.cuda.max_memory_allocated(device) / 2**30,
                "mfu": None if peak is None else tps * flops / (peak * 1e12),
            }
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the rows above stand
            trainer = {"impl": "tinygpt-trainer", "error": one_line(e)}
    elif ctx.smoke:
        trainer = skip(
            "the trainer's compiled step on a GPU recipe: GPU only (the rows above use its pieces)"
        )
    else:
        trainer = skip("the step's budget was spent")
    return {
        "shape": dataclasses.asdict(shape),
        "precision": prec.name,
        "rows": rows,
        "trainer_step": trainer,
    }


def step_speed_steps(ctx: Ctx) -> dict:
    shape = pretrain_shape(ctx)
    pre = ctx.results.get("pretrain", {})
    same = pre.get("status") == "ok" and pre["figures"]["shape"] == dataclasses.asdict(shape)
    base = (
        next(
            (r for r in pre["figures"]["rows"] if r["impl"] == "tinygpt" and "tokens_per_s" in r),
            None,
        )
        if same
        else None
    )
    import torch

    device = torch.device(
        "cpu"
        if ctx.smoke
        else ctx.device
        if ctx.device != "auto"
        else "cuda"
        if torch.cuda.is_available()
        else "cpu"
    )
    from tinygpt.model.losses import default_chunk_rows

    taken = trainer_loss(shape, device)
    full = taken == "off" or (
        taken == "auto" and not default_chunk_rows(shape.micro_batch * shape.seq_len, shape.vocab)
    )
    other = "on" if full else "off"  # the loss the trainer does not take
    # rows sharing the baseline's graph first (the optimizer is not compiled), compile off last
    variants = [
        ("AdamW unfused", lambda s, d: tinygpt_parts(s, d, fused_adamw=False), "auto"),
        (
            "chunked loss (full logits off)" if other == "on" else "full logits (chunked loss off)",
            lambda s, d: tinygpt_parts(s, d, chunked=other),
            "auto",
        ),
        ("fused projections on", lambda s, d: tinygpt_parts(s, d, fused_proj=True), "auto"),
        # the measured options (`tinygpt.model.fast_options`), each skipped with its reason where its
        # package or GPU is missing; bf16 residual in bf16 in --smoke too (the CPU's bf16 autocast)
        ("bf16 residual", option_parts("bf16_residual"), "auto", "bf16"),
        ("FP8 head", option_parts("fp8_head"), "auto"),
        ("FA3 attention", option_parts("fa3"), "auto"),
        ("whole-model compile", tinygpt_parts, "on"),
        ("compile off", tinygpt_parts, "off"),
    ]
    if base is None:  # pretrain did not run at this shape: measure the baseline here
        variants.insert(0, ("all on (as in pretrain)", tinygpt_parts, "on"))
    rows = run_rows(ctx, variants, shape, reserve_s=0 if ctx.smoke else 12)
    if base is not None:
        rows.insert(
            0,
            {**base, "impl": "all on (as in pretrain)", "from": "the pretrain step's tinygpt row"},
        )
    return {
        "shape": dataclasses.asdict(shape),
        "rows": with_ratios(rows, "all on (as in pretrain)"),
    }


# ------------------------------------------------------------------------------------------------ finetuning


def step_finetune(ctx: Ctx) -> dict:
    import gpu_finetune
    import torch

    if ctx.smoke:
        common = [
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--seq-len",
            "64",
            "--micro-batch",
            "2",
            "--grad-accum",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--records",
            "40",
            "--threads",
            "1",
        ]
    else:
        common = [
            "--size",
            "124m",
            "--seq-len",
            "768",
            "--micro-batch",
            "8",
            "--grad-accum",
            "2",
            "--steps",
            "6",
        ]
    out = {}
    # LoRA with the adapters' dropout at 0 (the presets' 0.05 is the row above): the speed side of
    # making 0 the default (benchmarks/lora_dropout.py measured the quality side: the same loss)
    rows = (
        ("lora_r16", ["--r", "16"]),
        ("qlora_nf4_r16", ["--quantize", "nf4"]),
        ("lora_r16_dropout0", ["--r", "16", "--lora-dropout", "0"]),
    )
    for name, extra in rows:
        if "--quantize" in extra and not torch.cuda.is_available():
            out[name] = skip("QLoRA needs CUDA and bitsandbytes' 4-bit kernels")
            continue
        if "--quantize" in extra and version("bitsandbytes") is None:
            out[name] = skip(
                "bitsandbytes is not installed (carry its wheel: benchmarks/README.md)"
            )
            continue
        if not ctx.smoke and ctx.left() < 20:
            out[name] = skip("the step's budget was spent")
            continue
        try:
            with quiet(), compiled_code(ctx):
                r = gpu_finetune.main(
                    [
                        *common,
                        *extra,
                        "--data",
                        "random",
                        "--reference",
                        "peft",
                        "--results",
                        "none",
                    ]
                )
            out[name] = {
                "lora_dropout": r["lora_dropout"],
                "plan": r["plan"],
                "rows": r["rows"],
                "ratio": r.get("ratio"),
                "same_batch_base_loss_diff": r.get("same_batch_base_loss_diff"),
            }
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the other recipe still runs
            out[name] = {"error": one_line(e)}
        finally:
            torch._dynamo.reset()
            free(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return out


# ------------------------------------------------------------------------------------------------ T4 paths


def train_losses(ctx: Ctx, precision: str, steps: int, shape: Shape) -> dict:
    """`steps` trainer-like steps (autocast, GradScaler, clip, AdamW) on 4 fixed batches: the losses."""
    import torch
    from gpu_pretrain import random_batches

    from tinygpt.core.precision import choose_precision

    device, _ = kit_device(ctx)
    prec = choose_precision(device, precision)
    model, loss_mod, opt, _ = tinygpt_parts(shape, device)
    scaler = prec.grad_scaler()
    params = [p for p in model.parameters() if p.requires_grad]
    batches = random_batches(4, shape.micro_batch, shape.seq_len, shape.vocab, device)
    losses, skipped = [], 0
    t0 = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        with prec.autocast():
            loss = loss_mod(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(opt)
        scaler.update()
        if before is not None and scaler.get_scale() < before:
            skipped += 1  # an inf/NaN gradient: the scaler skipped the step and lowered the scale
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    del model, loss_mod, opt
    free(device)
    finite = [v for v in losses if math.isfinite(v)]
    return {
        "precision": prec.name,
        "steps": steps,
        "seconds": round(time.perf_counter() - t0, 2),
        "nan_or_inf_losses": len(losses) - len(finite),
        "scaler_skipped_steps": skipped,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "min_loss": min(finite) if finite else None,
        "final_scale": scaler.get_scale() if scaler.is_enabled() else None,
    }


def step_t4_fp16(ctx: Ctx) -> dict:
    shape = Shape("tiny", 512, 64, 4, 0, 0) if ctx.smoke else Shape("50m", 50304, 512, 8, 0, 0)
    steps = 20 if ctx.smoke else 200
    fp16 = train_losses(ctx, "fp16", steps, shape)
    other = "fp32" if ctx.smoke else "bf16"  # a CPU has no native bf16: fp32 beside fp16 there
    ref = train_losses(ctx, other, steps, shape)
    return {
        "model": shape.size,
        "micro_batch": shape.micro_batch,
        "seq_len": shape.seq_len,
        "fp16": fp16,
        other: ref,
        "no_nan": fp16["nan_or_inf_losses"] == 0,
        "last_loss_diff": abs(fp16["last_loss"] - ref["last_loss"]),
    }


SDPA_OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "math": "_scaled_dot_product_attention_math",
    "flash_cpu": "_scaled_dot_product_flash_attention_for_cpu",
}


def sdpa_kernels(fn: Callable[[], None]) -> list[str]:
    """Which SDPA kernels ran in fn (forward and backward), from the profiler's aten ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    return sorted(
        k
        for k, op in SDPA_OPS.items()
        if any(n.endswith(op) or n.endswith(op + "_backward") for n in names)
    )


def step_t4_gqa(ctx: Ctx) -> dict:
    import torch

    from tinygpt.core.recipes import model_config
    from tinygpt.model import attention
    from tinygpt.model.gpt import GPT

    on_cuda = torch.cuda.is_available() and not ctx.smoke
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = torch.float16 if on_cuda else torch.float32
    decision = attention.attention_kernel(
        "cuda", (7, 5), torch.float16, attention.torch_version(), 64
    )
    cfg = (
        model_config("tiny", vocab_size=512, n_head=4, n_kv_head=1)
        if ctx.smoke
        else model_config("124m", vocab_size=50304, n_kv_head=4)
    )
    seq = 64 if ctx.smoke else 1024
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    x = torch.randint(0, cfg.vocab_size, (2, seq), device=device)

    def fwd_bwd():
        with torch.autocast(device.type, dtype=dtype, enabled=on_cuda):
            model.hidden_states(x).float().pow(2).mean().backward()
        if on_cuda:
            torch.cuda.synchronize()

    out = {
        "n_head": cfg.n_head,
        "n_kv_head": cfg.n_kv_head,
        "seq_len": seq,
        "dtype": str(dtype),
        "decision_sm75_fp16": decision,
        "decision_ok": decision == "expand",
    }
    real = attention.device_profile
    if on_cuda:
        out["decision_this_gpu"] = attention.attention_kernel(
            "cuda", real(device)[1], dtype, attention.torch_version(), cfg.d_model // cfg.n_head
        )
        out["kernels_this_gpu"] = sdpa_kernels(fwd_bwd)
    t4 = contextlib.nullcontext()
    if on_cuda:  # the SDPA kernels a T4 has: no flash attention below sm80
        from torch.nn.attention import SDPBackend, sdpa_kernel

        t4 = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
        with sdpa_kernel(
            [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        ):  # the control: grouped, as on sm80+
            out["kernels_t4_backends_unforced"] = sdpa_kernels(fwd_bwd)
    attention.device_profile = lambda dev: ("cuda", (7, 5)) if dev.type == "cuda" else real(dev)
    try:
        with t4:
            kernels = sdpa_kernels(fwd_bwd)
    finally:
        attention.device_profile = real
    if on_cuda:
        out["kernels_forced_sm75"] = (
            kernels  # with a T4's kernels only: the memory-efficient one, not math
        )
        out["math_ran"] = "math" in kernels
    else:
        out["kernels_cpu"] = kernels
        out["kernels_forced_sm75"] = skip(
            "which CUDA SDPA kernel runs needs a CUDA GPU (the forced decision and "
            "the profiler's reading of the kernels ran here on the CPU)"
        )
    return out


# ------------------------------------------------------------------------------------------------ time to a loss


def step_time_to_loss(ctx: Ctx) -> dict:
    from time_to_loss import (
        Clock,  # benchmarks/time_to_loss.py: (seconds after step 1, step, val loss)
    )

    from tinygpt.core.recipes import get_recipe
    from tinygpt.pretrain.run_pretrain import pretrain

    if ctx.smoke:  # the CPU pair, at a smaller shape
        pair, secs = ("cpu", "cpu-fast"), 2.0
        train = {"eval_batches": 2, "micro_batch_size": 4, "seq_len": 64}
    else:  # regional compile on both sides: the same per-step code, half the compile time of the whole model
        pair, secs = ("a100-124m", "a100-124m-fast"), ctx.ttl_seconds
        train = {"eval_batches": 8, "compile": "regional"}
    base_data = get_recipe(pair[0]).data.to_dict()  # one tokenizer and one validation set for both
    if ctx.smoke:
        base_data["max_chars"] = 300_000
    out = {"seconds_each": secs, "data": "builtin", "compile": train.get("compile", "off")}
    for name in pair:
        recipe = get_recipe(name)
        recipe = recipe.replace(
            data=base_data, train={**train, "eval_every": 10**6, "save_every": 0, "log_every": 10}
        )
        clock = Clock()
        run = ctx.work / "ttl" / name
        shutil.rmtree(run, ignore_errors=True)
        with quiet():
            res = pretrain(
                recipe,
                run,
                data="builtin",
                hours=secs / 3600,
                progress=False,
                probe="off",
                device="cpu" if ctx.smoke else None,
                cache_dir=ctx.work / "ttl-cache",
                callbacks=[clock],
            )
        out[name] = {
            "val_loss": res.val_loss,
            "steps": res.step,
            "tokens": res.step * recipe.train.tokens_per_step,
            "startup_s": round(clock.startup_s, 2),
            "wall_after_step1_s": round(clock.points[-1][0], 2) if clock.points else None,
            "tokens_per_s": res.tokens_per_s,
        }
    a, b = (out[n]["val_loss"] for n in pair)
    out["fast_minus_base"] = b - a if a is not None and b is not None else None
    return out


STEP_FUNCS: dict[str, Callable[[Ctx], dict]] = {
    "env": step_env,
    "startup": step_startup,
    "probe": step_probe,
    "pretrain": step_pretrain,
    "speed_steps": step_speed_steps,
    "finetune": step_finetune,
    "t4_fp16": step_t4_fp16,
    "t4_gqa": step_t4_gqa,
    "time_to_loss": step_time_to_loss,
}


# ------------------------------------------------------------------------------------------------ the runner


def has_figures(figures) -> bool:
    """Whether anything was measured (not only skipped or failed)."""
    if isinstance(figures, dict):
        if set(figures) <= {"skipped", "error", "impl"}:
            return False
        return any(has_figures(v) for k, v in figures.items() if k not in ("skipped", "error"))
    if isinstance(figures, list):
        return any(has_figures(v) for v in figures)
    return figures is not None


def entry(name: str, cap: float, seconds: float, figures=None, error: str | None = None) -> dict:
    status = "error" if error else "ok" if has_figures(figures) else "skipped"
    return {
        "step": name,
        "status": status,
        "seconds": round(seconds, 2),
        "cap_s": cap,
        "figures": figures,
        "error": error,
    }


def cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache and AOTAutograd's cache, hits and misses so far in this process (0 while nothing
    imported the compiler)."""
    if "torch._dynamo" not in sys.modules:
        return {"hits": 0, "misses": 0}
    from torch._dynamo.utils import counters

    return {
        "hits": counters["inductor"]["fxgraph_cache_hit"]
        + counters["aot_autograd"]["autograd_cache_hit"],
        "misses": counters["inductor"]["fxgraph_cache_miss"]
        + counters["aot_autograd"]["autograd_cache_miss"],
    }


def run_in_process(name: str, cap: float, ctx: Ctx) -> dict:
    t0 = time.monotonic()
    ctx.deadline = t0 + cap
    before = cache_counts()
    try:
        figures = STEP_FUNCS[name](ctx)
        e = entry(name, cap, time.monotonic() - t0, figures)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a step's failure is its result; the kit goes on
        if os.environ.get("GPU_KIT_TRACEBACK"):
            traceback.print_exc()
        e = entry(name, cap, time.monotonic() - t0, error=one_line(exc))
    after = cache_counts()
    e["compile_cache"] = {k: after[k] - before[k] for k in after}
    return e


def save_artifacts(out: Path, what: str, limit: int = ARTIFACTS_LIMIT) -> dict:
    """This process's compile artifacts (what Inductor compiled or loaded) into out/compile_artifacts/<what>.bin,
    while the folder stays within `limit` bytes: a later kit run given --artifacts loads them first."""
    if "torch._dynamo" not in sys.modules:
        return {"saved_bytes": 0, "skipped": "nothing was compiled in this process"}
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return {"saved_bytes": 0, "skipped": "nothing was compiled in this process"}
    folder = out / ARTIFACTS
    folder.mkdir(parents=True, exist_ok=True)
    held = sum(f.stat().st_size for f in folder.glob("*.bin") if f.name != f"{what}.bin")
    if held + len(saved[0]) > limit:
        return {
            "saved_bytes": 0,
            "skipped": f"{len(saved[0]) / 2**20:.0f} MiB would pass the "
            f"{limit / 2**20:.0f} MiB kept beside the results",
        }
    (folder / f"{what}.bin").write_bytes(saved[0])
    return {"saved_bytes": len(saved[0])}


def load_artifacts(folder: Path | None) -> dict:
    """A previous kit run's compile artifacts, loaded into this run's one Inductor cache folder before any step
    compiles (the child processes share the folder)."""
    files = sorted(folder.glob("*.bin")) if folder is not None and folder.is_dir() else []
    if not files:
        return {"loaded_files": 0}
    import torch

    for f in files:
        torch.compiler.load_cache_artifacts(f.read_bytes())
    return {"loaded_files": len(files), "loaded_bytes": sum(f.stat().st_size for f in files)}


def run_isolated(
    group: list[tuple[str, float]], ctx: Ctx, args, done: Callable[[str, dict], None]
) -> None:
    """The steps of `group` ((name, cap) each) in one process of their own, killed (with its children) at the
    sum of their caps; each step's entry comes back in a file, handed to `done` as soon as it is there."""
    names = [n for n, _ in group]
    tag = "+".join(names)
    state = ctx.work / f"state-{tag}.json"
    results = {n: ctx.work / f"result-{n}.json" for n in names}
    state.write_text(json.dumps({"results": ctx.results}))
    for f in results.values():
        f.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run-step",
        ",".join(names),
        "--state",
        str(state),
        "--step-result",
        str(ctx.work),
        "--work",
        str(ctx.work),
        "--device",
        ctx.device,
        "--out",
        args.out,
        "--ttl-seconds",
        str(ctx.ttl_seconds),
        "--cap",
        ",".join(str(c) for _, c in group),
        "--artifacts-mib",
        str(args.artifacts_mib),
    ]
    cmd += (["--smoke"] if ctx.smoke else []) + (["--llama"] if ctx.llama else [])
    t0, cap = time.monotonic(), sum(c for _, c in group)
    log = (ctx.work / f"log-{tag}.txt").open("w")
    p = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    pending, killed = list(names), False
    try:
        while pending:
            if results[pending[0]].exists():
                done(pending[0], json.loads(results[pending[0]].read_text()))
                pending.pop(0)
                continue
            if p.poll() is not None:
                break
            if (
                time.monotonic() - t0 > cap + GRACE_S
            ):  # each step watches its own budget; this is the backstop
                os.killpg(p.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.2)
        p.wait()
    finally:
        log.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # whatever the step left running
    lines = [
        ln
        for ln in (ctx.work / f"log-{tag}.txt").read_text(errors="replace").splitlines()
        if ln.strip()
    ]
    for name in pending:
        if results[name].exists():
            done(name, json.loads(results[name].read_text()))
            continue
        error = (
            f"killed at its cap ({cap:.0f} s + {GRACE_S:.0f} s)"
            if killed
            else f"the step's process exited {p.returncode}: {lines[-1][:300] if lines else 'no output'}"
        )
        done(name, entry(name, dict(group)[name], time.monotonic() - t0, error=error))


# ------------------------------------------------------------------------------------------------ the report


def fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v).lower()
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    if isinstance(v, dict) and set(v) == {"skipped"}:
        return f"skipped ({v['skipped']})"
    return str(v)


ROW_KEYS = (
    "tokens_per_s",
    "mfu",
    "peak_memory_gib",
    "step_ms",
    "tinygpt_x",
    "x_baseline",
    "losses",
    "loss_gap",
)


def rows_md(rows: list[dict]) -> list[str]:
    keys = [k for k in ROW_KEYS if any(k in r for r in rows)]
    out = ["| impl | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for r in rows:
        if "tokens_per_s" in r:
            cells = [
                "{:.1%}".format(r[k])
                if k == "mfu" and r.get(k) is not None
                else " ".join(f"{x:.3f}" for x in r[k])
                if k == "losses" and r.get(k)
                else fmt(r.get(k))
                for k in keys
            ]
        else:
            cells = [f"error: {r['error']}" if "error" in r else f"skipped: {r.get('skipped')}"] + [
                ""
            ] * (len(keys) - 1)
        out.append(f"| {r['impl']} | " + " | ".join(cells) + " |")
    return out


def flat(figures: dict, prefix: str = "") -> list[tuple[str, str]]:
    """(key, value) pairs of a step's figures, nested keys joined by '.', lists of rows left to rows_md."""
    out = []
    for k, v in figures.items():
        if (
            isinstance(v, dict)
            and set(v) != {"skipped"}
            and k not in ("breakdown", "settings", "plan", "speeds", "at_step1", "after_step1")
        ):
            out += flat(v, f"{prefix}{k}.")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            continue
        elif k in ("tokens_per_s",) and isinstance(v, list):
            continue
        elif isinstance(v, list):
            out.append((prefix + k, ", ".join(map(fmt, v)) or "none"))
        elif not isinstance(v, (dict, list)) or set(v) == {"skipped"}:
            out.append((prefix + k, fmt(v)))
    return out


def goals(results: dict) -> list[tuple[str, str, str]]:
    """(goal, measured, met?) for the issue's goals that this run measured."""

    def fig(step, *path):
        v = results.get(step, {}).get("figures")
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        return v

    out = []
    rows = fig("pretrain", "rows") or []
    tiny = next((r for r in rows if r.get("impl") == "tinygpt" and "tokens_per_s" in r), None)
    gpt2 = next((r for r in rows if r.get("impl") == "hf-gpt2" and "tokens_per_s" in r), None)
    if tiny and gpt2:
        x = tiny["tokens_per_s"] / gpt2["tokens_per_s"]
        out.append(
            ("pretraining >= 1.15x GPT2LMHeadModel's tokens/s", f"{x:.2f}x", str(x >= 1.15).lower())
        )
    if tiny and tiny.get("mfu") is not None:
        out.append(
            (
                "pretraining MFU >= 45% (at the recipe's accumulation)",
                f"{tiny['mfu']:.1%}",
                str(tiny["mfu"] >= 0.45).lower(),
            )
        )
    for name, bound in (("lora_r16", 1.3), ("qlora_nf4_r16", 1.2)):
        r = fig("finetune", name, "ratio", "tokens_per_s")
        if r is not None:
            out.append((f"{name} >= {bound}x the PEFT loop", f"{r:.2f}x", str(r >= bound).lower()))
    for key, bound in (("cold_s", 45), ("warm_s", 15)):
        v = fig("startup", key)
        if v is not None:
            out.append((f"start-up {key[:-2]} <= {bound} s", f"{v:.1f} s", str(v <= bound).lower()))
    timed = [
        r
        for step in ("pretrain", "speed_steps")
        for r in fig(step, "rows") or []
        if "tokens_per_s" in r or "compiles_in_timed_window" in r
    ]
    if timed:
        n = sum(r.get("compiles_in_timed_window", 0) for r in timed)
        out.append(("0 compiles in any timed window", str(n), str(n == 0).lower()))
    v = fig("startup", "recompiles_after_step1")
    if v is not None:
        out.append(("0 recompiles after step 1", str(v), str(v == 0).lower()))
    v = fig("probe", "predicted_over_measured")
    if v is not None:
        out.append(("probe's prediction within 15%", f"{v:.2f}", str(0.85 <= v <= 1.15).lower()))
    return out


def markdown(results: dict, meta: dict) -> str:
    env = (results.get("env") or {}).get("figures") or {}
    head = [
        f"# tinygpt GPU kit{' (smoke: tiny shapes on the CPU)' if meta['smoke'] else ''}",
        "",
        f"{env.get('date', meta['date'])}; GPU {fmt(env.get('gpu'))} (driver {fmt(env.get('driver'))}, "
        f"CUDA {fmt(env.get('cuda'))}); torch {fmt(env.get('torch'))}, transformers {fmt(env.get('transformers'))}, "
        f"peft {fmt(env.get('peft'))}, bitsandbytes {fmt(env.get('bitsandbytes'))}; Python {fmt(env.get('python'))}; "
        f"commit {fmt(env.get('commit'))}. Whole kit {meta['wall_s']:.0f} s.",
        "",
        "| step | status | s (cap) | figures |",
        "|---|---|---|---|",
    ]
    for name, _, _ in STEPS:
        e = results.get(name)
        if e is None:
            continue
        if e["status"] == "error":
            text = f"error: {e['error']}"
        else:
            text = "; ".join(f"{k}={v}" for k, v in flat(e["figures"] or {}))
        head.append(
            f"| {name} | {e['status']} | {e['seconds']:.0f} ({e['cap_s']:.0f}) | {text.replace('|', '/')} |"
        )
    for name in ("pretrain", "speed_steps"):
        e = results.get(name)
        if e and e["status"] == "ok" and e["figures"].get("rows"):
            head += ["", f"## {name}", "", *rows_md(e["figures"]["rows"])]
    e = results.get("finetune")
    if e and e["status"] == "ok":
        for k, v in e["figures"].items():
            if isinstance(v, dict) and v.get("rows"):
                head += [
                    "",
                    f"## finetune: {k}",
                    "",
                    *rows_md(
                        [{**r, "peak_memory_gib": r.get("peak_memory_gb")} for r in v["rows"]]
                    ),
                ]
    g = goals(results)
    if g:
        note = (
            " (smoke: tiny shapes on a CPU, so these only show the check runs)"
            if meta["smoke"]
            else ""
        )
        head += [
            "",
            f"## {GOALS}{note}",
            "",
            "| goal | measured | met |",
            "|---|---|---|",
            *[f"| {a} | {b} | {c} |" for a, b, c in g],
        ]
    return "\n".join(head) + "\n"


def write_results(out: Path, results: dict, meta: dict) -> dict:
    """results.json and results.md as they stand: written after every step, so that a kit cut off by its
    command's limit still returns every step it finished."""
    meta = {**meta, "wall_s": time.monotonic() - meta["t0"]}
    doc = {
        "kit": {k: v for k, v in meta.items() if k != "t0"},
        "steps": results,
        "goals": goals(results),
    }
    for name, text in (
        ("results.json", json.dumps(doc, indent=1, default=str)),
        ("results.md", markdown(results, meta)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)  # whole or not at all, for whoever reads it while the kit runs
    return doc


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=False, help="folder for results.json and results.md")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU: every step's code path"
    )
    ap.add_argument(
        "--only",
        help="comma-separated steps to run (default: all but "
        + ", ".join(OPTIONAL_STEPS)
        + "; --smoke: all)",
    )
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out")
    ap.add_argument(
        "--isolate",
        default="auto",
        choices=["auto", "on", "off"],
        help="each step in its own process, killed at its cap (auto: on with CUDA, off in --smoke)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--llama", action="store_true", help="the transformers Llama row too (always in --smoke)"
    )
    ap.add_argument(
        "--artifacts",
        help="a previous kit run's compile_artifacts folder, loaded before any step "
        "compiles (default: --out's, when there)",
    )
    ap.add_argument(
        "--artifacts-mib",
        type=float,
        default=ARTIFACTS_LIMIT / 2**20,
        help="at most this many MiB of compile artifacts kept in --out/compile_artifacts",
    )
    ap.add_argument(
        "--ttl-seconds",
        type=float,
        default=15.0,
        help="time_to_loss: the training budget of each recipe, start-up not counted (the issue's "
        "figure is 90 s each: --only time_to_loss --ttl-seconds 90)",
    )
    ap.add_argument("--cap-scale", type=float, default=1.0, help="multiply every step's cap")
    ap.add_argument(
        "--total",
        type=float,
        default=None,
        help=f"seconds for the whole kit (default {TOTAL_S:.0f} on a GPU: the kit ends inside 540 s; 420 "
        "in --smoke): a step gets at most what is left, and one that cannot start is recorded as "
        "skipped",
    )
    ap.add_argument("--work", help="scratch folder (default: a temporary one)")
    # internal: steps in this process (--isolate)
    ap.add_argument("--run-step", help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--step-result", help=argparse.SUPPRESS)
    ap.add_argument("--cap", help=argparse.SUPPRESS)
    return ap, ap.parse_args(argv)


def run_child(args) -> dict:
    """--run-step a,b: those steps in this process, each entry written to --step-result/result-<name>.json as it
    ends; this process's compile artifacts saved beside the results before the last one is."""
    names, caps = args.run_step.split(","), [float(c) for c in args.cap.split(",")]
    ctx = Ctx(
        args.smoke,
        args.device,
        Path(args.work),
        json.loads(Path(args.state).read_text())["results"],
        0.0,
        args.ttl_seconds,
        llama=args.smoke or args.llama,
    )
    res = {}
    for i, (name, cap) in enumerate(zip(names, caps)):
        res = run_in_process(name, cap, ctx)
        ctx.results[name] = res
        if i == len(names) - 1 and args.out:
            res["artifacts"] = save_artifacts(
                Path(args.out), "+".join(names), int(args.artifacts_mib * 2**20)
            )
        Path(args.step_result, f"result-{name}.json").write_text(json.dumps(res, default=str))
    return res


def step_cap(name: str, args) -> float:
    """A step's cap in seconds, before the kit's total bounds it."""
    gpu_cap, smoke_cap = next((g, c) for n, g, c in STEPS if n == name)
    cap = (smoke_cap if args.smoke else gpu_cap) * args.cap_scale
    if name == "time_to_loss" and not args.smoke:
        cap = max(cap, (2 * args.ttl_seconds + 50) * args.cap_scale)
    return cap


def default_steps(smoke: bool) -> list[str]:
    """The steps run without --only: all in --smoke; on a GPU all but OPTIONAL_STEPS."""
    return [n for n, _, _ in STEPS if smoke or n not in OPTIONAL_STEPS]


def units(chosen: list[str], isolate: bool) -> list[list[str]]:
    """The chosen steps in order, those of a group (GROUPS) together when each step gets its own process."""
    out: list[list[str]] = []
    for name in chosen:
        group = next((g for g in GROUPS if name in g), ()) if isolate else ()
        if out and name in group and out[-1][0] in group:
            out[-1].append(name)
        else:
            out.append([name])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap, args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the CPU, even on a machine with a GPU
        os.environ.setdefault(
            "OMP_NUM_THREADS", "1"
        )  # and its processes: a second thread on 2 busy cores is slower
    if args.run_step:
        return run_child(args)
    if not args.out:
        ap.error("--out is required")
    names = [n for n, _, _ in STEPS]
    chosen = [
        n
        for n in (args.only.split(",") if args.only else default_steps(args.smoke))
        if n and n not in args.skip.split(",")
    ]
    unknown = [n for n in chosen if n not in KEY_STEP]
    if unknown:
        ap.error(f"unknown steps {unknown}; the steps are {', '.join(names)}")
    chosen = [n for n in names if n in chosen]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = (
            Path(args.work)
            if args.work
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kit_")))
        )
        work.mkdir(parents=True, exist_ok=True)
        # one Inductor (and Triton) cache folder for every step of this run, child processes included
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
        os.environ.setdefault("TRITON_CACHE_DIR", str(work / "inductor" / "triton"))
        import torch

        if args.smoke:
            torch.set_num_threads(1)
        on_cuda = torch.cuda.is_available() and not args.smoke
        isolate = args.isolate == "on" or (args.isolate == "auto" and on_cuda)
        total = args.total if args.total is not None else (420.0 if args.smoke else TOTAL_S)
        previous = Path(args.artifacts) if args.artifacts else out / ARTIFACTS
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "smoke": args.smoke,
            "isolated": isolate,
            "t0": t0,
            "steps": chosen,
            "total_s": total,
            "inductor_cache": "one folder for every step",
            "artifacts_loaded": load_artifacts(previous),
        }
        results: dict = {}

        def done(name: str, e: dict) -> None:
            results[name] = e
            print(
                f"[gpu_kit] {name}: {e['status']} in {e['seconds']:.1f} s"
                + (f": {e['error']}" if e["error"] else ""),
                flush=True,
            )
            write_results(out, results, meta)

        write_results(out, results, meta)
        for unit in units(chosen, isolate):
            group = [(name, step_cap(name, args)) for name in unit]
            left = total - (time.monotonic() - t0) - GRACE_S
            if left < MIN_STEP_S:
                for name, cap in group:
                    done(
                        name,
                        entry(
                            name,
                            cap,
                            0.0,
                            skip(f"the kit's {total:.0f} s were spent before this step"),
                        ),
                    )
                continue
            scale = min(1.0, left / sum(c for _, c in group))
            group = [(n, c * scale) for n, c in group]
            ctx = Ctx(
                args.smoke,
                args.device,
                work,
                results,
                0.0,
                args.ttl_seconds,
                llama=args.smoke or args.llama,
            )
            print(
                f"[gpu_kit] {', '.join(unit)} (cap {sum(c for _, c in group):.0f} s) ...",
                flush=True,
            )
            if isolate:
                run_isolated(group, ctx, args, done)
            else:
                for name, cap in group:
                    done(name, run_in_process(name, cap, ctx))
        if not isolate:
            meta["artifacts"] = save_artifacts(out, "kit", int(args.artifacts_mib * 2**20))
    doc = write_results(out, results, meta)
    md = (out / "results.md").read_text()
    print(md)
    title, _, body = md.partition("\n")
    topic = "gpu-kit-smoke" if args.smoke else "gpu-kit"
    results_file.write(out, __file__, topic, title.lstrip("# "), body, argv)
    return doc


if __name__ == "__main__":
    main()
