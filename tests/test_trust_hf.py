"""A Hugging Face folder is data, never code (issue 32, items 7 and 8). Each test is the attack as it was made
against ee92b4d, through the command a user types (`python -m tinygpt ...` in a subprocess, "y" typed at any
prompt): a folder whose config.json names its own code (`auto_map` -> a module that leaves a file behind when
it is imported) given to `finetune --base` and `eval`, and a base whose tokenizer.json carries a regex that
backtracks for ever, given to `pretrain --init` and `finetune --base` with RUST_BACKTRACE=1 set. It asserts
that no code ran, that nothing was tokenized, and that the user sees one line naming the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinygpt.data import shard_writer
from tinygpt.model import hf
from tinygpt.model.tokenizer import KNOWN_REGEXES, Tokenizer, UnsafeTokenizer, train_bpe
from tinygpt.pretrain.init import read_base

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]
EVIL_REGEX = "(a|a)+$"  # every run of a's not at the end of its text: 2^n ways to fail (onig stops at its limit)
LLAMA3 = next(p for p, name in KNOWN_REGEXES.items() if name == "Llama-3")
EVIL_TEXT = "a" * 40 + "b"


def cli(*args: str, cwd: Path, **env_extra: str) -> subprocess.CompletedProcess:
    """`python -m tinygpt ARGS` as a user types it, answering "y" to any question; stdout and stderr together."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(cwd / "hf-home"),
        "TINYGPT_CACHE": str(cwd / "tg-cache"),
        "RUST_BACKTRACE": "1",
        **env_extra,
    }
    return subprocess.run(
        [sys.executable, "-m", "tinygpt", *args],
        input="y\ny\ny\n",
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def tok(shakespeare) -> Tokenizer:
    return train_bpe([shakespeare[:100_000]], 512)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tok) -> Path:
    """A tiny Llama folder as `save_pretrained` writes it, with its tokenizer: the honest base the attacks edit."""
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tok.eot_id,
        eos_token_id=tok.eot_id,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("llama") / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    hf.hf_tokenizer(tok).save_pretrained(out)
    return out


def copy_of(folder: Path, to: Path) -> Path:
    to.mkdir(parents=True)
    for p in folder.iterdir():
        (to / p.name).write_bytes(p.read_bytes())
    return to


def with_code(llama: Path, to: Path, marker: Path) -> Path:
    """The attack of item 8: a model type transformers does not know, whose config.json names modules beside it
    (`auto_map`); importing either leaves `marker` behind."""
    folder = copy_of(llama, to)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(
        model_type="evilgpt",
        architectures=["EvilForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    payload = (
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('the folder ran its code')\n"
    )
    (folder / "configuration_evil.py").write_text(
        payload
        + "from transformers import LlamaConfig\n\nclass EvilConfig(LlamaConfig):\n    model_type = 'evilgpt'\n"
    )
    (folder / "modeling_evil.py").write_text(
        payload
        + "from transformers import LlamaForCausalLM\n\nclass EvilForCausalLM(LlamaForCausalLM):\n    pass\n"
    )
    return folder


def with_regex(llama: Path, to: Path, pattern: str) -> Path:
    """The attack of item 7: the same base, its tokenizer.json pre-tokenizing with `pattern` (a `Split`, then
    byte-level without its own regex, as Llama-3's tokenizer.json is laid out)."""
    folder = copy_of(llama, to)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": pattern},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": False,
            },
        ],
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    """Instruction records whose text the evil regex chokes on."""
    p = tmp_path_factory.mktemp("records") / "records.json"
    p.write_text(
        json.dumps(
            [
                {"instruction": f"say {EVIL_TEXT} {i}", "input": "", "output": EVIL_TEXT}
                for i in range(24)
            ]
        )
    )
    return p


def one_line_refusal(out: subprocess.CompletedProcess) -> str:
    """The output of a refused command: exit 2, one line, no traceback, no Rust panic, no question asked."""
    text = out.stdout
    assert out.returncode == 2, text
    for noise in (
        "Traceback",
        "panicked",
        "stack backtrace",
        "[y/N]",
        "run the same command again",
    ):
        assert noise not in text, text
    errors = [line for line in text.splitlines() if line.startswith("tinygpt ")]
    assert len(errors) == 1, text
    return errors[0]


# ---- 8. auto_map: a folder's own code -----------------------------------------------------------


