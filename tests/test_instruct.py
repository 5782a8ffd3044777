"""Instruction data: prompt masking, record formats, packing, truncation, bad records, exact resume."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import INVALID

from tinygpt.data.sources import DataError
from tinygpt.finetune.instruct import InstructSource, build_instruct_data
from tinygpt.finetune.records import load_records, mbpp_instruction, record_segments
from tinygpt.model.losses import IGNORE_INDEX
from tinygpt.model.prompts import format_prompt
from tinygpt.model.tokenizer import train_bpe


@pytest.fixture(scope="module")
def alpaca(shared_data) -> list[dict]:
    return json.loads((shared_data / "code_alpaca_2k.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def mbpp(shared_data) -> list[dict]:
    return [
        json.loads(line)
        for line in (shared_data / "mbpp.jsonl").read_text(encoding="utf-8").splitlines()
    ]


@pytest.fixture(scope="module")
def tok(alpaca, mbpp):
    texts = [r["instruction"] + "\n" + r["input"] + "\n" + r["output"] for r in alpaca]
    return train_bpe(texts + [r["text"] + "\n" + r["code"] for r in mbpp], vocab_size=512)


def trained(y: torch.Tensor) -> list[int]:
    return [t for t in y.tolist() if t != IGNORE_INDEX]


def test_prompt_tokens_and_padding_carry_no_loss(alpaca, tok):
    recs = alpaca[:64]
    d = build_instruct_data(recs, tok, 512, val_fraction=0.0)
    assert d.report.truncated == 0 and d.report.train_examples == 64
    x, y = d.train.next_batch(64)
    order = d.train._perm[:64].tolist()  # the rows of this batch, in the source's seeded order
    for row, i in enumerate(order):
        r = recs[i]
        prompt = tok.encode(format_prompt(r["instruction"], r["input"]))
        response = tok.encode(r["output"])
        n = (
            1 + len(prompt) + len(response)
        )  # [eot] prompt response, then the closing eot as last target
        assert x[row, :n].tolist() == [tok.eot_id] + prompt + response
        assert (y[row, : len(prompt)] == IGNORE_INDEX).all()  # predicting prompt tokens: no loss
        assert y[row, len(prompt) : n].tolist() == response + [tok.eot_id]
        assert (y[row, n:] == IGNORE_INDEX).all() and (x[row, n:] == tok.eot_id).all()  # padding
    assert x.shape[1] % 8 == 0 and x.shape[1] >= max(len(r) for r in [x[0]])


def test_mbpp_records_train_on_code_and_skip_evaluation_ids(mbpp, tok):
    segs, fmt, excluded = record_segments(mbpp)
    n_eval = sum(11 <= r["task_id"] <= 510 for r in mbpp)  # ids 11-510 are MBPP's test split
    assert (
        n_eval in (500, 52)
        and fmt == "mbpp"
        and excluded == n_eval
        and len(segs) == len(mbpp) - n_eval
    )
    r = mbpp[0]  # task 1: a training id
    (prompt, p_trained), (code, c_trained), eos = segs[0]
    assert eos == (None, True)
    assert not p_trained and c_trained
    assert r["test_list"][0] in prompt and prompt == format_prompt(
        mbpp_instruction(r["text"], r["test_list"])
    )
    assert code == r["code"].replace("\r\n", "\n").strip()
    sanitized = {
        "prompt": r["text"],
        "code": r["code"],
        "test_list": r["test_list"],
        "task_id": 1,
    }  # its other config
    assert record_segments([sanitized])[0] == segs[:1]
    d = build_instruct_data(mbpp, tok, 384, val_fraction=0.05)
    assert d.report.excluded == n_eval
    assert d.report.train_examples + d.report.val_examples + d.report.dropped == len(mbpp) - n_eval


def test_chat_messages_train_only_assistant_turns(tok):
    msgs = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Add two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "Now subtract."},
        {"role": "assistant", "content": "def sub(a, b):\n    return a - b"},
    ]
    d = build_instruct_data([{"messages": msgs}] * 3, tok, 256, val_fraction=0.0)
    x, y = d.train.next_batch(1)
    text = tok.decode(trained(y[0]))
    assert text == msgs[2]["content"] + "<|endoftext|>" + msgs[4]["content"] + "<|endoftext|>"
    assert "### User:\nAdd two numbers." in tok.decode(x[0].tolist())


def test_chat_template_of_a_transformers_tokenizer(tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token="<|endoftext|>")
    hf.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    msgs = [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "print('hi')"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "print('hi again')"},
    ]
    d = build_instruct_data([{"messages": msgs}] * 2, hf, 256, val_fraction=0.0)
    _, y = d.train.next_batch(1)
    assert tok.decode(trained(y[0])) == "print('hi')\n" + "print('hi again')\n" + "<|endoftext|>"


def test_a_chat_template_the_sandbox_refuses_names_its_file(tok, tmp_path):
    """A base's chat template that jinja2's sandbox refuses (issue 48: the refusal named no file) fails in
    one line naming the base's chat_template.jinja."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token="<|endoftext|>")
    hf.chat_template = "{{ messages.__class__.__mro__ }}"
    hf.save_pretrained(tmp_path / "base")
    base = transformers.AutoTokenizer.from_pretrained(tmp_path / "base")
    msgs = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    with pytest.raises(ValueError) as e:
        build_instruct_data([{"messages": msgs}], base, 64, val_fraction=0.0)
    file = (
        tmp_path
        / "base"
        / (
            "chat_template.jinja"
            if (tmp_path / "base" / "chat_template.jinja").is_file()
            else "tokenizer_config.json"
        )
    )
    assert str(e.value).startswith(
        f"{file}: the base's chat template cannot render a conversation (access to "
        "attribute '__class__' of 'list' object is unsafe"
    )
    assert "\n" not in str(e.value) and "SecurityError" not in str(e.value)


