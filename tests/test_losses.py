"""The chunked cross-entropy equals the plain one, in value and gradients, and keeps less for backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import INVALID

from tinygpt.core.config import ConfigError, TrainConfig
from tinygpt.core.recipes import model_config
from tinygpt.model import losses
from tinygpt.model.gpt import GPT
from tinygpt.model.losses import IGNORE_INDEX, default_chunk_rows, linear_cross_entropy


def problem(n: int = 301, d: int = 16, vocab: int = 97, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(vocab, d, generator=g) * 0.5).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::7] = IGNORE_INDEX
    t[-3:] = IGNORE_INDEX
    return x, w, t


def plain(x, w, t, reduction):
    return F.cross_entropy(
        F.linear(x, w).float(), t, ignore_index=IGNORE_INDEX, reduction=reduction
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [7, 64, 300, 1000])  # none divides the 301 rows; 1000 > rows
def test_equals_plain_loss_and_gradients_fp32(reduction, chunk_rows):
    x, w, t = problem()
    ref = plain(x, w, t, reduction)
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, w))
    got = linear_cross_entropy(x, w, t, reduction=reduction, chunk_rows=chunk_rows)
    gx, gw = torch.autograd.grad(got, (x, w))
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-6)
    assert gx[t == IGNORE_INDEX].abs().max() == 0  # ignored tokens get no gradient


def test_batched_shapes_and_backward_scale():
    """(B, T, d) inputs as the model gives them; an upstream gradient (the trainer's 1/n, the
    GradScaler's scale) multiplies both gradients."""
    x, w, t = problem(n=4 * 50)
    x3 = x.detach().view(4, 50, 16).requires_grad_()
    (plain(x3.view(-1, 16), w, t, "sum") * 3.5).backward()
    ref_gx, ref_gw = x3.grad.clone(), w.grad.clone()
    x3.grad = w.grad = None
    (linear_cross_entropy(x3, w, t.view(4, 50), reduction="sum", chunk_rows=33) * 3.5).backward()
    # a sum over 200 rows, scaled: fp32 summation order differs between the chunked and plain paths
    # (and with the thread count), so the absolute tolerance follows the gradients' size
    torch.testing.assert_close(x3.grad, ref_gx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, ref_gw, rtol=1e-5, atol=1e-5)


def test_autocast_bf16_matches_plain_autocast():
    """Under autocast the chunk matmuls run in bf16 and the log-softmax in fp32, as in the plain path."""
    x, w, t = problem(n=200, d=32, vocab=500)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = linear_cross_entropy(x, w, t, chunk_rows=0)
        ref_g = torch.autograd.grad(ref, (x, w))
        got = linear_cross_entropy(x, w, t, chunk_rows=48)
        g = torch.autograd.grad(got, (x, w))
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) < 1e-3 * ref.item()
    for a, b in zip(g, ref_g):
        assert a.dtype == torch.float32
        assert (a - b).abs().max() < 2e-2 * b.abs().max()  # bf16 rounding of the logit gradients


def test_tied_embeddings_gradients_accumulate(monkeypatch):
    """The model's own loss, forced into chunks, gives every parameter the plain loss's gradient;
    the tied embedding / lm_head matrix gets the sum of both uses."""
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=300, max_seq_len=32, tie_embeddings=True))
    idx = torch.randint(0, 300, (3, 32))
    targets = torch.randint(0, 300, (3, 32))
    targets[:, :5] = IGNORE_INDEX

    def grads():
        model.zero_grad(set_to_none=True)
        loss = model(idx, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref = grads()  # 96 x 300 logits: the automatic choice is the plain loss
    monkeypatch.setattr(losses, "PLAIN_MAX_LOGITS", 0)
    monkeypatch.setattr(losses, "CHUNK_LOGITS", 300 * 37)  # chunks of 37 rows
    assert default_chunk_rows(96, 300) == 37
    loss, got = grads()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == ref.keys() and "model.embed_tokens.weight" in got
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_saves_far_less_for_backward():
    """Bytes kept for the backward pass: the plain loss keeps (rows x vocab) fp32 logits, the
    chunked one only the hidden states' and the weight's gradients."""
    n, d, vocab = 1024, 32, 2048

    def saved_bytes(chunk_rows: int) -> int:
        x, w, t = problem(n=n, d=d, vocab=vocab)
        total = 0

        def pack(tensor):
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = linear_cross_entropy(x, w, t, chunk_rows=chunk_rows)
        loss.backward()
        return total

    plain_bytes, chunked_bytes = saved_bytes(0), saved_bytes(128)
    assert plain_bytes >= n * vocab * 4  # the fp32 logits (8 MB)
    assert chunked_bytes <= (n * d + vocab * d) * 4 + 1024  # grad_x + grad_w (0.4 MB)
    assert chunked_bytes * 10 < plain_bytes


def test_under_torch_compile_fullgraph():
    x, w, t = problem()
    compiled = torch.compile(
        lambda x, w, t: linear_cross_entropy(x, w, t, chunk_rows=64),
        fullgraph=True,
        backend="aot_eager",
    )
    got = compiled(x, w, t)
    g = torch.autograd.grad(got, (x, w))
    ref = plain(x, w, t, "mean")
    ref_g = torch.autograd.grad(ref, (x, w))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_grad_and_all_ignored():
    x, w, t = problem()
    with torch.no_grad():
        assert linear_cross_entropy(x, w, t, chunk_rows=50).item() == pytest.approx(
            plain(x, w, t, "mean").item(), rel=1e-6
        )
    t_none = torch.full_like(t, IGNORE_INDEX)
    assert math.isnan(
        linear_cross_entropy(x, w, t_none, chunk_rows=50).item()
    )  # as F.cross_entropy
    assert math.isnan(plain(x, w, t_none, "mean").item())
    assert linear_cross_entropy(x, w, t_none, reduction="sum", chunk_rows=50).item() == 0.0
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, t, reduction="none")


