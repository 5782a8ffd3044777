"""Evaluation: perplexity / bits per byte against a direct computation, HellaSwag loading and
scoring, code metrics against sacrebleu and exact pass@k, the sandbox, run summaries and plots."""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import itertools
import json
import math
import os
from fractions import Fraction
from pathlib import Path

import pytest
import sacrebleu
import torch
import torch.nn as nn
import torch.nn.functional as F

from tinygpt import evals
from tinygpt.core import paths
from tinygpt.core.checkpoint import CheckpointError, model_state, save_checkpoint, step_name
from tinygpt.core.datafiles import DataFormatError
from tinygpt.core.files import UnsafePathError
from tinygpt.core.recipes import get_recipe
from tinygpt.core.rundir import RunDir, RunDirError
from tinygpt.evals import code, sandbox
from tinygpt.evals import lm as ev
from tinygpt.evals.harness import Loaded, Request
from tinygpt.evals.tasks import hellaswag as hsw
from tinygpt.evals.tasks import perplexity
from tinygpt.evals.tasks.humaneval import HUMANEVAL_STOPS, load_humaneval
from tinygpt.evals.tasks.mbpp import load_mbpp
from tinygpt.evals.texts import load_eval_text, read_text
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import train_bpe


@pytest.fixture(scope="module")
def tok(shakespeare):
    return train_bpe([shakespeare[:200_000]], 512)


def _model(max_seq_len: int = 128, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    m = GPT(dataclasses.replace(get_recipe("cpu-smoke").model, max_seq_len=max_seq_len))
    with torch.no_grad():  # weights far from init, so that logits differ clearly between tokens
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def wikitext(shared_data):
    return read_text(shared_data / "wikitext2_test.txt", max_chars=2500)


# --- perplexity ---------------------------------------------------------------------------------


def test_perplexity_non_overlapping_equals_direct_cross_entropy(model, tok, wikitext):
    ids = [tok.eot_id] + tok.encode(wikitext)
    W, total, count = 32, 0.0, 0
    for b in range(0, len(ids) - 1, W):
        x = torch.tensor([ids[b : b + W]])
        y = torch.tensor(ids[b + 1 : b + W + 1])
        with torch.no_grad():
            total += F.cross_entropy(model(x)[0, : len(y)], y, reduction="sum").item()
        count += len(y)
    r = ev.perplexity(model, tok, wikitext, window=W, batch_size=3)
    assert r["mode"] == "non-overlapping" and r["tokens"] == count == len(ids) - 1
    assert r["nll_nats"] == pytest.approx(total, rel=1e-5)
    assert r["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert r["bits_per_byte"] == pytest.approx(
        total / (math.log(2) * len(wikitext.encode("utf-8"))), rel=1e-5
    )
    same = ev.perplexity(model, tok, wikitext, window=W, stride=W, batch_size=1)
    assert (
        same["nll_nats"] == pytest.approx(r["nll_nats"], rel=1e-5)
        and same["mode"] == "non-overlapping"
    )


def test_sliding_window_gives_each_token_its_last_window_of_context(model, tok, wikitext):
    text = wikitext[:300]
    ids = [tok.eot_id] + tok.encode(text)
    W = 16
    total = 0.0
    for j in range(1, len(ids)):  # token j predicted from at most W tokens before it
        x = torch.tensor([ids[max(0, j - W) : j]])
        with torch.no_grad():
            total += -F.log_softmax(model(x)[0, -1], -1)[ids[j]].item()
    r = ev.perplexity(model, tok, text, window=W, stride=1, batch_size=7)
    assert r["mode"] == "sliding" and r["stride"] == 1
    assert r["nll_nats"] == pytest.approx(total, rel=1e-5)
    with pytest.raises(ValueError, match="stride"):
        ev.perplexity(model, tok, text, window=W, stride=W + 1)
    with pytest.raises(ValueError, match="window"):
        ev.perplexity(model, tok, text, window=10_000)


def _hf_twin(model: GPT, tok):
    """The same weights as a transformers LlamaForCausalLM, with the same tokenizer."""
    from transformers import LlamaForCausalLM

    from tinygpt.model.hf import hf_llama_config, hf_tokenizer

    hf = LlamaForCausalLM(hf_llama_config(model.config, tok.eot_id))
    hf.load_state_dict(model_state(model), strict=False)
    return hf.eval(), hf_tokenizer(tok)


def test_hugging_face_model_and_tokenizer_give_the_same_numbers(model, tok, wikitext, shared_data):
    hf, hf_tok = _hf_twin(model, tok)
    a = ev.perplexity(model, tok, wikitext[:1500], window=64, stride=32)
    b = ev.perplexity(hf, hf_tok, wikitext[:1500], window=64, stride=32)
    assert a["tokens"] == b["tokens"] and b["nll_nats"] == pytest.approx(a["nll_nats"], rel=1e-4)
    items = hsw.load_hellaswag(shared_data / "hellaswag_val.txt.bz2", limit=2)
    reqs = [(it.context, " " + e) for it in items for e in it.endings]
    assert ev.loglikelihoods(hf, hf_tok, reqs) == pytest.approx(
        ev.loglikelihoods(model, tok, reqs), abs=1e-3
    )
    texts = [wikitext[:1000], "def f(x):\n    return x"]
    assert (
        [ev.encoder(hf_tok)(t) for t in texts]
        == [ev.encoder(tok)(t) for t in texts]
        == [tok.encode(t) for t in texts]
    )


# --- HellaSwag --------------------------------------------------------------------------------


def test_load_real_hellaswag(shared_data):
    items = hsw.load_hellaswag(shared_data / "hellaswag_val.txt.bz2")
    lines = (
        bz2.open(shared_data / "hellaswag_val.txt.bz2", "rt", encoding="utf-8").read().splitlines()
    )
    assert len(items) == len(lines) // 6 and len(items) in (
        10042,
        200,
    )  # the full set, or the shipped sample
    assert (
        items[0].context == "Roof shingle removal: A man is sitting on a roof. He"
    )  # lm-eval's capitalised ctx_b
    assert items[0].label == 3 and items[0].endings[3] == "starts pulling up roofing on a roof."
    assert all(len(it.endings) == 4 and 0 <= it.label <= 3 for it in items)
    assert len(hsw.load_hellaswag(shared_data / "hellaswag_val.txt.bz2", limit=5)) == 5


