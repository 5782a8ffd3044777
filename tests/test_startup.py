"""Start-up: streamed token shards, one compile, the compile cache, the start-up breakdown.

Real text (the standard library's sources), real processes killed mid-tokenization, real compiles
counted with dynamo's own counters. No timing is asserted: counts, bytes and equal data orders are.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tinygpt.data.shards as shards_mod
from tinygpt.core.callback import Callback
from tinygpt.core.config import ConfigError, DataConfig
from tinygpt.data.sampler import WindowSampler
from tinygpt.data.shard_writer import ShardWriter, write_shards
from tinygpt.data.shards import MANIFEST, StreamedShards, build_token_cache
from tinygpt.data.sources import DataError, iter_documents
from tinygpt.data.token_files import write_llmc_shard
from tinygpt.data.tokens import open_token_shards
from tinygpt.model.tokenizer import load_gpt2, train_bpe
from tinygpt.pretrain.run_pretrain import pretrain

REPO = Path(__file__).resolve().parents[1]
SMALL_SHARDS = 20_000  # tokens: a few hundred kB of text makes many shards


@pytest.fixture(scope="module")
def stdlib_cfg():
    return DataConfig(source="builtin", vocab_size=512, max_chars=600_000)


@pytest.fixture(scope="module")
def tok(stdlib_cfg):
    return train_bpe(iter_documents(DataConfig(source="builtin", max_chars=200_000)), 512)


@pytest.fixture(scope="module")
def one_go(stdlib_cfg, tok, tmp_path_factory):
    """The reference: the whole source tokenized in this process, in one go."""
    return build_token_cache(
        stdlib_cfg, tok, tmp_path_factory.mktemp("one_go"), key="k", shard_tokens=SMALL_SHARDS
    )


def _manifest(folder: Path) -> dict:
    return (
        json.loads((folder / MANIFEST).read_text())
        if (folder / MANIFEST).is_file()
        else {"shards": []}
    )


def test_shards_hold_the_documents_in_order_with_the_split(one_go, stdlib_cfg, tok):
    m = one_go.meta
    assert m["done"] and len(m["shards"]) >= 5
    assert all(
        s["train"]["bytes"] // 2 >= SMALL_SHARDS for s in m["shards"][:-1]
    )  # every shard but the last is full
    docs = list(iter_documents(stdlib_cfg))
    first = tok.encode(docs[0]) + [tok.eot_id]  # document 0 trains, document 1 is held out
    assert one_go.shard(0)[: len(first)].tolist() == first
    held_out = tok.encode(docs[1]) + [tok.eot_id]
    assert one_go.validation(1)[: len(held_out)].tolist() == held_out
    assert m["train_tokens"] > 10 * m["val_tokens"] > 0 and m["documents"] == len(docs)


@pytest.mark.slow  # a real process killed
def test_a_writer_killed_mid_way_is_continued_without_tokenizing_again(
    one_go, stdlib_cfg, tok, tmp_path
):
    folder = tmp_path / "k"
    # at most 4 shards: a kill that comes late (a loaded machine writes the rest in one burst) still finds the
    # writer short of the end
    w = ShardWriter(stdlib_cfg, tok, folder, SMALL_SHARDS, max_shards=4)
    deadline = time.time() + 120
    while len(_manifest(folder)["shards"]) < 2 and time.time() < deadline:
        time.sleep(0.01)
    w.process.kill()  # kill -9 while it tokenizes
    w.process.wait()
    before = _manifest(folder)
    assert 2 <= len(before["shards"]) < len(one_go.meta["shards"]) and not before["done"]
    kept = {
        s[k]["name"]: (folder / s[k]["name"]).stat().st_mtime_ns
        for s in before["shards"]
        for k in ("train", "val")
    }
    after = write_shards(stdlib_cfg, tok, folder, SMALL_SHARDS)
    assert (
        after["done"] and after["shards"] == one_go.meta["shards"]
    )  # byte for byte the one-go shards
    assert {n: (folder / n).stat().st_mtime_ns for n in kept} == kept  # nothing tokenized twice
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp")]


def test_the_data_order_does_not_depend_on_how_fast_tokenization_runs(
    one_go, stdlib_cfg, tok, tmp_path
):
    """A sampler reading shards while a background process writes them (it waits for each one) gives
    the same batches as one reading the finished shards; a sampler resumed from its state goes on the same."""
    w = ShardWriter(stdlib_cfg, tok, tmp_path / "k", SMALL_SHARDS)
    try:
        streamed = WindowSampler(StreamedShards(tmp_path / "k", alive=w.alive), 64, seed=5)
        ref = WindowSampler(StreamedShards(one_go.folder), 64, seed=5)
        n = 0
        for i in range(100):  # 100 x 16 windows of 64: past several shards of 20k tokens
            x, y = streamed.next_batch(16)
            assert torch.equal(x, ref.next_batch(16)[0])
            if i == 30:
                state = json.loads(json.dumps(streamed.state_dict()))
            n += len(x)
        assert streamed.shard >= 3
        resumed = WindowSampler(StreamedShards(one_go.folder), 64, seed=5)
        resumed.load_state_dict(state)
        again = WindowSampler(StreamedShards(one_go.folder), 64, seed=5)
        for _ in range(31):
            again.next_batch(16)
        for _ in range(10):
            assert torch.equal(resumed.next_batch(16)[0], again.next_batch(16)[0])
    finally:
        w.stop()


def test_a_dead_writer_is_an_error_not_an_endless_wait(stdlib_cfg, tok, tmp_path):
    folder = tmp_path / "k"
    w = ShardWriter(stdlib_cfg, tok, folder, SMALL_SHARDS)
    w.process.kill()
    w.process.wait()
    shards = StreamedShards(folder, alive=w.alive)
    with pytest.raises(DataError, match="run the same command again"):
        shards.shard(10_000)
    bad = DataConfig(source=str(tmp_path / "empty.txt"), vocab_size=512)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty.txt is empty"):
        write_shards(bad, tok, tmp_path / "e")
    error = _manifest(tmp_path / "e")[
        "error"
    ]  # what a reader in another process sees: why, no class name
    assert "empty.txt is empty" in error and "DataError" not in error, error


def test_training_starts_before_tokenization_ends_and_records_its_start_up(tmp_path):
    """A source of many shards: the first step runs while later shards are still being written; the
    start-up breakdown is in metrics.jsonl; a second run goes on from the shards already there."""
    seen = {}

    class AtFirstStep(Callback):
        def on_startup(self, record):
            folder = next((tmp_path / "cache").iterdir())
            seen.update(manifest=_manifest(folder), record=record)

    kw = dict(
        max_steps=2,
        save_every=2,
        eval_every=2,
        progress=False,
        device="cpu",
        cache_dir=tmp_path / "cache",
    )
    from tinygpt.core.recipes import get_recipe

    recipe = get_recipe("cpu-smoke").replace(
        data={"max_chars": 40_000_000}
    )  # the whole stdlib: ~10 shards
    pretrain(recipe, tmp_path / "run", callbacks=[AtFirstStep()], **kw)
    assert not seen["manifest"]["done"] and len(seen["manifest"]["shards"]) >= 1
    rec = seen["record"]
    assert {
        "restore_s",
        "probe_s",
        "tokenizer_s",
        "data_s",
        "model_s",
        "first_step_s",
        "compile_s",
        "total_s",
    } <= set(rec)
    assert (
        rec["total_s"] >= rec["data_s"] + rec["first_step_s"]
        and min(v for k, v in rec.items() if k.endswith("_s")) >= 0
    )
    logged = [
        m
        for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "startup" in m
    ]
    assert logged == [{"step": 1, "startup": rec}]
    folder = next((tmp_path / "cache").iterdir())
    first = _manifest(folder)["shards"]
    mtimes = {s["train"]["name"]: (folder / s["train"]["name"]).stat().st_mtime_ns for s in first}
    pretrain(
        recipe, tmp_path / "run", **{**kw, "max_steps": 3}
    )  # resumes; the writer goes on from there
    assert _manifest(folder)["shards"][: len(first)] == first
    assert {n: (folder / n).stat().st_mtime_ns for n in mtimes} == mtimes


@pytest.mark.slow  # runs with a mirror
def test_shards_reach_the_mirror_and_a_new_vm_does_not_tokenize_again(tmp_path, monkeypatch):
    kw = dict(max_steps=2, save_every=2, eval_every=2, progress=False, device="cpu")
    pretrain(
        "cpu-smoke",
        tmp_path / "vm1" / "run",
        mirror=tmp_path / "drive" / "run",
        cache_dir=tmp_path / "c1",
        **kw,
    )
    mirrored = next((tmp_path / "drive" / "_token_cache").iterdir())
    assert _manifest(mirrored)["done"]

    def no_tokenizing(*a, **k):
        raise AssertionError("a new VM tokenized again although the mirror has every shard")

    monkeypatch.setattr(shards_mod, "ShardWriter", no_tokenizing)
    res = pretrain(
        "cpu-smoke",
        tmp_path / "vm2" / "run",
        mirror=tmp_path / "drive" / "run",
        cache_dir=tmp_path / "c2",
        **{**kw, "max_steps": 4},
    )
    assert res.resumed_from == 2 and res.step == 4
    restored = tmp_path / "c2" / mirrored.name
    assert _manifest(restored)["shards"] == _manifest(mirrored)["shards"]


_COUNT_COMPILES = """
import json, sys
from pathlib import Path
import torch
from torch._dynamo.utils import counters
from tinygpt.core.recipes import get_recipe
from tinygpt.pretrain.run_pretrain import pretrain
from tinygpt.data.tokens import open_token_shards
from tinygpt.data.shards import StreamedShards
from tinygpt.data.sampler import WindowSampler
run, cache = sys.argv[1:3]
# the graphs compiled when the sampler is first asked for a batch: the step compiles ahead of its data
first_batch = {}
take = WindowSampler.next_batch
def next_batch(self, *a, **k):
    first_batch.setdefault("graphs", counters["stats"]["unique_graphs"])
    return take(self, *a, **k)