@pytest.mark.slow  # the CLI in a subprocess (test_every_transformers_load_refuses_code... and test_init_base_with_a_backtracking_regex... are the fast ones)
def test_finetune_base_naming_its_own_code_is_refused_before_anything_runs(
    llama, records, tmp_path
):
    marker = tmp_path / "ran.txt"
    evil = with_code(llama, tmp_path / "evil", marker)
    out = cli(
        "finetune",
        "--recipe",
        "lora-r8",
        "--base",
        str(evil),
        "--data",
        str(records),
        "--run-dir",
        str(tmp_path / "run"),
        "--max-steps",
        "1",
        "--device",
        "cpu",
        "--quiet",
        cwd=tmp_path,
    )
    line = one_line_refusal(out)
    assert not marker.exists(), "the folder's code ran"
    assert (
        f"{evil / 'config.json'} names code of its own (auto_map: configuration_evil.EvilConfig"
        in line
    )
    assert "never runs a model folder's code" in line
    assert not (tmp_path / "run" / "finetune.json").exists()


@pytest.mark.slow  # the CLI in a subprocess (test_every_transformers_load_refuses_code... and test_init_base_with_a_backtracking_regex... are the fast ones)
def test_finetune_checks_data_before_it_reads_anything_of_the_base(llama, tmp_path):
    marker = tmp_path / "ran.txt"
    evil = with_code(llama, tmp_path / "evil", marker)
    out = cli(
        "finetune",
        "--recipe",
        "lora-r8",
        "--base",
        str(evil),
        "--data",
        str(tmp_path / "missing.json"),
        "--run-dir",
        str(tmp_path / "run"),
        "--device",
        "cpu",
        "--quiet",
        cwd=tmp_path,
    )
    line = one_line_refusal(out)
    assert "missing.json" in line and "does not exist" in line and not marker.exists()


@pytest.mark.slow  # the CLI in a subprocess (test_every_transformers_load_refuses_code... and test_init_base_with_a_backtracking_regex... are the fast ones)
def test_eval_of_a_folder_naming_its_own_code_is_refused_before_anything_runs(
    llama, tmp_path, shakespeare
):
    marker = tmp_path / "ran.txt"
    evil = with_code(llama, tmp_path / "evil", marker)
    text = tmp_path / "text.txt"
    text.write_text(shakespeare[:5000])
    out = cli(
        "eval",
        str(evil),
        "--task",
        "perplexity",
        "--data",
        str(text),
        "--device",
        "cpu",
        cwd=tmp_path,
    )
    line = one_line_refusal(out)
    assert not marker.exists(), "the folder's code ran"
    assert f"{evil / 'config.json'} names code of its own" in line


def test_every_transformers_load_refuses_code_and_unknown_model_types(llama, tmp_path):
    """The one loader (`hf.from_pretrained`) on the variants: auto_map with a model type transformers ships, an
    unknown model type without auto_map, a tokenizer_config.json naming a tokenizer class of its own; and the
    honest folder loads."""
    cfg = json.loads((llama / "config.json").read_text())
    shipped = copy_of(llama, tmp_path / "shipped")
    (shipped / "config.json").write_text(
        json.dumps({**cfg, "auto_map": {"AutoModelForCausalLM": "m.Evil"}})
    )
    with pytest.raises(
        hf.UntrustedModel, match=r"config.json names code of its own \(auto_map: m.Evil\)"
    ):
        hf.from_pretrained("AutoModelForCausalLM", shipped)
    unknown = copy_of(llama, tmp_path / "unknown")
    (unknown / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    with pytest.raises(hf.UntrustedModel, match="has model_type 'bert', not one tinygpt loads"):
        hf.from_pretrained("AutoConfig", unknown)
    tok_code = copy_of(llama, tmp_path / "tok-code")
    tc = json.loads((tok_code / "tokenizer_config.json").read_text())
    (tok_code / "tokenizer_config.json").write_text(
        json.dumps({**tc, "auto_map": {"AutoTokenizer": ["t.Evil", None]}})
    )
    with pytest.raises(hf.UntrustedModel, match="tokenizer_config.json names code of its own"):
        hf.from_pretrained("AutoTokenizer", tok_code)
    assert hf.from_pretrained("AutoConfig", llama).model_type == "llama"
    assert hf.from_pretrained("AutoTokenizer", llama)("abc")["input_ids"]


# ---- 7. a regex that backtracks for ever ----------------------------------------------------------


def test_init_base_with_a_backtracking_regex_is_refused_in_one_line(llama, tmp_path):
    evil = with_regex(llama, tmp_path / "evil", EVIL_REGEX)
    data = tmp_path / "text.txt"
    data.write_text((EVIL_TEXT + "\n") * 2000)
    out = cli(
        "pretrain",
        "--recipe",
        "cpu-smoke",
        "--init",
        str(evil),
        "--data",
        str(data),
        "--run-dir",
        str(tmp_path / "run"),
        "--max-steps",
        "2",
        "--device",
        "cpu",
        "--probe",
        "off",
        "--quiet",
        cwd=tmp_path,
    )
    line = one_line_refusal(out)
    assert (
        f"{evil / 'tokenizer.json'}: its pre_tokenizer.pretokenizers[0] regex '{EVIL_REGEX}'"
        in line
    )
    assert "is not one tinygpt runs (those of GPT-2, Llama-3, Qwen2" in line
    assert not list((tmp_path / "tg-cache").rglob("*.bin"))  # nothing was tokenized


@pytest.mark.slow  # the CLI in a subprocess (test_every_transformers_load_refuses_code... and test_init_base_with_a_backtracking_regex... are the fast ones)
def test_finetune_base_with_a_backtracking_regex_is_refused_in_one_line(llama, records, tmp_path):
    evil = with_regex(llama, tmp_path / "evil", EVIL_REGEX)
    out = cli(
        "finetune",
        "--recipe",
        "lora-r8",
        "--base",
        str(evil),
        "--data",
        str(records),
        "--run-dir",
        str(tmp_path / "run"),
        "--max-steps",
        "1",
        "--device",
        "cpu",
        "--quiet",
        cwd=tmp_path,
    )
    line = one_line_refusal(out)
    assert f"{evil / 'tokenizer.json'}: its pre_tokenizer.pretokenizers[0] regex" in line


def test_a_normalizer_regex_and_an_oversized_tokenizer_are_refused_too(llama, tmp_path):
    """Variants: the regex in a `Replace` normalizer; a 65 MB (sparse) tokenizer.json, refused before it is read."""
    folder = copy_of(llama, tmp_path / "normalizer")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Replace", "pattern": {"Regex": EVIL_REGEX}, "content": "b"}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(
        UnsafeTokenizer, match=r"its normalizer regex '\(a\|a\)\+\$' is not one tinygpt runs"
    ):
        read_base(str(folder))
    big = copy_of(llama, tmp_path / "big")
    with open(big / "tokenizer.json", "r+b") as f:
        f.truncate(65 << 20)
    with pytest.raises(
        ValueError, match=r"tokenizer.json holds 68,157,440 bytes, more than the 67,108,864"
    ):
        read_base(str(big))