def test_bad_hellaswag_files_say_what_is_expected(tmp_path):
    seven = tmp_path / "seven.txt"
    seven.write_text("ctx\n1\na\nb\nc\nd\nextra\n")
    with pytest.raises(DataFormatError, match="incomplete item of 1 lines at line 7"):
        hsw.load_hellaswag(seven)
    gold = tmp_path / "gold.txt"
    gold.write_text("ctx\n7\na\nb\nc\nd\n")
    with pytest.raises(DataFormatError, match="line 2.*0-3"):
        hsw.load_hellaswag(gold)
    with pytest.raises(ValueError, match="limit"):
        hsw.load_hellaswag(gold, limit=0)


class Bigram(nn.Module):
    """logits[t] = table[idx[t]]: a model whose every log-probability is known."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(table)
        self.config = type("Config", (), {"max_seq_len": 64})()

    def forward(self, idx):
        return self.table[idx]


@pytest.fixture(scope="module")
def byte_tok():
    return train_bpe(
        ["x"], 257
    )  # 256 bytes + end-of-text, no merges: one token per ASCII character


def test_loglikelihood_sums_the_continuation_tokens_only(byte_tok):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(257, 257, generator=g) * 3
    lm = Bigram(table)
    reqs = [("The cat", " sat down."), ("Hello, wor", "ld"), ("a", " b c"), ("", "xyz")]
    got = ev.loglikelihoods(lm, byte_tok, reqs, batch_size=3)
    logp = F.log_softmax(table, -1)
    for (ctx, cont), ll in zip(reqs, got):
        ctx_ids = byte_tok.encode(ctx) or [byte_tok.eot_id]
        cont_ids = byte_tok.encode(cont)
        prev = [ctx_ids[-1]] + cont_ids[:-1]
        assert ll == pytest.approx(sum(logp[p, c].item() for p, c in zip(prev, cont_ids)), rel=1e-5)


def test_acc_and_acc_norm_pick_the_endings_they_must(byte_tok):
    # Every position predicts the same distribution: 'a' likely, ' ' fairly, 'b' unlikely.
    w = torch.zeros(257)
    for ch, v in (("a", 5.0), (" ", 3.0), ("b", -2.0)):
        w[byte_tok.encode(ch)[0]] = v
    lm = Bigram(w.repeat(257, 1))
    endings = ["a a a a a a a a", "b", "zz", "aab"]
    # Summed log-likelihood prefers the short "b"; per character, the long likely "a a a ...".
    long_wins = ev.multiple_choice(lm, byte_tok, [ev.ChoiceItem("Context.", endings, 0)])
    short_wins = ev.multiple_choice(lm, byte_tok, [ev.ChoiceItem("Context.", endings, 1)])
    assert (long_wins["acc"], long_wins["acc_norm"]) == (0.0, 1.0)
    assert (short_wins["acc"], short_wins["acc_norm"]) == (1.0, 0.0)


def test_hellaswag_on_the_real_file(model, tok, shared_data):
    request = Request(data=shared_data / "hellaswag_val.txt.bz2", limit=4, batch_size=5)
    r = hsw.score(Loaded(model, tok, "m", False), request)
    assert r["n"] == 4 and 0 <= r["acc"] <= 1 and 0 <= r["acc_norm"] <= 1
    assert r["reference"]["random"]["acc"] == 0.25


# --- code metrics ------------------------------------------------------------------------------


def _bleu(hypotheses, references, **options) -> float:
    return code.bleu_with_signature(hypotheses, references, **options)[0]


def test_bleu_equals_sacrebleu():
    cases = [
        (["the cat sat on the mat"], ["the cat sat on the mat"]),
        (["the cat sat on the mat", "a dog"], ["the cat is on the mat", "the dog barked"]),
        (
            ["def f(x):\n    return x + 1", "print('hi')"],
            ["def f(x):\n    return x+1", 'print("hi")'],
        ),
        (["", "völlig anders: ünïcödé"], ["something", "völlig anders, ünïcödé!"]),
        (
            ["for i in range(10): pass"] * 3,
            ["for j in range(10): pass", "while True: pass", "for i in range(10): pass"],
        ),
    ]
    for hyps, refs in cases:
        assert _bleu(hyps, refs) == sacrebleu.corpus_bleu(hyps, [refs]).score
    hyps, r1 = ["a b c d e", "x y z"], ["a b c d f", "x y"]
    assert (
        _bleu(hyps, r1, tokenize="char") == sacrebleu.corpus_bleu(hyps, [r1], tokenize="char").score
    )
    metric = sacrebleu.metrics.BLEU()
    reference = metric.corpus_score(hyps, [r1])
    assert code.bleu_with_signature(hyps, r1) == (reference.score, str(metric.get_signature()))
    assert "tok:char" in code.bleu_with_signature(hyps, r1, tokenize="char")[1]
    with pytest.raises(ValueError, match="references"):
        _bleu(["a", "b"], ["a"])


def _pass_at_k_exact(n: int, c: int, k: int) -> Fraction:
    """The share of all k-subsets of n samples (c correct) that hold at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_exact_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert code.pass_at_k(n, c, k) == pytest.approx(
                    float(_pass_at_k_exact(n, c, k)), abs=1e-12
                )
    exact = 1 - Fraction(
        math.comb(197, 100), math.comb(200, 100)
    )  # large n: the product form stays exact
    assert code.pass_at_k(200, 3, 100) == pytest.approx(float(exact), rel=1e-12)
    with pytest.raises(ValueError, match="k=5"):
        code.pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        code.pass_at_k(4, 5, 1)


