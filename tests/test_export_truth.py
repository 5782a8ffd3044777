"""An export is the model you trained, in every client (issue 39): the context it was trained at, the prompt
format a finetune learned (the token its prompts began with and the instruction template), and a card of the
exported checkpoint; and, where llama-cpp-python is installed, llama.cpp's greedy tokens and a finetune's answer
equal tinygpt's."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_gguf

from tinygpt.cli import main
from tinygpt.core.recipes import get_recipe
from tinygpt.model.prompts import Codec, format_prompt
from tinygpt.pretrain.run_pretrain import pretrain
from tinygpt.publish.card import AMX_NOTE
from tinygpt.publish.export import export
from tinygpt.publish.source import trained_context

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
from tinygpt.model import gguf as gg  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SMOKE = get_recipe("cpu-smoke")  # trains at seq_len 64; its model's position tables reach 128
INSTRUCTION = "Write a function that returns the square of x."


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_data) -> Path:
    """cpu-smoke for 12 steps: checkpoints at 10 and 12, training losses logged at 5 and 10, validation at 6 and 12."""
    tmp = tmp_path_factory.mktemp("truth")
    pretrain(
        "cpu-smoke",
        tmp / "run",
        data=str(shared_data / "tinyshakespeare.txt"),
        max_steps=12,
        eval_every=6,
        progress=False,
        cache_dir=tmp / "cache",
    )
    return tmp / "run"


@pytest.fixture(scope="module")
def lora_run(run, shared_data, tmp_path_factory) -> Path:
    from tinygpt.finetune.run_finetune import finetune

    ft = tmp_path_factory.mktemp("truth-ft") / "ft"
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


def _json(p: Path) -> dict:
    return json.loads(p.read_text(encoding="utf-8"))


def _modelfile_template(text: str) -> str:
    return re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)


# --- 1. the context ---------------------------------------------------------------------------


def test_every_client_reads_the_context_the_model_was_trained_at(run, tmp_path, capsys):
    assert SMOKE.train.seq_len == 64 < SMOKE.model.max_seq_len == 128 and trained_context(run) == 64
    hf, gf = export(run, tmp_path / "hf"), export(run, tmp_path / "gguf", "gguf", "f16")
    assert _json(hf / "config.json")["max_position_embeddings"] == 64
    assert _json(hf / "tokenizer_config.json")["model_max_length"] == 64
    meta, _ = read_gguf(gf / "model-F16.gguf")
    assert (
        meta["llama.context_length"] == 64
        and "PARAMETER num_ctx 64\n" in (gf / "Modelfile").read_text()
    )
    for folder in (hf, gf):
        card = (folder / "README.md").read_text()
        assert (
            "context 64 tokens, the length it was trained at (its position tables reach 128; positions past 64 "
            "were never trained)" in card
        )

    # more, when a user asks for it: everywhere, and the card says what was trained
    assert (
        main(["export", str(run), str(tmp_path / "long"), "--format", "gguf", "--context", "128"])
        == 0
    )
    meta, _ = read_gguf(tmp_path / "long" / "model-F16.gguf")
    assert (
        meta["llama.context_length"] == 128
        and "PARAMETER num_ctx 128\n" in (tmp_path / "long/Modelfile").read_text()
    )
    assert (
        "context 128 tokens as exported (`--context`; it was trained at 64)"
        in (tmp_path / "long/README.md").read_text()
    )
    hf_long = export(run, tmp_path / "hf-long", context=128)
    assert _json(hf_long / "config.json")["max_position_embeddings"] == 128
    assert _json(hf_long / "tokenizer_config.json")["model_max_length"] == 128
    capsys.readouterr()


# --- 2. one prompt format ---------------------------------------------------------------------


def _training_prompt(lora_run: Path, instruction: str, input: str = "") -> list[int]:
    """The ids a finetune's training put before an answer (and `generate --adapter` gives the model)."""
    from tinygpt.finetune.lora import load_finetuned

    _, tok = load_finetuned(lora_run)
    return Codec(tok).encode_examples([[(format_prompt(instruction, input), False)]])[0][0]


