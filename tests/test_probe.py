"""The probe: GPU table, memory estimate against real measurements, and the trial search on the CPU
with injected memory limits and measurements (real steps of a tiny GPT; only the memory is made up)."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from tinygpt.core.config import DataConfig, ModelConfig, TrainConfig
from tinygpt.core.recipes import Recipe, get_recipe
from tinygpt.fit.hardware import HardwareReport, gpu_spec, hardware_report, mfu, peak_tflops
from tinygpt.fit.memory import GB, TensorMemoryTracker, estimate_memory
from tinygpt.fit.probe import ProbeError, apply_probe, probe
from tinygpt.fit.report import expectations, probe_report
from tinygpt.fit.step_speed import trainer_speed
from tinygpt.model import losses
from tinygpt.model.gpt import GPT
from tinygpt.train.optim import build_optimizer


def tiny_recipe(micro: int = 8, seq_len: int = 32, accum: int = 8, ckpt: bool = False) -> Recipe:
    model = ModelConfig(
        vocab_size=260,
        n_layer=1,
        n_head=2,
        d_model=32,
        d_ff=64,
        max_seq_len=64,
        activation_checkpointing=ckpt,
    )
    train = TrainConfig(
        micro_batch_size=micro, seq_len=seq_len, grad_accum_steps=accum, precision="fp32"
    )
    return Recipe("tiny-test", "", "cpu", model, train, DataConfig(vocab_size=257))


class Counting:
    """A measurement with a known answer; counts its calls (one per trial)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, b: int, t: int, ckpt: bool) -> float:
        self.calls += 1
        return self.fn(b, t, ckpt)


def run(recipe: Recipe, fn, limit: float, margin: float = 0.1, **kw):
    """The memory search alone (speed=None keeps the largest micro-batch that fits): its answers are exact."""
    kw.setdefault("speed", None)
    return probe(
        recipe,
        "cpu",
        measure=Counting(fn),
        memory_limit_gb=limit,
        margin=margin,
        cache_dir=None,
        **kw,
    )


@pytest.mark.parametrize(
    "name, tflops, hw",
    [
        ("Tesla T4", 65, "t4"),
        ("NVIDIA A100-SXM4-40GB", 312, "a100"),
        ("NVIDIA A100-SXM4-80GB", 312, "a100"),
        ("NVIDIA H100 80GB HBM3", 989, "h100"),
        ("NVIDIA H100 PCIe", 756, "h100"),
        ("NVIDIA L4", 121, "l4"),
        ("NVIDIA H200", 989, "h200"),
        ("NVIDIA L40S", 362, "a100"),
        ("NVIDIA A10G", 125, "l4"),
        ("Tesla V100-SXM2-16GB", 125, "t4"),
        ("NVIDIA GeForce RTX 4090", 165, "l4"),
        ("Tesla P100-PCIE-16GB", 19, "t4"),
    ],
)
def test_gpu_table(name, tflops, hw):
    assert gpu_spec(name) == (tflops, hw)


def test_unknown_gpu_and_peak_by_precision():
    assert gpu_spec("Some Future GPU 9000") == (None, None)
    assert (
        peak_tflops("NVIDIA A100-SXM4-40GB", "bf16") == 312
        and peak_tflops("Tesla T4", "fp16") == 65
    )
    assert (
        peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") is None
        and peak_tflops("Some Future GPU", "bf16") is None
    )


def test_hardware_report_on_cpu():
    r = hardware_report("cpu")
    assert (r.device, r.hardware_class, r.default_recipe, r.precision, r.peak_tflops) == (
        "cpu",
        "cpu",
        "cpu",
        "fp32",
        None,
    )
    assert r.cpu_cores >= 1 and not r.native_bf16
    assert json.loads(json.dumps(r.to_dict()))["device"] == "cpu"