def _syntax_accuracy(codes: list[str]) -> float:
    """The share of code strings that parse (`CodeProblem.valid_syntax` with no prefix)."""
    return sum(code.CodeProblem("", "", "", "", "").valid_syntax(c) for c in codes) / len(codes)


def test_extract_code_and_syntax_accuracy():
    assert code.extract_code("Here:\n```python\nx = 1\n```\nand more") == "x = 1\n"
    assert code.extract_code("```\ny = 2\n```") == "y = 2\n"
    assert code.extract_code("```js\nno\n```\n```py\nz = 3\n```") == "z = 3\n"
    assert code.extract_code("```python\nunclosed = 1\n") == "unclosed = 1\n"
    assert code.extract_code("    return 1\n") == "    return 1\n"
    assert code.truncate_at_stops("    return 1\ndef g(): pass", HUMANEVAL_STOPS) == "    return 1"
    assert _syntax_accuracy(["x = 1", "def f(:", "print('ok')", "a\0b"]) == 0.5


# --- the sandbox (its attacks: tests/test_sandbox.py) --------------------------------------------

# Without a kernel boundary (not root, no user namespaces) these run with rlimits only: what they
# check is the harness (statuses, verdicts), not the boundary.
UNSAFE = {"unsafe": sandbox.boundary().kind == "none"}


