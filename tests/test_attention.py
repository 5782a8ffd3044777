"""Grouped-query attention takes a fused kernel where one exists for the device, and keys/values repeated to
the query heads elsewhere (a T4, fp32 on CUDA), so that SDPA never falls back to the math kernel's T x T matrix.
The decision is made from the device's description, which the tests set to a T4's (sm75) or an A100's; the
model runs on the CPU either way, and SDPA is watched by a wrapper around the real function."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.test_probe import saved_bytes
from tinygpt.core.config import ModelConfig
from tinygpt.core.recipes import model_config
from tinygpt.finetune.memory_plan import memory_table
from tinygpt.fit.memory import GB, estimate_memory
from tinygpt.model import attention
from tinygpt.model.attention import attention_kernel, torch_version
from tinygpt.model.gpt import GPT, KVCache

CFG = ModelConfig(
    vocab_size=320, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=176, max_seq_len=64
)


@pytest.mark.parametrize(
    "device,cap,dtype,version,kernel",
    [
        ("cuda", (7, 5), torch.float16, (2, 9), "expand"),  # a T4: no flash attention
        ("cuda", (8, 0), torch.bfloat16, (2, 9), "fused"),  # an A100: flash takes the groups
        ("cuda", (9, 0), torch.float16, (2, 9), "fused"),
        ("cuda", (8, 0), torch.float32, (2, 9), "expand"),  # flash has no fp32 kernel
        ("cuda", (8, 0), torch.bfloat16, (2, 4), "expand"),  # no enable_gqa at all
        (
            "cpu",
            None,
            torch.float32,
            (2, 9),
            "fused",
        ),  # the CPU's flash kernel takes groups from 2.9
        ("cpu", None, torch.float32, (2, 8), "expand"),
        ("mps", None, torch.float32, (2, 9), "math"),
    ],
)
def test_the_kernel_follows_device_dtype_and_torch(device, cap, dtype, version, kernel):
    assert attention_kernel(device, cap, dtype, version) == kernel
    if device == "cuda" and kernel == "fused":  # flash's head size limits
        assert attention_kernel(device, cap, dtype, version, head_dim=320) == "expand"


def test_torch_version_parses_local_builds():
    assert torch_version("2.9.0+cu128") == (2, 9) and torch_version("2.13.0a0") == (2, 13)


def test_the_table_agrees_with_this_torchs_own_dispatcher():
    """On the machine the suite runs on, torch itself says whether its fused kernel takes grouped K/V."""
    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is None or torch_version() < (2, 5):
        pytest.skip("this torch cannot say which SDPA kernel it picks")
    q, kv = torch.randn(1, 4, 16, 32), torch.randn(1, 2, 16, 32)
    math = int(torch.nn.attention.SDPBackend.MATH)
    fused = choice(q, kv, kv, None, 0.0, True, enable_gqa=True) != math
    assert fused == (attention_kernel("cpu", None, torch.float32, torch_version(), 32) == "fused")


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every call SDPA receives: (query heads, key heads, value heads, enable_gqa); the real SDPA runs."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[1], k.shape[1], v.shape[1], kwargs.get("enable_gqa", False)))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def as_device(monkeypatch, device_type: str, capability):
    """Make every device look like this one to the decision (its input, not SDPA's result)."""
    monkeypatch.setattr(attention, "device_profile", lambda device: (device_type, capability))


def test_on_a_t4_keys_and_values_reach_sdpa_expanded_with_the_same_logits(monkeypatch, sdpa_calls):
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    x = torch.randint(0, CFG.vocab_size, (2, 40))
    as_device(monkeypatch, "cpu", None)
    with torch.no_grad():
        grouped = model(x)
    if torch_version() >= (2, 9):
        assert (
            sdpa_calls == [(4, 2, 2, True)] * CFG.n_layer
        )  # the CPU's flash kernel takes the groups
    sdpa_calls.clear()
    as_device(monkeypatch, "cuda", (7, 5))
    with torch.no_grad():
        expanded = model(x)
    assert (
        sdpa_calls == [(4, 4, 4, False)] * CFG.n_layer
    )  # no enable_gqa: K/V have the query's head count
    torch.testing.assert_close(expanded, grouped, atol=1e-5, rtol=0)


def test_expanded_attention_trains_to_the_same_gradients(monkeypatch):
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (2, 33))
    grads = []
    for dev in (("cpu", None), ("cuda", (7, 5))):
        as_device(monkeypatch, *dev)
        model.zero_grad()
        model(x, x).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_decoding_one_token_leaves_the_cache_grouped(monkeypatch, sdpa_calls):
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    as_device(monkeypatch, "cuda", (7, 5))
    x = torch.randint(0, CFG.vocab_size, (1, 12))
    with torch.no_grad():
        cache = KVCache.empty(CFG, 1, 16, "cpu", torch.float32)
        model(x[:, :8], cache=cache)
        model(x[:, 8:9], cache=cache)
    assert sdpa_calls[: CFG.n_layer] == [(4, 4, 4, False)] * CFG.n_layer  # the prompt: expanded
    assert (
        sdpa_calls[CFG.n_layer :] == [(4, 2, 2, True)] * CFG.n_layer
    )  # one new token: a 1 x T row, grouped