def test_mfu():
    assert mfu(1000.0, 6e9, 312.0) == pytest.approx(6e12 / 312e12)
    assert mfu(1000.0, 6e9, None) is None


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"tie_embeddings": True},
        {"n_kv_head": 2},
        {"attention_bias": True},
        {"value_embeds": 1, "unet_skips": True},
    ],
)
def test_parameter_gradient_optimizer_bytes_are_exact(kw):
    config = ModelConfig(vocab_size=300, n_layer=3, n_head=4, d_model=64, d_ff=160, **kw)
    n = GPT(config).num_params()
    est = estimate_memory(config, 4, 64, "bf16")
    assert (est.n_params, est.params_gb * GB, est.grads_gb * GB, est.optimizer_gb * GB) == (
        n,
        4 * n,
        4 * n,
        8 * n,
    )
    assert est.total_gb == pytest.approx(sum(float(r[1]) for r in est.rows()[1:-1]), abs=0.01)


def saved_bytes(model: GPT, x, y, dtype=None) -> int:
    """Bytes of the tensors autograd saves for backward (parameters and buffers excluded): the activations,
    under CPU autocast to `dtype` when given."""
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(x, y)
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"n_kv_head": 1},
        {"attention_bias": True},
        {"qk_norm": True},
        {"qk_norm": True, "n_kv_head": 1},
        {"mlp_act": "relu2"},
        {"value_embeds": 1, "unet_skips": True, "n_kv_head": 1},
    ],
)
def test_activation_estimate_matches_saved_tensors(precision, kw):
    config = ModelConfig(
        vocab_size=300, n_layer=2, n_head=2, d_model=64, d_ff=128, max_seq_len=64, **kw
    )
    model, (B, T) = GPT(config), (2, 64)
    x, y = torch.randint(300, (B, T)), torch.randint(300, (B, T))
    saved = saved_bytes(model, x, y, torch.bfloat16 if precision == "bf16" else None)
    est = estimate_memory(config, B, T, precision, device_type="cpu")
    # The estimate's loss line is the peak (12 B per logit); autograd saves the fp32 log-probs (4 B).
    expected = (est.activations_gb + est.weight_copies_gb) * GB + 4 * B * T * config.vocab_size
    assert expected == pytest.approx(saved, rel=0.01)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("ckpt", [False, True])
def test_peak_estimate_matches_tracked_peak(ckpt, chunked, precision, monkeypatch):
    """A whole training step (forward, backward, AdamW) measured tensor by tensor, with the plain
    loss and with tinygpt.model.losses' chunked one (its thresholds lowered so that a tiny model uses it)."""
    if chunked:
        monkeypatch.setattr(losses, "PLAIN_MAX_LOGITS", 2**10)
        monkeypatch.setattr(losses, "CHUNK_LOGITS", 2**14)
    config = ModelConfig(
        vocab_size=300,
        n_layer=2,
        n_head=2,
        d_model=64,
        d_ff=128,
        max_seq_len=64,
        activation_checkpointing=ckpt,
    )
    model = GPT(config)
    opt = build_optimizer(model, TrainConfig(), "cpu")
    for p in model.parameters():  # steady state: gradients and AdamW states exist before the step
        p.grad = torch.zeros_like(p)
    opt.step()
    x, y = torch.randint(300, (2, 64)), torch.randint(300, (2, 64))
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )
    with TensorMemoryTracker() as tracker:
        with autocast:
            loss = model(x, y)
        loss.backward()
        opt.step()
        del loss
    est = estimate_memory(config, 2, 64, precision, device_type="cpu")
    assert (est.loss_chunk_rows > 0) == chunked
    measured = tracker.peak_bytes / GB
    estimated = est.weight_copies_gb + est.activations_gb + est.loss_gb
    if ckpt:  # the recomputed block's gradients in flight are estimated on the safe side
        assert measured <= estimated <= 1.25 * measured
    else:  # exact but for small temporaries
        assert estimated == pytest.approx(measured, rel=0.03)
    assert tracker.live_bytes < tracker.peak_bytes / 10  # all freed again


def test_tracker_counts_new_memory_only():
    base = torch.zeros(1000)
    with TensorMemoryTracker() as tracker:
        a = torch.empty(2000)
        base.add_(1)  # in place: no new memory
        v = a.view(10, 200)  # a view: no new memory
        del a, v
    assert tracker.peak_bytes == 8000 and tracker.live_bytes == 0


