"""Time to the first training step, and compiles counted.

CPU (what CI machines and this repository's figures use):
    python benchmarks/startup.py cpu            # 3 MB vs 250 MB of local text, the `cpu` recipe, cold caches
    python benchmarks/startup.py compile        # compile=on vs regional: cold compile, graphs, recompiles
    python benchmarks/startup.py imports --repeat 5     # `tinygpt --help` / `recipes` vs `import torch`, CPU-s
    python benchmarks/startup.py tokenize --repeat 3    # GPT-2 through the shard writer vs tiktoken alone
    python benchmarks/startup.py first-step --repeat 5 --nanogpt DIR   # warm, vs nanoGPT's train.py
        (DIR: a checkout of karpathy/nanoGPT: its train.py, model.py, configurator.py as they are)
        (--before DIR: the writer of another checkout, e.g. `git archive COMMIT | tar -x -C DIR`;
         TINYGPT_TIKTOKEN=0: the writer on `tokenizers`)
GPU (an H100 or A100; `--data builtin` needs no network):
    python benchmarks/startup.py gpu --recipe a100-124m --steps 30
        cold: empty compiler and tinygpt caches; warm: the run's compile_cache.bin copied into a fresh run folder
        with an empty compiler cache (a new VM); both with the step times after the first

Each run is a real `tinygpt pretrain` process. "first step" is the wall time from launching the process to
its start-up record in metrics.jsonl (imports included); the record's own breakdown is printed beside it.
Each mode's table goes to a dated file in benchmarks/results/ (`--results`), with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import shutil
import site
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import results_file

REPO = Path(__file__).resolve().parents[1]
# what each mode's figures are set against
REFERENCE = {
    "cpu": "the same run on 3 MB of text (goal: 250 MB at most 1.5x its wall to the first step)",
    "compile": "whole-model compilation (`train.compile=on`) beside regional",
    "gpu": "goals: cold first step at most 45 s, warm at most 15 s",
    "imports": '`python -c "import torch"`, run in turn (goal: `tinygpt --help` at most 1.15x)',
    "tokenize": "tiktoken's encode_ordinary_batch alone on the same documents (goal: at least 0.8x)",
    "first-step": "nanoGPT's train.py at the same shape, run in turn (goal: at least 1.0x its speed)",
}


def run_until_first_step(args: list[str], run_dir: Path, env: dict, finish: bool = False) -> dict:
    """Launch `tinygpt pretrain ARGS`; the seconds until its start-up record appears, and that record.
    The process is stopped there unless `finish`."""
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-m", "tinygpt", "pretrain", "--run-dir", str(run_dir), "--quiet", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    metrics = run_dir / "metrics.jsonl"
    record = None
    while record is None:
        if p.poll() is not None and not metrics.exists():
            raise SystemExit(f"tinygpt pretrain failed:\n{p.stdout.read().decode()[-3000:]}")
        if metrics.exists():
            record = next(
                (
                    m
                    for m in map(json.loads, metrics.read_text().splitlines()[:3])
                    if "startup" in m
                ),
                None,
            )
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    if finish:
        out = p.communicate()[0].decode()
        if p.returncode != 0:
            raise SystemExit(f"tinygpt pretrain failed:\n{out[-3000:]}")
    else:
        p.terminate()
        p.wait()
    return {"wall_s": round(wall, 2), **record["startup"]}


def fresh_env(root: Path, **extra: str) -> dict:
    return {
        **os.environ,
        "TINYGPT_CACHE": str(root / "tinygpt-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        **extra,
    }


def cpu(args, say: Callable) -> None:
    corpus = args.corpus or site.getsitepackages()[0]
    say(
        f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"corpus {corpus}"
    )
    say("| text | wall to first step (s) | tokenizer | data (first shard) | model | first step |")
    say("|---|---|---|---|---|---|")
    rows = {}
    for chars in (3_000_000, 250_000_000):
        walls = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                r = run_until_first_step(
                    [
                        "--recipe",
                        "cpu",
                        "--data",
                        corpus,
                        "--set",
                        f"data.max_chars={chars}",
                        "--max-steps",
                        "1",
                    ],
                    Path(tmp) / "run",
                    fresh_env(Path(tmp)),
                )
            walls.append(r["wall_s"])
        rows[chars] = {**r, "wall_s": statistics.median(walls)}
        say(
            f"| {chars / 1e6:.0f} MB | {statistics.median(walls):.2f} ({', '.join(map(str, walls))}) | "
            f"{r['tokenizer_s']} | {r['data_s']} | {r['model_s']} | {r['first_step_s']} |"
        )
    ratio = rows[250_000_000]["wall_s"] / rows[3_000_000]["wall_s"]
    say(f"\n250 MB / 3 MB, medians: {ratio:.2f}x (goal: at most 1.5x)")


_COUNT = """
import json, sys
from torch._dynamo.utils import counters
from tinygpt.core.recipes import get_recipe
from tinygpt.pretrain.run_pretrain import pretrain
mode, run, cache = sys.argv[1:4]
recipe = get_recipe("cpu").replace(train={"compile": mode, "eval_every": 10, "max_steps": 30, "eval_batches": 3,
                                          "save_every": 30}, data={"max_chars": 300_000})
