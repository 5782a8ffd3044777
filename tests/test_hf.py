"""Hugging Face export and import, checked through `transformers` itself: same logits, same token ids."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import export_run

from tinygpt.core.checkpoint import CheckpointError, model_state, save_checkpoint, step_name
from tinygpt.core.config import ModelConfig
from tinygpt.core.recipes import get_recipe
from tinygpt.model import hf, hf_import
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import EOT, Tokenizer, train_bpe

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok(shakespeare) -> Tokenizer:
    return train_bpe([shakespeare[:200_000]], 512)


def _texts(shakespeare: str) -> list[str]:
    return [
        shakespeare[:400],
        shakespeare[50_000:50_300],
        "def f(x):\n    return x ** 2  # ünïcödé ✓",
        f"one document{EOT}the next",
        "  leading and trailing spaces  ",
    ]


def _perturbed(config: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    m = GPT(config)
    with (
        torch.no_grad()
    ):  # far from init, so that a wrong mapping of any weight shows in the logits
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


def _make_run(path: Path, tok: Tokenizer, model: GPT, seq_len: int | None = None) -> Path:
    """A run folder of `model`, its recipe trained at `seq_len` tokens (None: cpu-smoke's 64)."""
    recipe = get_recipe("cpu-smoke").replace(
        model=dataclasses.asdict(model.config),
        data={"vocab_size": tok.vocab_size},
        train={"seq_len": seq_len} if seq_len else None,
    )
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"recipe": recipe.to_dict()}))
    tok.save(path / "tokenizer.json")
    save_checkpoint(path / "checkpoints" / step_name(10), model_state(model), {"step": 10})
    return path


