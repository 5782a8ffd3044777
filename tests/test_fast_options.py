"""The speed options that stay off until a GPU measures them (`tinygpt.model.fast_options`): the bf16
residual stream works on the CPU (bf16 autocast) and trains on real text; the FP8 head and FlashAttention-3,
which need torchao / the kernels package and an sm89+ / Hopper GPU, are refused in one line where those are
missing, and their selection (which module converts, which attention call takes the kernel) is checked here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tinygpt.core.config import ConfigError, TrainConfig
from tinygpt.core.recipes import model_config
from tinygpt.data.sampler import WindowSampler, fixed_batches
from tinygpt.model import attention
from tinygpt.model.attention import fa3_problem, fa3_serves, load_fa3
from tinygpt.model.fast_options import fp8_filter, fp8_problem, residual
from tinygpt.model.gpt import GPT, KVCache
from tinygpt.train.step import TrainStep
from tinygpt.train.trainer import TrainData, Trainer


def _config(**kw):
    return dataclasses.replace(model_config("tiny", vocab_size=512, n_head=4), **kw)


def _stream_dtypes(model: GPT, idx: torch.Tensor, autocast: bool) -> list[torch.dtype]:
    """The dtype of the residual stream into and out of every block, and into the final norm."""
    seen = []
    hooks = [
        b.register_forward_hook(lambda m, a, out: seen.extend([a[0].dtype, out.dtype]))
        for b in model.blocks()
    ]
    hooks.append(model.model.norm.register_forward_hook(lambda m, a, out: seen.append(a[0].dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(idx, idx)
    for h in hooks:
        h.remove()
    return seen


def test_bf16_residual_keeps_the_stream_in_bf16_only_under_bf16_autocast():
    idx = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    on = GPT(_config(bf16_residual=True, n_kv_head=2, qk_norm=True))
    torch.manual_seed(0)
    off = GPT(_config())
    n = 2 * on.config.n_layer + 1
    assert _stream_dtypes(on, idx, autocast=True) == [torch.bfloat16] * n
    assert _stream_dtypes(off, idx, autocast=True) == [torch.float32] * n  # the default: fp32
    assert (
        _stream_dtypes(on, idx, autocast=False) == [torch.float32] * n
    )  # no autocast: nothing to do
    with torch.autocast("cpu", dtype=torch.float16):  # only bf16 autocast: fp16 would overflow
        assert residual(torch.ones(2), True).dtype == torch.float32
    # off, or outside autocast, the same numbers as the default model
    torch.manual_seed(0)
    plain = GPT(_config(n_kv_head=2, qk_norm=True))
    torch.testing.assert_close(on(idx), plain(idx), atol=0, rtol=0)


def _train(tokens, run_dir: Path, **model_kw):
    cfg = TrainConfig(
        micro_batch_size=8,
        seq_len=64,
        max_steps=12,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=3,
        eval_every=12,
        eval_batches=2,
        log_every=1,
        save_every=0,
        precision="bf16",
        device="cpu",
    )
    torch.manual_seed(0)
    model = GPT(_config(**model_kw))
    dtypes = []
    model.blocks()[-1].register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    sampler = WindowSampler(tokens.train, cfg.seq_len, cfg.seed)
    val = fixed_batches(tokens.val, cfg.seq_len, cfg.micro_batch_size, cfg.eval_batches)
    result = Trainer(model, cfg, TrainData(sampler, val), run_dir).fit()
    return [m["loss"] for m in result.metrics if "loss" in m], dtypes


@pytest.mark.slow  # two short bf16 trainings on the CPU
def test_a_tiny_model_trains_on_real_text_with_a_bf16_residual_stream(tokens, tmp_path):
    on, on_dtypes = _train(tokens, tmp_path / "on", bf16_residual=True)
    off, off_dtypes = _train(tokens, tmp_path / "off")
    assert len(on) == 12 and on[-1] < on[0] - 0.5  # it learns
    # every training forward (12 steps, and the evaluation's) kept the stream in bf16; the default in fp32
    assert len(on_dtypes) >= 12 and set(on_dtypes) == {torch.bfloat16}
    assert set(off_dtypes) == {torch.float32}
    # the same loss curve as the fp32 stream, within bf16's rounding of the sums
    assert on == pytest.approx(off, abs=0.01)


def test_bf16_residual_outside_bf16_is_refused_before_any_step(tokens):
    cfg = TrainConfig(precision="fp32", device="cpu", seq_len=32, micro_batch_size=2)
    sampler = WindowSampler(tokens.train, cfg.seq_len, cfg.seed)
    with pytest.raises(ConfigError, match="set train.precision=bf16, or model.bf16_residual=false"):
        TrainStep(GPT(_config(bf16_residual=True)), cfg, sampler)


def test_fp8_head_is_refused_in_one_line_without_its_gpu_or_torchao():
    cfg = _config()
    assert "sm89+" in fp8_problem("cpu", None, True, cfg) and "this is cpu" in fp8_problem(
        "cpu", None, True, cfg
    )
    assert "this is sm80" in fp8_problem("cuda", (8, 0), True, cfg)  # an A100: no FP8 matmuls
    assert "this is sm75" in fp8_problem("cuda", (7, 5), True, cfg)
    assert "pip install torchao" in fp8_problem("cuda", (9, 0), False, cfg)
    assert "multiples of 16" in fp8_problem("cuda", (8, 9), True, _config(vocab_size=500))
    assert (
        fp8_problem("cuda", (8, 9), True, cfg) is None
        and fp8_problem("cuda", (9, 0), True, cfg) is None
    )
    for reason in (fp8_problem("cpu", None, True, cfg), fp8_problem("cuda", (9, 0), False, cfg)):
        assert "\n" not in reason and reason.endswith("or set train.fp8_head=false")
    # this machine (no GPU): the trainer refuses before its first step
    train = TrainConfig(fp8_head=True, precision="bf16", device="cpu", seq_len=32)
    with pytest.raises(ConfigError, match="train.fp8_head needs a GPU with FP8 matmuls"):
        TrainStep(GPT(cfg), train, None)


@pytest.mark.parametrize("tied", [False, True])
def test_fp8_filter_converts_the_head_and_nothing_else(tied):
    model = GPT(_config(tie_embeddings=tied, fused_proj=True, n_kv_head=2))
    chosen = [fqn for fqn, m in model.named_modules() if fp8_filter(m, fqn)]
    assert chosen == ["lm_head"]
    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert (
        len(linears) == 1 + 4 * model.config.n_layer
    )  # qkv, o, gate_up, down: all left as they are
    odd = GPT(_config(vocab_size=500))  # FP8 matmuls need multiples of 16
    assert not any(fp8_filter(m, fqn) for fqn, m in odd.named_modules())


def test_fa3_is_refused_in_one_line_off_hopper_or_without_kernels():
    assert "this is cpu" in fa3_problem("cpu", None, True, 64)
    assert "this is sm80" in fa3_problem("cuda", (8, 0), True, 64)  # an A100
    assert "this is sm89" in fa3_problem("cuda", (8, 9), True, 64)  # an L4
    assert "this is sm100" in fa3_problem("cuda", (10, 0), True, 64)  # Blackwell: FA3 is Hopper's
    assert "pip install kernels" in fa3_problem("cuda", (9, 0), False, 64)
    assert "head_dim" in fa3_problem("cuda", (9, 0), True, 60)
    assert fa3_problem("cuda", (9, 0), True, 64) is None
    with pytest.raises(
        ConfigError,
        match="needs a Hopper GPU .* this is cpu: train on one, or set model.attn_impl='sdpa'",
    ):
        load_fa3(torch.device("cpu"), 64)
    train = TrainConfig(precision="bf16", device="cpu", seq_len=32)
    with pytest.raises(ConfigError, match="model.attn_impl='fa3' needs a Hopper GPU"):
        TrainStep(GPT(_config(attn_impl="fa3")), train, None)
    with pytest.raises(ConfigError, match="attn_impl must be one of"):
        _config(attn_impl="flash")


class _SdpaInFa3Layout:
    """FlashAttention-3's `flash_attn_func` signature and layout ((B, T, H, D), grouped keys and values),
    computed by SDPA, counting its calls: this CPU has no Hopper GPU to run the kernel itself, but the model's
    side of the call (layouts, heads, dtypes, which calls take it) is checked against it."""

    calls = 0

    def flash_attn_func(self, q, k, v, causal):
        assert causal and q.dtype == k.dtype == v.dtype == torch.bfloat16
        _SdpaInFa3Layout.calls += 1
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2), None  # some builds return (out, softmax_lse)


def test_fa3_serves_only_plain_causal_attention_in_half_precision(monkeypatch):
    assert not fa3_serves(False, False, torch.bfloat16)  # the kernel not loaded here: SDPA
    monkeypatch.setattr(attention, "FA3_LOADED", [_SdpaInFa3Layout()])
    assert fa3_serves(False, False, torch.bfloat16) and fa3_serves(False, False, torch.float16)
    assert not fa3_serves(True, False, torch.bfloat16)  # a training mask: SDPA
    assert not fa3_serves(False, True, torch.bfloat16)  # a KV cache (generation): SDPA
    assert not fa3_serves(False, False, torch.float32)  # the kernel has no fp32


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_head=2, qk_norm=True)])
def test_a_model_with_fa3_calls_the_kernel_in_its_layout(monkeypatch, kw):
    monkeypatch.setattr(attention, "FA3_LOADED", [_SdpaInFa3Layout()])
    idx = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    fa3 = GPT(_config(attn_impl="fa3", **kw))
    plain = GPT(_config(**kw))
    plain.load_state_dict(fa3.state_dict())
    _SdpaInFa3Layout.calls = 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = fa3(idx), plain(idx)
        assert _SdpaInFa3Layout.calls == fa3.config.n_layer  # every block's attention took it
        cache = KVCache.empty(fa3.config, 2, 32, "cpu", torch.bfloat16)
        fa3(idx, cache=cache)  # generation keeps SDPA
    assert _SdpaInFa3Layout.calls == fa3.config.n_layer
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    fa3(idx)  # fp32 (no autocast) keeps SDPA too
    assert _SdpaInFa3Layout.calls == fa3.config.n_layer
