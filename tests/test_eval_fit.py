"""Evaluations that fit the model: a prompt longer than the model's context is cut from the left with one
line said (no transformers warning), generation stops at the end of an answer, and a code score shows the
share of empty answers beside it. Real tiny models, tinygpt's and its transformers twin."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tinygpt.core.checkpoint import model_state
from tinygpt.core.paths import sample_path
from tinygpt.core.recipes import get_recipe
from tinygpt.evals import code, sandbox
from tinygpt.evals.harness import CHUNK, Generator, Loaded
from tinygpt.evals.tasks.mbpp import load_mbpp
from tinygpt.model.generate import generate
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import train_bpe

CONTEXT = 64


@pytest.fixture(scope="module")
def tok():
    return train_bpe([sample_path("sample:wikitext2").read_text(encoding="utf-8")[:100_000]], 512)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = GPT(dataclasses.replace(get_recipe("cpu-smoke").model, max_seq_len=CONTEXT))
    with torch.no_grad():  # weights far from init, so that greedy picks differ between contexts
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


@pytest.fixture(scope="module")
def prompts(tok):
    """MBPP prompts from the shipped sample: each longer than the model's 64-token context."""
    out = [p.prompt for p in load_mbpp(sample_path("sample:mbpp"))[:3]]
    assert all(len(tok.encode(p)) > CONTEXT for p in out)
    return out


def test_a_long_prompt_is_cut_from_the_left_and_said_once(model, tok, prompts):
    said: list[str] = []
    g = Generator(
        Loaded(model, tok, "m", False), max_new_tokens=384, temperature=0.0, say=said.append
    )
    answers = [g(p) for p in prompts]
    assert g.cut == 3 and len(said) == 1, said  # every prompt cut, one line
    assert (
        f"cut to its last {CONTEXT // 2} tokens" in said[0]
        and f"{CONTEXT}-token context" in said[0]
    )
    ids = tok.encode(prompts[0])[
        -CONTEXT // 2 :
    ]  # the answer is the model's to the prompt's last tokens
    direct = generate(model, torch.tensor([ids]), CONTEXT // 2, top_k=1, eot_id=tok.eot_id)[
        0, len(ids) :
    ].tolist()
    assert answers[0] == tok.decode(
        direct[: direct.index(tok.eot_id)] if tok.eot_id in direct else direct
    )
    assert answers[0].strip(), "a prompt too long for the context still gets an answer"


def test_a_transformers_model_is_cut_alike_without_its_warning(model, tok, prompts, capfd):
    from transformers import LlamaForCausalLM

    from tinygpt.model.hf import hf_llama_config, hf_tokenizer

    hf = LlamaForCausalLM(hf_llama_config(model.config, tok.eot_id))
    hf.load_state_dict(model_state(model), strict=False)
    hf_tok = hf_tokenizer(tok, CONTEXT)
    said: list[str] = []
    g = Generator(
        Loaded(hf.eval(), hf_tok, "hf", True), max_new_tokens=16, temperature=0.0, say=said.append
    )
    answer = g(prompts[0])
    err = capfd.readouterr().err
    assert g.cut == 1 and len(said) == 1 and answer.strip()
    assert "indexing errors" not in err and "longer than the specified maximum" not in err, err
    ours = Generator(
        Loaded(model, tok, "m", False), max_new_tokens=16, temperature=0.0, say=said.append
    )
    assert (
        ours(prompts[0]) == answer
    )  # the same weights, the same cut prompt: the same greedy answer


def test_generation_stops_at_the_end_of_an_answer_and_sampling_is_seeded(model, tok):
    ended = []

    def done(text: str) -> bool:
        ended.append(text)
        return bool(text)

    g = Generator(Loaded(model, tok, "m", False), max_new_tokens=48, temperature=0.0, done=done)
    answer = g("The game")
    assert (
        answer and g.calls == 1 and len(ended) == 2 and CHUNK < 48
    )  # one chunk of tokens, then done
    state = torch.get_rng_state()
    sampled = [
        Generator(Loaded(model, tok, "m", False), 24, temperature=0.8)("The game") for _ in range(2)
    ]
    assert sampled[0] == sampled[1] and torch.equal(
        torch.get_rng_state(), state
    )  # seeded, caller's RNG kept


def test_an_answer_inside_a_function_starts_its_body(model, tok):
    """After a docstring, the answer opens with indentation and code (`body`): the function is never left
    empty, even by a model whose likeliest next line is blank."""
    prompt = 'def add(a, b):\n    """Return a + b."""\n'
    for temperature in (0.0, 0.8):
        answer = Generator(Loaded(model, tok, "m", False), 12, temperature, body=True)(prompt)
        first_line = answer.split("\n")[0]
        assert first_line[:1] in (" ", "\t") and first_line.strip(), repr(answer)


def test_code_answers_end_at_a_stop_or_a_closed_fence_and_empty_ones_are_counted():
    assert code.answer_ended("    return 1\ndef f", ("\ndef ",))
    assert not code.answer_ended(
        "```python\ndef f", ("\ndef ",)
    )  # a fence: its close ends the answer
    assert code.answer_ended("```python\nx = 1\n```", ())
    assert code.empty_share(["", "  \n", "x = 1", "pass"]) == 0.5 and code.empty_share([]) == 0.0


def test_mbpp_on_the_shipped_sample_reports_cut_prompts_and_empty_answers(model, tok, tmp_path):
    """The whole task on a model whose context its prompts overflow: every answer is the model's own (none
    empty for want of room), the cut prompts are counted, the empty-answer rate stands beside pass@1."""
    from tinygpt.evals.harness import Request
    from tinygpt.evals.tasks.mbpp import TASK

    r = Request(
        data=sample_path("sample:mbpp"),
        limit=2,
        max_new_tokens=32,
        temperature=0.0,
        unsafe_exec=sandbox.boundary().kind == "none",
        say=lambda line: None,
    )
    res = TASK.score(Loaded(model, tok, "m", False), r)
    assert res["prompts_cut"] == 2 and res["problems"] == 2 and 0 <= res["empty_answers"] <= 1
    assert json.dumps(
        {k: v for k, v in res.items() if k != "per_problem"}
    )  # plain figures, for evals.jsonl