def test_default_chunk_rows():
    assert default_chunk_rows(64, 512) == 0  # small: the plain loss
    rows = default_chunk_rows(32 * 1024, 50304)  # a 124M recipe's micro-batch
    assert 0 < rows <= losses.CHUNK_LOGITS // 50304 and rows % 64 == 0
    assert default_chunk_rows(1000, 10**6) == 33  # huge vocabulary: fewer than 64 rows, no rounding


def test_loss_modes_give_the_same_loss_and_gradients_through_the_model():
    """TrainConfig.loss: "full" logits and "chunked" (here forced on a problem "auto" would take whole) are the
    same loss and the same gradients; only speed and memory differ."""
    assert (
        default_chunk_rows(8 * 32, 1000, "full") == 0
        and default_chunk_rows(8 * 32, 1000, "chunked") > 0
    )
    assert default_chunk_rows(8 * 32, 1000, "auto") == 0
    with pytest.raises(ConfigError, match="loss must be one of"):
        TrainConfig(loss=INVALID)
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=1000))
    x, y = torch.randint(1000, (8, 32)), torch.randint(1000, (8, 32))
    y[0, :5] = IGNORE_INDEX
    out = {}
    for mode in ("full", "chunked"):
        model.zero_grad()
        loss = model(x, y, reduction="sum", loss=mode)
        loss.backward()
        out[mode] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(out["full"][0], out["chunked"][0], rtol=1e-5, atol=1e-4)
    for a, b in zip(out["full"][1], out["chunked"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_default_chunk_rows_by_free_memory():
    """Where the free memory is known (a GPU), "auto" keeps the full logits while they take at most half of it,
    and a chunk's rows grow with it: 124M's 16 x 1024 tokens of a 50,304 vocabulary keep their 9.9 GB of full
    logits on an 80 GB GPU with 70 GB free, not on a T4 with 12 GB free."""
    n, vocab = 16 * 1024, 50304
    assert default_chunk_rows(n, vocab, "auto", free_bytes=70 * 2**30) == 0
    t4 = default_chunk_rows(n, vocab, "auto", free_bytes=12 * 2**30)
    assert t4 > 0 and t4 % 64 == 0
    assert default_chunk_rows(n, vocab, "chunked", free_bytes=70 * 2**30) > t4
    assert (
        default_chunk_rows(n, vocab, "chunked", free_bytes=70 * 2**30) * vocab * 8 <= 70 * 2**30 / 8
    )
    assert losses.resolve_loss("auto", n, vocab, torch.device("cpu")) == "auto"  # by size, per call


def _graph_nodes(fn, *args) -> tuple[int, int]:
    """(FX nodes of the graph dynamo traces, of the forward graph AOTAutograd hands to a compiler) for `fn`
    compiled, counted by a backend that records them and runs the graphs as they are."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = {"dynamo": 0, "aot": 0}

    def count_aot(gm, _inputs):
        seen["aot"] += len(gm.graph.nodes)
        return make_boxed_func(gm.forward)

    def backend(gm, inputs):
        # a higher-order op (an autograd.Function traced by dynamo) keeps its body in a submodule: counted too
        seen["dynamo"] += sum(len(m.graph.nodes) for m in gm.modules() if hasattr(m, "graph"))
        return aot_autograd(
            fw_compiler=count_aot, bw_compiler=lambda gm, _: make_boxed_func(gm.forward)
        )(gm, inputs)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    out.backward()
    torch._dynamo.reset()
    return seen["dynamo"], seen["aot"]


def test_compiled_chunked_loss_does_not_grow_with_the_micro_batch():
    """The chunk loop never unrolls into the compiled graph: 4x the tokens (4x the chunks) gives the compiler as
    many graph nodes as 1x (within 25%), a tied embedding and a tinygpt GPT included."""
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=1000, max_seq_len=32, tie_embeddings=True))
    counts = {}
    for micro in (2, 8):  # 64 and 256 rows: 2 and 8 chunks of 32 rows
        x, y = torch.randint(1000, (micro, 32)), torch.randint(1000, (micro, 32))
        counts[micro] = _graph_nodes(
            lambda x, y: losses.linear_cross_entropy(
                model.hidden_states(x), model.lm_head.weight, y, chunk_rows=32
            ),
            x,
            y,
        )
    (d1, a1), (d4, a4) = counts[2], counts[8]
    assert d1 > 0 and a1 > 0
    assert d4 <= 1.25 * d1 and a4 <= 1.25 * a1, counts