def test_packing_keeps_every_target_and_fits_seq_len(alpaca, tok):
    plain = build_instruct_data(alpaca[:300], tok, 512, val_fraction=0.0, template="short")
    packed = build_instruct_data(
        alpaca[:300], tok, 512, val_fraction=0.0, template="short", pack=True
    )
    assert packed.report.sequences < plain.report.sequences / 2
    assert all(len(x) <= 512 for x, _ in packed.train.rows)
    flat = lambda rows: [t for _, y in rows for t in y.tolist() if t != IGNORE_INDEX]  # noqa: E731
    assert flat(packed.train.rows) == flat(
        plain.train.rows
    )  # same examples, same order, same targets


def test_truncation_is_counted_and_all_too_long_is_an_error(alpaca, tok):
    d = build_instruct_data(alpaca, tok, 128)
    lengths = [
        1
        + len(tok.encode(format_prompt(r["instruction"], r["input"])))
        + len(tok.encode(r["output"]))
        + 1
        for r in alpaca
    ]
    assert d.report.truncated == sum(n > 129 for n in lengths) > 0
    assert all(len(x) <= 128 for x, _ in d.train.rows)
    with pytest.raises(DataError, match="every one of the 20 examples is longer than seq_len 16"):
        build_instruct_data(alpaca[:20], tok, 16)


def test_bad_records_name_the_record_and_field(tok):
    good = {"instruction": "Sum a list.", "input": "", "output": "sum(xs)"}
    with pytest.raises(DataError, match=r"record 2 has no field 'output'"):
        build_instruct_data([good, good, {"instruction": "x", "input": ""}], tok, 64)
    with pytest.raises(DataError, match=r"record 1: field 'output' must be text"):
        build_instruct_data([good, {**good, "output": 3}], tok, 64)
    with pytest.raises(DataError, match=r"record 1 has no field 'test_list'"):
        build_instruct_data(
            [{"text": "t", "code": "c", "test_list": []}, {"text": "t", "code": "c"}], tok, 64
        )
    with pytest.raises(
        DataError, match=r"record 0: message 1 needs the fields 'role' and 'content'"
    ):
        build_instruct_data(
            [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}], tok, 64
        )
    with pytest.raises(DataError, match=r"record 0 has fields \['prompt'\]; expected Alpaca"):
        build_instruct_data([{"prompt": "a"}], tok, 64)
    with pytest.raises(DataError, match="unknown prompt template"):
        build_instruct_data([good], tok, 64, template=INVALID)