def test_a_finetunes_prompt_format_is_the_same_in_training_transformers_the_gguf_and_ollama(
    lora_run, run, tmp_path
):
    import jinja2
    from transformers import AutoTokenizer

    from tinygpt.model.loading import load_run

    _, tok, _, _ = load_run(run)
    eot, eot_id = tok.eot, tok.eot_id
    instruction = "  " + INSTRUCTION + "\n"  # format_prompt trims it; so must every template
    ids = _training_prompt(lora_run, instruction)
    assert ids[0] == eot_id  # tinygpt starts each instruction prompt with end-of-text
    text = tok.decode(ids)  # tinygpt's own formatter, as text
    assert text == eot + format_prompt(instruction)

    hf = export(lora_run, tmp_path / "hf")
    gf = export(lora_run, tmp_path / "gguf", "gguf", "f32")
    config, tcfg = _json(hf / "config.json"), _json(hf / "tokenizer_config.json")
    meta, _ = read_gguf(gf / "model-F32.gguf")
    # the token a prompt begins with, and that it is added, agree with training everywhere
    assert (
        config["bos_token_id"] == eot_id
        and tcfg["add_bos_token"] is True
        and tcfg["bos_token"] == eot
    )
    assert (
        meta["tokenizer.ggml.bos_token_id"] == eot_id
        and meta["tokenizer.ggml.add_bos_token"] is True
    )
    assert meta["tokenizer.ggml.eos_token_id"] == eot_id
    hf_tok = AutoTokenizer.from_pretrained(hf)
    assert hf_tok(format_prompt(instruction))["input_ids"] == ids

    messages = [{"role": "user", "content": instruction}]
    by_transformers = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    by_gguf = (
        jinja2.Environment()
        .from_string(meta["tokenizer.chat_template"])
        .render(
            messages=messages,
            bos_token=meta["tokenizer.ggml.tokens"][meta["tokenizer.ggml.bos_token_id"]],
            eos_token=eot,
            add_generation_prompt=True,
        )
    )
    assert by_transformers == by_gguf == text
    assert (
        list(
            hf_tok.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        == ids
    )
    # Ollama: the Modelfile's TEMPLATE around the prompt, with the GGUF's BOS added by Ollama
    template = _modelfile_template((gf / "Modelfile").read_text())
    assert (
        eot + _go_template(template, {"Prompt": instruction}) == text
    )  # trimmed as training trims it
    # a whole conversation: each answer closed by end-of-text, as training closes it
    chat = [
        *messages,
        {"role": "assistant", "content": "return x * x"},
        {"role": "user", "content": "And cubes?"},
    ]
    assert (
        hf_tok.apply_chat_template(chat, tokenize=False)
        == jinja2.Environment()
        .from_string(meta["tokenizer.chat_template"])
        .render(messages=chat, bos_token=eot, eos_token=eot)
        == (text + "return x * x" + eot + format_prompt("And cubes?"))
    )
    # the context: the longer of the base's (64) and the finetune's (128)
    assert (
        config["max_position_embeddings"]
        == tcfg["model_max_length"]
        == meta["llama.context_length"]
        == 128
    )
    assert "PARAMETER num_ctx 128\n" in (gf / "Modelfile").read_text()


# (instruction, input): Alpaca's two record forms, with newlines, accents, emoji and surrounding spaces
FORMS = [
    ("  Sum a list.  ", ""),
    ("Sum a list.", "[1, 2, 3]"),
    (" Écris une fonction\nqui ajoute 🎉 \t", "  x = 1\ny = 2 \n"),
    ("Reverse it.\n", "   "),
]


def _messages(instruction: str, input: str) -> list[dict]:
    """The chat convention (docs/FINETUNING.md): a record's input is a second user message."""
    return [{"role": "user", "content": t} for t in (instruction, input) if t]


_GO_FUNCS = {
    "len": len,
    "index": lambda s, i: s[i],
    "not": lambda a: not a,
    "slice": lambda s, a, b=None: s[a:b],
    "eq": lambda a, *b: a in b,
    "and": lambda a, b: a and b,
    "lt": lambda a, b: a < b,
    "ge": lambda a, b: a >= b,
}


def _go_call(tokens: list, env: dict, data: dict) -> object:
    """One Go template pipeline (a function and its arguments, or one value), consumed from `tokens`."""
    if tokens[0] in _GO_FUNCS:
        name, args = tokens.pop(0), []
        while tokens and tokens[0] != ")":
            args.append(_go_value(tokens, env, data))
        return _GO_FUNCS[name](*args)
    return _go_value(tokens, env, data)


def _go_value(tokens: list, env: dict, data: dict) -> object:
    head = tokens.pop(0)
    if head == "(":
        v = _go_call(tokens, env, data)
        assert tokens.pop(0) == ")"
        return v
    if head.startswith("$"):
        return env[head]
    if head.startswith("."):
        return data[head[1:]].encode()  # Go's strings are bytes
    return {"true": True, "false": False}[head] if head in ("true", "false") else int(head)


def _go_template(template: str, data: dict) -> str:
    """Go's text/template, the subset Ollama's TEMPLATE uses here: variables (:= and =), if/else, range over an
    integer, and len, index (of a string: a byte), slice, eq (any of), not, and, lt, ge, with Go's truth."""
    parts = re.split(r"{{(.*?)}}", template, flags=re.S)
    env: dict = {}

    def call(tokens: list) -> object:
        return _go_call(tokens, env, data)

    def run(i: int, out: list, live: bool) -> tuple[int, str]:
        """Renders parts from i up to an unmatched else or end: (the index after it, which one)."""
        while i < len(parts):
            if i % 2 == 0:
                out.append(parts[i] if live else "")  # text
                i += 1
                continue
            tokens = re.findall(r"\(|\)|[^\s()]+", parts[i])
            i += 1
            if tokens[0] in ("end", "else"):
                return i, tokens[0]
            if tokens[0] == "if":
                cond = live and bool(call(tokens[1:]))
                i, closed = run(i, out, cond)
                if closed == "else":
                    i, _ = run(i, out, live and not cond)
            elif tokens[0] == "range":
                assert tokens[1:3] == ["$i", ":="]
                n, start = (call(tokens[3:]) if live else 0), i
                i, _ = run(start, out, False)  # to its end
                for k in range(n):
                    env["$i"] = k
                    run(start, out, True)
            elif len(tokens) > 1 and tokens[1] in (":=", "="):
                if live:
                    env[tokens[0]] = call(tokens[2:])
            elif live:
                out.append(call(tokens).decode())
        return i, ""

    out: list = []
    run(0, out, True)
    return "".join(out)


def test_both_alpaca_record_forms_are_the_same_in_training_transformers_llama_cpp_and_ollama(
    lora_run, tmp_path
):
    """Half of code_alpaca's records have an input and train with the "### Input:" form: the exported chat template
    (a second user message is the input) and the Modelfile (where Ollama joins the two with a blank line) render both
    forms as training does, each part trimmed."""
    import jinja2.sandbox
    from transformers import AutoTokenizer

    from tinygpt.finetune.lora import load_finetuned
    from tinygpt.finetune.records import record_segments

    _, tok = load_finetuned(lora_run)
    eot = tok.eos_token
    hf = AutoTokenizer.from_pretrained(export(lora_run, tmp_path / "hf"))
    gf = export(lora_run, tmp_path / "gguf", "gguf", "f32")
    meta, _ = read_gguf(gf / "model-F32.gguf")
    ollama = _modelfile_template((gf / "Modelfile").read_text(encoding="utf-8"))
    # llama-cpp-python's environment for a GGUF's chat template
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    segments, _, _ = record_segments(
        [{"instruction": i, "input": x, "output": "o"} for i, x in FORMS]
    )
    for (instruction, input), segs in zip(FORMS, segments):
        ids = Codec(tok).encode_examples([segs[:1]])[0][0]  # training's prompt, as it trained
        text = tok.decode(ids)
        assert ("### Input:" in text) == bool(input.strip())
        messages = _messages(instruction, input)
        assert (
            list(
                hf.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=True, return_dict=True
                )["input_ids"]
            )
            == ids
        ), (instruction, input)
        rendered = env.from_string(meta["tokenizer.chat_template"]).render(
            messages=messages, bos_token=eot, eos_token=eot, add_generation_prompt=True
        )
        assert rendered == text
        # Ollama: consecutive user messages joined by a blank line, the GGUF's BOS added before the template's text
        prompt = "\n\n".join(m["content"] for m in messages)
        assert [tok.eos_token_id] + hf(
            _go_template(ollama, {"Prompt": prompt}), add_special_tokens=False
        )["input_ids"] == ids, (instruction, input)
    # a conversation: an answer ends its turn; the next instruction starts a prompt of its own
    chat = [
        *_messages(*FORMS[1]),
        {"role": "assistant", "content": "return sum(x)"},
        {"role": "user", "content": "x"},
    ]
    assert hf.apply_chat_template(chat, tokenize=False) == (
        eot + format_prompt(*FORMS[1]) + "return sum(x)" + eot + format_prompt("x")
    )