WindowSampler.next_batch = next_batch
# 3 evaluations; micro-batch 8, eval_batches 3: the validation split has fewer windows than 24 and
# not a multiple of 8, so the last evaluation batch is a partial one
recipe = get_recipe("cpu-smoke").replace(train={"compile": "on", "eval_every": 4, "max_steps": 12, "log_every": 2,
                                                "eval_batches": 3, "save_every": 6}, data={"max_chars": 30_000})
res = pretrain(recipe, run, progress=False, device="cpu", cache_dir=cache)
val = StreamedShards(next(Path(cache).iterdir())).validation(10**9)
print(json.dumps({"val_windows": (len(val) - 1) // 64, "evals": sum("val_loss" in m for m in res.metrics),
                  "graphs_before_first_batch": first_batch["graphs"],
                  "counters": {k: dict(v) for k, v in counters.items()}}))
"""


# A bound for a hung compile, not a speed test: a cold compiled run is about 55 CPU-seconds (inductor's C++ compile
# of the training step; measured with torch 2.11 on Python 3.13), 160 to 400 s of wall time at load 10 on 2 cores,
# and it crossed 600 s at load 40 (issue 33)
COMPILE_RUN_TIMEOUT_S = 1800


def _run_py(code: str, *args: str, env: dict | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=COMPILE_RUN_TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # torch.compile
def test_compiled_training_never_recompiles_after_the_first_step_and_a_new_vm_reuses_the_compile(
    tmp_path,
):
    """One graph for the whole run, compiled before the first batch is taken (`compile_ahead`, on a
    batch that is not data): the training steps and evaluation (no grad, a partial last batch) add
    none. The compile
    cache saved in the run folder, copied into a fresh folder with an empty compiler cache (a new VM),
    is loaded: the compiler finds its graphs there instead of compiling them."""
    env = {"TINYGPT_CACHE": str(tmp_path / "tg"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind1")}
    cold = _run_py(_COUNT_COMPILES, str(tmp_path / "run1"), str(tmp_path / "cache"), env=env)
    assert cold["evals"] == 3 and cold["val_windows"] < 24 and cold["val_windows"] % 8 != 0
    c = cold["counters"]
    assert c["stats"]["unique_graphs"] == 1 and c["frames"]["total"] == 1
    assert cold["graphs_before_first_batch"] == 1  # compiled ahead, while the shards were written
    assert not c.get("recompiles") and c["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert (tmp_path / "run1" / "compile_cache.bin").stat().st_size > 10_000

    (tmp_path / "run2").mkdir()
    shutil.copy(tmp_path / "run1" / "compile_cache.bin", tmp_path / "run2")
    warm = _run_py(
        _COUNT_COMPILES,
        str(tmp_path / "run2"),
        str(tmp_path / "cache"),
        env={**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind2")},
    )
    w = warm["counters"]
    assert (
        w["inductor"].get("fxgraph_cache_hit", 0) >= 1
        and w["inductor"].get("fxgraph_cache_miss", 0) == 0
    )
    assert w["stats"]["unique_graphs"] == 1 and not w.get("recompiles")
    notes = [
        m["startup"].get("notes")
        for m in map(json.loads, (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines())
        if "startup" in m
    ]
    assert notes and "compile cache loaded" in notes[0][0]


def test_a_compile_cache_from_someone_else_or_another_setup_is_ignored(tmp_path):
    from tinygpt.train.compile_cache import CompileCache

    what = {
        "torch": torch.__version__,
        "device": "cpu-x86_64",
        "precision": "fp32",
        "batch": [8, 64],
        "model": "abc",
        "mode": "on",
    }
    mine = CompileCache(tmp_path, b"k" * 32, what)
    payload = b"not artifacts"
    (tmp_path / "compile_cache.bin").write_bytes(
        json.dumps(
            {"what": what, "hmac": CompileCache(tmp_path, b"x" * 32, what)._sign(payload)}
        ).encode()
        + b"\n"
        + payload
    )
    assert "not signed with this user's key" in mine.load()  # never handed to the compiler
    other = CompileCache(tmp_path, b"k" * 32, {**what, "device": "NVIDIA A100-SXM4-40GB sm80"})
    assert "another setup (device cpu-x86_64 vs NVIDIA A100" in other.load()
    (tmp_path / "compile_cache.bin").write_bytes(b"\x00garbage")
    assert "unreadable" in mine.load()


def _llmc_folder(folder: Path) -> Path:
    """llm.c shards of real GPT-2 ids (argparse.py): one for validation, two to train on."""
    ids = load_gpt2().encode((Path(os.__file__).parent / "argparse.py").read_text())
    folder.mkdir()
    write_llmc_shard(folder / "fineweb_val_000000.bin", ids[:4000])
    write_llmc_shard(folder / "fineweb_train_000001.bin", ids[4000:16000])
    write_llmc_shard(folder / "fineweb_train_000002.bin", ids[16000:])
    return folder


def test_a_tokenizer_that_cannot_read_the_source_is_refused_before_the_probe(tmp_path, monkeypatch):
    """Token ids with a tokenizer to train, or a base's: refused with the recipe's checks, before the mirror is
    read and the probe runs (on a GPU a minute of trials, for a run that then fails); a GPT-2 tokenizer too
    large for the model, or a base's tokenizer with no base, is refused by the recipe itself."""
    import tinygpt.pretrain.run_pretrain as pretrain_mod
    from tinygpt.core.recipes import get_recipe

    folder = _llmc_folder(tmp_path / "fineweb")
    probed = []
    monkeypatch.setattr(
        pretrain_mod, "fit_to_device", lambda *a, **k: probed.append(a) or (a[0], None)
    )
    kw = dict(
        max_steps=3,
        progress=False,
        device="cpu",
        cache_dir=tmp_path / "cache",
        mirror=tmp_path / "drive",
    )
    for tokenizer, init, said in (
        ("train", None, "no tokenizer can be trained on it"),
        ("init", "hf:HuggingFaceTB/SmolLM2-135M", "not the base's"),
    ):
        recipe = get_recipe("cpu-smoke").replace(
            data={"source": str(folder), "tokenizer": tokenizer}, model={"init": init}
        )
        with pytest.raises(ConfigError, match=said) as e:
            pretrain(recipe, tmp_path / "bad", **kw)
        assert "\n" not in str(e.value)
    assert probed == [] and not (tmp_path / "bad").exists() and not (tmp_path / "drive").exists()
    with pytest.raises(
        ConfigError,
        match="has 50257 tokens but the model's vocab_size is 512: add model.vocab_size=50304",
    ):
        get_recipe("cpu-smoke").replace(data={"source": str(folder), "tokenizer": "gpt2"})
    with pytest.raises(
        ConfigError, match="data.tokenizer=init takes the tokenizer of the base, but model.init"
    ):
        get_recipe("cpu-smoke").replace(data={"tokenizer": "init"})
    # the same recipe, told its tokenizer, trains: the probe's place in the run is reached
    pretrain(
        get_recipe("cpu-smoke").replace(
            data={"source": str(folder), "tokenizer": "gpt2"}, model={"vocab_size": 50304}
        ),
        tmp_path / "good",
        **kw,
    )
    assert len(probed) == 1


