"""GGUF export (llama.cpp, Ollama), the model card and `tinygpt push`, read back through `gguf`'s own reader,
and, where llama-cpp-python is installed, run through llama.cpp itself."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_gguf

from tinygpt.cli import main
from tinygpt.core.checkpoint import model_state
from tinygpt.core.recipes import get_recipe
from tinygpt.evals.compare_runs import summarize_run
from tinygpt.model import gguf as gg
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import EOT, Tokenizer, find_gpt2_files, load_gpt2, train_bpe
from tinygpt.pretrain.run_pretrain import pretrain
from tinygpt.publish.card import card_facts, read_evals
from tinygpt.publish.export import upload_folder
from tinygpt.publish.hub import hub_token

gguf = pytest.importorskip("gguf")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bpe(shakespeare) -> Tokenizer:
    return train_bpe([shakespeare[:200_000]], 512)


def _perturbed(config, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    m = GPT(config)
    with (
        torch.no_grad()
    ):  # far from init (zero-initialised projections included), so every weight matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


def _config(tok: Tokenizer, qk_norm: bool, tied: bool = False, bias: bool = False):
    vocab = (
        50304 if tok.vocab_size > 50000 else tok.vocab_size + 64
    )  # padded past the tokenizer, as recipes do
    return dataclasses.replace(
        get_recipe("cpu-smoke").model,
        vocab_size=vocab,
        n_kv_head=1,
        qk_norm=qk_norm,
        tie_embeddings=tied,
        rope_theta=5000.0,
        attention_bias=bias,
    )


def _hf_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's adjacent RoPE pairs back to rotate-half order (the inverse of the export's permutation)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _check_values(got: np.ndarray, want: np.ndarray, quant: str, ndim: int) -> None:
    if quant == "f32" or ndim == 1:
        np.testing.assert_array_equal(got, want)
    elif quant == "f16":
        np.testing.assert_allclose(got, want, rtol=2**-11, atol=2**-24)
    elif quant == "bf16":
        np.testing.assert_allclose(got, want, rtol=2**-8, atol=0)
    else:  # q8_0: blocks of 32 with one scale amax/127 (an f16)
        blocks, wb = (got - want).reshape(-1, 32), want.reshape(-1, 32)
        step = np.abs(wb).max(axis=1, keepdims=True) / 127
        assert (
            np.abs(blocks) <= 0.57 * step
        ).all()  # half a step, plus the f16 rounding of the scale (127 * 2^-11)


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return load_gpt2()


@pytest.fixture(scope="module")
def smollm(shakespeare) -> Tokenizer:
    """A BPE with SmolLM's pre-tokenizer (single digits, then ByteLevel): what a run continued from SmolLM has."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(
        [shakespeare[:100_000] + " 2026-11-25 3.14159 x1000"],
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=[EOT],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return Tokenizer(t)


CASES = [
    ("bpe", qk, tied, q)
    for qk, tied in [(False, False), (True, False), (False, True)]
    for q in gg.QUANTS
] + [
    ("gpt2", False, False, "f16"),
    ("gpt2", True, False, "q8_0"),  # the 50k vocabulary: two cases keep it quick
    ("smollm", False, False, "f16"),
]


