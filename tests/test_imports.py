"""Commands import what they use: `tinygpt --help` imports no torch at all, and `recipes`,
`generate` and CPU pretraining with compile off load nothing of the compiler (torch._dynamo, torch._inductor,
which bring sympy), transformers, peft, datasets or matplotlib (torch's own optimizers would import
torch._dynamo on their first call: `train.optim.EagerOptimizer`). Each command runs as a real
process under `python -X importtime` (its child processes too, the shard writer's included:
PYTHONPROFILEIMPORTTIME), and every module it imported is read from that list. What is counted is
modules, never time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPILER = ("torch._dynamo", "torch._inductor", "sympy")
UNUSED = (*COMPILER, "transformers", "peft", "datasets", "matplotlib")


def imported(*args: str, cwd: Path = REPO) -> set[str]:
    """Every module the command `python -m tinygpt ARGS` (and any Python process it starts) imported."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "tinygpt", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", out.stderr, re.M))


def unused(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in UNUSED or m.startswith(UNUSED))


def test_help_imports_no_torch_and_recipes_no_compiler_and_no_hugging_face():
    modules = imported("--help")
    assert "tinygpt.cli" in modules and "argparse" in modules  # the list is read
    assert not {m for m in modules if m.split(".")[0] == "torch"}  # nor the modules of any command
    assert not {
        m
        for m in modules
        if m.startswith(
            (
                "tinygpt.train",
                "tinygpt.data",
                "tinygpt.fit",
                "tinygpt.pretrain",
                "tinygpt.evals",
                "tinygpt.model",
            )
        )
    }
    modules = imported("recipes")
    assert "torch" in modules and unused(modules) == []


def test_compile_only_decoration_is_what_torch_would_apply():
    """attention.py marks `_expands` constant for the compiler without importing it; the mark is all that
    `torch.compiler.assume_constant_result` sets (if torch changes that, this fails, not the compiled graph)."""
    import torch

    from tinygpt.model import attention

    def f():
        return 0

    def g():
        return 0

    assert vars(torch.compiler.assume_constant_result(f)) == vars(
        attention.assume_constant_result(g)
    )
    assert vars(attention._expands) == vars(f)


def test_cpu_pretraining_and_generate_import_no_compiler_and_no_hugging_face(tmp_path):
    run = tmp_path / "run"
    text = tmp_path / "text.txt"
    text.write_text(
        "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(3000)), encoding="utf-8"
    )
    modules = imported(
        "pretrain",
        "--recipe",
        "cpu-smoke",
        "--data",
        str(text),
        "--run-dir",
        str(run),
        "--max-steps",
        "3",
        "--quiet",
        "--device",
        "cpu",
        "--set",
        "train.compile=off",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.save_every=3",
    )
    assert (
        "tinygpt.train.trainer" in modules and "tinygpt.data.shards" in modules
    )  # it trained and tokenized
    assert unused(modules) == []
    modules = imported(
        "generate", "--run-dir", str(run), "--prompt", "def main(", "--max-new-tokens", "5"
    )
    assert "tinygpt.model.generate" in modules
    assert unused(modules) == []


def test_the_shard_writer_tokenizes_gpt2_without_torch(tmp_path, monkeypatch, capfd):
    """The background process that turns text into GPT-2 token shards (`python -m tinygpt.data.shard_writer`)
    imports tiktoken and numpy, never torch: its start-up is part of every tokenizing run's cost."""
    from tinygpt.core.config import DataConfig
    from tinygpt.data.shard_writer import ShardWriter
    from tinygpt.model.tokenizer import load_gpt2

    text = tmp_path / "text.txt"
    text.write_text(
        "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(2000)), encoding="utf-8"
    )
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    capfd.readouterr()
    writer = ShardWriter(
        DataConfig(source=str(text), tokenizer="gpt2", vocab_size=50304),
        load_gpt2(),
        tmp_path / "shards",
    )
    assert writer.process.wait(300) == 0
    modules = set(
        re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", capfd.readouterr().err, re.M)
    )
    assert "tinygpt.data.sources" in modules and "tiktoken" in modules  # it ran, on tiktoken
    assert not {m for m in modules if m.split(".")[0] == "torch"}
    assert (tmp_path / "shards" / "manifest.json").is_file()