@pytest.mark.parametrize(
    "fn",
    [
        lambda b, t, c: 0.125 * b,
        lambda b, t, c: 0.3 + 0.07 * b,
        lambda b, t, c: 0.01 * b * b,
    ],
)
def test_search_finds_largest_micro_batch_by_brute_force(fn):
    recipe, limit, margin = (
        tiny_recipe(micro=8, seq_len=32, accum=8),
        4.0,
        0.25,
    )  # 64 sequences per step
    result = run(recipe, fn, limit, margin)
    brute = max(
        b for b in range(1, 33) if fn(b, 32, False) <= (1 - margin) * limit
    )  # cap: 4 x micro
    assert result.largest_micro_batch == brute
    assert not result.activation_checkpointing and result.seq_len == 32
    assert (
        result.micro_batch_size * result.grad_accum_steps * result.seq_len
        == recipe.train.tokens_per_step
    )
    assert (
        64 % result.micro_batch_size == 0
        and result.micro_batch_size <= brute < 2 * result.micro_batch_size
    )
    assert all(t.tokens_per_s > 0 for t in result.trials if not t.oom)  # real steps ran
    assert result.search_s > 0


def test_search_respects_margin():
    result = run(tiny_recipe(), lambda b, t, c: 0.125 * b, limit=2.0, margin=0.25)
    assert (
        result.largest_micro_batch == 12
    )  # 12 x 0.125 = 1.5 = 0.75 x 2.0; 16 would fit without the margin
    assert result.peak_gb <= 1.5
    assert all(t.peak_gb <= 1.5 for t in result.trials if t.ok)
    near = [t for t in result.trials if 1.5 < t.peak_gb <= 2.0]
    assert near and not any(t.ok or t.oom for t in near)
    assert all(t.oom and not t.ok for t in result.trials if t.peak_gb > 2.0)


def test_global_batch_is_kept_exactly():
    result = run(
        tiny_recipe(micro=3, seq_len=32, accum=5), lambda b, t, c: 0.1 * b, limit=0.5, margin=0.0
    )
    assert result.largest_micro_batch == 5  # 15 sequences per step: 5 divides them
    assert (result.micro_batch_size, result.grad_accum_steps) == (5, 3)


def test_global_batch_that_cannot_be_exact_is_reported():
    result = run(
        tiny_recipe(micro=1, seq_len=32, accum=7),
        lambda b, t, c: 0.1 * b,
        limit=0.55,
        margin=0.0,
        max_micro_batch=8,
    )
    assert result.largest_micro_batch == 5
    # 7 sequences is prime: 1 x 7 would waste the memory; 4 x 2 is the smallest overshoot in 2 steps.
    assert (result.micro_batch_size, result.grad_accum_steps) == (4, 2)
    assert any("256 tokens per step instead of the recipe's 224" in n for n in result.notes)


def test_checkpointing_is_turned_on_when_micro_batch_one_does_not_fit():
    result = run(tiny_recipe(), lambda b, t, c: (0.5 if c else 2.0) * b, limit=1.5, margin=0.1)
    assert (
        result.activation_checkpointing and result.largest_micro_batch == 2 and result.seq_len == 32
    )
    assert any("checkpointing turned on" in n for n in result.notes)
    assert [t.checkpointing for t in result.trials][:2] == [False, True]
    assert apply_probe(tiny_recipe(), result).model.activation_checkpointing


def test_context_is_shortened_when_nothing_fits():
    recipe = tiny_recipe(micro=8, seq_len=32, accum=8)
    result = run(
        recipe,
        lambda b, t, c: b * t / 32 * (0.75 if c else 1.0),
        limit=0.6,
        margin=0.0,
        min_seq_len=8,
    )
    assert (result.seq_len, result.activation_checkpointing, result.micro_batch_size) == (
        16,
        False,
        1,
    )
    assert result.grad_accum_steps * result.micro_batch_size * 16 == recipe.train.tokens_per_step
    assert any("context shortened from 32 to 16" in n for n in result.notes)


def test_nothing_fits_raises_a_clear_error():
    with pytest.raises(ProbeError, match="smaller recipe"):
        run(tiny_recipe(), lambda b, t, c: 10.0, limit=1.0, min_seq_len=16)


