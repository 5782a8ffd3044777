"""benchmarks/gpu_kit.py --smoke: every step of the GPU kit runs its code path on the CPU with tiny shapes, so the
kit cannot rot between GPU loans. Counts and reasons only: timings on a shared CI machine prove nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "benchmarks" / "gpu_kit.py"
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_kit  # noqa: E402

STEPS = [name for name, _, _ in gpu_kit.STEPS]


def run_kit(out: Path, *extra: str) -> tuple[dict, str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, str(KIT), "--smoke", "--out", str(out), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), p.stdout


def skipped_parts(figures) -> list[str]:
    """Every reason given for a figure not measured, anywhere in a step's figures."""
    if isinstance(figures, dict):
        own = [figures["skipped"]] if isinstance(figures.get("skipped"), str) else []
        return own + [r for k, v in figures.items() if k != "skipped" for r in skipped_parts(v)]
    if isinstance(figures, list):
        return [r for v in figures for r in skipped_parts(v)]
    return []


@pytest.mark.slow  # the whole kit's smoke run
def test_smoke_runs_every_step_with_figures_or_a_reasoned_skip(tmp_path):
    doc, stdout = run_kit(tmp_path / "out")
    steps = doc["steps"]
    assert list(steps) == STEPS == doc["kit"]["steps"]  # every step, in order
    assert len(STEPS) == 9
    for name, e in steps.items():
        assert e["status"] == "ok", (name, e["error"])  # none errored, none came back empty
        assert e["error"] is None and gpu_kit.has_figures(e["figures"])
        assert all(len(r) > 10 for r in skipped_parts(e["figures"])), name  # a skip says why
    f = {name: e["figures"] for name, e in steps.items()}
    # the rows the issue asks for, each measured or with its one-line error
    assert [r["impl"] for r in f["pretrain"]["rows"]] == ["tinygpt", "hf-gpt2", "hf-llama"]
    assert all(r["tokens_per_s"] > 0 for r in f["pretrain"]["rows"])
    # rows sharing the baseline's graph first; tiny logits: the trainer's loss is the full one, so the chunked row
    speed = {r["impl"]: r for r in f["speed_steps"]["rows"]}
    assert list(speed) == [
        "all on (as in pretrain)",
        "AdamW unfused",
        "chunked loss (full logits off)",
        "fused projections on",
        "bf16 residual",
        "FP8 head",
        "FA3 attention",
        "whole-model compile",
        "compile off",
    ]
    # the measured options: the bf16 residual stream runs on the CPU (bf16 autocast); the FP8 head and
    # FlashAttention-3 need a GPU this machine lacks, so they are skipped with their refusal's reason
    assert (
        speed["bf16 residual"]["precision"] == "bf16" and speed["bf16 residual"]["tokens_per_s"] > 0
    )
    assert "sm89+" in speed["FP8 head"]["skipped"] and "pip" not in speed["FP8 head"]["skipped"]
    assert "Hopper" in speed["FA3 attention"]["skipped"]
    timed = f["pretrain"]["rows"] + [r for r in speed.values() if "tokens_per_s" in r]
    assert len(timed) == 3 + 7
    assert all("x_baseline" in r and "loss_gap" in r for r in timed[4:])
    # every timed row's loss curve: each step of the warm-up and the timed window, from the same weights
    assert all(len(r["losses"]) == 4 and all(x > 0 for x in r["losses"]) for r in timed)
    # the same math, the same curve: the optimizer row is exact, the bf16 residual within bf16's rounding
    assert speed["AdamW unfused"]["loss_gap"] < 1e-3 and speed["bf16 residual"]["loss_gap"] < 0.1
    # at the recipe's accumulation: the optimizer once per step of 2 micro-batches
    assert all(r["grad_accum"] == 2 for r in timed)
    assert all(r["compiles_in_timed_window"] == 0 for r in timed if r is not timed[3])
    lora = f["finetune"]["lora_r16"]
    assert [r["impl"] for r in lora["rows"]] == ["tinygpt", "hf+peft"] and lora["ratio"][
        "tokens_per_s"
    ] > 0
    # the same LoRA with the adapters' dropout at 0, both sides: the speed of making it the default
    no_dropout = f["finetune"]["lora_r16_dropout0"]
    assert (lora["lora_dropout"], no_dropout["lora_dropout"]) == (0.05, 0.0)
    assert [r["impl"] for r in no_dropout["rows"]] == ["tinygpt", "hf+peft"]
    assert (
        "CUDA" in f["finetune"]["qlora_nf4_r16"]["skipped"]
    )  # QLoRA: skipped off a GPU, with the reason
    assert f["startup"]["cold_s"] > 0 and f["startup"]["warm_s"] > 0
    assert f["startup"]["recompiles_after_step1"] == 0
    assert f["probe"]["predicted_tokens_per_s"] > 0 and f["probe"]["measured_tokens_per_s"] > 0
    assert f["t4_fp16"]["no_nan"] and f["t4_fp16"]["fp16"]["steps"] == 20
    assert (
        f["t4_gqa"]["decision_sm75_fp16"] == "expand"
    )  # a T4 gets keys/values repeated, not the math kernel
    assert "CUDA" in f["t4_gqa"]["kernels_forced_sm75"]["skipped"]
    ttl = f["time_to_loss"]
    assert ttl["cpu"]["val_loss"] > 0 and ttl["cpu-fast"]["val_loss"] > 0
    md = (tmp_path / "out" / "results.md").read_text()
    assert md in stdout  # the table is printed at the end
    assert all(f"| {name} | ok |" in md for name in STEPS)
    assert "torch" in md and "bitsandbytes" in md and "driver" in md