def test_sandbox_contains_loops_memory_hogs_and_exits(monkeypatch):
    monkeypatch.setenv("TINYGPT_TEST_SECRET", "hunter2")
    cwd = os.getcwd()
    assert sandbox.run("while True:\n    pass\n", timeout_s=1, **UNSAFE).status == "timeout"
    assert (
        sandbox.run("while True:\n    pass\n", timeout_s=30, cpu_s=1, **UNSAFE).status
        == "cpu_limit"
    )
    assert sandbox.run("x = bytearray(4 * 1024**3)\n", **UNSAFE).status == "out_of_memory"
    r = sandbox.run("import sys\nsys.exit(3)\n", **UNSAFE)
    assert (r.status, r.returncode) == ("failed", 3)
    assert sandbox.run("import os\nos._exit(0)\n", **UNSAFE).status == "exited_early"
    assert sandbox.run("import sys\nsys.exit(0)\nassert False\n", **UNSAFE).status == "exited_early"
    assert (
        sandbox.run(
            "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
            max_output_mb=1,
            **UNSAFE,
        ).status
        == "output_limit"
    )
    r = sandbox.run(
        "import os\nassert 'TINYGPT_TEST_SECRET' not in os.environ, 'leaked'\n"
        "open('left_behind.txt', 'w').write('x')\nprint(os.getcwd())\n",
        **UNSAFE,
    )
    assert r.status == "passed", r.stderr
    assert not Path(r.stdout.strip()).exists()  # the working directory is gone
    assert (
        os.getcwd() == cwd and os.environ["TINYGPT_TEST_SECRET"] == "hunter2"
    )  # this process unharmed


def test_real_problems_pass_with_canonical_and_fail_with_wrong_solutions(shared_data):
    he = load_humaneval(shared_data / "HumanEval.jsonl.gz")
    mbpp = load_mbpp(shared_data / "mbpp.jsonl")
    n_he = len(gzip.open(shared_data / "HumanEval.jsonl.gz", "rt").read().splitlines())
    assert len(he) == n_he and n_he in (164, 8) and he[0].entry_point == "has_close_elements"
    ids = [
        json.loads(x)["task_id"]
        for x in (shared_data / "mbpp.jsonl").read_text().splitlines()
        if x.strip()
    ]
    assert len(mbpp) == sum(11 <= i <= 510 for i in ids) and mbpp[0].task_id == "MBPP/11"
    assert mbpp[-1].task_id == "MBPP/510"
    node = next(
        p for p in mbpp if p.task_id == "MBPP/367"
    )  # needs its test_setup_code after the solution
    probs = [he[0], he[1], mbpp[0], node]
    good = code.check_completions(probs, [p.canonical_solution for p in probs], **UNSAFE)
    assert [r.status for r in good] == ["passed"] * 4, [r.stderr for r in good]
    wrong = [
        "    return not "
        + he[0].canonical_solution.strip().splitlines()[-1].split("return ")[-1]
        + "\n",
        "    return []\n",
        "def remove_Occ(s, ch):\n    return s\n",
        "class Node: pass\n",
    ]
    assert [r.status for r in code.check_completions(probs, wrong, **UNSAFE)] == ["failed"] * 4