@pytest.mark.slow  # real timings
def test_real_measurement_on_cpu():
    """No injected measurement: the tracker measures real tensors; the limit makes the answer interesting."""
    recipe = tiny_recipe(micro=16, seq_len=64, accum=4)
    free = probe(recipe, "cpu", memory_limit_gb=1.0, margin=0.0, cache_dir=None)
    peaks = {t.micro_batch: t.peak_gb for t in free.trials}
    limit = (peaks[16] + peaks[32]) / 2  # somewhere between micro-batches 16 and 32
    result = probe(recipe, "cpu", memory_limit_gb=limit, margin=0.0, cache_dir=None)
    assert 16 <= result.largest_micro_batch < 32
    ok = {t.micro_batch for t in result.trials if t.ok}
    assert result.largest_micro_batch in ok and result.largest_micro_batch + 1 not in ok
    assert result.peak_gb <= limit


def test_the_fastest_micro_batch_that_fits_is_chosen_not_the_largest():
    """speed() answers as the trainer would on a GPU where the largest micro-batch is not the fastest."""
    timed = []

    def speed(recipe, device):
        t = recipe.train
        timed.append((t.micro_batch_size, t.grad_accum_steps))
        assert t.tokens_per_step == 8 * 32 * 8 and device.type == "cpu"
        return {16: 900.0, 8: 1000.0, 4: 700.0}[t.micro_batch_size]

    result = run(tiny_recipe(), lambda b, t, c: 0.05 * b, limit=1.0, margin=0.0, speed=speed)
    assert result.largest_micro_batch == 20 and timed == [(16, 4), (8, 8), (4, 16)]
    assert (result.micro_batch_size, result.grad_accum_steps) == (8, 8)
    assert result.tokens_per_s == 1000.0 and "trainer's step" in result.tokens_per_s_source
    assert result.speeds == {"16": 900.0, "8": 1000.0, "4": 700.0}
    assert any("micro-batch 8 is the fastest" in n for n in result.notes)
    assert (
        result.trials[-1].micro_batch == 8 and result.trials[-1].ok
    )  # the choice confirmed by a trial


def test_a_run_that_compiles_on_a_gpu_is_predicted_at_the_measured_compiled_speed(monkeypatch):
    """The probe times eagerly and ranks by the eager figures; the speed it predicts for the run is the
    eager one times the measured compiled-over-eager ratio where the run compiles on a GPU (a CPU
    compiled run keeps the eager figure: no CPU ratio is measured)."""
    import tinygpt.fit.probe as probe_mod
    from tinygpt.fit.step_speed import COMPILED_OVER_EAGER, compiled_speedup

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert (
        compiled_speedup("auto", cuda) == compiled_speedup("regional", cuda) == COMPILED_OVER_EAGER
    )
    assert compiled_speedup("off", cuda) == compiled_speedup("auto", cpu) == 1.0
    assert compiled_speedup("on", cpu) == 1.0
    assert 2.3 < COMPILED_OVER_EAGER < 2.5  # docs/BENCHMARKS.md section 5: 395,433 / 166,130

    def speed(recipe, device):
        return {16: 900.0, 8: 1000.0, 4: 700.0}[recipe.train.micro_batch_size]

    eager = run(tiny_recipe(), lambda b, t, c: 0.05 * b, limit=1.0, margin=0.0, speed=speed)
    # the device as a GPU run sees it: the factor follows the recipe's compile setting
    monkeypatch.setattr(
        probe_mod, "compiled_speedup", lambda mode, dev: compiled_speedup(mode, cuda)
    )
    as_run = run(tiny_recipe(), lambda b, t, c: 0.05 * b, limit=1.0, margin=0.0, speed=speed)
    assert as_run.micro_batch_size == eager.micro_batch_size == 8 and as_run.speeds == eager.speeds
    assert as_run.tokens_per_s == pytest.approx(1000.0 * COMPILED_OVER_EAGER)
    assert "for compiling" in as_run.tokens_per_s_source and "for compiling" not in (
        eager.tokens_per_s_source
    )
    off = tiny_recipe().replace(train={"compile": "off"})
    assert (
        run(off, lambda b, t, c: 0.05 * b, limit=1.0, margin=0.0, speed=speed).tokens_per_s == 1000
    )