def test_llama_cpp_renders_both_alpaca_record_forms_as_training_did(lora_run, tmp_path):
    pytest.importorskip(
        "llama_cpp", reason="llama.cpp is not installed here (pip install llama-cpp-python)"
    )
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from tinygpt.finetune.lora import load_finetuned

    _, tok = load_finetuned(lora_run)
    path = next(export(lora_run, tmp_path / "g", "gguf", "f32").glob("*.gguf"))
    llm = _llama(path, 128)
    formatter = Jinja2ChatFormatter(
        llm.metadata["tokenizer.chat_template"], eos_token=tok.eos_token, bos_token=tok.eos_token
    )
    for instruction, input in FORMS:
        ids = _training_prompt(lora_run, instruction, input)
        got = formatter(messages=_messages(instruction, input))
        # as its chat handler tokenizes the prompt: the template put the BOS in (added_special)
        added = getattr(got, "added_special", True)
        assert llm.tokenize(got.prompt.encode(), add_bos=not added, special=True) == ids, (
            instruction,
            input,
        )


def test_a_pretrained_export_adds_no_token_before_a_prompt(run, tmp_path):
    from transformers import AutoTokenizer

    hf = export(run, tmp_path / "hf")
    assert _json(hf / "tokenizer_config.json")["add_bos_token"] is False
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok("def main(")["input_ids"] == tok("def main(", add_special_tokens=False)["input_ids"]
    meta, _ = read_gguf(export(run, tmp_path / "g", "gguf", "f32") / "model-F32.gguf")
    assert meta["tokenizer.ggml.add_bos_token"] is False