def test_a_folder_of_llmc_shards_trains_without_tokenizing(tmp_path):
    folder = _llmc_folder(tmp_path / "fineweb")
    kw = dict(
        max_steps=3,
        save_every=3,
        eval_every=3,
        progress=False,
        device="cpu",
        cache_dir=tmp_path / "cache",
    )
    from tinygpt.core.recipes import get_recipe

    recipe = get_recipe("cpu-smoke").replace(
        data={"source": str(folder), "tokenizer": "gpt2"}, model={"vocab_size": 50304}
    )
    res = pretrain(recipe, tmp_path / "run", **kw)
    assert res.step == 3 and np.isfinite(res.val_loss) and not (tmp_path / "cache").exists()
    small = get_recipe("cpu-smoke").replace(
        data={"source": str(folder), "tokenizer": "gpt2"}, model={"vocab_size": 50304}
    )
    write_llmc_shard(
        folder / "fineweb_train_000003.bin", [60_000] * 100
    )  # beyond the vocabulary, used later
    sampler = WindowSampler(open_token_shards(str(folder), small.model.vocab_size), 64, 0)
    with pytest.raises(DataError, match="fineweb_train_000003.bin"):
        for _ in range(200):
            sampler.next_batch(8)


def test_tokenizing_stops_near_the_run_s_budget_and_goes_on_when_more_is_read(
    one_go, stdlib_cfg, tok, tmp_path
):
    stream = shards_mod.ShardStream(stdlib_cfg, tok, tmp_path / "k", SMALL_SHARDS, limit=2)
    try:
        stream.writer.process.wait(120)  # it stops by itself at its limit
        assert len(_manifest(tmp_path / "k")["shards"]) in (2, 3) and not stream.complete
        assert np.array_equal(stream.shard(4), one_go.shard(4))  # asked for more: it tokenizes on
        assert stream.limit >= 4
    finally:
        stream.stop()