def test_evaluate_code_reports_pass_at_k(shared_data):
    probs = load_humaneval(shared_data / "HumanEval.jsonl.gz")[:2]
    answers = {
        probs[0].prompt: iter(
            [f"Sure:\n```python\n{probs[0].prompt}{probs[0].canonical_solution}```", "    1/0\n"]
        ),
        probs[1].prompt: iter(["    return []\n\ndef unrelated():\n    pass\n", "    return []\n"]),
    }
    r = code.evaluate_code(probs, lambda prompt: next(answers[prompt]), n=2, ks=(1, 2), **UNSAFE)
    assert [p["passed"] for p in r["per_problem"]] == [1, 0]
    assert r["pass@1"] == pytest.approx(0.25) and r["pass@2"] == pytest.approx(0.5)
    assert r["per_problem"][1]["completions"][0] == "    return []\n"  # cut at the stop "\ndef "
    assert r["syntax_accuracy"] == 1.0 and 0 <= r["bleu"] <= 100
    called = []
    with pytest.raises(ValueError, match="k=3"):
        code.evaluate_code(probs, lambda p: called.append(p) or "", n=2, ks=(3,))
    assert not called  # refused before generating anything


def test_bad_code_data_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": 11, "text": "t"}) + "\n")
    with pytest.raises(DataFormatError, match="test_list"):
        load_mbpp(bad)
    bad.write_text("{not json\n")
    with pytest.raises(DataFormatError, match="line 1"):
        load_humaneval(bad)


# --- runs --------------------------------------------------------------------------------------


def _write_run(
    path: Path, records: list[dict], micro_batch_size: int = 8, truncated_tail: bool = False
) -> Path:
    recipe = get_recipe("cpu-smoke").replace(train={"micro_batch_size": micro_batch_size})
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"recipe": recipe.to_dict()}))
    text = "".join(json.dumps(r) + "\n" for r in records)
    (path / "metrics.jsonl").write_text(text + ('{"step": 99, "lo' if truncated_tail else ""))
    return path


def _records(losses, val_every=2, val=None):
    out = []
    for i, loss in enumerate(losses):
        m = {
            "step": 10 * (i + 1),
            "loss": loss,
            "lr": 1e-3,
            "tokens_per_s": 1000.0 + i,
            "mfu": 0.1,
            "grad_norm": 1.0,
        }
        if val and i % val_every == val_every - 1:
            m["val_loss"] = val[i // val_every]
        out.append(m)
    return out


def test_summarize_compare_and_plot_runs(tmp_path):
    a = _write_run(
        tmp_path / "a",
        _records([5.0, 4.0, 3.5, 3.2, 3.0, 2.9], val=[4.1, 3.4, 3.1]),
        truncated_tail=True,
    )
    b = _write_run(
        tmp_path / "b",
        _records([5.0, 3.0, 2.0, 1.5, 1.2, 1.0], val=[3.2, 3.4, 3.9]),
        micro_batch_size=16,
    )
    (a / "samples.txt").write_text("=== step 60 ===\nTo be\n\n")
    assert "To be" in RunDir(a).samples() and RunDir(b).samples() == ""
    s = evals.summarize_run(a)
    assert s["steps"] == 60 and s["loss_last"] == 2.9 and s["val_loss_best"] == 3.1
    assert s["tokens_seen"] == 60 * 8 * 64 and s["diagnosis"] == ["no problems found"]
    assert s["tokens_per_s"] == pytest.approx(1003.0)  # median, the first interval left out
    sb = evals.summarize_run(b)
    assert sb["val_loss_best_step"] == 20 and any("overfitting" in d for d in sb["diagnosis"])
    table = evals.compare_runs([a, b])
    assert [r["run"] for r in table] == ["a", "b"] and table[1]["tokens_seen"] == 60 * 16 * 64
    assert table[0]["params"] == GPT(get_recipe("cpu-smoke").model).num_params()
    pytest.importorskip("matplotlib")
    fig = evals.plot_runs([a, b])
    lines = fig.axes[0].get_lines()
    assert len(lines) == 4 and list(lines[2].get_xdata()) == [
        s * 16 * 64 for s in range(10, 70, 10)
    ]
    bad = _write_run(tmp_path / "bad", [])
    (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\nnot json\n{"step": 2, "loss": 1}\n')
    with pytest.raises(RunDirError, match="line 2"):
        evals.summarize_run(bad)


def test_list_runs_finds_run_folders_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run folders.*tinygpt pretrain"):
        evals.list_runs(tmp_path / "nothing")
    a, b = _write_run(tmp_path / "a", []), _write_run(tmp_path / "b", [])
    (tmp_path / "not-a-run").mkdir()
    assert evals.list_runs(tmp_path) == [a, b] and evals.list_runs(tmp_path, ["b"]) == [b]
    with pytest.raises(FileNotFoundError, match="no run c under .*there are: a, b"):
        evals.list_runs(tmp_path, ["a", "c"])


def test_diagnosis_finds_a_nan_and_a_flat_loss(tmp_path):
    nan = _write_run(tmp_path / "nan", _records([5.0, 4.0, float("nan"), 4.0]))
    assert any("step 30" in d for d in evals.summarize_run(nan)["diagnosis"])
    flat = _write_run(tmp_path / "flat", _records([5.0, 5.1, 5.2, 5.1]))
    assert any("not decreased" in d for d in evals.summarize_run(flat)["diagnosis"])


def _hand_made_run(path: Path, tok, model: GPT) -> Path:
    recipe = get_recipe("cpu-smoke").replace(
        model={"vocab_size": tok.vocab_size, "max_seq_len": model.config.max_seq_len},
        data={"vocab_size": tok.vocab_size},
    )
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"recipe": recipe.to_dict()}))
    tok.save(path / "tokenizer.json")
    save_checkpoint(path / "checkpoints" / step_name(10), model_state(model), {"step": 10})
    return path