# --- 3. the card of the exported checkpoint ----------------------------------------------------


def test_the_card_describes_the_exported_checkpoint_and_shows_no_none(run, tmp_path):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    at10 = next(r for r in rows if r.get("step") == 10 and "loss" in r)
    val6 = next(r for r in rows if r.get("step") == 6 and "val_loss" in r)
    out = export(
        run, tmp_path / "ten", "gguf", "f32", which=str(run / "checkpoints" / "step_000010")
    )
    card = (out / "README.md").read_text()
    assert "| steps | 10 |" in card and f"| tokens seen | {at10['tokens']:,} |" in card
    assert f"| training loss | {at10['loss']:.4g} |" in card
    assert f"| validation loss (step 6) | {val6['val_loss']:.4g} |" in card and "(step 10)" in card
    assert "None" not in card

    # a run that never evaluated: "not evaluated", never "None"
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("tensorboard"))
    (bare / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if "val_loss" not in r)
    )
    (bare / "evals.jsonl").unlink(missing_ok=True)
    card = (export(bare, tmp_path / "bare-out") / "README.md").read_text()
    assert "| validation loss | not evaluated |" in card and "None" not in card
    assert "| steps | 12 |" in card


# --- 4. q8_0 on CPUs with AMX -----------------------------------------------------------------


