"""FLOP counting (`GPT.flops_per_token`, the numerator of MFU) and the speed benchmark's CPU mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tinygpt.core.config import ModelConfig
from tinygpt.core.recipes import model_config
from tinygpt.model.gpt import GPT

REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "tiny": model_config("tiny", vocab_size=300),
    "tied-gqa": ModelConfig(
        vocab_size=300,
        n_layer=3,
        n_head=4,
        n_kv_head=2,
        d_model=64,
        d_ff=160,
        max_seq_len=64,
        tie_embeddings=True,
    ),
}


def matmul_weights(c: ModelConfig) -> int:
    """Weights used in a matmul, counted from the config by hand (the embedding lookup is not a matmul;
    a tied lm_head is)."""
    hd = c.head_dim
    attn = c.d_model * c.n_head * hd * 2 + c.d_model * c.n_kv_head * hd * 2  # q, o; k, v
    mlp = 3 * c.d_model * c.d_ff
    return c.n_layer * (attn + mlp) + c.vocab_size * c.d_model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_flops_per_token_is_6n_plus_attention(name):
    c = CONFIGS[name]
    T = 48
    manual = 6 * matmul_weights(c) + 12 * c.n_layer * T * c.d_model
    # GPT.flops_per_token may also count the RMSNorm gains ((2 n_layer + 1) d_model weights, no
    # matmul) as nanoGPT's "6N" does: 0.2% here, under 0.001% at 124M.
    norm_gains = (2 * c.n_layer + 1) * c.d_model
    assert GPT(c).flops_per_token(T) - manual in (0, 6 * norm_gains)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_flops_match_torch_flop_counter(name):
    """FlopCounterMode counts matmuls: forward = 2 * matmul weights * tokens + attention's QK^T and AV,
    2 * 2 * T * T * d_model per sequence and layer. The math SDPA kernel computes the causal
    product at full length (the CPU flash kernel has no FLOP formula); flops_per_token counts it so too."""
    c = CONFIGS[name]
    B, T = 2, 32
    model = GPT(c)
    idx = torch.randint(0, c.vocab_size, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx)
    attention = 2 * 2 * T * T * c.d_model * c.n_layer * B
    assert counter.get_total_flops() == 2 * matmul_weights(c) * B * T + attention

    # Forward and backward together: 3x the forward, the manual count that flops_per_token is.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    assert (
        counter.get_total_flops()
        == (6 * matmul_weights(c) + 12 * c.n_layer * T * c.d_model) * B * T
    )


@pytest.mark.slow  # the benchmark script's run
def test_benchmark_cpu_mode_runs(tmp_path):
    """`benchmarks/gpu_pretrain.py` on the CPU with a tiny model and the Hugging Face reference."""
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "gpu_pretrain.py"),
        "--size",
        "tiny",
        "--vocab-size",
        "512",
        "--seq-len",
        "64",
        "--micro-batch",
        "4",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--reference",
        "hf",
        "--json",
        str(out),
        "--results",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tinygpt / hf-llama" in proc.stdout
    result = json.loads(out.read_text())
    ours, hf = result["rows"]
    assert (ours["impl"], hf["impl"]) == ("tinygpt", "hf-llama")
    assert ours["params"] == hf["params"]
    assert (
        ours["tokens_per_s"] > 0 and hf["tokens_per_s"] > 0 and result["ratio"]["tokens_per_s"] > 0
    )
    assert result["hf_same_batch_loss_diff"] < 1e-4  # the same configuration and weights
    assert result["flops_per_token"] == GPT(model_config("tiny", vocab_size=512)).flops_per_token(
        64
    )
    # the dated result file: the command, both rows beside each other, the ratio as the reference
    [written] = tmp_path.glob("*-pretrain-speed.md")
    text = written.read_text()
    assert f"python benchmarks/gpu_pretrain.py {' '.join(cmd[2:])}`" in text
    assert f"| tinygpt | {ours['params']:,} | 4 | 64 |" in text
    assert f"| hf-llama | {hf['params']:,} | 4 | 64 |" in text
    assert "- reference: transformers' LlamaForCausalLM" in text and "tokens/s x" in text


def test_benchmark_max_micro_batch_search():
    """Doubling until out of memory, then bisecting, on a step that fails above 45 rows."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_pretrain as bench

    tried = []

    def step(x, y):
        tried.append(x.shape[0])
        if x.shape[0] > 45:
            raise torch.OutOfMemoryError("fake")

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    found = bench.max_micro_batch(
        step, opt, start=3, limit=1024, bisect=8, seq_len=4, vocab=10, device=torch.device("cpu")
    )
    assert found == 45
    assert sorted(set(tried))[:5] == [3, 6, 12, 24, 36] and max(tried) == 48
    assert (
        bench.max_micro_batch(
            step, opt, start=3, limit=20, bisect=2, seq_len=4, vocab=10, device=torch.device("cpu")
        )
        == 12
    )  # the limit stops the doubling