def test_run_eval_on_a_run_folder(tmp_path, tok, shared_data):
    model = _model(max_seq_len=512, seed=1)
    run = _hand_made_run(tmp_path / "run", tok, model)
    r = evals.run_eval(
        run, "perplexity", data=shared_data / "wikitext2_test.txt", max_chars=1500, window=128
    )
    direct = ev.perplexity(
        model, tok, read_text(shared_data / "wikitext2_test.txt", 1500), window=128
    )
    assert r["perplexity"] == pytest.approx(direct["perplexity"], rel=1e-6) and r["run"] == "run"
    assert (
        evals.run_eval(run, "hellaswag", data=shared_data / "hellaswag_val.txt.bz2", limit=2)["n"]
        == 2
    )
    code = evals.run_eval(
        run,
        "humaneval",
        data=shared_data / "HumanEval.jsonl.gz",
        limit=1,
        max_new_tokens=8,
        unsafe_exec=UNSAFE["unsafe"],
    )
    assert code["problems"] == 1 and code["pass@1"] == 0.0  # an untrained model
    with pytest.raises(ValueError, match="unknown task"):
        evals.run_eval(run, "mmlu", data="x")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "run.json").write_text((run / "run.json").read_text())
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        evals.run_eval(empty, "perplexity", data=shared_data / "wikitext2_test.txt")


# --- evaluation data: offline copy or Hub ------------------------------------------------------


def test_eval_data_prefers_the_offline_copy_else_names_the_hub(tmp_path, shared_data, monkeypatch):
    monkeypatch.setenv("TINYGPT_SHARED_DATA", str(shared_data))
    assert evals.eval_data("perplexity") == str(shared_data / "wikitext2_test.txt")
    assert hsw.hellaswag_path() == shared_data / "hellaswag_val.txt.bz2"
    monkeypatch.setenv("TINYGPT_SHARED_DATA", str(tmp_path / "none"))
    assert paths.shared_data_dir() is None
    assert (
        evals.eval_data("perplexity")
        == perplexity.WIKITEXT2_TEST_HUB
        == "hf:wikitext:wikitext-2-raw-v1@test"
    )
    assert evals.eval_data("hellaswag", data_dir=tmp_path) == hsw.HELLASWAG_HUB
    with pytest.raises(FileNotFoundError, match="HumanEval"):
        evals.eval_data("humaneval", data_dir=tmp_path)