def test_the_compiled_model_is_one_graph_with_the_decision_baked_in(monkeypatch):
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    x = torch.randint(0, CFG.vocab_size, (2, 24))
    as_device(monkeypatch, "cuda", (7, 5))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    with torch.no_grad():
        torch.testing.assert_close(
            torch.compile(model, backend="aot_eager")(x), model(x), atol=1e-5, rtol=0
        )
    torch._dynamo.reset()


def test_hugging_face_bases_get_expanded_keys_and_values_on_a_t4(monkeypatch, sdpa_calls, tmp_path):
    """A Llama base with GQA as finetuning loads it: on a T4 transformers' SDPA call receives keys and values
    with the query's head count and no enable_gqa (transformers itself would pass enable_gqa=True without a
    mask); packed rows keep their mask; the logits are those of transformers' own sdpa."""
    transformers = pytest.importorskip("transformers")
    from tinygpt.finetune.lora import load_base  # needs transformers

    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="sdpa",
        )
    ).eval()
    ref.save_pretrained(tmp_path)
    model = load_base(str(tmp_path)).eval()
    x = torch.randint(0, 320, (2, 30))
    pos = torch.cat([torch.arange(12), torch.arange(18)]).expand(
        2, -1
    )  # two packed records per row
    with torch.no_grad():
        want, want_packed = ref(x).logits, ref(x, position_ids=pos).logits
        as_device(monkeypatch, "cuda", (7, 5))
        sdpa_calls.clear()
        got = model(x).logits
        assert sdpa_calls == [(4, 4, 4, False)] * 2
        got_packed = model(x, position_ids=pos).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_packed, want_packed, atol=1e-5, rtol=0)
    assert not torch.allclose(got_packed, got, atol=1e-3)  # the records were kept apart


# ----- the memory estimate counts what runs --------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["fused", "expand", "math"])
def test_the_activation_estimate_counts_expanded_keys_and_the_math_kernels_matrix(
    kernel, monkeypatch
):
    config = ModelConfig(
        vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, max_seq_len=64
    )
    model, (B, T) = GPT(config), (2, 64)
    x, y = torch.randint(300, (B, T)), torch.randint(300, (B, T))
    as_device(monkeypatch, *(("cpu", None) if kernel == "fused" else ("cuda", (7, 5))))
    if kernel == "fused" and torch_version() < (2, 9):
        pytest.skip("this torch's CPU kernel does not take grouped keys/values")
    with (
        sdpa_kernel(SDPBackend.MATH)
        if kernel == "math"
        else sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    ):
        saved = saved_bytes(model, x, y)
    est = estimate_memory(config, B, T, "fp32", device_type="cpu", attention=kernel)
    # the estimate's loss line is its peak (12 B per logit); autograd saves the fp32 log-probs (4 B)
    assert (est.activations_gb * GB + 4 * B * T * config.vocab_size) == pytest.approx(
        saved, rel=0.01
    )
    assert est.attention == kernel


def test_the_estimate_decides_the_kernel_from_the_device():
    gqa = model_config("124m", n_kv_head=4)
    t4, a100 = estimate_memory(gqa, 8, 1024, "fp16"), estimate_memory(gqa, 8, 1024, "bf16")
    assert (t4.attention, a100.attention) == ("expand", "fused")
    assert (
        estimate_memory(gqa, 8, 1024, "fp16", capability=(8, 0)).attention == "fused"
    )  # fp16 on an A100
    assert estimate_memory(gqa, 8, 1024, "fp32", capability=(8, 0)).attention == "expand"
    # 12 layers x 8192 tokens x 2 x (12 - 4 heads) x 64 x 2 B of repeated keys and values
    extra = 12 * 8192 * 2 * 8 * 64 * 2
    assert (
        t4.activations_gb - estimate_memory(gqa, 8, 1024, "fp16", attention="fused").activations_gb
    ) * 2**30 == pytest.approx(extra)
    assert "repeated to the query heads" in dict((r[0], r[2]) for r in t4.rows())["activations"]
    assert (
        estimate_memory(model_config("124m"), 8, 1024, "fp16").attention == "fused"
    )  # no groups: nothing to do


def test_the_finetuning_plan_counts_expanded_keys_on_a_t4():
    smol = dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
    )  # SmolLM2-360M's shape

    def act(hw, c):
        return next(
            r["gb"]
            for r in memory_table("lora-r16", hw, c, activation_checkpointing=False)
            if r["part"] == "activations"
        )

    tokens = 4 * 512  # the t4 setting
    assert act("t4", smol) - act("t4", {**smol, "num_key_value_heads": 15}) == pytest.approx(
        32 * 2 * tokens * 2 * 10 * 64 / 1e9, abs=2e-3
    )
    gemma2 = dict(
        model_type="gemma2",
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
    )
    eager = act("t4", {**gemma2, "final_logit_softcapping": 30.0}) - act("t4", gemma2)
    assert eager == pytest.approx(
        26 * tokens * 8 * 512 * 6 / 1e9, abs=2e-3
    )  # eager attention's scores


def test_a_finetuned_base_on_a_t4_compiles_as_one_graph(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tinygpt.finetune.lora import attach_lora, load_base  # needs transformers
    from tinygpt.finetune.loss import FinetuneLoss
    from tinygpt.finetune.presets import LoraSettings

    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).save_pretrained(tmp_path)
    module = FinetuneLoss(
        attach_lora(load_base(str(tmp_path)), LoraSettings(r=2, alpha=4, dropout=0.0))
    )
    as_device(monkeypatch, "cuda", (7, 5))
    x = torch.randint(0, 64, (2, 16))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(module)(x, x)
    torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