def test_a_q8_0_export_says_how_to_run_it_on_a_cpu_with_amx(run, tmp_path, capsys):
    assert (
        main(["export", str(run), str(tmp_path / "q8"), "--format", "gguf", "--quant", "q8_0"]) == 0
    )
    err = capsys.readouterr().err
    assert "--no-repack" in err and "AMX" in err
    assert AMX_NOTE in (tmp_path / "q8" / "README.md").read_text()
    assert "--no-repack" in (REPO / "README.md").read_text()


# --- 5. llama.cpp itself ----------------------------------------------------------------------

PROMPTS = ["def main(", "The king said", "import os\n"]


def _llama(path: Path, n_ctx: int, logits_all: bool = False):
    try:
        from llama_cpp import Llama
    except ImportError:
        pytest.skip(
            "llama.cpp is not installed here (pip install llama-cpp-python builds it from source with CMake)"
        )
    return Llama(
        model_path=str(path), n_ctx=n_ctx, logits_all=logits_all, verbose=False, n_threads=2, seed=0
    )


def _greedy_cpp(llm, ids: list[int], n: int, stop: int | None = None) -> list[int]:
    llm.reset()
    out = []
    for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
        if tok == stop or len(out) == n:
            break
        out.append(int(tok))
    return out


def _greedy_ours(model, ids: list[int], n: int, hf: bool = False) -> list[int]:
    ids = list(ids)
    start = len(ids)
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits if hf else model(x)
            ids.append(int(logits[0, -1].argmax()))
    return ids[start:]


def _f16(model):
    """The model with its weights rounded to f16, as the GGUF holds them (norms stay f32 there)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.copy_(p.half().float())
    return model


def _perturbed(tok, qk_norm: bool):
    import dataclasses

    from tinygpt.model.gpt import GPT

    vocab = 50304 if tok.vocab_size > 50000 else tok.vocab_size + 64
    config = dataclasses.replace(
        SMOKE.model, vocab_size=vocab, n_kv_head=1, qk_norm=qk_norm, rope_theta=5000.0
    )
    torch.manual_seed(0)
    m = GPT(config)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


@pytest.mark.slow  # llama.cpp
@pytest.mark.parametrize("kind", ["own-bpe", "gpt2", "qwen3"])
def test_llama_cpp_greedy_tokens_at_f16_equal_tinygpts(kind, run, tmp_path):
    pytest.importorskip(
        "llama_cpp", reason="llama.cpp is not installed here (pip install llama-cpp-python)"
    )
    from tinygpt.model.loading import load_run
    from tinygpt.model.tokenizer import load_gpt2

    if kind == "own-bpe":  # the trained run, through `tinygpt export`
        model, tok, _, _ = load_run(run)
        path = next(export(run, tmp_path / "g", "gguf", "f16").glob("*.gguf"))
    else:  # GPT-2's BPE with llama, its own BPE with QK-norm (llama.cpp's qwen3): weights far from init
        tok = load_gpt2() if kind == "gpt2" else load_run(run)[1]
        model = _perturbed(tok, qk_norm=kind == "qwen3")
        path = gg.write_gguf(model, tok, tmp_path / "m.gguf", "f16")
    meta, _ = read_gguf(path)
    assert meta["general.architecture"] == ("qwen3" if kind == "qwen3" else "llama")
    llm = _llama(path, 128)
    model = _f16(model.float().eval())
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
        assert _greedy_cpp(llm, ids, 24) == _greedy_ours(model, ids, 24), (kind, prompt)


@pytest.mark.slow  # llama.cpp
def test_llama_cpp_greedy_tokens_of_a_merged_lora_at_f16_equal_its_merged_models(
    lora_run, tmp_path
):
    pytest.importorskip(
        "llama_cpp", reason="llama.cpp is not installed here (pip install llama-cpp-python)"
    )
    from tinygpt.finetune.lora import load_finetuned

    merged, tok = load_finetuned(lora_run, merge=True)
    path = next(export(lora_run, tmp_path / "g", "gguf", "f16").glob("*.gguf"))
    llm = _llama(path, 128)
    merged = _f16(merged.float().eval())
    for prompt in PROMPTS:
        ids = [tok.bos_token_id] + tok(prompt, add_special_tokens=False)[
            "input_ids"
        ]  # as the GGUF starts it
        assert llm.tokenize(prompt.encode(), add_bos=True, special=True) == ids
        assert _greedy_cpp(llm, ids, 24) == _greedy_ours(merged, ids, 24, hf=True), prompt


@pytest.mark.slow  # llama.cpp
def test_llama_cpp_greedy_tokens_of_a_full_finetune_at_f16_equal_its_hf_exports(
    run, shared_data, tmp_path
):
    """The fifth export kind: a full finetune (every weight trained). Its GGUF in llama.cpp and its Hugging Face export
    in transformers start a prompt with the same tokens (the finetune's BOS) and continue it greedily alike at f16."""
    pytest.importorskip(
        "llama_cpp", reason="llama.cpp is not installed here (pip install llama-cpp-python)"
    )
    import transformers

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
    hf = export(tmp_path / "full", tmp_path / "hf", "hf")
    path = next(export(tmp_path / "full", tmp_path / "g", "gguf", "f16").glob("*.gguf"))
    model = _f16(transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval())
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    llm = _llama(path, 128)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]  # what transformers adds before a prompt
        assert ids[0] == tok.bos_token_id
        assert llm.tokenize(prompt.encode(), add_bos=True, special=True) == ids
        assert _greedy_cpp(llm, ids, 24) == _greedy_ours(model, ids, 24, hf=True), prompt