def test_a_failing_step_is_one_line_and_the_kit_goes_on(tmp_path):
    # each step in a process of its own (as on a GPU); probe without the startup run it reads fails
    doc, _ = run_kit(tmp_path / "out", "--isolate", "on", "--only", "env,probe")
    steps = doc["steps"]
    assert list(steps) == ["env", "probe"] and doc["kit"]["isolated"]
    assert steps["env"]["status"] == "ok"
    assert steps["probe"]["status"] == "error" and "\n" not in steps["probe"]["error"]
    assert "startup" in steps["probe"]["error"]
    assert "| probe | error |" in (tmp_path / "out" / "results.md").read_text()
    # at the end, the same table in the dated result file, with the command and the device
    [dated] = (tmp_path / "out").glob("*-gpu-kit-smoke.md")
    text = dated.read_text()
    assert text.startswith("# tinygpt GPU kit (smoke") and "| probe | error |" in text
    assert "benchmarks/gpu_kit.py --smoke --out " in text and "--only env,probe`" in text


def test_steps_past_the_kits_total_are_skipped_with_the_reason(tmp_path):
    doc, _ = run_kit(tmp_path / "out", "--total", "1", "--only", "env,t4_gqa")
    for e in doc["steps"].values():
        assert e["status"] == "skipped" and "spent" in e["figures"]["skipped"]


def test_results_are_on_disk_after_each_step_while_the_kit_runs(tmp_path):
    """A kit cut off by its command's limit still returns the steps it finished: results.json and results.md are
    written after every step, so the first step's row is on disk while the second still runs."""
    out = tmp_path / "out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [sys.executable, str(KIT), "--smoke", "--out", str(out), "--only", "env,t4_fp16"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen = []  # the steps results.json held at each look while the kit was still running
    try:
        while p.poll() is None:
            if (out / "results.json").exists():
                seen.append(list(json.loads((out / "results.json").read_text())["steps"]))
            time.sleep(0.05)
    finally:
        p.kill() if p.poll() is None else None
    assert p.returncode == 0
    assert ["env"] in seen  # the first step's row, before the kit ended
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["steps"]) == ["env", "t4_fp16"] and doc["steps"]["env"]["status"] == "ok"
    assert all(
        e["compile_cache"] == {"hits": 0, "misses": 0} for e in doc["steps"].values()
    )  # nothing compiled
    assert "| env | ok |" in (out / "results.md").read_text()