@pytest.mark.parametrize("kind,qk_norm,tied,quant", CASES)
def test_gguf_reads_back_with_the_checkpoints_weights_and_tokenizer(
    tmp_path, bpe, gpt2, smollm, kind, qk_norm, tied, quant
):
    tok = {"bpe": bpe, "gpt2": gpt2, "smollm": smollm}[kind]
    config = _config(tok, qk_norm, tied)
    model = _perturbed(config)
    meta, tensors = read_gguf(gg.write_gguf(model, tok, tmp_path / "m.gguf", quant))

    arch = "qwen3" if qk_norm else "llama"
    assert meta["general.architecture"] == arch
    assert (
        meta[f"{arch}.block_count"] == config.n_layer
        and meta[f"{arch}.context_length"] == config.max_seq_len
    )
    assert meta[f"{arch}.attention.head_count_kv"] == 1 and meta[f"{arch}.rope.freq_base"] == 5000.0
    sd = model_state(model)
    names = {
        f"blk.{i}.{n}.weight"
        for i in range(config.n_layer)
        for n in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        )
    }
    names |= (
        {f"blk.{i}.attn_{x}_norm.weight" for i in range(config.n_layer) for x in "qk"}
        if qk_norm
        else set()
    )
    names |= {"token_embd.weight", "output_norm.weight"} | (set() if tied else {"output.weight"})
    assert set(tensors) == names and len(sd) == len(names)
    hf = {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
    for name, got in tensors.items():
        parts = name.split(".")
        key = (
            f"model.layers.{parts[1]}.{hf[parts[2]]}.weight"
            if parts[0] == "blk"
            else f"{hf[parts[0]]}.weight"
        )
        want = sd[key].numpy()
        assert got.shape == want.shape, name
        if arch == "llama" and parts[-2] in ("attn_q", "attn_k"):
            got = _hf_order(got, config.n_head if parts[-2] == "attn_q" else 1)
        _check_values(got, want, quant, want.ndim)

    # the tokenizer: every token in id order, the merges as tokenizers ranks them, GPT-2's pre-tokenizer
    spec = json.loads(tok.to_json())
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == ("smollm" if kind == "smollm" else "gpt-2")
    assert meta["tokenizer.ggml.tokens"][: tok.vocab_size] == [
        tok.tok.id_to_token(i) for i in range(tok.vocab_size)
    ]
    assert (
        len(meta["tokenizer.ggml.tokens"]) == config.vocab_size
        and meta["tokenizer.ggml.merges"] == merges
    )
    types = meta["tokenizer.ggml.token_type"]
    assert types[tok.eot_id] == gguf.TokenType.CONTROL and set(types[tok.vocab_size :]) <= {
        gguf.TokenType.UNUSED
    }
    assert (
        meta["tokenizer.ggml.eos_token_id"] == tok.eot_id
        and meta["tokenizer.ggml.add_bos_token"] is False
    )
    if kind == "gpt2":  # against OpenAI's own files, not only tokenizers' reading of them
        lines = find_gpt2_files()[1].read_text(encoding="utf-8").splitlines()
        assert meta["tokenizer.ggml.merges"] == [
            x for x in lines if x and not x.startswith("#version")
        ]


def test_the_rope_permutation_turns_rotate_half_into_adjacent_pairs(bpe):
    """What llama.cpp's `llama` computes on the permuted q/k rows (RoPE on adjacent pairs) is the permuted
    result of tinygpt's RoPE (on the two halves of each head): attention scores stay the same."""
    config = _config(bpe, qk_norm=False)
    model = _perturbed(config)
    hd, n = config.head_dim, config.n_head
    wq = model_state(model)["model.layers.0.self_attn.q_proj.weight"].numpy()
    wq_gguf = gg.gguf_tensors(model)["blk.0.attn_q.weight"]
    x = np.random.default_rng(0).standard_normal((5, config.d_model)).astype(np.float32)
    pos = np.arange(5)[:, None]
    freqs = pos * config.rope_theta ** (-np.arange(0, hd, 2) / hd)  # (T, hd/2)
    cos, sin = np.cos(freqs), np.sin(freqs)

    def half(q):  # transformers / tinygpt
        a, b = q[..., : hd // 2], q[..., hd // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def pairs(q):  # llama.cpp's LLAMA_ROPE_TYPE_NORM
        a, b = q[..., 0::2], q[..., 1::2]
        out = np.empty_like(q)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    for h in range(n):
        ours = half(x @ wq[h * hd : (h + 1) * hd].T)
        theirs = pairs(x @ wq_gguf[h * hd : (h + 1) * hd].T)
        np.testing.assert_allclose(_hf_order(theirs.T, 1).T, ours, rtol=1e-5, atol=1e-5)


def test_an_option_llama_cpps_architecture_cannot_load_is_refused_before_writing(tmp_path, bpe):
    """llama.cpp's `qwen3` loads no attention biases (its `llama` does: the llama.cpp test above runs one)."""
    model = _perturbed(_config(bpe, qk_norm=True, bias=True))
    with pytest.raises(
        ValueError, match="qwen3 architecture cannot load a model with attention_bias"
    ):
        gg.write_gguf(model, bpe, tmp_path / "m.gguf", "f32")
    assert list(tmp_path.iterdir()) == []


def test_a_tokenizer_llama_cpp_would_split_otherwise_is_refused(tmp_path, bpe):
    from tokenizers import pre_tokenizers

    odd = Tokenizer.from_json(bpe.to_json())
    odd.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    model = _perturbed(_config(odd, qk_norm=False))
    with pytest.raises(
        ValueError, match="does not tokenize as llama.cpp's GPT-2 BPE.*add_prefix_space"
    ):
        gg.write_gguf(model, odd, tmp_path / "m.gguf")
    with pytest.raises(
        ValueError, match="unknown GGUF quantization 'q4_k'; choose one of f32, f16, bf16, q8_0"
    ):
        gg.write_gguf(model, bpe, tmp_path / "m.gguf", "q4_k")
    assert not list(tmp_path.iterdir())


# --- a real run: export, card, push -----------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_data) -> Path:
    """A cpu-smoke run of 12 steps on Tiny Shakespeare, evaluated once (so its folder records an evaluation)."""
    tmp = tmp_path_factory.mktemp("gguf")
    pretrain(
        "cpu-smoke",
        tmp / "run",
        data=str(shared_data / "tinyshakespeare.txt"),
        max_steps=12,
        eval_every=6,
        progress=False,
        cache_dir=tmp / "cache",
    )
    assert (
        main(
            [
                "eval",
                str(tmp / "run"),
                "--task",
                "perplexity",
                "--data",
                str(shared_data / "wikitext2_test.txt"),
                "--max-chars",
                "2000",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    return tmp / "run"


def test_cli_exports_gguf_with_a_modelfile_and_a_card(run, tmp_path, capsys):
    out = tmp_path / "gguf"
    assert main(["export", str(run), str(out), "--format", "gguf", "--quant", "q8_0"]) == 0
    assert "ollama create" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "README.md", "model-Q8_0.gguf"]
    trained = get_recipe(
        "cpu-smoke"
    ).train.seq_len  # the context it was trained at, not its position tables
    modelfile = (out / "Modelfile").read_text()
    assert (
        modelfile.startswith("FROM ./model-Q8_0.gguf\n")
        and 'TEMPLATE """{{ .Prompt }}"""' in modelfile
    )
    assert (
        f"PARAMETER num_ctx {trained}\n" in modelfile
        and 'PARAMETER stop "<|endoftext|>"' in modelfile
    )
    meta, tensors = read_gguf(out / "model-Q8_0.gguf")
    assert (
        meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
        and meta["general.name"] == "run"
    )
    card = (out / "README.md").read_text()
    s = summarize_run(run)
    assert (
        s["steps"] == 12
        and f"| steps | {s['steps']} |" in card
        and f"| tokens seen | {s['tokens_seen']:,} |" in card
    )
    assert f"| training loss | {s['loss_last']:.4g} |" in card
    assert f"| validation loss | {s['val_loss_last']:.4g} |" in card and "ollama create" in card

    assert (
        main(["export", str(run), str(out), "--format", "gguf"]) == 2
    )  # the target is taken: refused
    assert "not empty; nothing was written" in capsys.readouterr().err


def test_push_folder_holds_hf_files_gguf_and_a_card_with_the_runs_figures(run, tmp_path):
    folder = upload_folder(run, tmp_path / "up", "alice/tiny", gguf="f16")
    assert sorted(p.name for p in folder.iterdir()) == [
        "Modelfile",
        "README.md",
        "config.json",
        "generation_config.json",
        "model-F16.gguf",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    card = (folder / "README.md").read_text()
    facts = card_facts(run)
    (ev,) = read_evals(run)
    assert ev["task"] == "perplexity" and ev["data"].endswith("wikitext2_test.txt")
    assert (
        f"perplexity {ev['scores']['perplexity']:.4g}, bits_per_byte {ev['scores']['bits_per_byte']:.4g}"
        in card
    )
    assert (
        f"| training loss | {facts['train_loss']:.4g} |" in card
        and "library_name: transformers" in card
    )
    assert (
        'AutoModelForCausalLM.from_pretrained("alice/tiny")' in card
        and "ollama run hf.co/alice/tiny:F16" in card
    )
    assert (
        "| `wikitext2_test.txt` |" in card and str(run.parent) not in card
    )  # no folder of this machine
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert m.config.num_hidden_layers == get_recipe("cpu-smoke").model.n_layer


def _push(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
    } | env
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "tinygpt", "push", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_push_stops_with_one_line_without_a_token_or_the_hub(run, tmp_path, capsys):
    assert (
        main(["push", str(run), "not-a-repo-id"]) == 2
    )  # in process: checked before the token is looked for
    assert "is not USER/NAME" in capsys.readouterr().err
    # where the token is looked for is read when huggingface_hub is imported: a process of its own for each
    home = {
        "HF_HOME": str(tmp_path / "hf-home")
    }  # no token saved by `huggingface-cli login` either
    p = _push([str(run), "alice/tiny"], home)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1
    assert "no Hugging Face token: set HF_TOKEN" in p.stderr
    # A token, but this machine has no network: the sign-in fails, before anything is exported.
    p = _push(
        [str(run), "alice/tiny"],
        home | {"HF_TOKEN": "hf_not_a_real_token", "TMPDIR": str(tmp_path)},
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "could not sign in to the Hugging Face Hub" in p.stderr and "HF_TOKEN" in p.stderr
    assert not list(tmp_path.glob("tinygpt-push-*"))


def test_the_token_comes_from_colabs_secrets(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.syspath_prepend(str(REPO / "tests" / "fake_colab"))
    from google.colab import userdata

    assert hub_token() is None  # no secret named HF_TOKEN
    monkeypatch.setitem(userdata.SECRETS, "HF_TOKEN", "hf_from_colab")
    assert hub_token() == "hf_from_colab"
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert hub_token() == "hf_from_env"


@pytest.fixture(scope="module")
def lora_run(run, shared_data, tmp_path_factory) -> Path:
    from tinygpt.finetune.run_finetune import finetune

    ft = tmp_path_factory.mktemp("gguf-ft") / "ft"
    finetune(
        "lora-r8",
        str(run),
        str(shared_data / "code_alpaca_2k.json"),
        ft,
        hardware="cpu",
        progress=False,
        train=dict(
            seq_len=128,
            micro_batch_size=4,
            grad_accum_steps=1,
            max_steps=6,
            warmup_steps=1,
            lr=5e-3,
            eval_every=3,
            save_every=3,
            eval_batches=1,
            log_every=3,
        ),
    )
    return ft


def test_a_finetune_exports_merged_with_its_prompt_format(lora_run, tmp_path):
    from tinygpt.finetune.lora import load_finetuned

    out = tmp_path / "ft-gguf"
    assert main(["export", str(lora_run), str(out), "--format", "gguf", "--quant", "f32"]) == 0
    meta, tensors = read_gguf(out / "model-F32.gguf")
    merged, _ = load_finetuned(lora_run, merge=True)
    sd = merged.state_dict()
    np.testing.assert_array_equal(
        tensors["blk.1.ffn_up.weight"], sd["model.layers.1.mlp.up_proj.weight"].numpy()
    )
    np.testing.assert_array_equal(
        tensors["blk.0.attn_v.weight"], sd["model.layers.0.self_attn.v_proj.weight"].numpy()
    )
    assert (
        "### Instruction:\n{{ message['content'] | trim }}\n\n### Response:\n"
        in meta["tokenizer.chat_template"]
    )
    modelfile = (out / "Modelfile").read_text()
    assert (
        "### Instruction:\n{{$inst}}\n\n### Response:\n" in modelfile
    )  # trimmed: test_export_truth renders it
    assert "### Instruction:\n{{$inst}}\n\n### Input:\n{{$input}}\n\n### Response:\n" in modelfile
    assert 'PARAMETER stop "### Instruction:"' in modelfile
    card = (out / "README.md").read_text()
    facts = card_facts(lora_run)
    assert facts["kind"] == "finetune" and facts["recipe"] == "lora-r8" and facts["steps"] == 6
    assert (
        "`lora-r8` finetune of `run`," in card and str(lora_run.parent) not in card
    )  # no folder of this machine
    assert (
        f"| validation loss | {facts['val_loss']:.4g} |" in card
        and "| data | `code_alpaca_2k.json` |" in card
    )

    hf_out = tmp_path / "ft-hf"
    assert main(["export", str(lora_run), str(hf_out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {
        p.name for p in hf_out.iterdir()
    }


# --- llama.cpp itself (llama-cpp-python builds it from source: `pip install llama-cpp-python`) ---------

TRICKY = [
    "I'll say it's 12345 or 3.14159, don't you? 2026-11-25",
    "def f(x):\n    return x ** 2  # ünïcödé ✓ 中文",
    "a  \n\n  b\t\tc   \n",
    f"one document{EOT}the next",
    "  leading and trailing spaces  ",
    "ÀÉÎÕÜ 🤖🤖 — «»",
]


def _llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.skip(
            "llama.cpp is not installed here (pip install llama-cpp-python builds it from source with CMake)"
        )
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gguf_agreement

    return gguf_agreement


@pytest.mark.slow  # llama.cpp
@pytest.mark.parametrize(
    "kind,qk_norm,bias",
    [("bpe", False, False), ("gpt2", True, False), ("smollm", False, False), ("bpe", False, True)],
)
def test_llama_cpp_tokenizes_generates_and_scores_as_tinygpt(
    tmp_path, bpe, gpt2, smollm, shakespeare, kind, qk_norm, bias
):
    ga = _llama_cpp()
    tok = {"bpe": bpe, "gpt2": gpt2, "smollm": smollm}[kind]
    model = _perturbed(_config(tok, qk_norm, bias=bias))
    path = gg.write_gguf(model, tok, tmp_path / "m.gguf", "f32")
    cpp = ga.LlamaCpp(path, model.config.max_seq_len)
    for text in TRICKY + [shakespeare[:500]]:
        assert cpp.tokenize(text) == tok.encode(text), text
    r = ga.compare(
        path, ga.logits_fn(model, False), tok, model.config.max_seq_len, shakespeare[1000:3000]
    )
    assert r["tokenization_equal"] and r["greedy_equal"], r
    assert abs(r["ppl_rel_diff"]) < 1e-3, r


@pytest.mark.slow  # llama.cpp
def test_llama_cpp_runs_a_trained_run_and_a_merged_finetune_as_tinygpt(run, lora_run, tmp_path):
    from tinygpt.finetune.lora import load_finetuned
    from tinygpt.model.loading import load_run
    from tinygpt.publish.export import export

    ga = _llama_cpp()
    text = ga.held_out_text()
    model, tok, recipe, _ = load_run(run)
    merged, hf_tok = load_finetuned(lora_run, merge=True)
    for source, logits_of, t in [
        (run, ga.logits_fn(model, False), tok),
        (lora_run, ga.logits_fn(merged, True), hf_tok),
    ]:
        for quant, tolerance in [("f32", 1e-3), ("f16", 1e-2)]:
            out = export(source, tmp_path / f"{source.name}-{quant}", "gguf", quant)
            r = ga.compare(next(out.glob("*.gguf")), logits_of, t, recipe.model.max_seq_len, text)
            assert r["tokenization_equal"] and abs(r["ppl_rel_diff"]) < tolerance, (
                source,
                quant,
                r,
            )
            if quant == "f32":
                assert r["greedy_equal"], (source, r)


def test_a_full_finetune_exports_its_whole_model(run, shared_data, tmp_path):
    from safetensors.numpy import load_file

    from tinygpt.finetune.run_finetune import finetune

    finetune(
        "full",
        str(run),
        str(shared_data / "code_alpaca_2k.json"),
        tmp_path / "full",
        hardware="cpu",
        progress=False,
        train=dict(
            seq_len=128,
            micro_batch_size=4,
            grad_accum_steps=1,
            max_steps=3,
            warmup_steps=1,
            eval_every=3,
            save_every=3,
            eval_batches=1,
            log_every=1,
        ),
    )
    assert main(["export", str(tmp_path / "full"), str(tmp_path / "hf")]) == 0
    hf_files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "README.md",
    } <= hf_files and "tinygpt_finetune.json" not in hf_files
    assert (
        main(
            [
                "export",
                str(tmp_path / "full"),
                str(tmp_path / "gguf"),
                "--format",
                "gguf",
                "--quant",
                "f32",
            ]
        )
        == 0
    )
    _, tensors = read_gguf(tmp_path / "gguf" / "model-F32.gguf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    np.testing.assert_array_equal(
        tensors["blk.1.ffn_down.weight"], sd["model.layers.1.mlp.down_proj.weight"]
    )
    assert (
        "`full` finetune of `run`, every weight trained"
        in (tmp_path / "gguf" / "README.md").read_text()
    )
