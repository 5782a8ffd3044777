"""Sampling with the KV cache against a plain loop without it."""

import pytest
import torch

from tinygpt.core.config import ModelConfig
from tinygpt.model.generate import generate, generate_text, sample_next
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import train_bpe


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(
        ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=64)
    ).eval()


def test_greedy_with_cache_equals_full_recompute(model):
    idx = torch.randint(0, 300, (2, 7))
    out = generate(model, idx, 20, temperature=0)
    ref = idx
    with torch.no_grad():
        for _ in range(20):
            ref = torch.cat([ref, model(ref)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


def test_top_k_1_and_tiny_top_p_are_greedy(model):
    idx = torch.randint(0, 300, (3, 5))
    greedy = generate(model, idx, 10, temperature=0)
    assert torch.equal(generate(model, idx, 10, temperature=1.0, top_k=1), greedy)
    assert torch.equal(generate(model, idx, 10, temperature=1.0, top_p=1e-6), greedy)


def test_top_p_keeps_the_smallest_set_covering_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {
        int(sample_next(logits, 1.0, top_p=0.75, generator=torch.Generator().manual_seed(i)))
        for i in range(200)
    }
    assert seen == {0, 1}  # 0.5 + 0.3 covers 0.75; the rest never appear
    seen_k = {
        int(sample_next(logits, 1.0, top_k=3, generator=torch.Generator().manual_seed(i)))
        for i in range(300)
    }
    assert seen_k == {0, 1, 2}


def test_seeded_sampling_is_reproducible_and_stops_at_eot(model, shakespeare):
    tok = train_bpe([shakespeare[:50_000]], 300)
    a = generate_text(model, tok, "ROMEO:", max_new_tokens=30, seed=1)
    b = generate_text(model, tok, "ROMEO:", max_new_tokens=30, seed=1)
    assert a == b and a.startswith("ROMEO:")
    out = generate(
        model,
        torch.tensor([[5, 6]]),
        40,
        temperature=0,
        eot_id=int(generate(model, torch.tensor([[5, 6]]), 1, temperature=0)[0, -1]),
    )
    assert out.shape[1] == 3  # the first greedy token was declared end-of-text: generation stops


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, torch.zeros(1, 1, dtype=torch.long), 5, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, torch.zeros(1, 1, dtype=torch.long), 5, top_p=1.5)
    long = generate(model, torch.zeros(1, 63, dtype=torch.long), 10, temperature=0)
    assert long.shape[1] == 64  # a full context generates up to max_seq_len