@pytest.mark.parametrize(
    "tied,qk_norm,arch",
    [
        (False, False, "LlamaForCausalLM"),
        (True, False, "LlamaForCausalLM"),
        (False, True, "Qwen3ForCausalLM"),
    ],
)
def test_export_round_trip_through_transformers(tmp_path, tok, shakespeare, tied, qk_norm, arch):
    config = dataclasses.replace(
        get_recipe("cpu-smoke").model,
        tie_embeddings=tied,
        n_kv_head=1,
        rope_theta=5000.0,
        qk_norm=qk_norm,
        zero_init_proj=qk_norm,
    )
    model = _perturbed(config)
    run = _make_run(tmp_path / "run", tok, model)
    out = export_run(run, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["eos_token_id"] == tok.eot_id
    assert cfg["rope_theta"] == 5000.0  # also at the top level, where transformers 4.x reads it
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token == hf_tok.bos_token == EOT
    for text in _texts(shakespeare):
        ids = tok.encode(text)
        assert hf_tok(text)["input_ids"] == ids and hf_tok.decode(ids) == text
        x = torch.tensor([ids[: config.max_seq_len]])
        with torch.no_grad():
            torch.testing.assert_close(hf_model(x).logits, model(x), atol=1e-4, rtol=0)


def test_evaluation_of_an_export_matches_the_run(tmp_path, tok, shared_data):
    """A run and its export give the same scores and the same greedy tokens when they read the same
    context: a run trained at its whole position table (512), which `export_run` advertises; and
    a run trained at 64 of its 512 positions, which `tinygpt export` advertises (issue 39) and to
    which both cut a long prompt from the left (issue 38)."""
    from tinygpt.evals import run_eval
    from tinygpt.publish.export import export

    model = _perturbed(dataclasses.replace(get_recipe("cpu-smoke").model, max_seq_len=512), seed=2)
    run = _make_run(tmp_path / "run", tok, model, seq_len=512)
    out = export_run(run, tmp_path / "export")
    for task, data, opts in [
        ("perplexity", "wikitext2_test.txt", {"max_chars": 1500, "window": 128, "stride": 64}),
        ("hellaswag", "hellaswag_val.txt.bz2", {"limit": 2}),
        ("humaneval", "HumanEval.jsonl.gz", {"limit": 1, "max_new_tokens": 8}),
    ]:
        a = run_eval(run, task, data=shared_data / data, **opts)
        b = run_eval(out, task, data=shared_data / data, **opts)
        if task == "perplexity":
            assert b["nll_nats"] == pytest.approx(a["nll_nats"], rel=1e-5)
        elif task == "hellaswag":
            assert (b["acc"], b["acc_norm"]) == (a["acc"], a["acc_norm"])
        else:  # greedy decoding through transformers' generate gives the same completion
            assert b["per_problem"][0]["completions"] == a["per_problem"][0]["completions"]
            assert a["prompts_cut"] == b["prompts_cut"] == 0
    short = _make_run(tmp_path / "short", tok, model)  # trained at cpu-smoke's 64 tokens
    shipped = export(short, tmp_path / "shipped")
    humaneval = {"data": shared_data / "HumanEval.jsonl.gz", "limit": 1, "max_new_tokens": 8}
    a, b = run_eval(short, "humaneval", **humaneval), run_eval(shipped, "humaneval", **humaneval)
    assert json.loads((shipped / "config.json").read_text())["max_position_embeddings"] == 64
    assert b["per_problem"][0]["completions"] == a["per_problem"][0]["completions"]
    assert a["prompts_cut"] == b["prompts_cut"] == 1  # HumanEval/0's 261 tokens, cut to 56


def test_export_refuses_a_target_that_exists(tmp_path, tok):
    run = _make_run(tmp_path / "run", tok, _perturbed(get_recipe("cpu-smoke").model))
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty; nothing was written"):
        export_run(run, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"] and (
        target / "keep.txt"
    ).read_text() == "mine"
    a_file = tmp_path / "file.bin"
    a_file.write_text("x")
    with pytest.raises(FileExistsError):
        export_run(run, a_file)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (export_run(run, empty) / "model.safetensors").is_file()  # an empty folder is fine
    assert not list(tmp_path.glob(".tmp-export-*"))


def test_export_of_a_run_without_checkpoint_says_train_first(tmp_path, tok):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"recipe": get_recipe("cpu-smoke").to_dict()}))
    with pytest.raises(CheckpointError, match="no valid checkpoint.*pretrain"):
        export_run(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tied,shard", [(False, False), (True, True)])
def test_import_of_a_transformers_llama(tmp_path, tok, shakespeare, tied, shard):
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=5000.0,
        tie_word_embeddings=tied,
        eos_token_id=tok.eot_id,
        bos_token_id=tok.eot_id,
    )
    torch.manual_seed(1)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path / "llama", **({"max_shard_size": "100KB"} if shard else {}))
    hf.hf_tokenizer(tok).save_pretrained(tmp_path / "llama")
    if shard:
        assert (tmp_path / "llama" / hf_import.SAFETENSORS_INDEX).is_file()
    model, imported_tok = hf_import.import_hf(tmp_path / "llama")
    assert (
        model.config.n_kv_head == 2
        and model.config.rope_theta == 5000.0
        and model.config.tie_embeddings == tied
    )
    assert imported_tok is not None and imported_tok.eot_id == tok.eot_id
    for text in _texts(shakespeare)[:3]:
        ids = imported_tok.encode(text)
        assert ids == tok.encode(text)
        x = torch.tensor([ids])
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x).logits, atol=1e-4, rtol=0)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("qk_norm", [False, True])
def test_export_then_import_gives_the_same_weights(tmp_path, tok, qk_norm):
    model = _perturbed(dataclasses.replace(get_recipe("cpu-smoke").model, qk_norm=qk_norm), seed=3)
    out = hf.export_model(model, tok, tmp_path / "exported")
    back, back_tok = hf_import.import_hf(out)
    a, b = model_state(model), model_state(back)
    assert back.config.qk_norm == qk_norm and any("q_norm" in k for k in a) == qk_norm
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert back_tok.to_json() == tok.to_json()


def test_import_refuses_what_it_cannot_load(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_import.import_hf(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ValueError, match="Llama"):
        hf_import.import_hf(tmp_path)
    llama = {**get_recipe("cpu-smoke").model.to_hf_llama(), "model_type": "llama"}
    (tmp_path / "config.json").write_text(
        json.dumps({**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    )
    with pytest.raises(ValueError, match="RoPE scaling"):
        hf_import.import_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        hf_import.import_hf(tmp_path)


@pytest.mark.parametrize(
    "kw", [dict(), dict(n_kv_head=1, tie_embeddings=True, rope_theta=5e5), dict(qk_norm=True)]
)
def test_every_network_field_goes_through_a_transformers_config_and_back(tmp_path, kw):
    """The fields' Hugging Face names (ModelConfig's field metadata) are the whole mapping: a config saved by
    transformers' own class reads back as the same network, and refuses nothing."""
    config = dataclasses.replace(get_recipe("cpu-smoke").model, init_std=0.03, **kw)
    hf.hf_llama_config(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    back = ModelConfig.from_hf_llama(saved)
    assert (
        saved["model_type"] == config.family.model_type
        and hf_import.representation_gaps(saved) == []
    )
    assert {k: getattr(back, k) for k in ModelConfig.network_fields()} == {
        k: getattr(config, k) for k in ModelConfig.network_fields()
    }
    assert (back.max_seq_len, back.init_std) == (config.max_seq_len, config.init_std)