def test_a_datasets_text_is_joined_as_it_is(tmp_path, shared_data):
    datasets = pytest.importorskip("datasets")
    lines = read_text(shared_data / "wikitext2_test.txt", 5000).splitlines(keepends=True)
    # WikiText on the Hub: one record per line, blank lines as empty records
    datasets.Dataset.from_dict({"text": [ln if ln.strip() else "" for ln in lines]}).save_to_disk(
        tmp_path / "wt"
    )
    text = "".join(ln if ln.strip() else "" for ln in lines)
    assert load_eval_text(tmp_path / "wt") == text
    assert load_eval_text(tmp_path / "wt", max_chars=700) == text[:700]


FIXTURES = Path(__file__).parent / "fixtures"


def _hellaswag_records() -> list[dict]:
    """Real HellaSwag records (tests/fixtures/README.md): the first 10 validation items and 6 train items,
    3 of them WikiHow items with [header], [title], [step] and [substeps] in context and endings."""
    return [
        json.loads(line) for line in (FIXTURES / "hellaswag_records.jsonl").read_text().splitlines()
    ]


def _lm_eval_preprocess(text: str) -> str:
    """lm-evaluation-harness's HellaSwag preprocess from its documented rules, written here without a
    regular expression: strip; " [title]" -> ". "; drop each "[" up to the first "]" after it; then one
    pass of "  " -> " "."""
    text = text.strip().replace(" [title]", ". ")
    kept, i = [], 0
    while (j := text.find("[", i)) >= 0 and (k := text.find("]", j + 1)) >= 0:
        kept.append(text[i:j])
        i = k + 1
    return ("".join(kept) + text[i:]).replace("  ", " ")


def _lm_eval_doc(rec: dict) -> tuple[str, list[str], int]:
    """lm-eval's (query, choices, gold) of a record: activity_label: ctx_a + " " + ctx_b capitalised."""
    ctx_b = rec["ctx_b"][:1].upper() + rec["ctx_b"][1:].lower()  # str.capitalize, spelled out
    query = _lm_eval_preprocess(rec["activity_label"] + ": " + rec["ctx_a"] + " " + ctx_b)
    return query, [_lm_eval_preprocess(e) for e in rec["endings"]], int(rec["label"])


def _docs(items: list[ev.ChoiceItem]) -> list[tuple[str, list[str], int]]:
    return [(it.context, it.endings, it.label) for it in items]


def test_hellaswag_text_is_lm_evals_on_real_records(tmp_path):
    records = _hellaswag_records()
    want = [_lm_eval_doc(r) for r in records]
    assert _docs(hsw.load_hellaswag(FIXTURES / "hellaswag_records.jsonl")) == want
    # what lm-eval's rules do, seen on the real text: ctx_b capitalised, [title] a sentence end, brackets gone
    assert want[0][0] == "Roof shingle removal: A man is sitting on a roof. He"
    health = next(w for w, r in zip(want, records) if r["ind"] == 12)
    assert health[0].startswith(
        "Health: How to cope with suicidal thoughts. Put off any plans. Promise yourself"
    )
    assert health[1][0].endswith(
        "lurking around your brain. For instance, don't tell yourself that you can't make it."
    )
    assert not any("[" in q or "[" in "".join(e) for q, e, _ in want)
    # the same records as a gzipped file, and limit
    gz = tmp_path / "hellaswag_val.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write((FIXTURES / "hellaswag_records.jsonl").read_text())
    assert _docs(hsw.load_hellaswag(gz, limit=3)) == want[:3]