def test_order_is_seeded_and_resume_is_exact(alpaca, tok):
    a = build_instruct_data(alpaca[:50], tok, 128, seed=3).train
    b = build_instruct_data(alpaca[:50], tok, 128, seed=3).train
    for _ in range(4):
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(7), b.next_batch(7)))
    state = a.state_dict()
    c = build_instruct_data(alpaca[:50], tok, 128, seed=3).train
    c.load_state_dict(state)
    for _ in range(12):  # past the end of an epoch (48 rows)
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(7), c.next_batch(7)))
    other = build_instruct_data(alpaca[:50], tok, 128, seed=4).train
    fresh = build_instruct_data(alpaca[:50], tok, 128, seed=3).train
    assert not torch.equal(other.next_batch(7)[0], fresh.next_batch(7)[0])
    with pytest.raises(DataError, match="resume with the same data"):
        build_instruct_data(alpaca[:60], tok, 128, seed=3).train.load_state_dict(state)


def test_ranks_share_one_global_batch(alpaca, tok):
    one = build_instruct_data(alpaca[:40], tok, 128).train
    r0, r1 = (build_instruct_data(alpaca[:40], tok, 128).train for _ in range(2))
    for _ in range(3):
        x, y = one.next_batch(8)
        x0, y0 = r0.next_batch(4, rank=0, world_size=2)
        x1, y1 = r1.next_batch(4, rank=1, world_size=2)
        assert trained(torch.cat([y0, y1]).flatten()) == trained(y.flatten())


def test_validation_is_fixed_and_apart_from_training(alpaca, tok):
    d = build_instruct_data(
        alpaca[:200], tok, 256, val_fraction=0.1, val_batch_size=4, eval_batches=3
    )
    assert (
        d.report.val_examples == 20
        and len(d.val_batches) == 3
        and d.val_batches[0][0].shape[0] == 4
    )
    again = build_instruct_data(
        alpaca[:200], tok, 256, val_fraction=0.1, val_batch_size=4, eval_batches=3
    )
    assert all(torch.equal(a[1], b[1]) for a, b in zip(d.val_batches, again.val_batches))
    train = {tuple(trained(torch.from_numpy(y))) for _, y in d.train.rows}
    assert not any(tuple(trained(row)) in train for _, y in d.val_batches for row in y)


def test_local_json_jsonl_and_saved_dataset_give_the_same_records(
    tmp_path, alpaca, mbpp, shared_data
):
    assert load_records(str(shared_data / "code_alpaca_2k.json")) == alpaca
    assert load_records(str(shared_data / "mbpp.jsonl")) == mbpp
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(alpaca[:30]).save_to_disk(str(tmp_path / "ds"))
    assert load_records(str(tmp_path / "ds")) == alpaca[:30]
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(alpaca[:5]),
            "test": datasets.Dataset.from_list(alpaca[5:8]),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    assert load_records(str(tmp_path / "dd"), split="test") == alpaca[5:8]
    with pytest.raises(DataError, match="has no split 'valid'; it has train, test"):
        load_records(str(tmp_path / "dd"), split="valid")
    with pytest.raises(DataError, match="does not exist"):
        load_records(str(tmp_path / "missing.json"))
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{oops\n')
    with pytest.raises(DataError, match="not valid JSON lines"):
        load_records(str(tmp_path / "bad.jsonl"))


def test_empty_source_is_refused():
    with pytest.raises(DataError, match="no training examples"):
        InstructSource([], 16, 0, 0)