res = pretrain(recipe, run, progress=False, device="cpu", cache_dir=cache)
print(json.dumps({"evals": sum("val_loss" in m for m in res.metrics), "graphs": counters["stats"]["unique_graphs"],
                  "frames": counters["frames"]["total"], "recompiles": sum(counters["recompiles"].values())}))
"""


def compile_modes(args, say: Callable) -> None:
    say(
        f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        "`cpu` recipe, 30 steps, 3 evaluations, cold compiler cache"
    )
    say("| compile | first step (s) | of which compile (s) | graphs | recompiles after step 1 |")
    say("|---|---|---|---|---|")
    for mode in ("on", "regional"):
        with tempfile.TemporaryDirectory() as tmp:
            env = fresh_env(Path(tmp))
            out = subprocess.run(
                [sys.executable, "-c", _COUNT, mode, f"{tmp}/run", f"{tmp}/cache"],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            c = json.loads(out.stdout.strip().splitlines()[-1])
            start = next(
                json.loads(x)["startup"]
                for x in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()
                if "startup" in x
            )
        say(
            f"| {mode} | {start['first_step_s']} | {start['compile_s']} | {c['graphs']} | {c['recompiles']} |"
        )


def child_cpu_s(cmd: list[str], env: dict | None = None) -> float:
    """User + system CPU seconds of one finished child process (the kernel's accounting, all its threads)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def imports(args, say: Callable) -> None:
    """CPU seconds of `tinygpt --help` and `tinygpt recipes` against `python -c "import torch"`, run in turn
    (A B A B ...), the ratio taken pair by pair; medians."""
    say(
        f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {args.repeat} pairs each, CPU seconds (user + system)"
    )
    say("| command | CPU-s | `import torch` CPU-s | ratio (median of pairs) |")
    say("|---|---|---|---|")
    base = [sys.executable, "-c", "import torch"]
    child_cpu_s(base)  # warm the file cache
    for what in (["--help"], ["recipes"]):
        cmd = [sys.executable, "-m", "tinygpt", *what]
        child_cpu_s(cmd)
        a, b = [], []
        for _ in range(args.repeat):
            a.append(child_cpu_s(cmd))
            b.append(child_cpu_s(base))
        ratio = statistics.median(x / y for x, y in zip(a, b))
        say(
            f"| `tinygpt {' '.join(what)}` | {statistics.median(a):.2f} | {statistics.median(b):.2f} | {ratio:.2f}x |"
        )
    say("\ngoal: `tinygpt --help` at most 1.15x `import torch`")


_WRITER = """
import json, resource, sys, tempfile
from tinygpt.core.config import DataConfig
from tinygpt.model.tokenizer import load_gpt2
from tinygpt.data.shards import build_token_cache
cfg = DataConfig(source=sys.argv[1], tokenizer="gpt2", max_chars=int(sys.argv[2]))
tok = load_gpt2()
with tempfile.TemporaryDirectory() as tmp:
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    m = build_token_cache(cfg, tok, tmp).meta
    r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"tokens": m["train_tokens"] + m["val_tokens"],
                  "cpu_s": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime}))
"""

_TIKTOKEN = """
import json, resource, sys
from tinygpt.core.config import DataConfig
from tinygpt.model.tokenizer import tiktoken_gpt2
from tinygpt.data.sources import iter_documents
from tinygpt.data.shard_writer import BATCH_DOCS
docs = list(iter_documents(DataConfig(source=sys.argv[1], tokenizer="gpt2", max_chars=int(sys.argv[2]))))
enc = tiktoken_gpt2()
r0 = resource.getrusage(resource.RUSAGE_SELF)
n = sum(len(ids) + 1 for i in range(0, len(docs), BATCH_DOCS) for ids in enc.encode_ordinary_batch(docs[i:i + BATCH_DOCS]))
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"tokens": n, "cpu_s": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime}))
"""


def tokenize(args, say: Callable) -> None:
    """GPT-2 tokens per CPU-second: the shard writer (`build_token_cache`: read, encode, uint16, hash, write)
    against tiktoken's `encode_ordinary_batch` alone on the same documents (already read), in turn; medians."""
    corpus = args.corpus or "builtin"
    say(
        f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"corpus {corpus}, {args.chars / 1e6:.0f} MB, {args.repeat} runs each, CPU seconds of all threads"
    )
    env = dict(os.environ)
    if (
        args.before
    ):  # its folder first on the path (`python -c` puts the working folder before PYTHONPATH)
        env["PYTHONPATH"] = args.before
    rates: dict[str, list[float]] = {"writer": [], "tiktoken": []}
    tokens = {}
    for _ in range(args.repeat):
        for name, code, e in (("writer", _WRITER, env), ("tiktoken", _TIKTOKEN, None)):
            out = subprocess.run(
                [sys.executable, "-c", code, corpus, str(args.chars)],
                env=e,
                text=True,
                cwd=args.before if e is env and args.before else REPO,
                capture_output=True,
            )
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rates[name].append(r["tokens"] / r["cpu_s"])
            tokens[name] = r["tokens"]
    w, t = statistics.median(rates["writer"]), statistics.median(rates["tiktoken"])
    label = (
        f"writer from {args.before}"
        if args.before
        else (
            "writer, tokenizers (TINYGPT_TIKTOKEN=0)"
            if os.environ.get("TINYGPT_TIKTOKEN") == "0"
            else "writer"
        )
    )
    say("| path | tokens | tokens per CPU-s (median) | runs |")
    say("|---|---|---|---|")
    say(
        f"| {label} | {tokens['writer']:,} | {w / 1e6:.2f}M | {', '.join(f'{x / 1e6:.2f}M' for x in rates['writer'])} |"
    )
    say(
        f"| tiktoken encode_ordinary_batch alone | {tokens['tiktoken']:,} | {t / 1e6:.2f}M | "
        f"{', '.join(f'{x / 1e6:.2f}M' for x in rates['tiktoken'])} |"
    )
    say(f"\nwriter / tiktoken: {w / t:.2f}x (goal: at least 0.8x)")


def cpu_until(cmd: list[str], cwd: Path, env: dict, done) -> float:
    """CPU seconds (user + system, the kernel's accounting) of `cmd` from launch until `done(lines
    printed)` is true, when it is killed (SIGKILL: nothing it would do after that is counted)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    while not done(lines):
        line = p.stdout.readline()
        if not line and p.poll() is not None and not done(lines):
            raise SystemExit(f"{cmd[:3]} ended before its first step:\n{''.join(lines)[-3000:]}")
        lines.append(line)
    p.kill()
    p.communicate()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def first_step(args, say: Callable) -> None:
    """Launch to the end of the first step on a warm cache, `cpu-smoke`'s shape (2 layers, d_model
    64, 2 heads, context 64, micro-batch 8, vocabulary 512, fp32, no compile), CPU seconds: `tinygpt
    pretrain` (its token cache filled by a run before) until its start-up line, against nanoGPT's
    `train.py` (its train.bin / val.bin written before) until its `iter 0:` line, in turn."""
    if not args.nanogpt:
        raise SystemExit("give --nanogpt DIR, a checkout of karpathy/nanoGPT")
    import numpy as np

    say(
        f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, {args.repeat} pairs, CPU-s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = {**fresh_env(tmp), "PYTHONUNBUFFERED": "1"}
        tiny = [
            sys.executable,
            "-m",
            "tinygpt",
            "pretrain",
            "--recipe",
            "cpu-smoke",
            "--device",
            "cpu",
            "--max-steps",
            "1",
            "--compile",
            "off",
        ]
        subprocess.run(
            [*tiny, "--run-dir", str(tmp / "warm-up"), "--quiet"],
            cwd=REPO,
            env=env,
            check=True,
            capture_output=True,
        )  # fills the token cache
        nano = tmp / "nanogpt"
        (nano / "data" / "tg").mkdir(parents=True)
        for f in ("train.py", "model.py", "configurator.py"):
            shutil.copy(Path(args.nanogpt) / f, nano / f)
        rng = np.random.default_rng(0)
        rng.integers(0, 512, 150_000, dtype=np.uint16).tofile(nano / "data" / "tg" / "train.bin")
        rng.integers(0, 512, 8_000, dtype=np.uint16).tofile(nano / "data" / "tg" / "val.bin")
        with open(nano / "data" / "tg" / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": 512}, f)
        nano_cmd = [
            sys.executable,
            "train.py",
            "--dataset=tg",
            "--n_layer=2",
            "--n_head=2",
            "--n_embd=64",
            "--block_size=64",
            "--batch_size=8",
            "--gradient_accumulation_steps=1",
            "--device=cpu",
            "--compile=False",
            "--dtype=float32",
            "--dropout=0.0",
            "--bias=False",
            "--eval_iters=1",
            "--eval_interval=1000",
            "--log_interval=1",
            "--max_iters=0",
            "--out_dir=out",
        ]
        ours, theirs = [], []
        for i in range(args.repeat + 1):  # the first pair warms the file cache
            run = tmp / f"run{i}"
            a = cpu_until(
                [*tiny, "--run-dir", str(run)],
                REPO,
                env,
                lambda lines: any("to the first step" in x for x in lines),
            )
            b = cpu_until(
                nano_cmd, nano, env, lambda lines: any(x.startswith("iter 0:") for x in lines)
            )
            if i:
                ours.append(a)
                theirs.append(b)
        records = (run / "metrics.jsonl").read_text().splitlines()
        startup = next(json.loads(x)["startup"] for x in records if "startup" in x)
    ratio = statistics.median(b / a for a, b in zip(ours, theirs))
    say("| launch to the end of the first step | CPU-s (median) | runs |")
    say("|---|---|---|")
    for name, runs in (("tinygpt pretrain", ours), ("nanoGPT train.py", theirs)):
        say(f"| {name} | {statistics.median(runs):.2f} | {', '.join(f'{x:.2f}' for x in runs)} |")
    say(f"\nnanoGPT / tinygpt (speed, median of pairs): {ratio:.2f}x (goal: at least 1.0x)")
    say(f"tinygpt's last start-up record (wall s): {json.dumps(startup)}")


def gpu(args, say: Callable) -> None:
    base = [
        "--recipe",
        args.recipe,
        "--data",
        args.data,
        "--max-steps",
        str(args.steps),
        "--save-every",
        "0",
        "--eval-every",
        "0",
        "--set",
        "train.log_every=1",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cold = run_until_first_step(base, tmp / "cold", fresh_env(tmp / "a"), finish=True)
        (tmp / "warm").mkdir()
        shutil.copy(tmp / "cold" / "compile_cache.bin", tmp / "warm")
        for f in ("run.json", "tokenizer.json"):
            shutil.copy(tmp / "cold" / f, tmp / "warm")
        env = fresh_env(
            tmp / "b", TINYGPT_CACHE=str(tmp / "a" / "tinygpt-cache")
        )  # the same signing key
        warm = run_until_first_step(base, tmp / "warm", env, finish=True)
        steps = [
            m
            for m in map(json.loads, (tmp / "cold" / "metrics.jsonl").read_text().splitlines())
            if "loss" in m
        ]
    say("```json\n" + json.dumps({"cold": cold, "warm": warm}, indent=1) + "\n```")
    say("goals: cold first step <= 45 s, warm <= 15 s (wall, imports included)")
    if len(steps) > 3:
        tps = [m["tokens_per_s"] for m in steps[1:] if m.get("tokens_per_s")]
        med = statistics.median(tps)
        slow = [
            m["step"] for m in steps[1:] if m.get("tokens_per_s") and m["tokens_per_s"] < med / 2
        ]
        say(
            f"tokens/s per step after the first: median {med:.0f}, min {min(tps):.0f}; steps slower than twice "
            f"the median: {slow or 'none'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=["cpu", "compile", "gpu", "imports", "tokenize", "first-step"])
    ap.add_argument("--corpus", help="a folder of text (default: this Python's site-packages)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--recipe", default="a100-124m")
    ap.add_argument("--data", default="builtin")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--chars", type=int, default=20_000_000, help="tokenize: characters of the corpus"
    )
    ap.add_argument("--nanogpt", help="first-step: a checkout of karpathy/nanoGPT")
    ap.add_argument(
        "--before", help="tokenize: a checkout whose shard writer to measure (PYTHONPATH)"
    )
    results_file.add_option(ap)
    args = ap.parse_args()
    say = results_file.Report()
    {
        "cpu": cpu,
        "compile": compile_modes,
        "gpu": gpu,
        "imports": imports,
        "tokenize": tokenize,
        "first-step": first_step,
    }[args.what](args, say)
    results_file.write(
        args.results,
        __file__,
        f"startup-{args.what}",
        f"Start-up: `startup.py {args.what}`",
        say.text(),
        reference=REFERENCE[args.what],
    )


if __name__ == "__main__":
    main()