def test_the_six_line_file_gives_lm_evals_text(shared_data):
    """The offline six-line file (klosax/hellaswag_text_data) holds "activity_label: ctx" with ctx_b in lower
    case and some brackets left: read, it gives lm-eval's text for the validation items we have records of."""
    val = [r for r in _hellaswag_records() if r["split"] == "val"]
    raw = (
        bz2.open(paths.sample_path("sample:hellaswag"), "rt", encoding="utf-8").read().splitlines()
    )
    assert (
        raw[0] == "Roof shingle removal: A man is sitting on a roof. he"
    )  # what the file itself holds
    files = [paths.sample_path("sample:hellaswag")]
    if (
        (paths.shared_data_dir() or Path("/nonexistent"))
        .joinpath("hellaswag_val.txt.bz2")
        .is_file()
    ):
        files.append(
            paths.shared_data_dir() / "hellaswag_val.txt.bz2"
        )  # the full offline file: the same items
    for path in files:
        assert _docs(hsw.load_hellaswag(path, limit=len(val))) == [_lm_eval_doc(r) for r in val]


def test_the_full_offline_file_is_read_as_lm_evals_text():
    full = (paths.shared_data_dir() or Path("/nonexistent")) / "hellaswag_val.txt.bz2"
    if not full.is_file():
        pytest.skip(
            "the full HellaSwag file (../shared/data/hellaswag_val.txt.bz2) is absent; the shipped "
            "sample is tested above"
        )
    items = hsw.load_hellaswag(full)
    lines = bz2.open(full, "rt", encoding="utf-8").read().splitlines()
    assert len(items) == 10042
    texts = [t for it in items for t in (it.context, *it.endings)]
    assert (
        sum(_lm_eval_preprocess(t) != t for t in lines if len(t) > 1) > 0
    )  # the file has [...] left
    assert all(_lm_eval_preprocess(t) == t for t in texts)  # none is left after reading
    # ctx_b capitalised on the ActivityNet items (3,243 of them), never on the WikiHow items
    changed = [(it, line) for it, line in zip(items, lines[::6]) if it.context != line]
    assert 3200 < len(changed) < 3300
    assert all(
        line.split(": ", 1)[0] not in hsw.WIKIHOW_LABELS
        for it, line in changed
        if it.context.lower() == line.lower()
    )


def test_bad_hellaswag_records_say_what_is_expected(tmp_path):
    rec = _hellaswag_records()[0]
    bad = tmp_path / "bad.jsonl"
    for broken, message in (
        ({**rec, "label": ""}, "label 0-3"),
        ({k: v for k, v in rec.items() if k != "ctx_b"}, "no 'ctx_b'"),
    ):
        bad.write_text(json.dumps(broken) + "\n")
        with pytest.raises(DataFormatError, match=message):
            hsw.load_hellaswag(bad)
    bad.write_text("{not json\n")
    with pytest.raises(DataFormatError, match="line 1 is not valid JSON"):
        hsw.load_hellaswag(bad)


def test_hub_hellaswag_records_give_lm_evals_text(tmp_path):
    pytest.importorskip("datasets")
    records = _hellaswag_records()
    # hf:NAME@SPLIT goes through datasets.load_dataset: a local dataset folder stands in for the Hub
    src = tmp_path / "hub"
    src.mkdir()
    (src / "validation.jsonl").write_text(
        "".join(json.dumps({**r, "label": str(r["label"])}) + "\n" for r in records)
    )
    path = hsw.hellaswag_path(f"hf:{src}@validation", cache_dir=tmp_path / "cache")
    assert (
        path.parent == tmp_path / "cache"
        and path.suffix == ".jsonl"
        and not list(path.parent.glob("*.tmp-*"))
    )
    assert _docs(hsw.load_hellaswag(path)) == [_lm_eval_doc(r) for r in records]
    (src / "test.jsonl").write_text(
        json.dumps({**records[0], "label": ""}) + "\n"
    )  # the Hub's test split: no labels
    with pytest.raises(DataFormatError, match="label 0-3"):
        hsw.hellaswag_path(f"hf:{src}@test", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / path.name.replace("validation", "test")).exists()


def test_a_hub_hellaswag_split_cannot_place_its_cache_file_outside_the_cache(tmp_path):
    """The cached copy's file name comes from the spec: a split of "../x" is refused before anything is read."""
    cache = tmp_path / "eval" / "cache"
    with pytest.raises(UnsafePathError, match="is not one file name|climbs out"):
        hsw.hellaswag_path("hf:Rowan/hellaswag@../../../outside", cache_dir=cache)
    assert not list(tmp_path.rglob("*outside*"))