def test_a_finetuned_gguf_answers_an_instruction_as_generate_adapter_does(lora_run, tmp_path):
    pytest.importorskip(
        "llama_cpp", reason="llama.cpp is not installed here (pip install llama-cpp-python)"
    )
    from tinygpt.finetune.lora import load_finetuned
    from tinygpt.model.generate import generate_response

    merged, tok = load_finetuned(lora_run, merge=True)
    want = generate_response(
        merged, tok, INSTRUCTION, max_new_tokens=24
    )  # `tinygpt generate --adapter`, greedy
    path = next(export(lora_run, tmp_path / "g", "gguf", "f32").glob("*.gguf"))
    llm = _llama(path, 128)
    # the prompt as llama.cpp and Ollama build it: the instruction format, the GGUF's BOS added by the tokenizer
    ids = llm.tokenize(format_prompt(INSTRUCTION).encode(), add_bos=True, special=True)
    assert ids == _training_prompt(lora_run, INSTRUCTION)
    got = _greedy_cpp(llm, ids, 24, stop=tok.eos_token_id)
    assert tok.decode(got, skip_special_tokens=True) == want
    # (a model this briefly trained may answer with little but newlines:) the whole next-token distribution
    # after the prompt, llama.cpp's against the merged model's, with the BOS in place
    scorer = _llama(path, 128, logits_all=True)
    scorer.eval(ids)
    with torch.no_grad():
        ours = merged(input_ids=torch.tensor([ids])).logits[0, -1].double().numpy()
    theirs = np.asarray(scorer.scores[len(ids) - 1], dtype=np.float64)
    np.testing.assert_allclose(
        theirs, ours, atol=1e-3 * max(1.0, float(np.abs(ours).max())), rtol=0
    )
    # llama.cpp's chat mode (the GGUF's Jinja template, as llama-cpp-python renders it) gives the same answer
    llm.reset()
    chat = llm.create_chat_completion(
        messages=[{"role": "user", "content": INSTRUCTION}],
        temperature=0.0,
        top_k=1,
        repeat_penalty=1.0,
        max_tokens=24,
    )
    assert chat["choices"][0]["message"]["content"] == want