@pytest.mark.slow  # real timings
def test_full_logits_are_timed_where_they_fit_and_kept_when_faster():
    """A vocabulary large enough that the recipe's "auto" loss would chunk: the probe also tries the full
    logits (a memory trial, then the trainer's step) and keeps them when they measure faster."""
    recipe = tiny_recipe(micro=16, seq_len=64, accum=2)
    recipe = recipe.replace(model={"vocab_size": 16384}, data={"vocab_size": 16384})
    timed = []

    def speed(r, device):
        timed.append((r.train.micro_batch_size, r.train.loss))
        return 1000.0 * r.train.micro_batch_size + (500.0 if r.train.loss == "full" else 0.0)

    result = run(
        recipe, lambda b, t, c: 0.01 * b, limit=1.0, margin=0.0, max_micro_batch=32, speed=speed
    )
    assert result.largest_micro_batch == 32 and (
        result.micro_batch_size,
        result.grad_accum_steps,
    ) == (32, 1)
    assert timed[:2] == [(32, "auto"), (32, "full")] and result.loss == "full"
    assert result.speeds["32 full"] == 32_500.0 and result.tokens_per_s == 32_500.0
    assert [t.micro_batch for t in result.trials].count(
        32
    ) >= 2  # the full logits had their own memory trial
    assert apply_probe(recipe, result).train.loss == "full"
    # a recipe that says how to take its loss is timed that way only
    timed.clear()
    chunked = run(
        recipe.replace(train={"loss": "chunked"}),
        lambda b, t, c: 0.01 * b,
        limit=1.0,
        margin=0.0,
        max_micro_batch=32,
        speed=speed,
    )
    assert {mode for _, mode in timed} == {"chunked"} and chunked.loss == "chunked"


