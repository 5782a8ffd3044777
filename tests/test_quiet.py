"""What a newcomer sees on a plain LoRA run: tinygpt's own lines, and none of the third-party warnings
known to be harmless (issue 26 item 3). Real processes through the `tinygpt` command, so every import
happens as it does for a user: a tiny base pretrained on real prose, finetuned on instruction data whose
records are longer than the base's context (so transformers' length check would fire), then
`generate --adapter` (which imports peft, and through it bitsandbytes)."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_finetune import make_run, texts
from tinygpt.model.tokenizer import train_bpe

REPO = Path(__file__).resolve().parents[1]
NOISE = (
    "Token indices sequence length is longer than the specified maximum sequence length",
    "Failed to load CPU gemm_4bit_forward from kernels-community",
)


def _tinygpt(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "tinygpt", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory, shared_data) -> Path:
    records = json.loads((shared_data / "code_alpaca_2k.json").read_text(encoding="utf-8"))
    prose = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:60_000]
    docs = [prose[i : i + 2000] for i in range(0, len(prose), 2000)]
    tok = train_bpe(texts(records[:300]) + docs, vocab_size=512)
    return make_run(tmp_path_factory.mktemp("quiet") / "base", docs, tok, seed=0, steps=10)


@pytest.mark.slow  # real LoRA finetune and generate in subprocesses
def test_lora_finetune_and_generate_show_no_harmless_third_party_warning(
    base, shared_data, tmp_path
):
    ft = _tinygpt(
        "finetune",
        "--recipe",
        "lora-r8",
        "--base",
        str(base),
        "--data",
        str(shared_data / "code_alpaca_2k.json"),
        "--run-dir",
        str(tmp_path / "ft"),
        "--max-steps",
        "2",
        "--hardware",
        "cpu",
        "--device",
        "cpu",
        "--quiet",
    )
    said = ft.stdout + ft.stderr
    # the case arises: records longer than the base's context of 64, which tinygpt truncates and reports itself
    truncated = int(said.split(" truncated")[0].rsplit(" ", 1)[-1])
    assert truncated > 0, said
    gen = _tinygpt(
        "generate",
        "--adapter",
        str(tmp_path / "ft"),
        "--prompt",
        "Write a function",
        "--max-new-tokens",
        "5",
    )
    for out in (said, gen.stdout + gen.stderr):
        for text in NOISE:
            assert text not in out, out


def test_only_that_bitsandbytes_note_is_dropped():
    """The filter is on bitsandbytes' optional-kernel logger and drops that one note: its other records,
    and other loggers, still reach the user."""
    import tinygpt.finetune  # noqa: F401  (installs the filter)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    kept: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: kept.append(record.getMessage())
    logger.addHandler(handler)
    other = logging.getLogger("bitsandbytes.functional")
    other.addHandler(handler)
    try:
        logger.warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s.",
            "No module named 'kernels'",
        )
        logger.warning("something else went wrong")
        other.warning("Failed to load CPU gemm_4bit_forward from kernels-community: elsewhere")
    finally:
        logger.removeHandler(handler)
        other.removeHandler(handler)
    assert kept == [
        "something else went wrong",
        "Failed to load CPU gemm_4bit_forward from kernels-community: elsewhere",
    ]