def test_the_known_regexes_and_tinygpts_own_tokenizer_are_accepted(llama, tok, tmp_path):
    """Llama-3's pattern (as its tokenizer.json writes it) loads, and encodes as tokenizers does; a tokenizer
    tinygpt trained (byte-level, no regex written out) and GPT-2's load as before."""
    base = read_base(str(with_regex(llama, tmp_path / "llama3", LLAMA3)))
    assert (
        base.tokenizer.encode("Hello world 12345")
        == base.tokenizer.tok.encode("Hello world 12345").ids
    )
    tok.save(tmp_path / "own.json")
    assert Tokenizer.load(tmp_path / "own.json").to_json() == tok.to_json()
    from tinygpt.model.tokenizer import load_gpt2

    gpt2 = load_gpt2()
    assert Tokenizer.from_json(gpt2.to_json()).encode("Hello world") == gpt2.encode("Hello world")


def test_the_token_writer_runs_without_rust_backtraces(monkeypatch, tok, tmp_path):
    """The tokenizing process is started without RUST_BACKTRACE: a panic there is one line, not a backtrace."""
    seen = {}

    class FakePopen:
        def __init__(self, cmd, **kw):
            seen.update(kw)
            self.stdin = open(os.devnull, "wb")

    monkeypatch.setenv("RUST_BACKTRACE", "1")
    monkeypatch.setattr(shard_writer.subprocess, "Popen", FakePopen)
    from tinygpt.core.config import DataConfig

    shard_writer.ShardWriter(DataConfig(source="builtin"), tok, tmp_path)
    assert seen.get("env") is not None and "RUST_BACKTRACE" not in seen["env"]
    assert seen["env"].get("PATH") == os.environ.get("PATH")


def test_a_hub_cache_download_is_read_through_its_links_and_nothing_else_is(
    llama, tmp_path, monkeypatch
):
    """huggingface_hub's cache keeps each file of a download as a link to its blob: those links are read (an
    `--init hf:NAME` base works), but a link out of the cache, or in a plain folder, is refused, naming it."""
    import huggingface_hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--test-org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot, blobs = repo / "snapshots" / commit, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, p in enumerate(sorted(llama.iterdir())):
        (blobs / f"blob{i}").write_bytes(p.read_bytes())
        (snapshot / p.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert read_base("hf:test-org/tiny").tokenizer.vocab_size == 512
    hf.check_hf_folder(snapshot)  # the same download given as a folder

    outside = tmp_path / "elsewhere.json"
    outside.write_text((llama / "tokenizer.json").read_text())
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(outside)
    with pytest.raises(
        ValueError, match=r"tokenizer.json is a symbolic link \(to .*elsewhere.json\)"
    ):
        read_base("hf:test-org/tiny")
    plain = copy_of(llama, tmp_path / "plain")
    (plain / "config.json").unlink()
    (plain / "config.json").symlink_to(llama / "config.json")
    with pytest.raises(ValueError, match=r"config.json is a symbolic link"):
        read_base(str(plain))