def test_trainer_speed_times_the_trainers_own_step_on_cpu(tmp_path, monkeypatch):
    """The default speed runs the real Trainer step (random tokens), writes nothing, and leaves the
    caller's random state as it was."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    assert trainer_speed(tiny_recipe(micro=4, seq_len=32, accum=4), "cpu", steps=2, warmup=1) > 0
    assert torch.equal(torch.get_rng_state(), before)
    result = probe(
        tiny_recipe(micro=4, seq_len=32, accum=4),
        "cpu",
        memory_limit_gb=1.0,
        margin=0.0,
        cache_dir=None,
        max_micro_batch=8,
        time_limit_s=None,
    )
    assert not list(tmp_path.iterdir())
    assert set(result.speeds) == {"8", "4", "2"} and all(v > 0 for v in result.speeds.values())
    assert result.tokens_per_s == result.speeds[str(result.micro_batch_size)]
    assert result.tokens_per_s_source.startswith("measured: the trainer's step (eager)")


@pytest.mark.slow  # real timings
def test_cache_is_written_and_reused(tmp_path):
    measure = Counting(lambda b, t, c: 0.1 * b)
    kw = dict(measure=measure, memory_limit_gb=1.0, cache_dir=tmp_path)
    first = probe(tiny_recipe(), "cpu", **kw)
    calls = measure.calls
    assert calls > 0 and not first.from_cache
    files = list(tmp_path.glob("*.json"))
    assert (
        len(files) == 1
        and "tiny-test" in files[0].name
        and torch.__version__.split("+")[0] in files[0].name
    )
    second = probe(tiny_recipe(), "cpu", **kw)
    assert measure.calls == calls and second.from_cache
    assert (second.micro_batch_size, second.grad_accum_steps, second.trials) == (
        first.micro_batch_size,
        first.grad_accum_steps,
        first.trials,
    )
    probe(tiny_recipe(), "cpu", **{**kw, "memory_limit_gb": 2.0})  # another limit: searched again
    assert measure.calls > calls


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError(
            "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"
        ),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ],
)
def test_a_candidate_whose_step_runs_out_of_memory_is_dropped_with_a_line(error):
    """The trainer's step of micro-batch 16 fails to allocate, in each form the error takes (inside a
    compiled graph too, where it is what the timing call raises): that candidate is dropped and said, the
    others are timed, and the fastest of them is taken. Any other error is not an allocation failure."""

    def speed(recipe, device):
        if recipe.train.micro_batch_size == 16:
            raise error
        return 1000.0 * recipe.train.micro_batch_size

    result = run(tiny_recipe(), lambda b, t, c: 0.05 * b, limit=1.0, margin=0.0, speed=speed)
    assert result.speeds == {"8": 8000.0, "4": 4000.0} and result.micro_batch_size == 8
    assert any(
        n.startswith("micro-batch 16 dropped: the trainer's step ran out of memory")
        for n in result.notes
    )

    def broken(recipe, device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        run(tiny_recipe(), lambda b, t, c: 0.05 * b, limit=1.0, margin=0.0, speed=broken)


def test_the_result_is_kept_in_the_run_folder_and_a_new_vm_reads_it_without_timing(tmp_path):
    """A run folder restored on a new VM (an empty user cache) holds probe.json: the probe reads it, with
    no trial and no timing; its time limit is reported."""
    timings = []

    def speed(recipe, device):
        timings.append(recipe.train.micro_batch_size)
        return 100.0 * recipe.train.micro_batch_size

    measure = Counting(lambda b, t, c: 0.05 * b)
    kw = dict(
        measure=measure, memory_limit_gb=1.0, margin=0.0, speed=speed, run_dir=tmp_path / "run"
    )
    first = probe(tiny_recipe(), "cpu", cache_dir=tmp_path / "vm1", **kw)
    assert timings and measure.calls and not first.from_cache and first.time_limit_s == 60.0
    assert (
        json.loads((tmp_path / "run" / "probe.json").read_text())["micro_batch_size"]
        == first.micro_batch_size
    )
    n_timings, n_trials = len(timings), measure.calls
    second = probe(
        tiny_recipe(), "cpu", cache_dir=tmp_path / "vm2", **kw
    )  # a new VM: its own cache is empty
    assert len(timings) == n_timings and measure.calls == n_trials and second.from_cache
    assert (second.micro_batch_size, second.speeds) == (first.micro_batch_size, first.speeds)
    assert list((tmp_path / "vm2").glob("*.json"))  # and the VM's cache keeps it from now on
    from tinygpt.core.rundir import RUN_FILES

    assert "probe.json" in RUN_FILES  # what the mirror copies to Drive and restores


@contextlib.contextmanager
def graphs_compiled():
    """Counts the graphs torch.compile makes inside the block (dynamo's own counters): {"graphs": n}."""
    from torch._dynamo.utils import counters

    out = {"graphs": 0}
    before = counters["stats"]["unique_graphs"]
    try:
        yield out
    finally:
        out["graphs"] = counters["stats"]["unique_graphs"] - before


@pytest.mark.slow  # real timings, one compile
def test_the_probe_and_the_size_planner_compile_nothing(monkeypatch):
    """For a recipe that compiles, the probe (3 micro-batches timed) and the size planner (rungs timed) run
    eagerly: 0 graphs compiled inside either. The training step that follows compiles once, for its own
    micro-batch, with static shapes: 0 recompiles after step 1, and a batch of another size needs a new
    graph (a symbolic batch dimension would have served it)."""
    from torch._dynamo.utils import counters

    import tinygpt.fit.plan as plan_mod
    from tinygpt.fit.step_speed import RandomBatches
    from tinygpt.train.step import TrainStep

    recipe = tiny_recipe(micro=4, seq_len=32, accum=4).replace(
        train={"compile": "on", "device": "cpu"}
    )
    torch._dynamo.reset()
    with graphs_compiled() as in_probe:
        result = probe(
            recipe,
            "cpu",
            memory_limit_gb=1.0,
            margin=0.0,
            cache_dir=None,
            max_micro_batch=8,
            time_limit_s=None,
            speed=lambda r, d: trainer_speed(r, d, steps=1, warmup=0),
        )
    assert set(result.speeds) == {"8", "4", "2"} and in_probe["graphs"] == 0
    monkeypatch.setattr(plan_mod, "PLAN_SPEED_STEPS", 1)
    monkeypatch.setattr(plan_mod, "PLAN_WARMUP_STEPS", 0)
    planned = get_recipe("cpu-fast").replace(
        train={"compile": "on", "micro_batch_size": 1, "seq_len": 32, "grad_accum_steps": 1}
    )
    with graphs_compiled() as in_planner:
        plan = plan_mod.choose_size(planned, 0.05, torch.device("cpu"), None)[1]
    assert sum(c.timed for c in plan.candidates) >= 1 and in_planner["graphs"] == 0
    counters.clear()
    torch.manual_seed(0)
    step = TrainStep(GPT(recipe.model), recipe.train, RandomBatches(recipe.model.vocab_size, 32))
    with graphs_compiled() as in_training:
        for _ in range(3):
            step.optimizer_step()
    assert (
        in_training["graphs"] >= 1
        and counters["frames"]["total"] == 1
        and not counters["recompiles"]
    )
    x = torch.randint(260, (5, 32))
    with (
        torch.compiler.set_stance("fail_on_recompile"),
        pytest.raises(Exception, match="(?i)recompil"),
    ):
        step.forward_model(x, x)
    torch._dynamo.reset()


def test_apply_probe_returns_a_new_recipe():
    recipe = tiny_recipe()
    result = run(recipe, lambda b, t, c: 0.125 * b, limit=2.0, margin=0.25)
    applied = apply_probe(recipe, result)
    assert (applied.train.micro_batch_size, applied.train.grad_accum_steps) == (8, 8)
    assert applied.train.tokens_per_step == recipe.train.tokens_per_step
    assert recipe.train.micro_batch_size == 8 and applied is not recipe


def _a100() -> HardwareReport:
    return HardwareReport(
        "cuda",
        "NVIDIA A100-SXM4-40GB",
        39.4,
        39.0,
        "8.0",
        True,
        312.0,
        12,
        "a100",
        "a100-124m",
        "bf16",
        "compute capability 8.0",
        "2.x",
    )


def test_expectations_from_the_table_and_from_a_trial():
    recipe = get_recipe("a100-124m")
    exp = expectations(recipe, _a100())
    assert exp.memory_source == "estimated" and exp.mfu == pytest.approx(0.4)
    assert exp.time_to_finish_s == pytest.approx(recipe.token_budget / exp.tokens_per_s)
    assert exp.peak_memory_gb == pytest.approx(
        estimate_memory(recipe.model, 32, 1024, "bf16").total_gb
    )

    small = tiny_recipe()
    result = run(small, lambda b, t, c: 0.125 * b, limit=2.0, margin=0.25)
    exp = expectations(small, hardware_report("cpu"), result)
    assert exp.memory_source.startswith("measured") and exp.peak_memory_gb == result.peak_gb
    assert exp.tokens_per_s == result.tokens_per_s and exp.mfu is None
    assert exp.time_to_finish_s == pytest.approx(small.token_budget / result.tokens_per_s)


def test_bf16_recipe_on_a_gpu_without_native_bf16_is_estimated_in_fp16():
    t4 = HardwareReport(
        "cuda",
        "Tesla T4",
        14.7,
        14.6,
        "7.5",
        False,
        65.0,
        2,
        "t4",
        "t4-50m",
        "fp16",
        "compute capability 7.5 < 8.0",
        "2.x",
    )
    recipe = get_recipe("a100-124m")  # asks for bf16, which a T4 only emulates
    exp = expectations(recipe, t4)
    assert exp.peak_memory_gb == pytest.approx(
        estimate_memory(recipe.model, 32, 1024, "fp16").total_gb
    )
    assert exp.fits is False and exp.mfu == pytest.approx(0.4)


def test_probe_report_on_cpu(tmp_path):
    out = json.loads(probe_report("cpu-smoke", as_json=True, cache_dir=tmp_path))
    assert out["hardware"]["device"] == "cpu" and out["recipe"] == "cpu-smoke"
    assert (
        out["search"] is None and "recipe's micro-batch is used as is" in out["note"]
    )  # no trials on a CPU
    assert out["memory_estimate"]["total_gb"] > 0 and out["expectations"]["tokens_per_s"] > 0
    assert out["expectations"]["tokens_per_s_source"].startswith(
        "measured: the trainer's step"
    )  # a CPU recipe
    text = probe_report("a100-124m", as_json=False, cache_dir=tmp_path)
    assert "runs on a CUDA GPU" in text and "AdamW states" in text and "Expectations" in text
    assert (
        "MFU assumed" in text or "rough guess" in text
    )  # a GPU recipe on a CPU is estimated, and says so
    assert not math.isnan(
        json.loads(probe_report("a100-124m", True, cache_dir=tmp_path))["memory_estimate"][
            "loss_gb"
        ]
    )