def _compiled_code_objects(*functions) -> list[int]:
    """How many compiled entries dynamo holds for each function's code object."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return [len(_debug_get_cache_entry_list(f.__code__)) for f in functions]


@pytest.mark.slow  # torch.compile
def test_regional_compile_compiles_the_blocks_and_on_compiles_the_whole_model():
    """Told apart by what dynamo compiled, not by time: under "regional" the block's forward holds the one
    graph (shared by both blocks) and the model's forward none; under "on", the other way round. A
    FinetuneLoss over a PEFT-wrapped Hugging Face Llama compiles its decoder layers the same way."""
    from tinygpt.core.recipes import model_config
    from tinygpt.model.gpt import GPT, Block
    from tinygpt.train.step import compiled, transformer_blocks

    seen = {}
    for mode in ("regional", "on"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(model_config("tiny", vocab_size=256))
        assert transformer_blocks(model) is model.model.layers and len(model.model.layers) == 2
        x = torch.randint(256, (2, 16))
        compiled(model, mode)(x, x, reduction="sum").backward()
        seen[mode] = _compiled_code_objects(Block.forward, GPT.forward)
    assert seen == {"regional": [1, 0], "on": [0, 1]}

    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from tinygpt.finetune.loss import FinetuneLoss

    torch._dynamo.reset()
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    pm = get_peft_model(
        transformers.LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    module = FinetuneLoss(pm)
    assert transformer_blocks(module) is pm.base_model.model.model.layers
    x = torch.randint(128, (2, 16))
    assert compiled(module, "regional")(x, x) is not None and module.training
    module(x, x).backward()
    layer, whole = _compiled_code_objects(LlamaDecoderLayer.forward, FinetuneLoss.forward)
    # one graph, plus at most one more once dynamo sees the layers' differing `layer_idx` and makes it dynamic
    assert 1 <= layer <= 2 and whole == 0
    torch._dynamo.reset()


@pytest.mark.slow  # torch.compile
def test_by_regions_the_head_and_the_loss_are_a_second_compiled_region():
    """ "regional" (and on a GPU "auto", for a tinygpt GPT): the trainer's step compiles the blocks (one graph,
    shared, fullgraph and static shapes) and the head with the loss as a second region, the model's own forward
    never; its losses are the eager step's. Under "auto" a finetuning base is compiled by its decoder
    layers too (without the head-and-loss region: its loss is the module's own)."""
    import dataclasses

    from tinygpt.core.recipes import get_recipe, model_config
    from tinygpt.finetune.loss import FinetuneLoss
    from tinygpt.fit.step_speed import RandomBatches
    from tinygpt.model.gpt import GPT, Block, cross_entropy
    from tinygpt.train.step import TrainStep, regional

    recipe = get_recipe("cpu-smoke")
    model_cfg = model_config("tiny", vocab_size=256)
    assert regional(GPT(model_cfg), "auto") and regional(GPT(model_cfg), "regional")
    assert not regional(GPT(model_cfg), "on") and not regional(
        FinetuneLoss(torch.nn.Linear(2, 2)), "auto"
    )  # no transformer blocks to compile one by one: the whole module
    losses = {}
    for mode in ("regional", "off"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = dataclasses.replace(
            recipe.train,
            compile=mode,
            device="cpu",
            micro_batch_size=2,
            seq_len=16,
            grad_accum_steps=2,
            precision="fp32",
        )
        step = TrainStep(GPT(model_cfg), cfg, RandomBatches(256, 16))
        losses[mode] = [float(step.optimizer_step().loss_sum) for _ in range(2)]
        if mode == "regional":
            assert _compiled_code_objects(Block.forward, cross_entropy, GPT.forward) == [1, 1, 0]
    assert losses["regional"] == pytest.approx(losses["off"], rel=1e-4)
    torch._dynamo.reset()


def test_a_sampler_made_before_its_first_shard_is_written_waits_at_the_first_batch(tmp_path):
    """The run builds its sampler before the first shard exists (the step compiles meanwhile): made,
    it has waited for nothing; its first batch waits, and a writer that died is the one-line error
    there instead."""
    alive = {"writing": True}
    shards = StreamedShards(tmp_path, alive=lambda: alive["writing"], poll_s=0.01)
    sampler = WindowSampler(shards, 64, 0)  # returns at once: nothing is written yet
    assert not shards.written(0)
    alive["writing"] = False
    with pytest.raises(DataError, match="stopped before shard 0"):
        sampler.next_batch(2)
    # a first shard too short for one window: refused when made, where the shard is there
    with pytest.raises(DataError, match="fewer than one window"):
        WindowSampler(np.arange(50, dtype=np.uint16), 64, 0)


@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize("mode, warmup", [("on", False), ("regional", False), ("regional", True)])
def test_compile_ahead_makes_the_steps_graphs_and_moves_nothing(mode, warmup):
    """`compile_ahead` compiles the step on zeros of its shape (documents and a growing window
    included; in a batch warm-up, the first step's fewer rows) before any batch: the steps after it
    compile nothing and never recompile (in a warm-up without accumulation each new row count is a
    new shape: its first step only); the weights, the optimizer and the random state are as they
    were (the gradients dropped)."""
    from torch._dynamo.utils import counters

    from tinygpt.core.recipes import get_recipe
    from tinygpt.model.gpt import GPT
    from tinygpt.train.step import TrainStep

    recipe = get_recipe("cpu-smoke").replace(
        train={
            "compile": mode,
            "device": "cpu",
            "micro_batch_size": 4 if warmup else 2,
            "grad_accum_steps": 1 if warmup else 2,
            "batch_warmup": 0.5 if warmup else 0.0,  # step 0: 1 row of 4
            "seq_len": 32,
            "doc_mask": True,
            "window_start": 8,
            "max_steps": 10,
        },
        model={"max_seq_len": 32},
    )
    torch.manual_seed(0)
    model = GPT(recipe.model)
    text = np.frombuffer(Path(torch.__file__).read_bytes()[:20_000], dtype=np.uint8) % 250
    sampler = WindowSampler(text.astype(np.uint16), 32, 0, eot_id=10)
    torch._dynamo.reset()
    counters.clear()
    step = TrainStep(model, recipe.train, sampler)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    assert step.compile_ahead()
    made = counters["stats"]["unique_graphs"]
    assert made >= 1 and not step.optimizer.state
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    for _ in range(1 if warmup else 2):
        step.optimizer_step()
    assert counters["stats"]["unique_graphs"] == made and not counters["recompiles"]
    torch._dynamo.reset()