def test_the_default_kit_fits_one_540_s_command_and_leaves_time_to_loss_out():
    """On a GPU the default steps' caps add up within the kit's total, which ends it inside 540 s (one command
    of a short GPU loan); time_to_loss runs only when asked, and --smoke still runs every step. Pretrain and
    speed rows share one process when each step is isolated."""
    gpu = gpu_kit.default_steps(smoke=False)
    assert "time_to_loss" not in gpu and gpu_kit.default_steps(smoke=True) == STEPS
    assert sum(cap for name, cap, _ in gpu_kit.STEPS if name in gpu) <= gpu_kit.TOTAL_S
    assert (
        gpu_kit.TOTAL_S + gpu_kit.GRACE_S + 30 <= 540
    )  # 30 s for the interpreter, torch's import and the report
    assert ["pretrain", "speed_steps"] in gpu_kit.units(gpu, isolate=True)
    assert ["pretrain"] in gpu_kit.units(gpu, isolate=False)


@pytest.mark.slow  # an Inductor compile on the CPU
def test_compile_artifacts_saved_beside_the_results_make_the_next_run_hit(tmp_path, monkeypatch):
    """What one kit run compiled is saved into --out/compile_artifacts (within its byte limit); a later run that
    loads them into a fresh Inductor cache folder compiles the same graph from the cache: its hits are counted."""
    import torch

    def compile_once():
        torch._dynamo.reset()
        fn = torch.compile(lambda x: (x.sin() * 2).sum(), dynamic=False)
        return fn(torch.ones(8))

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-1"))
    torch.compiler.reset()
    before = gpu_kit.cache_counts()
    compile_once()
    assert gpu_kit.cache_counts()["misses"] > before["misses"]
    assert (
        gpu_kit.save_artifacts(tmp_path / "out", "kit", limit=1)["saved_bytes"] == 0
    )  # over its limit: kept out
    saved = gpu_kit.save_artifacts(tmp_path / "out", "kit")
    assert (
        saved["saved_bytes"]
        == (tmp_path / "out" / gpu_kit.ARTIFACTS / "kit.bin").stat().st_size
        > 0
    )

    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-2")
    )  # a new machine's empty cache
    torch.compiler.reset()
    assert gpu_kit.load_artifacts(tmp_path / "out" / gpu_kit.ARTIFACTS)["loaded_files"] == 1
    before = gpu_kit.cache_counts()
    compile_once()
    assert gpu_kit.cache_counts()["hits"] > before["hits"]
    torch._dynamo.reset()


def test_a_row_that_compiles_inside_its_timed_window_is_an_error_not_a_figure(tmp_path):
    """A recompile (here: a Python number the compiled code guards on, new at every step) or a graph break in
    the timed window means the row timed a compile: it is recorded as an error with the count, no tokens/s.
    The same row without the recompile is a figure."""
    import torch

    from tinygpt.core.precision import choose_precision

    @torch.compile(backend="eager", dynamic=False)
    def scaled(h, k):
        return h * k

    class Loss(torch.nn.Module):
        chunked = None

        def __init__(self, recompile: bool):
            super().__init__()
            self.emb, self.recompile, self.calls = torch.nn.Embedding(16, 8), recompile, 0

        def forward(self, x, y):
            self.calls += 1
            k = (
                self.calls if self.recompile else 1
            )  # a new constant each call: a new graph each call
            return torch.nn.functional.cross_entropy(
                scaled(self.emb(x), k).flatten(0, 1), y.flatten()
            )

    shape = gpu_kit.Shape("tiny", vocab=8, seq_len=4, micro_batch=2, warmup=1, steps=3)
    ctx = gpu_kit.Ctx(False, "cpu", tmp_path, {}, time.monotonic() + 60, 1.0)
    rows = {}
    for recompile in (True, False):
        torch._dynamo.reset()
        loss = Loss(recompile)
        opt = torch.optim.SGD(loss.parameters(), lr=0.1)
        prec = choose_precision(torch.device("cpu"), "fp32")
        rows[recompile] = gpu_kit.timed_row(
            "row", loss, loss, opt, prec, torch.device("cpu"), "off", shape, 1.0, None, ctx
        )
    bad, good = rows[True], rows[False]
    assert "timed window" in bad["error"] and bad["compiles_in_timed_window"] >= 3
    assert "tokens_per_s" not in bad
    assert (
        "error" not in good and good["compiles_in_timed_window"] == 0 and good["tokens_per_s"] > 0
    )
    torch._dynamo.reset()
